#!/usr/bin/env bash
# build-rootfs.sh [DEST] - debootstrap a Debian bookworm minbase rootfs for the local
# Proxmox stand-in (a systemd LXC container), once, into a cache; print its path.
#
# Idempotent: a finished rootfs is marked with DEST/.dflash-rootfs-complete and a second
# run only prints the path. The container has no network, so everything Ansible modules
# and the trainer venv need at runtime is installed here.
set -euo pipefail

DEST="${1:-${DFLASH_ROOTFS:-/var/lib/dflash-standin/rootfs-bookworm}}"
MIRROR="${DFLASH_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
STAMP="$DEST/.dflash-rootfs-complete"
# systemd as PID 1; python3 for Ansible modules; python3-venv for /opt/dflash/venv;
# rsync for staging weights inside the container; procps/iproute2 for operators.
PACKAGES=systemd,systemd-sysv,dbus,python3,python3-venv,python3-apt,ca-certificates,procps,iproute2,rsync,less,libgomp1

# Fixups for a network-less systemd container on this kind of host, applied on every run
# (cheap, idempotent) so an older cache picks them up too.
#  - dbus-daemon cannot finish starting here (its inotify setup is refused and the bus
#    never comes up, so dbus/logind hang until their start timeout and boot stays
#    "starting"). Nothing we run needs the bus: systemctl talks to PID 1 over
#    /run/systemd/private as root. Masked, so `systemctl is-system-running` says running.
#  - units that only fail or wait without a network or real hardware.
fixups() {
    local root="$1" unit
    for unit in dbus.service dbus.socket systemd-logind.service \
                systemd-networkd-wait-online.service systemd-timesyncd.service \
                apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
                getty@tty1.service; do
        [[ "$(readlink "$root/etc/systemd/system/$unit" 2>/dev/null)" == /dev/null ]] \
            || ln -sf /dev/null "$root/etc/systemd/system/$unit"
    done
}

if [[ -f "$STAMP" ]]; then
    fixups "$DEST"
    echo "$DEST"
    exit 0
fi

if [[ $EUID -ne 0 ]]; then
    echo "build-rootfs.sh: must run as root (debootstrap)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "build-rootfs.sh: debootstrap not installed" >&2; exit 1; }

# Build into a temp dir beside DEST and rename, so an interrupted run never leaves a
# half-built tree that looks finished.
parent="$(dirname "$DEST")"
mkdir -p "$parent"
work="$(mktemp -d "$parent/.rootfs-build.XXXXXX")"
# (an if, not `[[ ]] && rm`: a false test as the trap's last command would become the exit status)
cleanup() { if [[ -n "${work:-}" && -d "$work" ]]; then rm -rf --one-file-system "$work"; fi; }
trap cleanup EXIT

echo "build-rootfs.sh: debootstrap $SUITE minbase into $work (a few minutes)" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work" "$MIRROR" >&2

# Settings that make a network-less systemd container boot clean.
echo "dflash-ct" > "$work/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 dflash-ct\n::1 localhost\n' > "$work/etc/hosts"
: > "$work/etc/machine-id"           # systemd generates one on first boot
rm -f "$work/var/lib/dbus/machine-id"
fixups "$work"
apt_clean() { rm -rf "$work"/var/cache/apt/archives/*.deb "$work"/var/lib/apt/lists/*; }
apt_clean
date -u +%FT%TZ > "$work/.dflash-rootfs-complete"

rm -rf --one-file-system "$DEST"
mv "$work" "$DEST"
work=""
echo "$DEST"
