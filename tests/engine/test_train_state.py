"""The train state (trainer/engine/train_state.py) and the job's checkpoint protocol (trainer/engine/checkpoint.py) against
the on-disk format: training_state.pt is the dict the trainer has always written, and a checkpoint
directory written the way the trainer wrote it before the train state existed resumes exactly."""

from __future__ import annotations

import io
import json
import logging
import random
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.torch
import torch

from trainer.data.dataset import DataPosition
from trainer.engine.checkpoint import Checkpointer
from trainer.engine.train_state import (
    FILE_KEYS,
    DataFeedState,
    DrafterState,
    LoopState,
    NanSkips,
    RNGState,
    RunInfo,
    ScheduleState,
    TrainState,
    capture_rng_state,
)
from trainer.model import checkpoint_format as ckpt_format

BATCHES_PER_STEP, PER_EPOCH = 3, 10
CFG = {"lr": 6e-4, "target_model": None, "max_steps": 8}


class Feed:
    """Feed.position: the stream's epoch and batch of a micro-batch number."""
    def position(self, seq):
        return seq // PER_EPOCH, seq % PER_EPOCH


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, n: int):
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()


def _state(model=None, opt=None, step=0, tokens=0, warmup=0, nan_skips=0, group=None) -> TrainState:
    loop = LoopState(step, tokens)
    drafter = DrafterState(model, opt, SimpleNamespace(to_dict=lambda: {"hidden_size": 8})) if model else None
    return TrainState(loop=loop, schedule=ScheduleState(warmup),
                      data=DataFeedState(Feed(), loop, BATCHES_PER_STEP),
                      health=NanSkips(SimpleNamespace(nan_skips=nan_skips)),
                      run=RunInfo("run0", SimpleNamespace(to_dict=lambda: dict(CFG)), 1),
                      rng=RNGState(0, 1, group, True), drafter=drafter)


def _old_literal(step, tokens, warmup, nan_skips, rngs) -> dict:
    """What train.py's save_checkpoint built, and checkpoint.py added the RNG states to, before the train state."""
    ep, bi = Feed().position(step * BATCHES_PER_STEP)
    tstate = {"step": step, "seq_next": step * BATCHES_PER_STEP,
              "batches_per_step": BATCHES_PER_STEP, "warmup_steps": warmup,
              "data_position": DataPosition(ep, bi).to_dict(), "tokens_seen": tokens,
              "nan_skips": nan_skips, "drafter_ranks": 1,
              "config": dict(CFG), "run_id": "run0"}
    return dict(tstate, rng_by_rank=rngs)


def _seed_all(n):
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_train_state_is_the_dict_the_trainer_always_wrote():
    _seed_all(7)
    old = _old_literal(7, 1234, 2, 1, [capture_rng_state()])
    _seed_all(7)
    new = _state(step=7, tokens=1234, warmup=2, nan_skips=1).state_dict()
    assert list(new) == list(old) == list(FILE_KEYS)
    assert new["data_position"] == {"epoch": 2, "batch_index": 1} and new["seq_next"] == 21
    assert _saved_bytes(new) == _saved_bytes(old)   # training_state.pt byte for byte (same RNG state)


def test_every_part_is_a_stateful_and_declares_its_own_keys():
    from torch.distributed.checkpoint.stateful import Stateful
    state = _state(*_model_and_opt(0))
    parts = state.file_parts() + (state.drafter,)
    assert all(isinstance(p, Stateful) for p in parts)
    keys = [set(p.state_dict()) for p in state.file_parts()]
    assert sum(len(k) for k in keys) == len(set().union(*keys)) == len(FILE_KEYS)
    assert set(state.drafter.state_dict()) == {"model", "optim"}   # dcp/'s layout


def test_loading_sets_the_owners_fields_and_warns_of_a_new_batch_count(caplog):
    state = _state()
    _seed_all(3)
    rng = capture_rng_state()
    want = torch.rand(3)
    flat = _old_literal(5, 99, 4, 2, [rng])
    flat["seq_next"] = 5 * 2           # trained with 2 micro-batches per step, this run makes 3
    flat["batches_per_step"] = 2
    _seed_all(11)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        state.load_state_dict(flat)
    assert (state.loop.step, state.loop.tokens_seen, state.schedule.warmup_steps) == (5, 99, 4)
    assert state.health.report.nan_skips == 2
    assert torch.equal(torch.rand(3), want)            # this drafter rank's RNG is back
    assert "3 micro-batches per step (it was trained with 2)" in caplog.text


def test_an_older_state_without_the_newer_keys_loads():
    """The single-process trainer's training_state.pt: step, one rng, no counters or warmup length."""
    state = _state(warmup=5)
    _seed_all(1)
    flat = {"step": 4, "rng": capture_rng_state(), "data_position": {"epoch": 0, "batch_index": 4}}
    want = torch.rand(2)
    state.load_state_dict(flat)
    assert (state.loop.step, state.loop.tokens_seen, state.schedule.warmup_steps) == (4, 0, 5)
    assert state.health.report.nan_skips == 0 and torch.equal(torch.rand(2), want)


def test_a_rank_without_a_drafter_restores_no_rng():
    state = _state()
    state.rng.index = None
    _seed_all(1)
    flat = _old_literal(2, 0, 0, 0, [capture_rng_state()])
    _seed_all(2)
    want = torch.rand(2)
    _seed_all(2)
    state.load_state_dict(flat)
    assert torch.equal(torch.rand(2), want)


# ------------------------------------------------------------------------------- through the protocol

