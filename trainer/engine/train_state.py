"""The train state: what a checkpoint holds of a run, one typed object whose parts their owners declare.

Each part is a ``torch.distributed.checkpoint.stateful.Stateful`` (``state_dict()`` /
``load_state_dict()``: DCP's runtime-checkable protocol, which a class meets by having both methods), the way torchtitan's trainer hands its TrainState, model, optimizer and data
loader to its checkpointer. train.py builds the :class:`TrainState` once (``Trainer.setup``) and hands
it to the job's checkpointer (trainer/engine/checkpoint.py), which reads fields, not string keys. Each part is
declared here for its owner and reads and writes only that owner's fields (the loop's and the
schedule's parts are where the Trainer keeps those numbers; the others wrap the owner's object).

  part       owner                                   where it is kept
  loop       the step loop (train.py)                training_state.pt: step, tokens_seen
  data       the data feed (feed.py, dispatch.py)    training_state.pt: seq_next, batches_per_step, data_position
  schedule   the LR schedule (optim.py)              training_state.pt: warmup_steps
  health     the reporter (report.py)                training_state.pt: nan_skips
  run        the run (train.py)                      training_state.pt: drafter_ranks, config, run_id
  rng        each drafter rank                       training_state.pt: rng_by_rank
  drafter    the drafter stage (drafter.py)          dcp/ (model and AdamW, sharded; DCP reshards them),
                                                     config.json (the drafter's config)

``training_state.pt`` is one flat dict (:meth:`TrainState.state_dict`; its keys in the order the file
has always had, :data:`FILE_KEYS`), so checkpoints written before this module load unchanged, and the
single-process trainer's (one ``rng``, no ``dcp/``) too. The learning-rate schedule is a function of
the step: its only state is the warmup length fixed when the run first started.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from trainer.data.dataset import DataPosition

if TYPE_CHECKING:
    # a protocol, met by the methods alone: the parts do not subclass it, so a rank imports DCP (and with it
    # DTensor's ops and sympy, half a CPU-second) only when it saves or loads a checkpoint (checkpoint.py)
    from torch.distributed.checkpoint.stateful import Stateful

    from trainer.config.options import TrainConfig
    from trainer.model.drafter import DFlashConfig

# the name the run log has always shown for the resume's lines
log = logging.getLogger("trainer.checkpoint")

# training_state.pt's keys, in the order the file has always had them (torch.save keeps a dict's order)
FILE_KEYS = ("step", "seq_next", "batches_per_step", "warmup_steps", "data_position", "tokens_seen",
             "nan_skips", "drafter_ranks", "config", "run_id", "rng_by_rank")


# ------------------------------------------------------------------------------- the parts

@dataclass
class LoopState:
    """The step loop's: optimizer steps done and the real tokens they trained on (live: the loop counts
    here; the Trainer reads them as Trainer.loop)."""
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = state_dict.get("tokens_seen", 0)


@dataclass
class ScheduleState:
    """The learning-rate schedule's (optim.lr_at): the warmup length, fixed when a run first starts, so a
    run extended with a larger --max-steps keeps its warmup and follows the new cosine."""
    warmup_steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup_steps}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict.get("warmup_steps") is not None:   # older checkpoints: this run's own
            self.warmup_steps = int(state_dict["warmup_steps"])


@dataclass
class DataFeedState:
    """The data feed's position: the next micro-batch is number step x batches_per_step of the stream
    (``feed.position`` maps it to epoch and batch). Recorded; a resume recomputes it from the step (the
    feed starts there), and warns when the checkpoint was trained with another batches_per_step."""
    feed: Any                  # Feed: position(seq) -> (epoch, batch)
    loop: LoopState
    batches_per_step: int      # micro-batches per optimizer step, this run's (dispatch.py)
    total_steps: int = 0       # this run's schedule length (Trainer._build_schedule), for the warning

    @property
    def seq_next(self) -> int:
        return self.loop.step * self.batches_per_step

    def position(self) -> DataPosition:
        return DataPosition(*self.feed.position(self.seq_next))

    def state_dict(self) -> dict[str, Any]:
        return {"seq_next": self.seq_next, "batches_per_step": self.batches_per_step,
                "data_position": self.position().to_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        seq_next, step = state_dict.get("seq_next"), int(state_dict["step"])
        if seq_next is not None and seq_next != step * self.batches_per_step:
            log.warning("%s", self.changed_size_warning(step, state_dict))

    def changed_size_warning(self, step: int, state_dict: Mapping[str, Any]) -> str:
        """What resuming at another step size (another drafter rank count) does: the step is kept, the data
        position and the schedule are recomputed for the new size, so both jump."""
        old_bps = int(state_dict.get("batches_per_step") or 0)
        # the old length, from the same data and epochs at the old size (--max-steps may have capped either)
        old_total = self.total_steps * self.batches_per_step // old_bps if old_bps else 0
        where = ""
        if old_total and self.total_steps:
            where = (f"; the schedule is recomputed for the new size: {self.total_steps} steps in all instead of "
                     f"about {old_total}, so the learning rate's warmup and cosine stand at step {step} of "
                     f"{self.total_steps} ({100 * step / self.total_steps:.0f}% through) where they stood at "
                     f"{100 * step / old_total:.0f}%: the learning rate jumps at the resume")
        return (f"resuming step {step} with {self.batches_per_step} micro-batches per step (it was trained with "
                f"{old_bps or 'another number'}): the step size is drafter ranks x --grad-accum, and the data "
                f"position is step x the new size, so some batches are skipped or repeated{where}")


@dataclass
class NanSkips:
    """The reporter's: optimizer steps skipped for a non-finite loss (report.Reporter.nan_skips)."""
    report: Any                # Reporter

    def state_dict(self) -> dict[str, Any]:
        return {"nan_skips": self.report.nan_skips}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.report.nan_skips = state_dict.get("nan_skips", 0)


