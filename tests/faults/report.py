"""Render the fault suite's evidence as the results table of docs/reliability.md.

tests/faults/test_faults.py writes one JSON per case (what it saw: steps, checkpoints, unit state, journal
lines, timings) and 00-setup.json (commit, start and end, CPUs, load) to $DFLASH_FAULTS_EVIDENCE;
tests/run.sh renders them after the suite. The expectation of each case is its test's docstring and
the result is read from its evidence, so the table cannot say more than a run saw.

    python tests/faults/report.py EVIDENCE_DIR                      # the table on stdout
    python tests/faults/report.py EVIDENCE_DIR --out report.md      # into a file
    python tests/faults/report.py EVIDENCE_DIR --docs docs/reliability.md   # replace the doc's block
    python tests/faults/report.py --check docs/reliability.md       # the doc's rows == the suite's cases
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "tests" / "faults" / "test_faults.py"
BEGIN = "<!-- BEGIN fault-suite results (tests/faults/report.py renders this block from the suite's evidence) -->"
END = "<!-- END fault-suite results -->"


def suite_cases() -> dict[str, str]:
    """{case id as pytest names it (test_05_...[unknown-flag]): its test's docstring}, in file order."""
    sys.path.insert(0, str(SUITE.parent))   # faultlib.py, beside the suite
    spec = importlib.util.spec_from_file_location("dflash_fault_suite", SUITE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = {}
    for name, fn in vars(mod).items():
        if not name.startswith("test_") or not callable(fn):
            continue
        doc = " ".join((fn.__doc__ or "").split())
        ids = [None]
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "parametrize":
                values = list(mark.args[1])
                ids = list(mark.kwargs.get("ids") or [str(v) for v in values])
        for i in ids:
            cases[name if i is None else f"{name}[{i}]"] = doc
    return cases


def _j(lines, *needles) -> str:
    """The first journal line holding one of needles, without its timestamp and host."""
    for line in lines or []:
        if any(n in line for n in needles):
            line = re.sub(r"^.*?\]: ", "", str(line))                          # journal: date host unit[pid]:
            return re.sub(r"^\d{4}-\d\d-\d\dT\S+Z\s+\w+\s+", "", line).strip()  # the trainer's own stamp
    return ""


def _name(path) -> str:
    return Path(str(path)).name if path else "?"


def observed(case: str, ev: dict) -> str:
    """One cell: what the case saw, from its evidence (fields absent when it failed early say None)."""
    try:
        return _observed(case, ev)
    except Exception as e:  # noqa: BLE001  evidence of a case that failed early: say what is there
        return f"(evidence incomplete: {type(e).__name__}) " + _plain(ev)


def _plain(ev: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in ev.items() if isinstance(v, (int, float, str)))[:400]


def _observed(case: str, ev: dict) -> str:
    g = ev.get
    if case.startswith("test_01"):
        rep = {int(k): v for k, v in (g("replayed_steps") or {}).items()}
        return (f"killed pid {g('killed_pid')} at step {g('status_at_kill')} (checkpoints {g('checkpoints_at_kill')}); "
                f"restarts {g('n_restarts')}; resumed from {_name(g('resumed_from'))}, seq_next "
                f"{(g('checkpoint') or {}).get('seq_next')}; steps {sorted(rep)} trained again with the same tokens "
                f"and loss ({'; '.join(f'{s}: {v[0]:.6f} / {v[1]:.6f}' for s, v in sorted(rep.items())[:3])})")
    if case.startswith("test_02"):
        return (f"save killed in {g('tmp_dir_at_kill')} (files {g('tmp_files')}); complete at the kill "
                f"{g('complete_at_kill')}; resumed from {_name(g('resumed_from'))}; "
                f"journal: `{_j(g('journal'), 'stale checkpoint')}`")
    if case.startswith("test_03"):
        u = g("unit") or {}
        return (f"stopped at step {g('step_stopped')} in {g('stop_took_s')} s (TimeoutStopSec {g('timeout_stop_s')} s), "
                f"checkpoint {g('checkpoint_after_s')} s after the stop began; {u.get('ActiveState')}/{u.get('Result')}, "
                f"exit status {u.get('ExecMainStatus')}, is-failed `{g('is_failed')}`")
    if case.startswith("test_04"):
        a, r, c, rep = (g("truncated_json") or {}), (g("restart_yml_failed") or {}), (g("crash_loop") or {}), \
            (g("repair") or {})
        ua = a.get("unit") or {}
        return (f"(a) truncated JSON: {ua.get('ActiveState')}, exit {ua.get('ExecMainStatus')}, "
                f"`{_j(a.get('journal'), 'error:')}`, no restart; (b) wrong shape: {c.get('starts')} starts "
                f"(StartLimitBurst {(c.get('limits') or {}).get('StartLimitBurst')}), "
                f"`{_j(c.get('journal'), 'repeated too quickly')}`; restart.yml rc {r.get('rc')} after {r.get('seconds')} s "
                f"in `{r.get('failed_task')}`; checkpoints unchanged {g('checkpoints_unchanged')}; repaired: "
                f"restart.yml {rep.get('restart_yml_s')} s, resumed from {_name(rep.get('resumed_from'))}")
    if case.startswith("test_05"):
        msg = next((m for m in g("message") or [] if "msg" in m or "error" in m), "")
        return (f"rc {g('rc')} after {g('seconds')} s in `{g('failed_task')}`, changed={g('changed_on_ct201')}: "
                f"`{msg.strip()[:240]}`; pid {g('pid')}, restarts {g('n_restarts')}, step {g('step')}")
    if case.startswith("test_06"):
        return (f"`pct reboot` took {g('reboot_s')} s; previous run: `{_j(g('previous_run_log'), 'stopped cleanly')}`; "
                f"staging unit {(g('stage_unit') or {}).get('Result')}, verified {g('stamp_verified_after_reboot_s')} s "
                f"after the reboot began; resumed from {_name(g('resumed_from'))}, step {g('step_after')}, pid {g('pid')}")
    if case.startswith("test_07"):
        st = g("status") or {}
        return (f"`{_j(g('journal'), 'training failed')[:260]}`; status.json phase {st.get('phase')}; checkpoints "
                f"{g('checkpoints_before')} -> {g('checkpoints_after')}, left: {g('dirs_after')}")
    if case.startswith("test_08"):
        u, ds = (g("unit") or {}), (g("dflash_status") or {})
        return (f"`{_j(g('journal'), 'error:')[:260]}`; {u.get('ActiveState')}, exit {u.get('ExecMainStatus')}, "
                f"restarts {u.get('NRestarts')}; dflash-status rc {ds.get('rc')}, phase {ds.get('phase')}")
    if case.startswith("test_09"):
        skipped = [m[0] for m in g("metrics") or [] if m[2]]
        good = (g("last_good_checkpoint") or {}).get("step")
        return (f"NaN from step {g('nan_from')}, --max-nan-skips {g('max_nan_skips')}: skipped steps {skipped}; "
                f"`{(g('status') or {}).get('error', '')[:200]}`; last good checkpoint step {good} (finite); "
                f"resumed from {_name(g('resumed_from'))}, step {g('step_after')}")
    if case.startswith("test_10"):
        return (f"hung at step {g('hang_at')} (WatchdogSec {g('watchdog')}): `{_j(g('journal'), 'Watchdog timeout')}`, "
                f"`{_j(g('journal'), 'Killing process')}`; detected and restarted {g('detected_after_hang_s')} s after "
                f"the hang was seen; restarts {g('n_restarts')}; resumed from {_name(g('resumed_from'))}")
    return _plain(ev)


def render(evidence: Path) -> str:
    cases = suite_cases()
    run = json.loads((evidence / "00-setup.json").read_text()) if (evidence / "00-setup.json").exists() else {}
    rows, passed, failed, missing = [], 0, 0, 0
    for n, (case, doc) in enumerate(cases.items(), 1):
        f = evidence / f"{case.replace('/', '_')}.json"
        ev = json.loads(f.read_text()) if f.exists() else {}
        outcome = ev.get("outcome", "not run")
        passed += outcome == "passed"
        failed += outcome == "failed"
        missing += outcome == "not run"
        result = f"**{outcome.capitalize()}**" + (f" ({ev['duration_s']:.0f} s)" if "duration_s" in ev else "")
        cell = (result + (". " + observed(case, ev) if ev else "")).replace("|", "\\|").replace("\n", " ")
        key = case.split("_", 2)[2].split("[")[0] if "[" not in case else case.split("[")[1].rstrip("]")
        rows.append(f"| {n} | `{case}` | {doc.replace('|', '/')} | {cell} | `pytest -m faults -k {key}` |")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run["started_at"])) if "started_at" in run else "?"
    took = f", {run['ended_at'] - run['started_at']:.0f} s in all" if "ended_at" in run else ""
    load = [f"{run[k]:.1f}" if isinstance(run.get(k), (int, float)) else "?" for k in ("loadavg_at_start", "loadavg_at_end")]
    head = (f"Run of {when} at commit `{run.get('commit') or '?'}` on {run.get('cpus', '?')} CPUs (1-minute load "
            f"{load[0]} at the start, {load[1]} at the end): "
            f"**{passed} passed, {failed} failed, {missing} not run** of {len(cases)}; stand-in and first deploy "
            f"{run.get('setup_s', '?')} s{took}. Durations are the case's own (restoring a healthy job before it "
            f"not included).")
    return "\n".join([BEGIN, head, "", "| # | Case | Expectation | Result (observed) | Reproduce |",
                      "|---|------|-------------|-------------------|-----------|", *rows, END])


