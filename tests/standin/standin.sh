#!/usr/bin/env bash
# standin.sh up|down|status|wheelhouse|tiny - the local Proxmox stand-in.
#
# Only Proxmox itself is simulated. `up` builds (idempotently):
#   - a cached debootstrapped bookworm rootfs (build-rootfs.sh; DFLASH_STANDIN_TEMPLATE=bare: the
#     variant without python3-venv, whose apt source is a local file repo) copied into LXC container
#     $VMID, unprivileged as PVE's default (lxc.idmap u/g 0 100000 65536, the copy's ownership
#     shifted by idshift.py; DFLASH_STANDIN_PRIVILEGED=1 for the old privileged one), no network,
#     booted with systemd (lxc-start), waited on until `systemctl is-system-running` says
#     running/degraded;
#   - bind mounts into it, read-only: the node's weights store ($CACHE/tiny/target, the tiny
#     target from `dflash-tiny`) at /workspace/models/$MODEL, the tiny dataset at
#     /workspace/data/tiny and the host wheelhouse at /srv/wheelhouse for offline pip installs;
#     tests/standin/zipcode at /srv/dflash-standin-zipcode, with a tmpfs for its cache (node_up);
#     DFLASH_STANDIN_ARCH=qwen3_5: the tiny hybrid instead (`dflash-tiny --arch qwen3_5`, the seeds'
#     Qwen3.5 / Qwen3.6-27B architecture as a vision-language checkpoint, cached in $CACHE/tiny-qwen3_5,
#     mounted as tiny-qwen3_5 unless DFLASH_STANDIN_MODEL says otherwise);
#   - an sshd on 127.0.0.1:$PORT (DFLASH_STANDIN_ADDR: another loopback address) with its own
#     config, host key and a generated client key
#     (key-only): this plays the Proxmox node that Ansible's proxmox_pct_remote connects to;
#   - the pct shim (tests/standin/pct) at /usr/sbin/pct.
# `down` removes the container, the sshd instance and the shim; caches (rootfs, wheelhouse,
# tiny model) stay. Must run as root.
# Several nodes on one host (molecule/multinode): each node is its own sshd (DFLASH_STANDIN_PORT,
# DFLASH_STANDIN_NODE) and LXC path (DFLASH_STANDIN_LXCPATH); the sshd hands it to the pct shim
# (PCT_STANDIN_LXCPATH), so a node's pct sees only its own containers, as a PVE node's does.
# DFLASH_STANDIN_HOSTNAME names the container, DFLASH_STANDIN_CT_EXTRA is a file of lxc.* lines
# appended to its config (a network there replaces the empty one): it boots once, as it should be.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VMID="${DFLASH_STANDIN_VMID:-200}"
PORT="${DFLASH_STANDIN_PORT:-2222}"
ADDR="${DFLASH_STANDIN_ADDR:-127.0.0.1}"             # the node's address: a loopback one (127.0.0.0/8)
CACHE="${DFLASH_STANDIN_CACHE:-/var/lib/dflash-standin}"
NODE="${DFLASH_STANDIN_NODE:-$CACHE/node}"          # sshd state; removed by `down`
ARCH="${DFLASH_STANDIN_ARCH:-qwen3}"                 # dflash-tiny --arch: qwen3 (dense) | qwen3_5 (hybrid)
case "$ARCH" in
    qwen3) TINY_NAME=tiny ;;                         # the dense cache keeps its old path
    qwen3_5) TINY_NAME="tiny-$ARCH" ;;
    *) echo "standin: DFLASH_STANDIN_ARCH must be qwen3 or qwen3_5, got '$ARCH'" >&2; exit 2 ;;
