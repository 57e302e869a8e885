#!/usr/bin/env bash
# tests/run.sh - the whole test suite, from a bare Debian 12 host (root, no GPU):
# host setup (apt + .venv), then pytest over tests/: the trainer on the CPU with tiny models,
# the benchmark smoke test, rendering/syntax/lint of the Ansible side, the Proxmox API stand-in,
# and the real-container scenarios (molecule default + multinode + provision, the fault-injection suite).
#
# With no arguments the suite runs as lanes side by side, because the container scenarios spend most
# of their time waiting (boots, apt, pip, systemd restarts, watchdog and RestartSec windows, health
# polls) while the trainer tests want a core:
#   lanes B1 B2 B3 P  -m "not standin"   everything without a container, in four pytests (below);
#   lane R            -m real            the chain on a real pretrained model (dflash-real), its own pytest;
#   lanes A-*, F      the stand-in's caches (debootstrapped rootfs and its bare variant, wheelhouse,
#                     tiny model) built once, then every container test in a pytest of its own, all at
#                     once: each molecule scenario (-m "standin and not faults", one process per test)
#                     and the fault-injection suite (-m faults, its own CT 201). They share nothing but
#                     the caches: each has its own containers, node sshd port and state directory
#                     (tests/pve/test_standin_vmids.py checks the VMIDs and ports).
# Every lane writes a log, shown whole when it ends, with its slowest tests (--durations) and its
# costliest in CPU (tests/conftest.py); the summary at the end (tests/budget.py) gives each lane's exit,
# wall and CPU seconds with its three costliest tests, then checks the suite's budget (25 minutes wall
# and 40 CPU-minutes from a fresh clone on 2 cores, and each lane's CPU share): an overrun is a warning
# line naming the lane (`run: OVER BUDGET: ...`), and DFLASH_SUITE_BUDGET_STRICT=1 makes it exit 3.
# The fault suite's evidence (one JSON per case) goes to $DFLASH_FAULTS_EVIDENCE (default: a directory
# of this run), and its report to faults-report.md there (tests/faults/report.py; docs/reliability.md is
# rendered the same way).
# Extra arguments run one plain pytest instead, e.g. `tests/run.sh -m "not standin"` or
# `tests/run.sh -m faults`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
start=$(date +%s)
machine_busy_s() {   # CPU seconds all cores spent outside idle and iowait since boot
    awk '$1 == "cpu" {printf "%d", ($2 + $3 + $4 + $7 + $8 + $9) / 100}' /proc/stat
}
busy0=$(machine_busy_s)   # the budget counts from here: a fresh clone's host setup is part of the run
bash tests/setup-host.sh
echo "run: host setup took $(( $(date +%s) - start ))s"
export PATH="$REPO/.venv/bin:$PATH"
# Bytecode: hundreds of this run's processes import the trainer (a rank: 54 of its modules) and each pytest
# collects test modules, so with writes off (PYTHONDONTWRITEBYTECODE, which hosts like CI's set) every one
# compiled them from source again: 0.1-0.2 CPU-s a rank, and collecting tests/ took 13.5 CPU-s against 8.5
# with pytest's rewritten modules cached (2026-12-06). The run writes __pycache__ (git ignores it) for its own
# processes; what ships is built without it (roles/dflash_trainer/tasks/build.yml).
unset PYTHONDONTWRITEBYTECODE
# torch on 2 shared cores: one intra-op thread per process keeps the threaded pipeline tests fast
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PY="$REPO/.venv/bin/python"
PYTEST=("$PY" -m pytest -ra --durations=15)

