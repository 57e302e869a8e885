"""trainer/engine/faults.py's hooks are read from the environment once, and the stand-ins' step pacing
(DFLASH_TEST_STEP_PACE_S, set by inventory/local) really holds each step back."""
import time

from trainer.engine.faults import Faults


def test_step_pacing_holds_each_step_and_is_not_reported_as_a_fault(monkeypatch, caplog):
    monkeypatch.setenv("DFLASH_TEST_STEP_PACE_S", "0.2")
    caplog.set_level("INFO", logger="trainer")
    f = Faults(rank=0)
    assert f.active == {"step_pace": 0.2}
    t = time.monotonic()
    f.before_step(3, drafter=None)
    f.before_step(4, drafter=None)
    assert time.monotonic() - t >= 0.4
    assert "fault injection" not in caplog.text and "DFLASH_TEST_STEP_PACE_S" in caplog.text


def test_no_hooks_without_the_environment(monkeypatch):
    for k in ("DFLASH_TEST_STEP_PACE_S", "DFLASH_FAULT_STEP_DELAY", "DFLASH_FAULT_NAN_FROM_STEP"):
        monkeypatch.delenv(k, raising=False)
    f = Faults(rank=0)
    t = time.monotonic()
    f.before_step(1, drafter=None)
    assert f.active == {} and time.monotonic() - t < 0.1


def test_a_slow_checkpoint_keeps_status_json_moving_for_the_watchdog(tmp_path, monkeypatch):
    """Issue 61, item 7: a drafter writes GBs through DCP, and the supervisor pets systemd's watchdog only when
    status.json moves. Trainer.save_checkpoint wraps the write in the heartbeat the tau eval uses."""
    import json
    from types import SimpleNamespace

    from trainer.engine import train
    from trainer.status import StatusWriter
    monkeypatch.setattr(train, "CHECKPOINT_BEAT_S", 0.2)
    path = tmp_path / "status.json"
    status = StatusWriter(path, "run", strict=True)
    status.update(phase="training", step=5, force=True)
    seen = []

    def save(state, reason, device):   # a write as slow as a 7 GB shard on slow storage, at test scale
        t = time.monotonic()
        while time.monotonic() - t < 1.6:
            st = json.loads(path.read_text())
            seen.append((st["phase"], st["updated_at"]))
            time.sleep(0.05)
        return str(tmp_path / "checkpoint-00000005")
    trainer = SimpleNamespace(report=SimpleNamespace(status=status), ckpt=SimpleNamespace(save=save), state=None,
                              device=None, loop=SimpleNamespace(step=5))
    train.Trainer.save_checkpoint(trainer, "interval")
    assert {p for p, _ in seen} == {"checkpointing"}
    assert len({u for _, u in seen}) >= 5, "status.json stood still while the checkpoint was written"
    st = json.loads(path.read_text())
    assert st["phase"] == "training" and st["last_checkpoint"].endswith("checkpoint-00000005")