esac
MODEL="${DFLASH_STANDIN_MODEL:-tiny-$ARCH}"
LXCPATH="${DFLASH_STANDIN_LXCPATH:-/var/lib/lxc}"   # the node's containers: its pct sees these only
NODE_NAME="${DFLASH_STANDIN_NODE_NAME:-stand-in}"   # the node's PVE name (pct's messages)
CTDIR="$LXCPATH/$VMID"
CT_HOSTNAME="${DFLASH_STANDIN_HOSTNAME:-dflash-ct}"
CT_EXTRA="${DFLASH_STANDIN_CT_EXTRA:-}"
PYTHON="${DFLASH_STANDIN_PYTHON:-}"
WHEELHOUSE="$CACHE/wheelhouse"
TINY="$CACHE/$TINY_NAME"
TEMPLATE="${DFLASH_STANDIN_TEMPLATE:-prepared}"        # prepared | bare
PRIVILEGED="${DFLASH_STANDIN_PRIVILEGED:-0}"
IDMAP_BASE=100000                                    # PVE's default map for unprivileged CTs
ZIPCODE_CT=/srv/dflash-standin-zipcode             # in the container: tests/standin/zipcode, read-only
ZIPCODE_CACHE_CT=/var/cache/dflash-zipcode           # in the container: a tmpfs of its own
TORCH_SPEC="${DFLASH_TORCH_SPEC:-torch==2.13.0+cpu}"   # +cpu: never resolves to a CUDA build

log() { echo "standin: $*" >&2; }

pick_python() {
    if [[ -z "$PYTHON" ]]; then
        for p in "$REPO/.venv/bin/python" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" /tmp/venv/bin/python; do
            [[ -n "$p" && -x "$p" ]] && { PYTHON="$p"; break; }
        done
    fi
    [[ -n "$PYTHON" ]] || PYTHON=python3
}

ct_state() { lxc-info -n "$VMID" -P "$LXCPATH" -sH 2>/dev/null || echo ABSENT; }

# ---------------------------------------------------------------- caches
wheelhouse() {
    pick_python
    local stamp="$WHEELHOUSE/.complete"
    # what the wheelhouse holds: a cache made for another list is topped up
    local -a want=("$TORCH_SPEC" transformers safetensors pyarrow numpy setuptools wheel torchao)
    if [[ "$(head -1 "$stamp" 2>/dev/null)" == "${want[*]}" ]]; then echo "$WHEELHOUSE"; return; fi
    mkdir -p "$WHEELHOUSE"
    log "downloading cp311 wheels into $WHEELHOUSE ($TORCH_SPEC from the local find-links)"
    # Same interpreter ABI as the container (Debian 12: CPython 3.11).
    "$PYTHON" -m pip download --quiet -d "$WHEELHOUSE" --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        "${want[@]}" >&2
    if ls "$WHEELHOUSE" | grep -E '^nvidia_|^torch-.*cu[0-9]' >&2; then
        log "CUDA wheels in the wheelhouse; refusing"; exit 1
    fi
    printf '%s\n%s\n' "${want[*]}" "$(date -u +%FT%TZ)" > "$stamp"
    echo "$WHEELHOUSE"
}

tiny() {
    pick_python
    local stamp="$TINY/.complete"
    if [[ -f "$stamp" ]]; then echo "$TINY"; return; fi
    log "generating the tiny $ARCH target and dataset with dflash-tiny into $TINY"
    rm -rf "$TINY"; mkdir -p "$(dirname "$TINY")"
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
        'import sys; from trainer.tools.tiny import main; sys.argv = ["dflash-tiny", *sys.argv[1:]]; sys.exit(main())' \
        "$TINY" --arch "$ARCH" >&2
    [[ -f "$TINY/target/config.json" ]] || { log "dflash-tiny wrote no $TINY/target/config.json"; exit 1; }
    date -u +%FT%TZ > "$stamp"
    echo "$TINY"
}

# ---------------------------------------------------------------- the node (sshd + pct)
# node_sshd [NODE]: the pid of NODE's sshd (default: this node's), read from its pid file and printed only
# when that process is still this node's sshd: after a killed run the pid file outlives the process, and
# its number may belong to another process since.
node_sshd() {
    local node="${1:-$NODE}" pid
    pid="$(cat "$node/sshd.pid" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$node/sshd_config" \
        && echo "$pid"
}