def check(doc: Path) -> list[str]:
    """Problems: the doc's generated block is missing, or its rows are not exactly the suite's cases."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        return [f"{doc}: no generated block ({BEGIN})"]
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \|", block, re.M)
    cases = list(suite_cases())
    problems = [f"{doc}: row for {c}, which tests/faults/test_faults.py does not have" for c in rows if c not in cases]
    problems += [f"{doc}: no row for {c} (render it: tests/faults/report.py EVIDENCE --docs {doc})"
                 for c in cases if c not in rows]
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tests/faults/report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("evidence", nargs="?", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--docs", type=Path, help="replace the generated block of this markdown file")
    ap.add_argument("--check", type=Path, help="check that this doc's block lists exactly the suite's cases")
    a = ap.parse_args(argv)
    if a.check:
        problems = check(a.check)
        print("\n".join(problems) or f"{a.check}: the results block lists the suite's {len(suite_cases())} cases")
        return 1 if problems else 0
    if a.evidence is None:
        ap.error("EVIDENCE_DIR is required unless --check")
    block = render(a.evidence)
    if a.docs:
        text = a.docs.read_text()
        if BEGIN in text and END in text:
            text = text.split(BEGIN, 1)[0] + block + text.split(END, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        a.docs.write_text(text)
    if a.out:
        a.out.write_text(block + "\n")
    if not a.docs and not a.out:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
