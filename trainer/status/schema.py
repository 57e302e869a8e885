"""What status.json holds, declared once: every key's meaning, the phases that write it, and whether it is
there from the first write on. docs/contracts.md's table is rendered from it
(``trainer/lab/contracts_tables.py --write``); the writer (trainer/status/writer.py) refuses, when strict, a
key it does not declare. Standard library only.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

PHASES = ("starting", "loading", "warmup", "training", "checkpointing", "eval", "done", "failed")


class StatusField(NamedTuple):
    """One key of status.json: its meaning, the phases whose writes set it, and whether it is in the file
    from the first write on (``always``, null until known) or only once first written."""
    name: str
    meaning: str
    phases: tuple[str, ...]
    always: bool = True


# What status.json reports, declared once. StatusWriter refuses (under pytest, or DFLASH_STATUS_STRICT=1) a key
# not declared here; docs/contracts.md's table is rendered from it (python trainer/lab/contracts_tables.py --write);
# tests/status/test_status.py checks every writer in trainer/ against it.
STATUS_SCHEMA: tuple[StatusField, ...] = (
    StatusField("phase", "where the job is: " + "|".join(PHASES) + " (`failed` also by the supervisor for a "
                "failed rank, and by a start refused as bad input)", PHASES),
    StatusField("step", "optimizer steps done (0 before the first; the checkpoint's step on resume)",
                ("starting", "training", "checkpointing", "eval", "done", "failed")),
    StatusField("epoch", "the epoch the data has reached (0-based)", ("training",)),
    StatusField("tokens_seen", "tokens trained on so far (carried over a resume)", ("training",)),
    StatusField("tokens_per_s", "training tokens/s over the last 50 steps (eval pauses left out)", ("training",)),
    StatusField("loss", "loss of the last step with a finite loss", ("training",)),
    StatusField("nan_skips", "optimizer steps skipped for a non-finite loss or gradient, in total",
                ("starting", "training", "failed")),
    StatusField("nan_streak", "of those, how many in a row up to the last step (--max-nan-skips fails the run)",
                ("starting", "training", "failed")),
    StatusField("updated_at", "unix seconds (float) of this write: the heartbeat dflash-status ages", PHASES),
    StatusField("started_at", "unix seconds the writer started (a pid that started later is a reused one)",
                ("starting",)),
    StatusField("pid", "the job's process: the supervisor `python -m trainer`, the unit's MainPID; its ranks "
                "die with it", PHASES),
    StatusField("run_id", "this run's id (also in its log file's name)", PHASES),
    StatusField("last_checkpoint", "path of the newest checkpoint, or null", ("training",)),
    StatusField("error", "why the run failed (a failed rank is named: `rank N failed (signal 9): ...`), else null",
                ("done", "failed")),
    StatusField("resumed_from", "the checkpoint this run resumed from, or null", ("training",)),
    StatusField("log_file", "this run's log file", ("starting",)),
    StatusField("eval", "the last tau eval, null until one ran (a resumed run starts with the last one "
                "metrics.jsonl kept): `step`, `tau`, `per_position_acceptance`, `prompts`, `verify_steps`, "
                "`seconds`, and `block_accuracy` for the end-of-run eval", ("loading", "eval")),
    StatusField("startup", "per rank, during the start-up (trainer/distributed/startup.py): its last progress note, "
                "`role`, `phase`, `detail` (e.g. `target shape 2 of 3 (1x4096, compile and autotune)`), `seq` "
                "(counts its notes) and `at` (unix seconds); the supervisor ends a start-up none of whose notes "
                "moves for the stall bound", ("starting", "loading", "warmup"), always=False),
    StatusField("world_size", "processes in the job (ranks)", ("starting",), always=False),
    StatusField("ranks", "per rank, from the first training step on (null until its first stop vote): `rank`, "
                "`role` (target, drafter or target+drafter), `items` (micro-batches), `busy_s` (stage seconds), "
                "`wait_s` (seconds waiting), `peak_gib` (peak GPU memory), `recompiles` (graphs it compiled after "
                "the warmup)", ("training",), always=False),
    StatusField("recompiles", "graphs compiled after the warmup, all ranks together, from the first stop vote on: "
                "each is a micro-batch shape the warmup's compiled graphs did not cover, a compile in the middle of "
                "a step; the rank that compiled it logs the step and the guard it failed "
                "(trainer/ops/compiling.py)", ("training",), always=False),
)

# Every key of the contract, present from the first write on (null until known).
STATUS_FIELDS = tuple(f.name for f in STATUS_SCHEMA if f.always)
# Keys written once known, absent before (world_size at start, ranks from the first training step).
STATUS_LATER_FIELDS = tuple(f.name for f in STATUS_SCHEMA if not f.always)
STATUS_KEYS = frozenset(f.name for f in STATUS_SCHEMA)


class UndeclaredStatusField(TypeError):
    """A writer gave StatusWriter a key STATUS_SCHEMA does not declare (raised only when strict), as a
    function refuses an unexpected keyword."""


def strict_default(env: Mapping[str, str] | None = None) -> bool:
    """Whether a StatusWriter refuses undeclared keys by default: DFLASH_STATUS_STRICT=1/0 when set, else
    under pytest (PYTEST_CURRENT_TEST, which a trainer the tests start inherits). Outside tests an undeclared
    key is written and logged once: the heartbeat must not kill training."""
    env = os.environ if env is None else env
    flag = env.get("DFLASH_STATUS_STRICT")
    if flag is not None:
        return flag.strip() not in ("", "0")
    return "PYTEST_CURRENT_TEST" in env
