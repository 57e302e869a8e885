"""The suite's budget check (tests/budget.py, run by tests/run.sh at the end of a full run): every lane's
exit, wall and CPU seconds with its costliest tests, and an overrun named: the lane over its CPU share
with its costliest tests, the run over 25 minutes wall or 40 CPU-minutes. A warning unless
DFLASH_SUITE_BUDGET_STRICT=1, and never in place of a failed lane's exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import budget  # noqa: E402


def _work(tmp_path: Path, lanes: dict[str, tuple[int, int, int | str]], tests: dict[str, dict]) -> Path:
    """A run directory as tests/run.sh leaves it: lanes.tsv, each lane's log and per-test costs."""
    rows = []
    for name, (rc, wall, cpu) in lanes.items():
        rows.append(f"{name}\t{rc}\t{wall}\t{cpu}")
        (tmp_path / f"{name}.log").write_text(f"...\n======= {3 if rc else 5} passed in {wall}.00s =======\n")
        if name in tests:
            (tmp_path / f"{name}.tests.json").write_text(json.dumps(tests[name]))
    (tmp_path / "lanes.tsv").write_text("\n".join(rows) + "\n")
    return tmp_path


def _run(work: Path, wall: int, busy: int, containers: int, strict: bool = False):
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_SUITE_BUDGET_STRICT"}
    if strict:
        env["DFLASH_SUITE_BUDGET_STRICT"] = "1"
    return subprocess.run([sys.executable, str(TESTS / "budget.py"), str(work), str(wall), str(busy), str(containers)],
                          capture_output=True, text=True, env=env)


def _cost(cpu: float, wall: float) -> dict:
    return {"cpu_s": cpu, "wall_s": wall}


B2_TESTS = {"tests/test_a.py::test_cheap": _cost(1.0, 1.5), "tests/test_b.py::test_heavy": _cost(300.0, 320.0),
            "tests/test_c.py::test_mid": _cost(40.0, 41.0), "tests/test_d.py::test_waits": _cost(2.0, 400.0),
            "tests/test_e.py::test_small": _cost(3.0, 4.0)}


def test_the_shares_add_up_to_the_suites_cpu_budget():
    """Every lane's share, the molecule lanes', the containers' and what runs in no lane are a split of the
    suite's 40 CPU-minutes: a share raised without taking it from another would pass a run over budget."""
    total = (sum(budget.LANE_CPU_S.values()) + budget.CONTAINER_LANES * budget.CONTAINER_LANE_CPU_S
             + budget.CONTAINERS_CPU_S + budget.SETUP_CPU_S)
    assert total <= budget.SUITE_CPU_S, total
    scenarios = sorted(p.parent.name for p in (TESTS.parent / "molecule").glob("*/molecule.yml"))
    assert len(scenarios) == budget.CONTAINER_LANES, scenarios   # run.sh runs each in a lane of its own


def test_within_budget_prints_each_lane_with_its_costliest_tests(tmp_path):
    cpu = budget.LANE_CPU_S["B2"] - 10
    work = _work(tmp_path, {"B2": (0, 500, cpu), "P": (0, 300, 100)}, {"B2": B2_TESTS})
    r = _run(work, 1200, 2000, 50)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    lane = next(i for i, ln in enumerate(out) if ln.startswith(f"run: lane B2 exit 0 in 500s wall, {cpu}s CPU"))
    shown = [ln.split()[-1] for ln in out[lane + 1:lane + 6]]
    # the three of most CPU, then the one that waited longest (not among them), then the next lane
    assert shown == ["tests/test_b.py::test_heavy", "tests/test_c.py::test_mid", "tests/test_e.py::test_small",
                     "tests/test_d.py::test_waits", shown[4]] and out[lane + 5].startswith("run: lane P ")
    assert out[lane + 1].split() == ["run:", "300.0s", "cpu", "320.0s", "wall", "tests/test_b.py::test_heavy"]
    assert "5 passed in 500.00s" in out[lane]
    assert "OVER BUDGET" not in r.stdout and "within the budget" in out[-1]


