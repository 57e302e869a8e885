"""The in-training eval's pause, as systemd sees it: status.json says eval and keeps moving."""

from __future__ import annotations

import json
import time

from trainer.status import StatusWriter, beating


def _read(path):
    return json.loads(path.read_text())


def test_an_eval_writes_phase_eval_and_keeps_the_heartbeat_moving(tmp_path):
    """Rank 0 waits in a gloo collective while the eval owner evaluates; the supervisor pets the watchdog
    only when status.json moves, so the file must move while rank 0 is blocked."""
    path = tmp_path / "status.json"
    w = StatusWriter(path, "run", min_interval=1.0)
    w.update(phase="training", step=7, force=True)
    with beating(w, interval=0.01, phase="eval", step=7):
        first = _read(path)
        assert first["phase"] == "eval"
        deadline = time.time() + 10
        while _read(path)["updated_at"] == first["updated_at"] and time.time() < deadline:
            time.sleep(0.01)
        assert _read(path)["updated_at"] > first["updated_at"] and _read(path)["phase"] == "eval"
    assert _read(path)["phase"] == "training" and _read(path)["step"] == 7


def test_a_rank_without_a_status_file_only_runs_the_block():
    ran = []
    with beating(object(), interval=0.01, phase="eval"):
        ran.append(1)
    assert ran == [1]
