#!/usr/bin/env bash
# tests/run.sh - the whole test suite, from a bare Debian 12 host (root, no GPU):
# host setup (apt + .venv), then pytest over tests/: the trainer on the CPU with tiny models,
# the benchmark smoke test, rendering/syntax/lint of the Ansible side, the Proxmox API stand-in,
# and the real-container scenarios (molecule default + provision, the fault-injection suite).
# Extra arguments go to pytest, e.g. `tests/run.sh -m "not standin"` or `tests/run.sh -m faults`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
start=$(date +%s)
bash tests/setup-host.sh
echo "run: host setup took $(( $(date +%s) - start ))s"
export PATH="$REPO/.venv/bin:$PATH"
# torch on 2 shared cores: one intra-op thread per process keeps the threaded pipeline tests fast
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
"$REPO/.venv/bin/python" -m pytest -ra --durations=15 "$@"
rc=$?
set -e
echo "run: pytest exit $rc after $(( $(date +%s) - start ))s in all"
exit $rc
