"""trainer/lab/gpu/old_drafter_baseline.py refuses what would time the wrong work: a directory without a bench,
and a target cut that would hand the drafter fewer distinct taps (a narrower fc) than the full target."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "trainer" / "lab" / "gpu" / "old_drafter_baseline.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_a_directory_without_a_bench_is_refused(tmp_path):
    r = run(str(tmp_path), "--", "--shape", "tiny")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"old_drafter_baseline: {tmp_path}: no trainer/bench.py, trainer/tools/bench.py, "
                                        "trainer/lab/bench/run.py there"]


def test_a_cut_that_merges_taps_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """In this process: the command line is the test above's business, and a process of its own imported the
    trainer's engine and model (about 12 CPU-s a run) that this one has already. The checkout is this one."""
    from trainer.lab.bench import run as bench
    from trainer.lab.gpu import old_drafter_baseline
    monkeypatch.setattr(sys, "path", list(sys.path))          # the script puts the checkout first
    monkeypatch.setattr(bench, "make_target_factory", bench.make_target_factory)   # and cuts the target
    # the tiny shape has 8 layers: taps [1..5]; 6 layers would give [1, 2, 2, 2, 3]
    out = tmp_path / "b.json"
    assert old_drafter_baseline.main([str(REPO), "--target-layers", "6", "--", "--shape", "tiny", "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("old_drafter_baseline: --target-layers 6: gives taps [1, 2, 2, 2, 3]"), last
    assert not out.exists()
    # one tap per drafter layer: with 3 drafter layers, 6 target layers still give 3 distinct taps,
    # so the same cut passes the check (the bench then fails fast on its own unknown-variant check)
    with pytest.raises(SystemExit) as e:
        old_drafter_baseline.main([str(REPO), "--target-layers", "6", "--", "--shape", "tiny", "--set",
                                   "num_draft_layers=3", "--variants", "no-such-variant"])
    err = capsys.readouterr().err
    assert "gives taps" not in err and "no-such-variant" in str(e.value), (err[-2000:], e.value)