node_up() {
    # Shared by every stand-in node on this host, some running at once (tests/run.sh lane A): a
    # rename replaces it atomically (install unlinks it first, and a pct run in that gap is not found).
    if ! cmp -s "$HERE/pct" /usr/sbin/pct; then
        install -m 0755 "$HERE/pct" "/usr/sbin/.pct.$$"
        mv -f "/usr/sbin/.pct.$$" /usr/sbin/pct
    fi
    mkdir -p "$NODE" /run/sshd; chmod 0700 "$NODE"
    [[ -f "$NODE/ssh_host_ed25519_key" ]] || ssh-keygen -q -t ed25519 -N "" -f "$NODE/ssh_host_ed25519_key"
    [[ -f "$NODE/id_ed25519" ]] || ssh-keygen -q -t ed25519 -N "" -C dflash-standin -f "$NODE/id_ed25519"
    install -m 0600 "$NODE/id_ed25519.pub" "$NODE/authorized_keys"
    cat > "$NODE/sshd_config" <<CONF
# sshd playing the Proxmox node for the dflash stand-in (key-only, loopback only)
Port $PORT
ListenAddress $ADDR
HostKey $NODE/ssh_host_ed25519_key
PidFile $NODE/sshd.pid
AuthorizedKeysFile $NODE/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
X11Forwarding no
AllowUsers root
Subsystem sftp internal-sftp
LogLevel ERROR
# this node's containers, for the pct shim (a PVE node's pct sees the CTs of that node only);
# SHLVL=1: every command Ansible sends runs in root's login shell, \`bash -c\`, which sources ~/.bashrc
# when sshd runs it as a top-level shell (SHLVL < 2). This host's root .bashrc is not a PVE node's (here it
# ran \`pyenv init\`: 95 ms of CPU a session, four fifths of the node's CPU per Ansible task, measured
# 2026-12-06); a session's bash at level 2 skips it. Nothing the node runs reads .bashrc.
# PYTHONPATH, DFLASH_ZIPCODE_CACHE: the module runs Ansible starts in a container (\`pct exec\` keeps this
# environment) load module_utils' code compiled by an earlier run instead of compiling it from their zip
# (tests/standin/zipcode; about a third of a module run's CPU): the container has the directory on the
# path read-only and the cache on a tmpfs of its own (ct_config). The node has neither: nothing changes there.
SetEnv SHLVL=1 PCT_STANDIN_LXCPATH=$LXCPATH PCT_STANDIN_NODE=$NODE_NAME PYTHONPATH=$ZIPCODE_CT DFLASH_ZIPCODE_CACHE=$ZIPCODE_CACHE_CT
CONF
    /usr/sbin/sshd -t -f "$NODE/sshd_config"
    local running
    if running="$(node_sshd)"; then
        kill -HUP "$running"      # reload the config we just wrote
    else
        /usr/sbin/sshd -f "$NODE/sshd_config"
    fi
    # known_hosts for the controller: the node's host key on [$ADDR]:PORT
    printf '[%s]:%s %s\n' "$ADDR" "$PORT" "$(cut -d' ' -f1,2 "$NODE/ssh_host_ed25519_key.pub")" > "$NODE/known_hosts"
    for _ in $(seq 50); do
        ssh -q -o BatchMode=yes -o UserKnownHostsFile="$NODE/known_hosts" -i "$NODE/id_ed25519" \
            -p "$PORT" root@$ADDR true && return 0
        sleep 0.2
    done
    log "sshd on $ADDR:$PORT does not answer"; exit 1
}

node_down() {
    if pid="$(node_sshd)"; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -rf "$NODE"
    # /usr/sbin/pct is shared by every stand-in node on this host (e.g. the fault suite's CT 201
    # behind its own sshd): remove it only when no other node is up, and only if it is our shim.
    local other
    for other in "$CACHE"/node*/; do
        node_sshd "${other%/}" >/dev/null && return 0
    done
    if [[ -f /usr/sbin/pct ]] && grep -q 'STAND-IN for Proxmox' /usr/sbin/pct; then rm -f /usr/sbin/pct; fi
}

