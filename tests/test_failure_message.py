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
