"""A resume is a contract (issue 51 item 4): a changed block size, --arch or --loss is refused in one line
naming the flag, this run's value and the checkpoint's, before anything in the output dir is touched
(status.json, logs and checkpoints stay as they were)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model.test_identity import one_line, snapshot, tiny_args
from trainer.__main__ import main as train_main
from trainer.model.checkpoint_format import CheckpointManager, ResumeChanged, check_resume_keeps

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tiny_trained_dir):
    """One checkpoint (step 2) of block 8, dflash, ce+dpace on hard labels (the defaults; tests/conftest.py's
    2-step run, shared with the other tests that resume from it)."""
    return tiny_trained_dir


@pytest.mark.parametrize("extra, needle", [
    (["--block-size", "4"], "--block-size: this run's 4, the checkpoint's 8 (resuming "),
    (["--arch", "dflash2"], "--arch: this run's dflash2, the checkpoint's dflash (resuming "),
    (["--loss", "ce"], "--loss: this run's ce, the checkpoint's ce+dpace (resuming "),
], ids=["block-size", "arch", "loss"])
def test_a_changed_block_size_arch_or_loss_is_refused_and_nothing_is_touched(tiny_small_dir, trained, extra,
                                                                              needle, capfd):
    before = snapshot(trained)
    args = tiny_args(tiny_small_dir, trained, "--max-steps", "3", "--no-use-soft-labels", "--loss", "ce+dpace")
    assert train_main(args + extra) == 2
    err = one_line(capfd.readouterr().err)
    assert err.startswith("dflash-train: error: " + needle.split(":")[0]) and needle in err, err
    assert "step-00000002" in err and err.endswith("or another --output-dir to train a new drafter)")
    assert snapshot(trained) == before


def test_the_same_flags_resume(tiny_small_dir, trained):
    args = tiny_args(tiny_small_dir, trained, "--max-steps", "3", "--no-use-soft-labels", "--loss", "ce+dpace",
                     "--check-config")
    assert train_main(args) == 0


def test_a_resume_check_reads_the_checkpoint_without_starting_torch(tiny_small_dir, trained):
    """--check-config judges a resume from the checkpoint's names and meta.json alone: in a fresh interpreter it
    passes, and then refuses a changed block size, without importing torch (trainer/model/checkpoint_format.py
    loads torch only where tensors are read or written; the unit's preflight runs it at every start)."""
    args = tiny_args(tiny_small_dir, trained, "--max-steps", "3", "--no-use-soft-labels", "--loss", "ce+dpace",
                     "--check-config")
    code = ("import sys\nfrom trainer.__main__ import main\n"
            f"print(main({args!r}), main({args + ['--block-size', '4']!r}), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].split() == ["0", "2", "False"], (r.stdout, r.stderr)


def test_a_checkpoint_without_a_run_config_is_judged_by_its_drafter_config(tmp_path):
    """Older checkpoints: config.json's block size and architecture; no loss recorded, none compared."""
    import torch
    out = CheckpointManager(tmp_path).save(3, {"w": torch.zeros(1)}, {"block_size": 16,
                                                                     "architectures": ["DFlashDraftModel"]}, {})

    class Cfg:
        block_size, arch, loss = 16, "dflash", "ce+dpace"
    check_resume_keeps(Cfg, out)
    Cfg.block_size = 32
    with pytest.raises(ResumeChanged, match=r"^--block-size: this run's 32, the checkpoint's 16 "):
        check_resume_keeps(Cfg, out)