@pytest.fixture
def world1(tmp_path):
    """A one-rank gloo job in this process: the checkpointer's collectives and DCP run for real."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield SimpleNamespace(leader=True, drafter_index=0, drafter_ranks=[0]), \
            SimpleNamespace(control=None, dctl=None)
    finally:
        dist.destroy_process_group()


def _write_old_layout(out: Path, step: int, model, opt, flat: dict, with_dcp: bool = True) -> Path:
    """A step dir as the trainer wrote it before the train state and the split of checkpoint.py: DCP of
    {"model", "optim"} from get_state_dict, the fp32 weights, the drafter config, torch.save of the flat
    dict, meta.json with the file sizes (written here file by file, not through ckpt_format)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    d = out / f"step-{step:08d}"
    d.mkdir(parents=True)
    if with_dcp:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp"))
    full = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    safetensors.torch.save_file(full, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}, indent=2, sort_keys=True) + "\n")
    with open(d / "training_state.pt", "wb") as f:
        torch.save(flat, f)
    meta = {"epoch": flat["step"] * BATCHES_PER_STEP // PER_EPOCH, "reason": "interval", "step": step,
            "trainer_version": "0", "created_at": time.time(), "target": None,
            "files": {fn: (d / fn).stat().st_size for fn in ("model.safetensors", "config.json", "training_state.pt")}}
    (d / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return d


def _opt_tensors(opt):
    return [t.clone() for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]


def test_a_checkpoint_in_the_old_layout_resumes_exactly(world1, tmp_path):
    topo, groups = world1
    model, opt = _model_and_opt(0)
    _train(model, opt, 2)
    _seed_all(5)
    flat = _old_literal(6, 600, 2, 1, [capture_rng_state()])
    want_rand = torch.rand(4)
    d = _write_old_layout(tmp_path / "out", 6, model, opt, flat)

    fresh, fresh_opt = _model_and_opt(1)
    state = _state(fresh, fresh_opt)
    ckpt = Checkpointer(tmp_path / "out", 0, topo, groups)
    _seed_all(9)
    assert ckpt.resume(state, allowed=True) == d and ckpt.resumed_from == ckpt.last == str(d)
    assert torch.equal(torch.rand(4), want_rand)
    assert (state.loop.step, state.loop.tokens_seen, state.schedule.warmup_steps) == (6, 600, 2)
    assert state.health.report.nan_skips == 1
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(_opt_tensors(opt), _opt_tensors(fresh_opt)):
        assert torch.equal(a, b)
    # the same next step on both
    _seed_all(4)
    _train(model, opt, 1)
    _seed_all(4)
    _train(fresh, fresh_opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_the_single_process_trainers_checkpoint_resumes_its_weights(world1, tmp_path, caplog):
    topo, groups = world1
    model, opt = _model_and_opt(0)
    _train(model, opt, 1)
    _seed_all(5)
    flat = {"step": 3, "rng": capture_rng_state()}
    want = torch.rand(2)
    _write_old_layout(tmp_path / "out", 3, model, opt, flat, with_dcp=False)
    fresh, fresh_opt = _model_and_opt(1)
    state = _state(fresh, fresh_opt, warmup=7)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        Checkpointer(tmp_path / "out", 0, topo, groups).resume(state, allowed=True)
    assert "AdamW moments start fresh" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert (state.loop.step, state.schedule.warmup_steps) == (3, 7) and torch.equal(torch.rand(2), want)


def test_a_save_writes_the_old_layout_and_loads_back(world1, tmp_path):
    topo, groups = world1
    model, opt = _model_and_opt(0)
    _train(model, opt, 2)
    import torch.distributed as dist
    state = _state(model, opt, step=7, tokens=700, warmup=2, nan_skips=1, group=dist.group.WORLD)  # RNG gathered
    ckpt = Checkpointer(tmp_path / "out", 2, topo, groups)
    _seed_all(8)
    path = Path(ckpt.save(state, "interval", torch.device("cpu")))
    assert path.name == "step-00000007" and ckpt.last == str(path)
    assert sorted(p.name for p in path.iterdir()) == sorted(ckpt_format.REQUIRED_FILES + ("dcp",))
    _seed_all(8)
    old = _old_literal(7, 700, 2, 1, [capture_rng_state()])
    ts = ckpt_format.load_train_state(path)
    assert list(ts) == list(old)
    assert _saved_bytes(ts) == _saved_bytes(old)
    ms, cfg, ts2, meta = ckpt_format.load(path)
    assert cfg == {"hidden_size": 8} and ts2["step"] == 7
    assert meta["step"] == 7 and meta["epoch"] == 2 and meta["reason"] == "interval"
    assert all(torch.equal(ms[n], p) for n, p in model.named_parameters())
    fresh, fresh_opt = _model_and_opt(1)
    back = _state(fresh, fresh_opt)
    Checkpointer(tmp_path / "out", 2, topo, groups).resume(back, allowed=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(_opt_tensors(opt), _opt_tensors(fresh_opt)))
    assert (back.loop.step, back.loop.tokens_seen) == (7, 700)


def test_no_resume_refuses_an_output_dir_with_a_checkpoint(world1, tmp_path):
    from trainer.errors import TrainingFailed
    topo, groups = world1
    model, opt = _model_and_opt(0)
    _write_old_layout(tmp_path / "out", 2, model, opt, _old_literal(2, 0, 0, 0, [None]))
    with pytest.raises(TrainingFailed, match="--no-resume"):
        Checkpointer(tmp_path / "out", 0, topo, groups).resume(_state(model, opt), allowed=False)
    assert Checkpointer(tmp_path / "empty", 0, topo, groups).resume(_state(model, opt), allowed=True) is None
