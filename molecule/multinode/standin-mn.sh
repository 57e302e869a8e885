#!/usr/bin/env bash
# standin-mn.sh up|down - two stand-in containers on one stand-in Proxmox node, networked.
#
# Reuses tests/standin/standin.sh for each container (CT 211 and CT 212, cached rootfs, wheelhouse and
# tiny model, one sshd on 127.0.0.1:2231 playing the node that holds both, the pct shim), then gives
# them what several nodes of one job have:
#   - a network: a host bridge mn-br0 (no address on the host) and a veth per container, named mn0
#     inside, with 10.77.0.11/24 and 10.77.0.12/24;
#   - their own hostnames (mn-ct1, mn-ct2);
#   - a shared output directory ($CACHE/mn-shared, bind-mounted at /workspace/checkpoints): the
#     checkpoint's DCP shards are written by the drafter ranks of both nodes.
# The container configs are rewritten after standin.sh made them and the containers rebooted.
# `down` removes both containers, the sshd, the bridge and the shared directory. Must run as root.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STANDIN="$HERE/../../tests/standin/standin.sh"
CACHE="${DFLASH_STANDIN_CACHE:-/var/lib/dflash-standin}"
export DFLASH_STANDIN_PORT=2231 DFLASH_STANDIN_NODE="$CACHE/node-mn"
BRIDGE=mn-br0
SHARED="$CACHE/mn-shared"
LXCPATH=/var/lib/lxc
declare -A ADDR=([211]=10.77.0.11 [212]=10.77.0.12)
declare -A NAME=([211]=mn-ct1 [212]=mn-ct2)

log() { echo "standin-mn: $*" >&2; }

net_config() {  # VMID
    cat <<CONF
lxc.net.0.type = veth
lxc.net.0.link = $BRIDGE
lxc.net.0.name = mn0
lxc.net.0.veth.pair = mn-veth$1
lxc.net.0.ipv4.address = ${ADDR[$1]}/24
lxc.net.0.flags = up
lxc.mount.entry = $SHARED workspace/checkpoints none bind,create=dir 0 0
CONF
}

wait_booted() {  # VMID
    local st=""
    for _ in $(seq 120); do
        st="$(lxc-attach -n "$1" -P "$LXCPATH" --clear-env -- /bin/systemctl is-system-running 2>/dev/null || true)"
        case "$st" in running|degraded) return 0 ;; esac
        sleep 1
    done
    log "CT $1 did not boot (systemd says '${st:-nothing}')"; exit 1
}

up() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip link set "$BRIDGE" up
    mkdir -p "$SHARED"
    # the containers are unprivileged (standin.sh): their root is 100000 here
    [[ "${DFLASH_STANDIN_PRIVILEGED:-0}" == 1 ]] || chown 100000:100000 "$SHARED"
    local id cfg
    for id in 211 212; do
        DFLASH_STANDIN_VMID=$id "$STANDIN" up
        cfg="$LXCPATH/$id/config"
        if ! grep -q "^lxc.net.0.link = $BRIDGE" "$cfg"; then
            sed -i -e '/^lxc.net.0.type = empty/d' -e "s/^lxc.uts.name = .*/lxc.uts.name = ${NAME[$id]}/" "$cfg"
            net_config "$id" >> "$cfg"
            echo "${NAME[$id]}" > "$LXCPATH/$id/rootfs/etc/hostname"
            printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "${NAME[$id]}" > "$LXCPATH/$id/rootfs/etc/hosts"
            # owned as the rest of the rootfs (shifted when the CT is unprivileged)
            chown --reference="$LXCPATH/$id/rootfs/etc" "$LXCPATH/$id/rootfs/etc/hostname" "$LXCPATH/$id/rootfs/etc/hosts"
            lxc-stop -n "$id" -P "$LXCPATH" -t 60
            lxc-start -n "$id" -P "$LXCPATH" -d -o "$CACHE/lxc-$id.log" -l INFO
        fi
        wait_booted "$id"
    done
    # the network carries: from CT 212, CT 211's address answers (a refused port is an answer)
    lxc-attach -n 212 -P "$LXCPATH" --clear-env -- /usr/bin/python3 -c "
import socket, sys
try:
    socket.create_connection(('${ADDR[211]}', 9), 5)
except ConnectionRefusedError:
    sys.exit(0)
except OSError as e:
    sys.exit(f'CT 212 cannot reach ${ADDR[211]}: {e}')
" || { log "no network between the containers"; exit 1; }
    log "up: CT 211 (${ADDR[211]}) and CT 212 (${ADDR[212]}) on $BRIDGE; node sshd root@127.0.0.1:2231"
}

down() {
    local id
    for id in 212 211; do DFLASH_STANDIN_VMID=$id "$STANDIN" down; done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    rm -rf --one-file-system "$SHARED"
    log "down"
}

[[ $EUID -eq 0 ]] || { log "must run as root"; exit 1; }
case "${1:-}" in
    up) up ;;
    down) down ;;
    *) sed -n '2,14s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
