"""Resuming at another drafter rank count (issue 54, item 7): the step is kept while the step size, and with it
the schedule's length, is recomputed; the warning says what that does to the data and to the learning rate."""
from __future__ import annotations

import logging

from trainer.engine.optim import lr_at
from trainer.engine.train_state import DataFeedState, LoopState


class Feed:
    def position(self, seq):
        return divmod(seq, 100)


def test_a_changed_drafter_count_says_what_it_does_to_the_schedule(caplog):
    """Trained with 3 drafter ranks x grad accum 4 (12 micro-batches a step, 1,000 steps), resumed at step 500
    with 6 drafter ranks (24 a step, 500 steps): the run resumes at its last step, where the old cosine was
    half-way; the warning names both totals and both positions."""
    old = DataFeedState(Feed(), LoopState(step=500), 12, 1000).state_dict()
    old["step"] = 500
    new = DataFeedState(Feed(), LoopState(step=500), 24, 500)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        new.load_state_dict(old)
    line = caplog.records[-1].getMessage()
    assert "\n" not in line and "24 micro-batches per step (it was trained with 12" in line
    assert "drafter ranks x --grad-accum" in line
    assert "500 steps in all instead of about 1000" in line and "100% through" in line and "50%" in line
    assert "jumps" in line
    # what it says is what lr_at does: the old schedule at step 500 and the new one differ
    assert lr_at(500, 1.0, 40, 1000) > 0.4 and lr_at(500, 1.0, 40, 500) == 0.0


def test_the_same_step_size_resumes_quietly(caplog):
    state = DataFeedState(Feed(), LoopState(step=7), 12, 1000).state_dict()
    state["step"] = 7
    with caplog.at_level(logging.WARNING, logger="trainer"):
        DataFeedState(Feed(), LoopState(step=7), 12, 1000).load_state_dict(state)
    assert not caplog.records