# ---------------------------------------------------------------- the container
ct_config() {
    cat <<CONF
# LXC container $VMID: stand-in for Proxmox CT $VMID (dflash). Written by tests/standin/standin.sh.
lxc.include = /usr/share/lxc/config/common.conf
$(if [[ "$PRIVILEGED" != 1 ]]; then printf '%s\n' \
    "# Unprivileged, as PVE creates a CT by default: root inside is $IDMAP_BASE on this host." \
    "lxc.include = /usr/share/lxc/config/userns.conf" \
    "lxc.idmap = u 0 $IDMAP_BASE 65536" "lxc.idmap = g 0 $IDMAP_BASE 65536"; fi)
lxc.arch = amd64
lxc.uts.name = $CT_HOSTNAME
lxc.rootfs.path = dir:$CTDIR/rootfs
$(if [[ -n "$CT_EXTRA" ]] && grep -q '^lxc\.net\.0\.type' "$CT_EXTRA"; then :; else
    printf '%s\n' "# No network inside: everything comes from the bind-mounted wheelhouse." "lxc.net.0.type = empty"; fi)
lxc.mount.auto = cgroup:mixed proc:mixed sys:mixed
# PVE's cgroup layout: limits on lxc/$VMID, the container in its inner ns group (memory.max: max)
lxc.cgroup.relative = 0
lxc.cgroup.dir.monitor = lxc.monitor/$VMID
lxc.cgroup.dir.container = lxc/$VMID
lxc.cgroup.dir.container.inner = ns
lxc.apparmor.profile = unconfined
lxc.autodev = 1
lxc.tty.max = 0
lxc.pty.max = 64
lxc.mount.entry = $TINY/target workspace/models/$MODEL none bind,ro,create=dir 0 0
lxc.mount.entry = $TINY/data workspace/data/tiny none bind,ro,create=dir 0 0
lxc.mount.entry = $WHEELHOUSE srv/wheelhouse none bind,ro,create=dir 0 0
# module_utils' compiled code for Ansible's module runs (node_up's SetEnv): the code, and a cache of its own
lxc.mount.entry = $HERE/zipcode ${ZIPCODE_CT#/} none bind,ro,create=dir 0 0
lxc.mount.entry = tmpfs ${ZIPCODE_CACHE_CT#/} tmpfs create=dir,mode=0700,size=64m 0 0
$([[ -z "$CT_EXTRA" ]] || cat "$CT_EXTRA")
CONF
}

# DFLASH_STANDIN_HOSTNAME: systemd sets the hostname from /etc/hostname, so the rootfs says it too
# (owned as the rest of the rootfs: shifted when the CT is unprivileged)
ct_hostname() {
    [[ -n "${DFLASH_STANDIN_HOSTNAME:-}" ]] || return 0
    local etc="$CTDIR/rootfs/etc"
    [[ "$(cat "$etc/hostname" 2>/dev/null)" == "$CT_HOSTNAME" ]] && return 0
    echo "$CT_HOSTNAME" > "$etc/hostname"
    printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$CT_HOSTNAME" > "$etc/hosts"
    chown --reference="$etc" "$etc/hostname" "$etc/hosts"
}

wait_booted() {
    local st=""
    for _ in $(seq 120); do
        st="$(lxc-attach -n "$VMID" -P "$LXCPATH" --clear-env -- /bin/systemctl is-system-running 2>/dev/null || true)"
        case "$st" in running|degraded) log "CT $VMID systemd: $st"; return 0 ;; esac
        sleep 1
    done
    log "CT $VMID did not boot (systemd says '${st:-nothing}')"
    lxc-attach -n "$VMID" -P "$LXCPATH" --clear-env -- /bin/systemctl --failed --no-pager >&2 || true
    exit 1
}

ct_up() {
    local rootfs owner want_owner=0
    case "$TEMPLATE" in
        prepared) rootfs="$("$HERE/build-rootfs.sh")" ;;
        bare) rootfs="$("$HERE/build-rootfs.sh" --bare)" ;;
        *) log "DFLASH_STANDIN_TEMPLATE must be prepared or bare, not '$TEMPLATE'"; exit 2 ;;
    esac
    [[ "$PRIVILEGED" == 1 ]] || want_owner=$IDMAP_BASE
    mkdir -p "$TINY/target" "$TINY/data" "$WHEELHOUSE"
    if [[ -d "$CTDIR/rootfs" ]]; then
        owner="$(stat -c %u "$CTDIR/rootfs")"
        if [[ "$owner" != "$want_owner" ]]; then      # made privileged/unprivileged before: remake
            log "CT $VMID rootfs is owned by $owner, want $want_owner: recreating it"
            ct_down
        fi
    fi
    if [[ ! -d "$CTDIR/rootfs" ]]; then
        log "creating CT $VMID from $rootfs ($TEMPLATE template, $([[ "$PRIVILEGED" == 1 ]] && echo privileged || echo "unprivileged, ids shifted by $IDMAP_BASE"))"
        mkdir -p "$CTDIR"
        rm -rf --one-file-system "$CTDIR/rootfs.tmp"
        cp -a --reflink=auto "$rootfs" "$CTDIR/rootfs.tmp"
        [[ "$PRIVILEGED" == 1 ]] || python3 "$HERE/idshift.py" "$CTDIR/rootfs.tmp" "$IDMAP_BASE"
        mv "$CTDIR/rootfs.tmp" "$CTDIR/rootfs"
    fi
    ct_hostname
    local want; want="$(ct_config)"
    if [[ ! -f "$CTDIR/config" ]] || [[ "$(cat "$CTDIR/config")" != "$want" ]]; then
        printf '%s\n' "$want" > "$CTDIR/config"
        [[ "$(ct_state)" == RUNNING ]] && { log "config changed; restarting CT $VMID"; lxc-stop -n "$VMID" -P "$LXCPATH" -t 60; }
    fi
    if [[ "$(ct_state)" != RUNNING ]]; then
        "$HERE/lxc-stale-cgroups" "$VMID"
        local log="$CACHE/lxc-$VMID.log" seen
        seen="$(wc -l < "$log" 2>/dev/null || echo 0)"
        if ! lxc-start -n "$VMID" -P "$LXCPATH" -d -o "$log" -l INFO; then
            log "CT $VMID did not start; this start's errors in $log:"
            tail -n +"$((seen + 1))" "$log" | grep -E ' (ERROR|WARN) ' | grep -v -E 'new[ug]idmap|fchownat' | tail -n 12 >&2 || true
            exit 1
        fi
    fi
    wait_booted
}

