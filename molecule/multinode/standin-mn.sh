#!/usr/bin/env bash
# standin-mn.sh up|down - two stand-in Proxmox nodes, one container on each, networked.
#
# Reuses tests/standin/standin.sh once per node (cached rootfs, wheelhouse and tiny model, the pct
# shim). Each node is its own sshd and its own LXC path, and its pct sees only its own container,
# as a PVE node's pct does (another node's CT "does not exist" there):
#   node mn-node1: sshd on 127.0.0.1:2231, CT 211 (mn-ct1, 10.77.0.11/24)
#   node mn-node2: sshd on 127.0.0.2:2232, CT 212 (mn-ct2, 10.77.0.12/24)
# (two addresses, as two nodes have: Ansible reuses an open connection for a loop's next item, a
# task delegated to each host of the job, when the address is the same, whatever the port)
# and gives the containers what several nodes of one job have:
#   - a network: a host bridge mn-br0 (no address on the host; the nodes' wire) and a veth per
#     container, named mn0 inside;
#   - their own hostnames;
#   - a shared output directory ($CACHE/mn-shared, bind-mounted at /workspace/checkpoints, the
#     NFS/CephFS share of real nodes): the checkpoint's DCP shards are written by the drafter
#     ranks of both nodes.
# Each container boots once, with all of that in its config (standin.sh's DFLASH_STANDIN_CT_EXTRA).
# The nodes' weights store holds the tiny hybrid (standin.sh's DFLASH_STANDIN_ARCH=qwen3_5: the seeds'
# Qwen3.5 / Qwen3.6-27B architecture, a vision-language checkpoint) at /workspace/models/tiny-qwen3_5,
# so this scenario deploys and trains the real target's kind; molecule default keeps the dense one.
# `down` removes both containers, both sshd, the bridge and the shared directory. Must run as root.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STANDIN="$HERE/../../tests/standin/standin.sh"
CACHE="${DFLASH_STANDIN_CACHE:-/var/lib/dflash-standin}"
BRIDGE=mn-br0
ARCH=qwen3_5        # the tiny target's architecture (inventory/multinode's multinode.yml names its weights)
SHARED="$CACHE/mn-shared"
# per container: its node (PVE name and inventory host), the node's sshd port, address, hostname
declare -A NODE=([211]=mn-node1 [212]=mn-node2)
declare -A NODE_ADDR=([211]=127.0.0.1 [212]=127.0.0.2)
declare -A PORT=([211]=2231 [212]=2232)
declare -A ADDR=([211]=10.77.0.11 [212]=10.77.0.12)
declare -A NAME=([211]=mn-ct1 [212]=mn-ct2)

log() { echo "standin-mn: $*" >&2; }

lxcpath() { echo "$CACHE/${NODE[$1]}/lxc"; }      # VMID -> its node's LXC path

extra_config() {  # VMID
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

standin() {  # VMID up|down: standin.sh as node ${NODE[VMID]}
    DFLASH_STANDIN_VMID=$1 DFLASH_STANDIN_ADDR="${NODE_ADDR[$1]}" DFLASH_STANDIN_PORT="${PORT[$1]}" DFLASH_STANDIN_NODE="$CACHE/node-${NODE[$1]}" \
        DFLASH_STANDIN_LXCPATH="$(lxcpath "$1")" DFLASH_STANDIN_NODE_NAME="${NODE[$1]}" \
        DFLASH_STANDIN_HOSTNAME="${NAME[$1]}" DFLASH_STANDIN_CT_EXTRA="$CACHE/${NODE[$1]}/ct-$1.extra" \
        DFLASH_STANDIN_ARCH="$ARCH" "$STANDIN" "$2"
}

up() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip link set "$BRIDGE" up
    mkdir -p "$SHARED"
    # the containers are unprivileged (standin.sh): their root is 100000 here
    [[ "${DFLASH_STANDIN_PRIVILEGED:-0}" == 1 ]] || chown 100000:100000 "$SHARED"
    local id pid rc=0
    declare -A pids=()
    # the caches once, before the nodes come up side by side (two first builds at once would race)
    DFLASH_STANDIN_ARCH="$ARCH" "$STANDIN" wheelhouse >/dev/null
    DFLASH_STANDIN_ARCH="$ARCH" "$STANDIN" tiny >/dev/null
    for id in 211 212; do           # the two nodes side by side (copy, id shift and boot: I/O waits)
        mkdir -p "$CACHE/${NODE[$id]}"
        extra_config "$id" > "$CACHE/${NODE[$id]}/ct-$id.extra"
        standin "$id" up & pids[$id]=$!
    done
    for id in 211 212; do
        pid=${pids[$id]}
        wait "$pid" || { rc=$?; log "node ${NODE[$id]} (CT $id) did not come up (exit $rc)"; }
    done
    (( rc == 0 )) || exit "$rc"
    # each node's pct sees its own container and not the other's
    [[ "$(PCT_STANDIN_LXCPATH="$(lxcpath 211)" /usr/sbin/pct list | awk 'NR > 1 {print $1}' | xargs)" == 211 ]] \
        || { log "node ${NODE[211]}'s pct does not list CT 211 alone"; exit 1; }
    [[ "$(PCT_STANDIN_LXCPATH="$(lxcpath 212)" /usr/sbin/pct list | awk 'NR > 1 {print $1}' | xargs)" == 212 ]] \
        || { log "node ${NODE[212]}'s pct does not list CT 212 alone"; exit 1; }
    # the network carries: from CT 212, CT 211's address answers (a refused port is an answer)
    lxc-attach -n 212 -P "$(lxcpath 212)" --clear-env -- /usr/bin/python3 -c "
import socket, sys
try:
    socket.create_connection(('${ADDR[211]}', 9), 5)
except ConnectionRefusedError:
    sys.exit(0)
except OSError as e:
    sys.exit(f'CT 212 cannot reach ${ADDR[211]}: {e}')
" || { log "no network between the containers"; exit 1; }
    log "up: CT 211 (${ADDR[211]}) on ${NODE[211]} (root@${NODE_ADDR[211]}:${PORT[211]}), CT 212 (${ADDR[212]}) on ${NODE[212]} (root@${NODE_ADDR[212]}:${PORT[212]}), on $BRIDGE"
}

down() {
    local id
    for id in 212 211; do           # side by side, as they came up
        { standin "$id" down; rm -rf --one-file-system "${CACHE:?}/${NODE[$id]}"; } &
    done
    wait
    # left by the one-node layout of this stand-in (both CTs in /var/lib/lxc behind node-mn's sshd)
    for id in 212 211; do
        [[ -d /var/lib/lxc/$id || -d "$CACHE/node-mn" ]] || continue
        DFLASH_STANDIN_VMID=$id DFLASH_STANDIN_PORT=2231 DFLASH_STANDIN_NODE="$CACHE/node-mn" "$STANDIN" down
    done
    # molecule verify's traffic drop (an nft table on the bridge), should a failed run have left it
    nft delete table bridge dflash_mn_drop 2>/dev/null || true
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    rm -rf --one-file-system "$SHARED" "$CACHE/mn-trainer-src" "$CACHE/mn-trainer-src.tar"
    log "down"
}

[[ $EUID -eq 0 ]] || { log "must run as root"; exit 1; }
case "${1:-}" in
    up) up ;;
    down) down ;;
    *) sed -n '2,22s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
