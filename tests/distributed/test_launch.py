"""The NaN failure message, as status.json and dflash-status show it, says its cause once (issue 30).

The rank records `rank 0: <why>`; the supervisor then wrote `rank 0 failed (exit 1): TrainingFailed: <why>;
rank 0: <why>` (the supervisor, trainer/distributed/launch.py, joined the two), so every reader saw the reason twice."""

from __future__ import annotations

import json

from trainer.__main__ import main as train_main

WHY = "consecutive optimizer steps had a non-finite loss or gradient"


def test_nan_failure_states_its_reason_once(tiny_small_dir, tmp_path, monkeypatch, capfd):
    out = tmp_path / "nan"
    monkeypatch.setenv("DFLASH_FAULT_NAN_FROM_STEP", "2")
    rc = train_main(["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(tiny_small_dir / "data"),
                     "--output-dir", str(out), "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--token-budget",
                     "1024", "--max-seq-len", "256", "--block-size", "8", "--max-anchors", "8", "--num-draft-layers",
                     "2", "--grad-accum", "1", "--max-steps", "10", "--max-nan-skips", "2", "--profile-interval",
                     "600"])
    assert rc == 1
    err = json.loads((out / "status.json").read_text())["error"]
    assert err.count(WHY) == 1, err
    assert err.startswith("rank 0 failed (exit 1): ") and "--max-nan-skips 2" in err, err
    ours = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("dflash-train: error: ")]
    assert len(ours) == 1 and ours[0].count(WHY) == 1, ours


def test_the_supervisor_names_the_cause_not_the_launchers_own_signals():
    """Which failed rank the supervisor reports (launch.failure_cause). A rank killed by a signal is the cause
    (an OOM kill; its peers' errors, a second later, are echoes); the SIGTERM the launcher sends the survivors
    is not, nor the SIGKILL it sends one that did not stop within its shutdown wait (recorded after that wait:
    the two-node stand-in's traffic drop, where a target stuck in a send was SIGKILLed 30 s after rank 0's
    timeout and the report blamed the SIGKILL)."""
    from types import SimpleNamespace as F

    from trainer.distributed.launch import failure_cause
    oom = {0: F(exitcode=1, timestamp=100), 1: F(exitcode=-9, timestamp=101), 2: F(exitcode=-15, timestamp=101)}
    assert failure_cause(oom)[0] == 1
    drop = {0: F(exitcode=1, timestamp=120), 1: F(exitcode=1, timestamp=121), 2: F(exitcode=-9, timestamp=151)}
    assert failure_cause(drop)[0] == 0
    stopped = {0: F(exitcode=-15, timestamp=10), 1: F(exitcode=1, timestamp=12)}
    assert failure_cause(stopped)[0] == 1
