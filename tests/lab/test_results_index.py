"""results/ has an index that covers every file (issue 42): each result file is on exactly one line of
results/index.json, every line's files exist, results/INDEX.md is the rendering of it, and a result that
records its commit is indexed under that commit."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("results_index", REPO / "trainer" / "lab" / "results_index.py")
ri = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ri)


def test_every_result_file_has_one_line_and_every_line_a_file():
    assert ri.problems(ri.load_runs()) == []


def test_index_md_is_the_rendering_of_index_json():
    assert ri.INDEX_MD.read_text() == ri.render(ri.load_runs()), \
        "results/INDEX.md is stale: python trainer/lab/results_index.py --write"


def test_the_current_performance_page_quotes_only_indexed_files_and_says_where():
    """Every result the current page cites resolves to an index line, and the index names the page back."""
    runs = ri.load_runs()
    quoted = ri.quotes([f for r in runs for f in r["files"]])
    assert "docs/performance.md: Per-GPU rates: training" in quoted["h200-27b-orig-ctxcopy.json"]
    assert "docs/performance.md: FP8 parity" in quoted["h200-fp8-parity-wide-5.json"]


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    res = tmp_path / "results"
    res.mkdir()
    monkeypatch.setattr(ri, "RESULTS", res)
    return res


def _line(files, commit="abc1234"):
    return {"date": "2026-12-04", "topic": "t", "files": files, "commit": commit, "command": "c", "headline": "h"}


def test_an_unindexed_file_a_missing_file_and_a_double_line_are_named(tmp_results):
    (tmp_results / "a.json").write_text("{}")
    (tmp_results / "new.json").write_text("{}")
    bad = ri.problems([_line(["a.json"]), _line(["gone.json", "a.json"])])
    assert "not indexed: results/new.json" in bad
    assert "indexed but missing: results/gone.json" in bad
    assert "indexed twice: results/a.json" in bad


def test_a_recorded_commit_must_match_the_index(tmp_results):
    (tmp_results / "r.json").write_text(json.dumps({"meta": {"commit": "0123456789abcdef"}}))
    assert ri.problems([_line(["r.json"], commit="0123456")]) == []
    assert ri.problems([_line(["r.json"], commit="fedcba9")]) == [
        "results/r.json: recorded commit 0123456789abcdef, index says fedcba9"]


def test_new_run_takes_commit_date_and_command_from_the_metadata(tmp_results):
    (tmp_results / "r.json").write_text(json.dumps({"meta": {"commit": "0123456789abcdef", "started": 1796342400.0,
                                                             "argv": ["--shape", "8b"]}}))
    line = ri.new_run(tmp_results / "r.json", "training", "1 tok/s")
    assert (line["commit"], line["date"], line["command"]) == ("0123456", "2026-12-04", "--shape 8b")


def test_brace_lists_and_patterns_in_the_docs_count_as_quotes():
    assert ri._expand("h200-{27b-b16,8b-orig}-df36c97.json") == ["h200-27b-b16-df36c97.json", "h200-8b-orig-df36c97.json"]
    assert ri._expand("log-world1-{new,old}.txt.gz") == ["log-world1-new.txt.gz", "log-world1-old.txt.gz"]


def test_a_benchmark_records_the_commit_it_ran_at(monkeypatch):
    """bench's metadata (and results_file's, which the trainer/lab/gpu scripts use) carries `git rev-parse HEAD`,
    or $DFLASH_GIT_COMMIT where the tree was copied without its .git."""
    import subprocess

    from trainer.lab.bench import run as bench
    monkeypatch.delenv("DFLASH_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    got = bench.git_commit()
    assert got["commit"] == head and got["commit_dirty"] in (True, False)
    monkeypatch.setenv("DFLASH_GIT_COMMIT", "0123456789abcdef")
    res, _ = bench.results_file(None, {"shape": "tiny"})
    assert res["meta"]["commit"] == "0123456789abcdef" and res["meta"]["shape"] == "tiny"
