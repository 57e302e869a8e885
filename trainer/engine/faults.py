"""Test hooks for the fault-injection suite (docs/reliability.md), read from the environment; unset in
production. The Trainer calls before_step() at the top of every step; the checkpoint hook is installed
on the leader's CheckpointManager.

One hook is not a fault: DFLASH_TEST_STEP_PACE_S=S paces the CPU stand-ins' trainers (inventory/local,
the fault suite's and multinode inventories). Their tiny job would otherwise train flat out for the
whole of a scenario, each container taking a core's share from the suite that shares 2 cores with it;
paced, a step still comes every S seconds or so, which is all the health checks and tests wait for."""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger("trainer")


def read_faults() -> dict:
    """Test hooks for the fault-injection suite (docs/reliability.md); unset in production.
    DFLASH_FAULT_NAN_FROM_STEP=N  losses become NaN from optimizer step N on
    DFLASH_FAULT_HANG_AT_STEP=N   the main loop stops making progress at step N (process stays alive)
    DFLASH_FAULT_SLOW_CHECKPOINT=S  sleep S seconds inside each checkpoint write (before the rename)
    DFLASH_FAULT_STEP_DELAY=S     sleep S seconds before each optimizer step
    DFLASH_FAULT_DIE_AT_STEP=N and DFLASH_FAULT_DIE_RANK=R   rank R kills itself (SIGKILL) at step N
    DFLASH_TEST_STEP_PACE_S=S     not a fault: sleep S seconds before each step (the stand-ins' pacing)
    """
    out = {}
    for env, key, typ in (("DFLASH_FAULT_NAN_FROM_STEP", "nan_from_step", int),
                          ("DFLASH_FAULT_HANG_AT_STEP", "hang_at_step", int),
                          ("DFLASH_FAULT_SLOW_CHECKPOINT", "slow_checkpoint", float),
                          ("DFLASH_FAULT_STEP_DELAY", "step_delay", float),
                          ("DFLASH_FAULT_DIE_AT_STEP", "die_at_step", int),
                          ("DFLASH_FAULT_DIE_RANK", "die_rank", int)):
        if os.environ.get(env):
            out[key] = typ(os.environ[env])
            log.warning("fault injection active: %s=%s", env, os.environ[env])
    pace = os.environ.get("DFLASH_TEST_STEP_PACE_S")
    if pace:
        out["step_pace"] = float(pace)
        log.info("test pacing: each step waits %s s (DFLASH_TEST_STEP_PACE_S, a CPU stand-in's setting)", pace)
    return out


class Faults:
    """The faults this rank injects (read once, at start)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.active: dict = read_faults()

    def slow_checkpoint(self, ckpt_manager) -> None:
        """DFLASH_FAULT_SLOW_CHECKPOINT: each checkpoint is held before its rename (the leader's manager)."""
        if "slow_checkpoint" in self.active:
            delay = self.active["slow_checkpoint"]
            ckpt_manager.before_publish = lambda tmp: (log.warning("fault injection: checkpoint %s held %.0fs "
                                                                   "before its rename", tmp, delay), time.sleep(delay))

    def before_step(self, step: int, drafter) -> None:
        """At the top of step `step` + 1: delay, poison the drafter's loss, hang or die, as asked."""
        f = self.active
        if "step_delay" in f:
            time.sleep(f["step_delay"])
        if "step_pace" in f:
            time.sleep(f["step_pace"])
        if "nan_from_step" in f and drafter is not None:
            drafter.poison = step + 1 >= f["nan_from_step"]
        if "hang_at_step" in f and step + 1 >= f["hang_at_step"]:
            log.warning("fault injection: hanging at step %d (DFLASH_FAULT_HANG_AT_STEP)", step + 1)
            while True:
                time.sleep(3600)
        if "die_at_step" in f and step + 1 >= f["die_at_step"] and self.rank == f.get("die_rank", -1):
            log.error("fault injection: rank %d killing itself at step %d (DFLASH_FAULT_DIE_AT_STEP)",
                      self.rank, step + 1)
            os.kill(os.getpid(), signal.SIGKILL)
