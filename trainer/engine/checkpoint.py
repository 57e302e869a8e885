"""The job's checkpoint protocol: when a rank does what with a checkpoint, and who decides.

Rank 0 finds, begins and publishes a checkpoint (the on-disk format: trainer/model/checkpoint_format.py); the
drafter ranks write and load their shards of model and optimizer with DCP together; each decision of
rank 0 reaches every rank through :func:`leader_decides`, so all raise or none does. What a checkpoint
holds of the run is the train state (trainer/engine/train_state.py), which train.py builds once and hands to
:class:`Checkpointer`'s ``save`` and ``resume``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from trainer.engine.train_state import TrainState
from trainer.model.checkpoint_format import (
    MODEL_FILE,
    CheckpointError,
    CheckpointManager,
    load_train_state,
    step_dir_name,
)

log = logging.getLogger("trainer.checkpoint")   # the name it has always logged under

# ------------------------------------------------------------------------------ the job's protocol

def leader_decides(leader: bool, group, decide, error: type[Exception] = CheckpointError) -> Any:
    """Rank 0 decides, every rank of `group` learns the answer: the leader runs `decide()`, its result
    (or the text of the `error` it raised) is broadcast, and an error is raised on every rank alike, so
    no rank goes on to a collective the others have left."""
    import torch.distributed as dist
    box: list = [None]
    if leader:
        try:
            box[0] = {"value": decide()}
        except error as e:
            box[0] = {"error": str(e)}
    dist.broadcast_object_list(box, src=0, group=group)
    if "error" in box[0]:
        raise error(box[0]["error"])
    return box[0]["value"]


def consolidated_state(model: torch.nn.Module, device: torch.device, leader: bool) -> dict[str, torch.Tensor]:
    """The whole fp32 drafter, on the leader's CPU (empty elsewhere): every drafter rank together
    (FSDP all-gathers each parameter). What model.safetensors holds and what the tau eval loads."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    full = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if leader:
            full[n] = t.detach().float().cpu()
        del t
    return full


class Checkpointer:
    """A rank's side of the job's checkpoints. Rank 0 finds, writes and publishes them (CheckpointManager);
    drafter ranks write and load their shards of model and optimizer with DCP, together. What is saved
    and restored is the run's TrainState (train_state.py), its parts read as fields."""

    def __init__(self, output_dir: Path, keep: int, topo, groups):
        self.out = Path(output_dir)
        self.topo, self.groups = topo, groups
        self.manager = CheckpointManager(self.out, keep)
        self.last: str | None = None           # the newest checkpoint of this run (saved or resumed from)
        self.resumed_from: str | None = None

    def resume(self, state: TrainState, allowed: bool) -> Path | None:
        """Rank 0 finds the newest checkpoint and tells every rank where the run stands; drafter ranks
        (state.drafter given) load the sharded model and optimizer state with DCP (any number of drafter
        ranks); then every rank loads the train state's other parts from training_state.pt (the drafter
        ranks their own RNG state). Returns the checkpoint resumed from (None: a fresh start)."""
        from trainer.errors import TrainingFailed

        def find():
            latest = self.manager.latest()
            if latest is not None and not allowed:
                raise TrainingFailed(f"--no-resume: {self.out} holds {latest.name}; refusing to overwrite")
            if latest is None:
                return None
            return {"path": str(latest), "state": load_train_state(latest)}
        r = leader_decides(self.topo.leader, self.groups.control, find, TrainingFailed)
        if r is None:
            return None
        path = Path(r["path"])
        if state.drafter is not None:
            self._load_drafter_state(path, state)
        state.load_state_dict(r["state"])
        self.resumed_from = self.last = str(path)
        return path

    def _load_drafter_state(self, path: Path, state: TrainState):
        import torch.distributed.checkpoint as dcp
        if (path / "dcp").is_dir():
            sd = state.drafter.state_dict()
            dcp.load(sd, checkpoint_id=str(path / "dcp"), process_group=self.groups.dctl)
            state.drafter.load_state_dict(sd)
        else:   # a checkpoint of the single-process trainer: weights only, fresh optimizer moments
            state.drafter.load_full_weights(safetensors.torch.load_file(str(path / MODEL_FILE)))
            log.warning("%s has no sharded optimizer state (dcp/): weights resumed, AdamW moments start fresh", path)

    def save(self, state: TrainState, reason: str, device: torch.device) -> str:
        """Drafter ranks, together: DCP writes every rank's shard of model and optimizer into the temp dir;
        rank 0 adds the consolidated fp32 model.safetensors, config.json, training_state.pt (the train
        state, every drafter rank's RNG state with it) and meta.json and publishes the directory atomically."""
        import torch.distributed.checkpoint as dcp

        from trainer.errors import root_cause
        topo, g, drafter = self.topo, self.groups.dctl, state.drafter
        step = state.loop.step
        t0 = time.perf_counter()
        full = consolidated_state(drafter.model, device, topo.leader)
        train_state = state.state_dict()      # a collective: the RNG states gather to the leader
        tmp = Path(leader_decides(topo.leader, g, lambda: str(self.manager.begin(step))))
        try:
            dcp.save(drafter.state_dict(), checkpoint_id=str(tmp / "dcp"), process_group=g)
        except (Exception, dcp.api.CheckpointException) as e:  # DCP raises on every rank when one fails
            if topo.leader:
                self.manager.abort(tmp)
            why = root_cause(e)
            free = shutil.disk_usage(self.out).free
            if "Errno" not in why and free < 2 * sum(t.numel() * 4 for t in full.values()) + (1 << 20):
                # torch.save's zip writer reports a full disk as "unexpected pos ...": say what it is
                why = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({free} bytes free; {why})"
            raise CheckpointError(f"checkpoint step {step} not saved to {self.out / step_dir_name(step)}: "
                                  f"{why} (earlier checkpoints left intact)") from e
        meta = {"epoch": state.data.position().epoch, "reason": reason}
        commit = lambda: str(self.manager.commit(tmp, step, full, drafter.config.to_dict(),  # noqa: E731
                                                 train_state, meta=meta))
        self.last = leader_decides(topo.leader, g, commit)
        log.info("checkpoint %s (%s) in %.1fs", self.last, reason, time.perf_counter() - t0)
        return self.last
