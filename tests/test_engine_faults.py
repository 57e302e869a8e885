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
