"""A quiet first contact (issue 28): every console script's --help, and a normal run, print only our
own lines. Before, every call printed two "Failed to load ... torchao ... .so" lines and two torch
pytree deprecation warnings (transformers imports torchao whenever it is installed), and dflash-tiny a
"Writing model shards" progress bar; they reached the unit's journal too. Each script runs in a
fresh interpreter, as a newcomer runs it, from its entry point in pyproject.toml."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
NOISE = ("Failed to load", "_pytree.py", "is deprecated", "Warning:", "it/s]")   # what others printed before


# script -> (the module it runs (trainer/cli.py), modules its fresh interpreter must not have imported by its
# exit), checked by its --help run: the eval tool leaves the training engine out (it runs where only serving does)
NOT_IMPORTED = {"dflash-eval": ("trainer.serving.evaluate", {"trainer.engine.train"})}


def _run(name: str, *args: str, timeout: float = 300, modules_to=None) -> subprocess.CompletedProcess:
    """The script `name` in a fresh interpreter; with `modules_to`, its sys.modules at exit go there."""
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; from {module} import {func} as main; sys.argv[0] = {name!r}; sys.exit(main())"
    if modules_to:
        code = (f"import atexit, sys; atexit.register(lambda: open({str(modules_to)!r}, 'w')"
                f".write(chr(10).join(sorted(sys.modules)))); " + code)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=timeout)


def test_every_console_script_is_checked():
    assert {"dflash-train", "dflash-status", "dflash-tiny", "dflash-eval", "dflash-export"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_prints_usage_and_nothing_on_stderr(name, tmp_path):
    r = _run(name, "--help", modules_to=tmp_path / "modules" if name in NOT_IMPORTED else None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: "), r.stdout[:300]
    assert r.stderr == "", r.stderr
    assert not [n for n in NOISE if n in r.stdout], r.stdout[:2000]
    if name in NOT_IMPORTED:
        runs, absent = NOT_IMPORTED[name]
        modules = set((tmp_path / "modules").read_text().splitlines())
        assert runs in modules and not modules & absent, (runs in modules, modules & absent)


@pytest.mark.slow
def test_a_normal_run_prints_only_our_lines(tmp_path):
    """dflash-tiny, then two optimizer steps of dflash-train on the CPU (supervisor and ranks, each a
    fresh interpreter that imports transformers): nothing on stderr, no foreign line on stdout."""
    r = _run("dflash-tiny", str(tmp_path / "tiny"), "--num-train", "16", "--num-heldout", "0")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = _run("dflash-train", "--target-model", str(tmp_path / "tiny" / "target"),
             "--data-dir", str(tmp_path / "tiny" / "data"), "--output-dir", str(tmp_path / "out"),
             "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--token-budget", "1024", "--max-seq-len", "256",
             "--block-size", "8", "--max-anchors", "8", "--num-draft-layers", "2", "--max-steps", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr == "", r.stderr
    assert "training complete: 2 steps" in r.stdout, r.stdout[-2000:]
    foreign = [ln for ln in r.stdout.splitlines() if not re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z [A-Z]+ +trainer", ln)]
    assert not foreign, foreign


def test_a_refused_start_says_why_in_status_json_of_an_existing_output_dir(tmp_path):
    """Bad input at start is one line on stderr and exit 2; in a job's output dir status.json says failed
    with the same reason (the fault suite's corrupt shard: since shards are hashed before any rank starts,
    dflash-status showed the previous run's `done`). A mistyped output dir is not created."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "status.json").write_text('{"phase": "done", "step": 7}')
    args = ["--target-model", str(tmp_path / "no-such-model"), "--data-dir", str(tmp_path), "--target-gpus", "cpu",
            "--drafter-gpus", "cpu"]
    r = _run("dflash-train", *args, "--output-dir", str(out), timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("dflash-train: error: --target-model")
    import json
    st = json.loads((out / "status.json").read_text())
    assert st["phase"] == "failed" and st["error"] == r.stderr.strip().removeprefix("dflash-train: error: ")
    assert st["step"] == 7
    r = _run("dflash-train", *args, "--output-dir", str(tmp_path / "typo" / "out"), timeout=600)
    assert r.returncode == 2 and not (tmp_path / "typo").exists()
