#!/usr/bin/env bash
# build-rootfs.sh [--bare] [DEST] - debootstrap a Debian bookworm minbase rootfs for the local
# Proxmox stand-in (a systemd LXC container), once, into a cache; print its path.
#
# Two templates, as on a node (a prepared one for speed, the plain Debian one a deploy must cope
# with):
#   (default)  the prepared template: everything Ansible modules and the trainer venv need at
#              runtime is installed here (the container has no network).
#   --bare     DEST-bare, derived from the prepared one: python3-venv (and what only it pulls in:
#              python3.11-venv, python3-pip-whl, python3-setuptools-whl) purged, as in PVE's
#              debian-12-standard template. Its apt source is a local file repo baked into it
#              (/var/local/dflash-apt: the .debs apt in that rootfs needs to install python3-venv,
#              downloaded on this host, with a Packages index), so the deploy's real `apt` task
#              installs python3-venv without a network.
#
# Idempotent: a finished rootfs is marked with .dflash-rootfs-complete and a second run only
# prints the path.
set -euo pipefail

BARE=0
if [[ "${1:-}" == --bare ]]; then BARE=1; shift; fi
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

# --bare: DEST-bare from the prepared DEST (built first if needed), python3-venv removed, a local
# file repo holding what installing it takes.
APT_REPO=/var/local/dflash-apt
BARE_PURGE="python3-venv python3.11-venv python3-pip-whl python3-setuptools-whl"
bare() {
    local bare="$DEST-bare" work parent
    if [[ -f "$bare/.dflash-rootfs-complete" && "$bare/.dflash-rootfs-complete" -nt "$STAMP" ]]; then
        fixups "$bare"; echo "$bare"; return 0
    fi
    [[ $EUID -eq 0 ]] || { echo "build-rootfs.sh: must run as root (chroot)" >&2; exit 1; }
    parent="$(dirname "$bare")"
    work="$(mktemp -d "$parent/.rootfs-bare.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf --one-file-system '$work'" EXIT
    echo "build-rootfs.sh: bare template $bare from $DEST (purge $BARE_PURGE; local apt repo $APT_REPO)" >&2
    cp -a --reflink=auto "$DEST/." "$work/"
    rm -f "$work/.dflash-rootfs-complete"
    # shellcheck disable=SC2086
    chroot "$work" /usr/bin/dpkg --purge $BARE_PURGE >&2
    # What apt *in this rootfs* needs to install python3-venv again (exact versions, deps
    # included), fetched from the mirror on this host (the chroot shares its network).
    rm -f "$work/etc/resolv.conf"
    cp -L /etc/resolv.conf "$work/etc/resolv.conf"
    mkdir -p "$work$APT_REPO/partial"
    chroot "$work" /usr/bin/apt-get -q update >&2
    chroot "$work" /usr/bin/apt-get -q -y --download-only -o Dir::Cache::archives="$APT_REPO" \
        -o APT::Sandbox::User=root install python3-venv >&2
    rm -rf "$work$APT_REPO/partial" "$work$APT_REPO/lock"
    rm -f "$work/etc/resolv.conf"
    cp -a "$DEST/etc/resolv.conf" "$work/etc/resolv.conf" 2>/dev/null || true
    ls "$work$APT_REPO"/python3-venv_*.deb >/dev/null
    (cd "$work$APT_REPO" && dpkg-scanpackages --multiversion . /dev/null > Packages 2>/dev/null)
    # the only apt source: the local repo (a real template's mirror is unreachable from here)
    printf 'deb [trusted=yes] file:%s ./\n' "$APT_REPO" > "$work/etc/apt/sources.list"
    rm -f "$work"/etc/apt/sources.list.d/*
    rm -rf "$work"/var/cache/apt/archives/*.deb "$work"/var/lib/apt/lists/*
    if [[ "$(chroot "$work" /usr/bin/dpkg-query --show --showformat='${db:Status-Status}' python3-venv 2>/dev/null)" == installed ]]; then
        echo "build-rootfs.sh: python3-venv still installed in the bare template" >&2; exit 1
    fi
    date -u +%FT%TZ > "$work/.dflash-rootfs-complete"
    rm -rf --one-file-system "$bare"
    mv "$work" "$bare"
    trap - EXIT
    echo "$bare"
}

if [[ -f "$STAMP" ]]; then
    fixups "$DEST"
    if [[ "$BARE" == 1 ]]; then bare; else echo "$DEST"; fi
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
if [[ "$BARE" == 1 ]]; then bare; else echo "$DEST"; fi