@dataclass
class RunInfo:
    """The run's record: its id, its config and its drafter rank count. Recorded only (a resumed run has
    its own id and config; preflight compares the target, identity.for_checkpoint reads the config)."""
    run_id: str
    cfg: "TrainConfig"
    drafter_ranks: int

    def state_dict(self) -> dict[str, Any]:
        return {"drafter_ranks": self.drafter_ranks, "config": self.cfg.to_dict(), "run_id": self.run_id}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        pass


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python `random`, numpy (if importable), torch CPU and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        try:
            state["cuda"] = torch.cuda.get_rng_state_all()
        except Exception as e:  # noqa: BLE001 - e.g. driver trouble; CPU state still useful
            log.warning("could not capture CUDA RNG state: %s", e)
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (missing parts are left as they are)."""
    if not state:
        return
    if "python" in state:
        py = state["python"]
        # a round trip through some serializers turns the inner tuple into a list
        if isinstance(py, list):
            py = (py[0], tuple(py[1]), py[2])
        random.setstate(py)
    if "numpy" in state:
        try:
            import numpy as np
            np.random.set_state(state["numpy"])
        except ImportError:  # pragma: no cover
            log.warning("checkpoint has a numpy RNG state but numpy is not installed")
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint has CUDA RNG states but CUDA is not available; skipped")
            return
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("checkpoint has %d CUDA RNG states, this machine %d devices; "
                        "restoring the first %d", len(cuda), n, min(n, len(cuda)))
        for i, s in enumerate(list(cuda)[:n]):
            torch.cuda.set_rng_state(torch.as_tensor(s, dtype=torch.uint8).cpu(), i)


@dataclass
class RNGState:
    """Each drafter rank's generators (python, numpy, torch CPU and CUDA). ``state_dict`` is a collective
    over ``group`` (every drafter rank): the leader gets every drafter rank's state in drafter order
    (``rng_by_rank``; None elsewhere); without a group, this process's alone. ``load_state_dict``
    restores this rank's (``index``: its drafter index; None: a rank without a drafter restores
    nothing); a checkpoint of the single-process trainer holds one state, ``rng``."""
    index: int | None
    count: int = 1             # drafter ranks
    group: Any = None          # the drafter ranks' gloo group (groups.dctl)
    leader: bool = True

    def state_dict(self) -> dict[str, Any]:
        mine = capture_rng_state()
        if self.group is None:
            return {"rng_by_rank": [mine]}
        import torch.distributed as dist
        rngs = [None] * self.count if self.leader else None
        dist.gather_object(mine, rngs, dst=0, group=self.group)
        return {"rng_by_rank": rngs}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self.index is None:
            return
        rngs = state_dict.get("rng_by_rank") or [state_dict.get("rng")]
        if self.index < len(rngs) and rngs[self.index] is not None:
            restore_rng_state(rngs[self.index])


@dataclass
class DrafterState:
    """The drafter stage's model and AdamW, as torch.distributed.checkpoint's state dict
    ``{"model": ..., "optim": ...}`` (get_state_dict / set_state_dict: each drafter rank's shards; ``dcp/``
    holds them and DCP reshards them onto any number of drafter ranks), and the drafter's config
    (config.json)."""
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    config: "DFlashConfig"

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.opt, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])

    def load_full_weights(self, full: Mapping[str, torch.Tensor]) -> None:
        """The whole model's weights (model.safetensors), each rank taking its shard; AdamW untouched."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(self.model, dict(full), options=StateDictOptions(full_state_dict=True))

    def warm_start(self, path: str) -> tuple[Any, int]:
        """--init-drafter: the published drafter's weights at `path` (preflight checked its contract) into
        this rank's shard; AdamW untouched. Returns (published.Published, how many tensors); BadInput (exit
        2) for a drafter whose weights do not load."""
        from trainer.errors import BadInput
        from trainer.model import published
        try:
            pub = published.read(path)
            shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
            weights = published.load_weights(pub, shapes)
        except published.PublishedError as e:
            raise BadInput(str(e)) from None
        self.load_full_weights(weights)
        return pub, len(shapes)


# ------------------------------------------------------------------------------- the whole

@dataclass
class TrainState:
    """Everything a checkpoint holds of a run. ``state_dict`` / ``load_state_dict`` are training_state.pt's
    flat dict (every part but the drafter's, whose state DCP writes to ``dcp/``); ``state_dict`` is a
    collective over the drafter ranks (the RNG states gather to the leader)."""
    loop: LoopState
    schedule: ScheduleState
    data: DataFeedState
    health: NanSkips
    run: RunInfo
    rng: RNGState
    drafter: DrafterState | None = None   # drafter ranks only

    def file_parts(self) -> tuple[Stateful, ...]:
        """The parts training_state.pt holds, in the order they load."""
        return (self.loop, self.data, self.schedule, self.health, self.run, self.rng)

    def state_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for part in self.file_parts():
            sd = part.state_dict()
            clash = flat.keys() & sd.keys()
            if clash:
                raise ValueError(f"train state: {type(part).__name__} declares {sorted(clash)} again")
            flat.update(sd)
        ordered = {k: flat.pop(k) for k in FILE_KEYS if k in flat}
        ordered.update(flat)
        return ordered

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for part in self.file_parts():
            part.load_state_dict(state_dict)