def test_a_lane_over_its_share_is_named_with_its_costliest_tests(tmp_path):
    over = budget.LANE_CPU_S["B2"] + 1
    work = _work(tmp_path, {"B2": (0, 900, over), "R": (0, 600, 100)}, {"B2": B2_TESTS})
    r = _run(work, 1200, 2000, 50)
    warn = [ln for ln in r.stdout.splitlines() if ln.startswith("run: OVER BUDGET")]
    assert warn == [f"run: OVER BUDGET: lane B2 took {over}s CPU, its budget is {budget.LANE_CPU_S['B2']}s "
                    "(costliest: tests/test_b.py::test_heavy 300s, tests/test_c.py::test_mid 40s)"]
    assert r.returncode == 0   # a warning by default


def test_the_run_over_its_wall_and_cpu_names_the_longest_and_costliest_lanes(tmp_path):
    work = _work(tmp_path, {"B1": (0, 1400, 400), "R": (0, 1450, 450)}, {})
    r = _run(work, budget.SUITE_WALL_S + 60, budget.SUITE_CPU_S + 1, budget.CONTAINERS_CPU_S + 1)
    warn = [ln for ln in r.stdout.splitlines() if ln.startswith("run: OVER BUDGET")]
    assert f"run: OVER BUDGET: the run took {budget.SUITE_WALL_S + 60}s wall, the budget is {budget.SUITE_WALL_S}s " \
           "(the longest lane: R, 1450s)" in warn
    assert any(w.startswith(f"run: OVER BUDGET: the cores were busy {budget.SUITE_CPU_S + 1}s") and "lane: R, 450s CPU"
               in w for w in warn)
    assert any("the containers took" in w for w in warn)


def test_strict_exits_3_only_when_every_lane_passed(tmp_path):
    over = budget.LANE_CPU_S["B2"] + 1
    (tmp_path / "green").mkdir()
    green = _work(tmp_path / "green", {"B2": (0, 900, over)}, {})
    assert _run(green, 1000, 1000, 0, strict=True).returncode == 3
    assert _run(green, 1000, 1000, 0).returncode == 0
    (tmp_path / "red").mkdir()
    red = _work(tmp_path / "red", {"B2": (1, 900, over)}, {})
    assert _run(red, 1000, 1000, 0, strict=True).returncode == 0   # run.sh keeps the failed lane's status
    (tmp_path / "ok").mkdir()
    ok = _work(tmp_path / "ok", {"B2": (0, 900, 10)}, {})
    assert _run(ok, 1000, 1000, 0, strict=True).returncode == 0


def test_a_lane_without_cpu_accounting_is_reported_not_judged(tmp_path):
    work = _work(tmp_path, {"A-molecule_default": (0, 900, "?")}, {})
    r = _run(work, 1000, 1000, 0)
    assert r.returncode == 0, r.stderr
    assert "run: lane A-molecule_default exit 0 in 900s wall, ?s CPU" in r.stdout and "OVER" not in r.stdout


def test_conftest_writes_every_tests_cpu_and_wall(tmp_path):
    """The per-test figures the summary reads: conftest.py's hook, in a pytest of its own."""
    out = tmp_path / "costs.json"
    env = dict(os.environ, DFLASH_TEST_CPU_JSON=str(out))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={TESTS.parent}",
                        f"{Path(__file__).resolve()}::test_a_lane_without_cpu_accounting_is_reported_not_judged"],
                       capture_output=True, text=True, env=env, cwd=TESTS.parent)
    assert r.returncode == 0, r.stdout[-2000:]
    costs = json.loads(out.read_text())
    (nodeid, cost), = costs.items()
    assert nodeid.endswith("test_suite_budget.py::test_a_lane_without_cpu_accounting_is_reported_not_judged")
    assert set(cost) == {"cpu_s", "wall_s"} and cost["wall_s"] > 0 and cost["cpu_s"] > 0
    assert "s cpu" in r.stdout and "s wall" in r.stdout and nodeid in r.stdout