if (( $# )); then
    set +e
    "${PYTEST[@]}" "$@"
    rc=$?
    set -e
    echo "run: pytest exit $rc after $(( $(date +%s) - start ))s in all"
    exit $rc
fi

work="$(mktemp -d /tmp/dflash-run.XXXXXX)"      # logs and each pytest's own temp root
export DFLASH_FAULTS_EVIDENCE="${DFLASH_FAULTS_EVIDENCE:-$work/faults-evidence}"
# the tiny targets and data of tests/conftest.py's fixtures, built once for all the lanes of this run
export DFLASH_TINY_CACHE="$work/tiny"
declare -A PIDS=() T0=() LOGS=() RCS=() TOOK=() CPU=()
# On every exit (the normal end too: the trap stays set to the end; bash runs it on TERM, INT and HUP as
# well): the lanes still running killed (none at the normal end), the lxc/ weight put back. The trap
# keeps the script's exit status: no command in it fails under set -e.
cleanup() { local p; for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; restore_lxc_cpu; }
restore_lxc_cpu() { :; }   # defined below once the weight is set
trap cleanup EXIT

# CPU time per lane, so that the summary says where the cores went (the lanes share 2 cores: the
# slowest lane's wall time is mostly the others' CPU): each lane runs in a cpu accounting cgroup of its
# own (v1 cpuacct or v2), which its children inherit. Containers' own processes are accounted by LXC
# in the containers' cgroups, not here; the machine's total comes from /proc/stat.
CG=""
if [[ -w /sys/fs/cgroup/cgroup.procs && -f /sys/fs/cgroup/cgroup.controllers ]]; then
    CG="/sys/fs/cgroup/dflash-run-$$"; CG_KIND=v2
elif [[ -d /sys/fs/cgroup/cpuacct && -w /sys/fs/cgroup/cpuacct/tasks ]]; then
    CG="/sys/fs/cgroup/cpuacct/dflash-run-$$"; CG_KIND=v1
fi
[[ -n "$CG" ]] && { mkdir -p "$CG" 2>/dev/null || CG=""; }
cpu_s() {   # cpu_s NAME: CPU seconds used so far by lane NAME's cgroup
    if [[ $CG_KIND == v2 ]]; then
        awk '$1 == "usage_usec" {printf "%d", $2 / 1e6}' "$CG/$1/cpu.stat" 2>/dev/null || echo "?"
    else
        awk '{printf "%d", $1 / 1e9}' "$CG/$1/cpuacct.usage" 2>/dev/null || echo "?"
    fi
}
# The containers' own CPU (LXC puts them under lxc/, in the cpuacct hierarchy too; a removed
# container's usage stays counted in its parent).
containers_cpu_s() {
    local f
    for f in /sys/fs/cgroup/cpuacct/lxc/cpuacct.usage /sys/fs/cgroup/lxc/cpu.stat; do
        [[ -r "$f" ]] || continue
        if [[ $f == *cpu.stat ]]; then awk '$1 == "usage_usec" {printf "%d", $2 / 1e6}' "$f"; else awk '{printf "%d", $1 / 1e9}' "$f"; fi
        return
    done
    echo 0
}
containers0=$(containers_cpu_s)

# The containers' CPU weight. Every stand-in container sits under one cgroup parent, lxc/ (pve-container's
# layout: lxc/<vmid>), which the scheduler weighs as ONE nice-0 task against each host process: the four
# containers' boots, deploys and trainers shared that while each niced B-lane process weighed a tenth of
# one, and a trainer's start in CT 201 took 7.5 min (the fault suite's deploy then timed out). For the
# run, lxc/ weighs as 8 nice-0 tasks (v1 cpu.shares 8192, v2 cpu.weight 800), so that the container
# chains go first, as the B lanes' nice intends; restored when the run ends. (Not in the cpuset hierarchy:
# an lxc/ made there before LXC makes it would have no cpus for the containers.)
LXC_CPU=""; LXC_CPU_WAS=""
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null && mkdir -p /sys/fs/cgroup/lxc 2>/dev/null \
        && [[ -f /sys/fs/cgroup/lxc/cpu.weight ]] && LXC_CPU=/sys/fs/cgroup/lxc/cpu.weight && LXC_CPU_SET=800
elif [[ -d /sys/fs/cgroup/cpu ]] && mkdir -p /sys/fs/cgroup/cpu/lxc 2>/dev/null; then
    LXC_CPU=/sys/fs/cgroup/cpu/lxc/cpu.shares; LXC_CPU_SET=8192
fi
if [[ -n "$LXC_CPU" ]] && LXC_CPU_WAS="$(cat "$LXC_CPU")" && echo "$LXC_CPU_SET" > "$LXC_CPU" 2>/dev/null; then
    echo "run: containers' cgroup parent weighs $LXC_CPU_SET ($LXC_CPU, was $LXC_CPU_WAS) for the run"
else
    LXC_CPU=""
fi
# Once: it empties LXC_CPU.
restore_lxc_cpu() {
    if [[ -n "$LXC_CPU" ]]; then
        echo "$LXC_CPU_WAS" > "$LXC_CPU" 2>/dev/null || true
        echo "run: containers' cgroup parent weighs $LXC_CPU_WAS again ($LXC_CPU)" || true
        LXC_CPU=""
    fi
}

# lane NAME ARGS...: a pytest of its own (own temp root, no cache writes, own CPU cgroup), output to
# NAME's log
lane() {
    local name="$1"; shift
    LOGS[$name]="$work/$name.log"
    T0[$name]=$(date +%s)
    local cg=""
    if [[ -n "$CG" ]] && mkdir -p "$CG/$name" 2>/dev/null; then
        cg="$CG/$name/cgroup.procs"; [[ $CG_KIND == v1 ]] && cg="$CG/$name/tasks"
    fi
    DFLASH_TEST_CPU_JSON="$work/$name.tests.json" CG_PROCS="$cg" bash -c '[[ -n "$CG_PROCS" ]] && echo $$ > "$CG_PROCS" 2>/dev/null; exec "$@"' lane \
        nice -n "${LANE_NICE:-0}" "${PYTEST[@]}" -p no:cacheprovider --basetemp="$work/tmp-$name" "$@" \
        > "${LOGS[$name]}" 2>&1 &
    PIDS[$name]=$!
    echo "run: lane $name started (pid ${PIDS[$name]}): pytest $*"
}

# Lane B, no containers, in four pytests that share nothing (own temp roots, free ports):
#   P   -m "provision and not standin"  the provision playbook and the first-deploy runbook against the
#                                        Proxmox API stand-in with fake LXC: chains of ansible-playbook runs;
#   B1  the multi-rank trainer runs (test_trainer, test_multi_rank, test_evaltrain), test_regenerate, and the
#       files of two session runs (tests/conftest.py: the DFlash2 run's, the learning run's);
#   B3  the other files whose tests start a training job: every job is a supervisor and its rank
#       processes, each importing torch and transformers (about 5 CPU-s) before its first step;
#   B2  everything else without a container (a new test file lands here).
# On 2 cores the run's wall time is at least its longest lane's CPU, so no lane may hold much more than
# a sixth of the suite's: B2 alone took 785 CPU-s (2026-12-06), which B2 and B3 now share.
B1_FILES=(tests/engine/test_trainer.py tests/serving/test_regenerate.py tests/distributed/test_multi_rank.py tests/engine/test_evaltrain.py
          tests/engine/test_warm_start.py tests/model/test_dflash2.py tests/engine/test_fp8.py tests/ops/test_loss_no_redundant_work.py)
B3_FILES=(tests/distributed/test_streamcheck.py tests/ansible/test_molecule_multinode.py tests/chain/test_hybrid_chain.py
          tests/distributed/test_heartbeat.py tests/model/test_families.py tests/distributed/test_startup.py
          tests/model/test_contract.py tests/model/test_identity.py
          tests/engine/test_resume_contract.py tests/distributed/test_launch.py)
existing() { local f; for f in "$@"; do [[ -f "$f" ]] && echo "$f"; done; }
mapfile -t B1_FILES < <(existing "${B1_FILES[@]}")
mapfile -t B3_FILES < <(existing "${B3_FILES[@]}")
B_MARK="not standin and not provision and not real"
# B1..B3 only compute; the container lanes (P, F, A-*) are chains of short steps (ssh, pct exec, a
# module, a poll) that each wait for a core, and each multi-rank trainer test runs 3-4 busy processes.
# Niced, the B lanes take the cores the chains leave, instead of making every step of a chain queue
# behind them (their tests' time bounds are on detection and exits, measured from the event).
# marked NAME: the test files that use pytest marker NAME, for the lanes that run one marker's tests
# (collecting the whole suite imports every test module: about 10 CPU-s a pytest); -m still selects
marked() { grep -rlE --include='test_*.py' "pytest\.mark\.$1\b" tests | sort; }
mapfile -t P_FILES < <(marked provision)
mapfile -t R_FILES < <(marked real)
mapfile -t F_FILES < <(marked faults)
mapfile -t A_FILES < <(marked standin)
lane P -m "provision and not standin" "${P_FILES[@]}"
(( ${#B1_FILES[@]} )) && LANE_NICE=10 lane B1 -m "$B_MARK" "${B1_FILES[@]}"
(( ${#B3_FILES[@]} )) && LANE_NICE=10 lane B3 -m "$B_MARK" "${B3_FILES[@]}"
LANE_NICE=10 lane B2 -m "$B_MARK" "${B1_FILES[@]/#/--ignore=}" "${B3_FILES[@]/#/--ignore=}"
# Lane R: the real pretrained model (tests/chain/test_real_model.py): dflash-real builds it once per machine into
# $DFLASH_REAL_CACHE (default /var/lib/dflash-real, kept like the stand-in's caches), then the README's chain
# on it. Niced less than the B lanes (nice 5 weighs three times nice 10): it is one chain, the longest in
# CPU (about 800 s on 2026-12-06), so the run ends when it does; at nice 10 beside three B lanes its
# 30-step training timed out (1,800 s) on a loaded machine.
LANE_NICE=5 lane R -m real "${R_FILES[@]}"

# Lane A's test ids, collected while the caches build (collection imports every test module).
"$PY" -m pytest -p no:cacheprovider --collect-only -q -m "standin and not faults" "${A_FILES[@]}" > "$work/collect.txt" 2>&1 &
collect_pid=$!
# Lane A: the caches every stand-in copies, built once before the scenarios start side by side
# (two first builds at once would both debootstrap, and race on the rename).
if [[ $EUID -eq 0 ]] && command -v debootstrap >/dev/null && command -v lxc-start >/dev/null; then
    t=$(date +%s)
    tests/standin/build-rootfs.sh --bare >/dev/null
    tests/standin/standin.sh wheelhouse >/dev/null
    tests/standin/standin.sh tiny >/dev/null
    DFLASH_STANDIN_ARCH=qwen3_5 tests/standin/standin.sh tiny >/dev/null   # molecule multinode's target
    echo "run: stand-in caches (rootfs, bare rootfs, wheelhouse, tiny models) ready in $(( $(date +%s) - t ))s"
fi
lane F -m faults "${F_FILES[@]}"
# One process per molecule scenario test: the collected ids, so a new scenario runs without an edit here.
set +e; wait "$collect_pid"; rc_collect=$?; set -e
mapfile -t scenarios < <(grep '::' "$work/collect.txt" || true)
if (( rc_collect != 0 )) || (( ${#scenarios[@]} == 0 )); then
    echo "run: collecting the container tests failed (exit $rc_collect); one lane A runs them all"
    cat "$work/collect.txt"
    lane A -m "standin and not faults"
else
    # each lane named for its scenario: tests/x.py::test_molecule_default_scenario -> A-molecule_default
    for id in "${scenarios[@]}"; do
        name="${id##*::test_}"; name="${name%_scenario}"; name="A-${name//[^A-Za-z0-9_]/_}"
        [[ -n "${LOGS[$name]:-}" ]] && name="$name-$(( ${#LOGS[@]} ))"
        lane "$name" "$id"
    done
fi

# Each lane's log, whole, when it ends (in the order they end).
while (( ${#PIDS[@]} )); do
    for name in "${!PIDS[@]}"; do
        pid=${PIDS[$name]}
        kill -0 "$pid" 2>/dev/null && continue
        set +e; wait "$pid"; RCS[$name]=$?; set -e
        TOOK[$name]=$(( $(date +%s) - T0[$name] ))
        [[ -n "$CG" ]] && CPU[$name]=$(cpu_s "$name")
        unset "PIDS[$name]"
        echo "================ lane $name: exit ${RCS[$name]} after ${TOOK[$name]}s, ${CPU[$name]:-?}s CPU ================"
        cat "${LOGS[$name]}"
    done
    (( ${#PIDS[@]} )) && sleep 2
done
# (The EXIT trap stays: it puts the lxc/ weight back at the end, after the summary.)

if compgen -G "$DFLASH_FAULTS_EVIDENCE/*.json" >/dev/null; then
    "$PY" tests/faults/report.py "$DFLASH_FAULTS_EVIDENCE" --out "$DFLASH_FAULTS_EVIDENCE/faults-report.md" \
        || echo "run: tests/faults/report.py failed"
fi
echo "================ summary ================"
overall=0
for name in $(printf '%s\n' "${!RCS[@]}" | sort); do
    printf '%s\t%s\t%s\t%s\n' "$name" "${RCS[$name]}" "${TOOK[$name]}" "${CPU[$name]:-?}"
    (( RCS[$name] == 0 )) || overall=${RCS[$name]}
done > "$work/lanes.tsv"
wall=$(( $(date +%s) - start ))
busy=$(( $(machine_busy_s) - busy0 ))
containers=$(( $(containers_cpu_s) - containers0 ))
set +e; "$PY" tests/budget.py "$work" "$wall" "$busy" "$containers"; rc_budget=$?; set -e
(( overall == 0 && rc_budget == 3 )) && overall=3
echo "run: all lanes done after ${wall}s in all (host setup included) on $(getconf _NPROCESSORS_ONLN) cores; logs in $work"
rm -rf "$work/tmp-"* "$work/tiny"
# The lanes' cgroups go when empty; a process a test left running keeps its cgroup (and is named),
# never the exit status (CI's all-green run once ended with exit 1 here: under set -e, "$CG"/* also
# matched the cgroup's own interface files, which rmdir refuses).
if [[ -n "$CG" ]] && ! rmdir "$CG"/*/ "$CG" 2>/dev/null; then
    echo "run: still running in the lanes' cgroups: $(cat "$CG"/*/cgroup.procs "$CG"/*/tasks 2>/dev/null | xargs -r ps -o comm= -p | sort | uniq -c | tr -s ' \n' ' ')"
fi
exit "$overall"
