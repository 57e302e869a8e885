"""tests/run.sh's summary and budget: each lane's exit, wall and CPU seconds with its costliest tests, then
the budget check.

The suite's budget, from a fresh clone on a 2-core machine (host setup, the stand-in's caches and the real
model's build included): 25 minutes wall and 40 CPU-minutes (the machine's busy core-seconds from the
start of tests/run.sh to its summary). On 2 cores the wall time is mostly the CPU time shared out, so each
lane has a CPU budget of its own (LANE_CPU_S): a lane over it is named with its costliest tests, which is
where to look first. A lane's CPU is its own processes' (one cgroup per lane); the containers' processes
are accounted apart (LXC puts them under lxc/), as the "containers" line.

By default an overrun is a warning line (`run: OVER BUDGET: ...`) and the exit status stays the tests':
the same commit's wall time moves by minutes with the host and its other load, and a red run whose tests
all passed teaches people to read past red. DFLASH_SUITE_BUDGET_STRICT=1 makes an overrun exit 3 when
every lane passed.

    python tests/budget.py WORK WALL_S BUSY_CPU_S CONTAINERS_CPU_S

WORK is the run's directory: lanes.tsv (name, exit, wall s, CPU s; one line a lane, as run.sh writes it),
NAME.log (the lane's pytest output: its last line is pytest's verdict) and NAME.tests.json (conftest.py's
per-test cost: {nodeid: {cpu_s, wall_s}}).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SUITE_WALL_S = 25 * 60
SUITE_CPU_S = 40 * 60
# Each lane's CPU seconds (its cgroup: pytest and every process it starts, the containers apart), the
# containers' own, and what runs in no lane (SETUP_CPU_S: the host setup, the stand-in's caches and the real
# model's build when they are cold, the collection of lane A's tests) add up to the suite's 2,400
# (test_suite_budget checks the sum). The shares follow the split the lanes' work takes: each is the larger of
# two runs on 2026-12-07 (tests/run.sh on a new machine with every cache cold but the venv, 2,075 busy
# CPU-s; a fresh clone of 2b99c8d, 1,953) plus a tenth, so that a lane over its share has grown. Lane P is a
# chain of ansible-playbook runs (the node and provision roles' module runs, about 5 CPU-s a node-role play,
# 15-20 a whole provision.yml run) and takes the largest share; it had 250 from the split of 2026-12-06, when
# the B lanes took more, and was over it in every run since while the others had a fifth to spare.
LANE_CPU_S = {
    "B1": 285,   # the multi-rank trainer runs, regenerate, eval in training, two session runs (255, 258)
    "B2": 270,   # everything else without a container (245, 234)
    "B3": 240,   # the other files whose tests start a training job (220, 209)
    "P": 385,    # the provision playbook and the first-deploy runbook against the PVE API stand-in (350, 320)
    "R": 260,    # the chain on the real pretrained model (237 with its cache cold, 196)
    "F": 60,     # the fault suite's host side (ansible, ssh; its trainer runs in CT 201) (54, 51)
}
CONTAINER_LANE_CPU_S = 120   # each molecule scenario's host side (A-*): molecule, ansible, ssh, the node's sshd (<= 110)
CONTAINERS_CPU_S = 315       # every stand-in container's own processes (systemd, pip, the paced trainers) (287, 281)
SETUP_CPU_S = 225            # in no lane: host setup, caches, collection (about 180 with every cache cold, 93 warm)
CONTAINER_LANES = 3          # the molecule scenarios: default, multinode, provision
TOP = 3                      # the costliest tests shown per lane


def lane_budget(name: str) -> int:
    return LANE_CPU_S.get(name, CONTAINER_LANE_CPU_S if name.startswith("A") else min(LANE_CPU_S.values()))


def read_lanes(work: Path) -> list[dict]:
    lanes = []
    for line in (work / "lanes.tsv").read_text().splitlines():
        name, rc, wall, cpu = line.split("\t")
        log = work / f"{name}.log"
        last = log.read_text(errors="replace").rstrip().splitlines()[-1:] if log.exists() else []
        tests = work / f"{name}.tests.json"
        lanes.append({"name": name, "rc": int(rc), "wall": int(wall), "cpu": int(cpu) if cpu.isdigit() else None,
                      "verdict": last[0].strip("= ") if last else "(no log)",
                      "tests": json.loads(tests.read_text()) if tests.exists() else {}})
    return lanes


def costliest(tests: dict, n: int = TOP) -> list[tuple[str, float, float]]:
    """The n tests of most CPU, then the one of most wall time if it is not among them (a container lane's
    tests wait more than they compute)."""
    rows = sorted(((k, v["cpu_s"], v["wall_s"]) for k, v in tests.items()), key=lambda r: -r[1])
    top = rows[:n]
    slowest = max(rows, key=lambda r: r[2], default=None)
    if slowest and slowest not in top:
        top.append(slowest)
    return top


def report(lanes: list[dict], wall: int, busy: int, containers: int | None) -> tuple[list[str], list[str]]:
    """(the summary's lines, the overruns' lines)."""
    lines, over = [], []
    for lane in sorted(lanes, key=lambda x: x["name"]):
        cpu = "?" if lane["cpu"] is None else lane["cpu"]
        lines.append(f"run: lane {lane['name']} exit {lane['rc']} in {lane['wall']}s wall, {cpu}s CPU "
                     f"(budget {lane_budget(lane['name'])}s): {lane['verdict']}")
        for nodeid, c, w in costliest(lane["tests"]):
            lines.append(f"run:     {c:7.1f}s cpu {w:7.1f}s wall  {nodeid}")
        if lane["cpu"] is not None and lane["cpu"] > lane_budget(lane["name"]):
            top = ", ".join(f"{k} {c:.0f}s" for k, c, _ in costliest(lane["tests"], 2)[:2])
            over.append(f"run: OVER BUDGET: lane {lane['name']} took {lane['cpu']}s CPU, its budget is "
                        f"{lane_budget(lane['name'])}s" + (f" (costliest: {top})" if top else ""))
    if containers is not None:
        lines.append(f"run: the containers' own processes: {containers}s CPU (budget {CONTAINERS_CPU_S}s)")
        if containers > CONTAINERS_CPU_S:
            over.append(f"run: OVER BUDGET: the containers took {containers}s CPU, their budget is {CONTAINERS_CPU_S}s")
    last = max(lanes, key=lambda x: x["wall"], default=None)
    lines.append(f"run: {wall}s wall in all (budget {SUITE_WALL_S}s), the cores busy {busy}s "
                 f"(budget {SUITE_CPU_S}s; host setup, caches, containers and any other work included)")
    if wall > SUITE_WALL_S:
        over.append(f"run: OVER BUDGET: the run took {wall}s wall, the budget is {SUITE_WALL_S}s"
                    + (f" (the longest lane: {last['name']}, {last['wall']}s)" if last else ""))
    if busy > SUITE_CPU_S:
        heavy = max((x for x in lanes if x["cpu"] is not None), key=lambda x: x["cpu"], default=None)
        over.append(f"run: OVER BUDGET: the cores were busy {busy}s, the budget is {SUITE_CPU_S}s"
                    + (f" (the costliest lane: {heavy['name']}, {heavy['cpu']}s CPU)" if heavy else ""))
    return lines, over


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: budget.py WORK WALL_S BUSY_CPU_S CONTAINERS_CPU_S", file=sys.stderr)
        return 2
    work, wall, busy, containers = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    lanes = read_lanes(work)
    lines, over = report(lanes, wall, busy, int(containers) if containers.isdigit() else None)
    print("\n".join(lines + (over or [f"run: within the budget ({SUITE_WALL_S}s wall, {SUITE_CPU_S}s CPU)"])))
    strict = os.environ.get("DFLASH_SUITE_BUDGET_STRICT") == "1"
    return 3 if over and strict and all(x["rc"] == 0 for x in lanes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
