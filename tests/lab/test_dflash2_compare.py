"""trainer/lab/gpu/dflash2_compare.py (issue 43) on the CPU: its commands, as the H200 runs them, parse as the
programs read them and differ only in the recipe; its summary of the records it collects."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainer" / "lab" / "gpu"))
import dflash2_compare as cmp  # noqa: E402


def test_dry_run_checks_the_four_runs_flags_and_they_differ_only_in_the_recipe(capsys):
    assert cmp.main(["--dry-run", "--out", "/nonexistent/x.json"]) == 0   # validate_flags on each run
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6 and "trainer.tools.tiny" in lines[0] and "--device cuda:0" in lines[0]
    assert "--variants base,dflash2" in lines[1] and "--set compile=none" in lines[1]
    runs = cmp.plan(cmp.build_parser().parse_args([]))["runs"]
    assert list(runs) == ["dflash-ce", "dflash-dpace", "dflash2-ce", "dflash2-dpace"]

    def common(argv):   # without the output dir and the recipe's flags
        drop = {"--output-dir", "--arch", "--loss"}
        return [x for i, x in enumerate(argv) if x not in drop and argv[i - 1] not in drop]
    assert len({tuple(common(v)) for v in runs.values()}) == 1
    assert all("--no-use-soft-labels" in v and "--eval-data-dir" in v for v in runs.values())


def test_an_unknown_run_is_one_line_and_exit_2(capsys):
    assert cmp.main(["--dry-run", "--runs", "dflash-ce,dflash3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash2_compare: error: --runs: unknown 'dflash3'")


def test_summary_and_rates_from_the_records(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    recs = [{"step": s, "loss": 3.0 - s / 10, "acc": [0.1 * s, 0.05 * s]} for s in range(1, 21)]
    recs.append({"kind": "eval", "step": 20, "final": True, "tau": 1.5})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 21, "lo')
    assert cmp.acc_tail(out) == [0.1 * 19.5, 0.05 * 19.5]   # the last 10%: steps 19 and 20; a torn line skipped
    s = cmp.summary({"dflash-ce": {"tau": 1.5}, "dflash2-ce": {"tau": 1.65}, "dflash2-dpace": {}})
    assert abs(s["dflash2-ce"]["tau_minus_dflash_ce"] - 0.15) < 1e-12
    assert s["dflash2-dpace"]["tau_minus_dflash_ce"] is None
    bench = {"results": [{"variant": "base", "drafter": {"block_rows_per_s": 200.0}},
                         {"variant": "dflash2", "drafter": {"block_rows_per_s": 150.0}}, {"setting": "(complete)"}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert cmp.bench_rates(tmp_path / "bench.json")["dflash2_over_dflash"] == 0.75



def test_a_failed_runs_error_carries_its_logs_last_lines(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("starting\n\nwarmup done\ndflash-train: error: --eval-prompts: bad\n\n")
    assert cmp.log_tail(log, 2) == "warmup done | dflash-train: error: --eval-prompts: bad"
    assert cmp.log_tail(tmp_path / "missing.log").startswith("no log (")
