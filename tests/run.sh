#!/usr/bin/env bash
# tests/run.sh - the whole test suite, from a bare Debian 12 host (root, no GPU):
# host setup (apt + .venv), then pytest over tests/: the trainer on the CPU with tiny models,
# the benchmark smoke test, rendering/syntax/lint of the Ansible side, the Proxmox API stand-in,
# and the real-container scenarios (molecule default + multinode + provision, the fault-injection suite).
#
# With no arguments the suite runs in two lanes at once, because the container scenarios spend most
# of their time waiting (boots, apt, health polls) while the trainer tests want a core:
#   lane A  -m "standin and not faults"   the molecule scenarios, output live;
#   lane B  -m "not standin"              everything without a container, output to a log shown
#                                          when it ends;
# then the fault-injection suite (-m faults) alone, since its watchdog and restart timings are the
# ones a loaded machine could skew. The two lanes share nothing: lane B's tests use temporary
# directories and free ports, never the stand-in's containers, ports or caches.
# Extra arguments run one plain pytest instead, e.g. `tests/run.sh -m "not standin"` or
# `tests/run.sh -m faults`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
start=$(date +%s)
bash tests/setup-host.sh
echo "run: host setup took $(( $(date +%s) - start ))s"
export PATH="$REPO/.venv/bin:$PATH"
# torch on 2 shared cores: one intra-op thread per process keeps the threaded pipeline tests fast
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PYTEST=("$REPO/.venv/bin/python" -m pytest -ra --durations=15)

if (( $# )); then
    set +e
    "${PYTEST[@]}" "$@"
    rc=$?
    set -e
    echo "run: pytest exit $rc after $(( $(date +%s) - start ))s in all"
    exit $rc
fi

logb="$(mktemp /tmp/dflash-lane-b.XXXXXX.log)"
tmpb="$(mktemp -d /tmp/dflash-lane-b.XXXXXX)"   # lane B's own pytest temp root, removed when it ends
"${PYTEST[@]}" -p no:cacheprovider --basetemp="$tmpb" -m "not standin" > "$logb" 2>&1 &
lane_b=$!
trap 'kill $lane_b 2>/dev/null || true' EXIT
set +e
"${PYTEST[@]}" -m "standin and not faults"
rc_a=$?
echo "run: lane A (containers) exit $rc_a after $(( $(date +%s) - start ))s"
wait $lane_b
rc_b=$?
set -e
trap - EXIT
echo "================ lane B (no containers): $logb ================"
cat "$logb"
echo "run: lane B exit $rc_b after $(( $(date +%s) - start ))s"
rm -rf "$tmpb" "$logb"
set +e
"${PYTEST[@]}" -m faults
rc_f=$?
set -e
echo "run: lanes A/B/faults exit $rc_a/$rc_b/$rc_f after $(( $(date +%s) - start ))s in all"
for rc in $rc_a $rc_b $rc_f; do
    if (( rc != 0 )); then exit "$rc"; fi
done