ct_down() {
    if [[ -f "$CTDIR/config" ]]; then
        [[ "$(ct_state)" == RUNNING ]] && lxc-stop -n "$VMID" -P "$LXCPATH" -k
    fi
    # Root removes the files itself: lxc-destroy deletes an unprivileged CT's rootfs from inside its
    # user namespace, about 90 s for this one on a busy host, against seconds for rm.
    rm -rf --one-file-system "$CTDIR"
}

[[ $EUID -eq 0 ]] || { log "must run as root"; exit 1; }
case "${1:-}" in
    up)
        [[ "${DFLASH_STANDIN_SKIP_CACHES:-0}" == 1 ]] || { wheelhouse >/dev/null; tiny >/dev/null; }
        # Bind-mounted into an unprivileged CT, whose root is nobody to these host files: readable by
        # others, as a node's weights store must be (dflash-tiny writes model.safetensors 0600).
        chmod -R a+rX "$TINY" "$WHEELHOUSE" 2>/dev/null || true
        ct_up
        node_up
        log "up: CT $VMID running; node sshd root@$ADDR:$PORT key $NODE/id_ed25519" ;;
    down)
        ct_down; node_down; log "down (caches kept in $CACHE)" ;;
    status)
        echo "CT $VMID: $(ct_state)"
        if node_sshd >/dev/null; then echo "node sshd: running"; else echo "node sshd: stopped"; fi ;;
    wheelhouse) wheelhouse ;;
    tiny) tiny ;;
    *) sed -n '2,27s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
