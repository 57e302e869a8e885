"""Atomic checkpoints: roundtrip, keep-K, latest(), failures, re-save, stale temp dirs, RNG."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch

from trainer.engine.train_state import capture_rng_state, restore_rng_state
from trainer.model import checkpoint_format as ck
from trainer.model.checkpoint_format import CheckpointError, CheckpointManager, load

CONFIG = {"architectures": ["DFlashDraftModel"], "hidden_size": 8, "block_size": 4,
          "target_layer_ids": [1, 3], "mask_token_id": 5}


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(8, 16, generator=g),
            "layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(8)}


def _train_state(step):
    # shaped like an AdamW state_dict (building a real AdamW costs seconds of imports)
    opt = {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(3),
                         "exp_avg_sq": torch.rand(3)}},
           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}
    return {"step": step, "optimizer": opt, "data_position": {"epoch": 1, "batch": 7},
            "rng": capture_rng_state(), "run_config": {"lr": 6e-4}}


def _save(mgr, step, seed=0, **meta):
    return mgr.save(step, _model(seed), CONFIG, _train_state(step), meta or {"epoch": 0})


def test_roundtrip(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    model = _model()
    # non-contiguous input must be saved fine
    model["t"] = torch.arange(12.0).reshape(3, 4).t()
    p = mgr.save(12, model, CONFIG, _train_state(12), {"epoch": 2})
    assert p == tmp_path / "step-00000012" and p.is_dir()
    assert sorted(x.name for x in p.iterdir()) == sorted(ck.REQUIRED_FILES)
    ms, cfg, ts, meta = load(p)
    assert set(ms) == set(model)
    for k in model:
        assert ms[k].dtype == model[k].dtype
        assert torch.equal(ms[k], model[k].contiguous())
    assert cfg == CONFIG
    assert ts["step"] == 12 and ts["data_position"] == {"epoch": 1, "batch": 7}
    assert "state" in ts["optimizer"] and ts["run_config"]["lr"] == 6e-4
    assert meta["step"] == 12 and meta["epoch"] == 2 and meta["trainer_version"]
    assert meta["created_at"] > 0
    # config.json is plain JSON an engine can read
    assert json.loads((p / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    # manager method alias
    assert mgr.load(p)[1] == CONFIG
    assert mgr.latest() == p and CheckpointManager.step_of(p) == 12
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".tmp")]


def test_tied_weights_saved(tmp_path):
    w = torch.randn(4, 4)
    p = CheckpointManager(tmp_path).save(1, {"a": w, "b": w}, CONFIG, {})
    ms = load(p)[0]
    assert torch.equal(ms["a"], w) and torch.equal(ms["b"], w)


def test_keep_k_pruning(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for s in (10, 20, 30, 40):
        _save(mgr, s)
    assert [p.name for p in mgr.list()] == ["step-00000030", "step-00000040"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]
    # keep <= 0 keeps all
    mgr_all = CheckpointManager(tmp_path, keep=0)
    _save(mgr_all, 50)
    _save(mgr_all, 60)
    assert len(mgr_all.list()) == 4


def test_prune_never_removes_just_saved_lower_step(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1)
    _save(mgr, 100)
    p = _save(mgr, 50)
    assert p.is_dir() and (tmp_path / "step-00000100").is_dir()


def test_latest_ignores_tmp_and_incomplete(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep=0)
    assert mgr.latest() is None and mgr.list() == []
    good = _save(mgr, 5)
    # a leftover temp dir with a higher step
    tmp = tmp_path / ".tmp-step-00000009-999999"
    tmp.mkdir()
    (tmp / "meta.json").write_text('{"step": 9}')
    # an incomplete step dir (missing files)
    inc = tmp_path / "step-00000007"
    inc.mkdir()
    (inc / "model.safetensors").write_bytes(b"x")
    # a step dir with unreadable meta
    bad = tmp_path / "step-00000008"
    bad.mkdir()
    for f in ck.REQUIRED_FILES:
        (bad / f).write_text("garbage")
    # a truncated file (size differs from meta)
    trunc = tmp_path / "step-00000006"
    import shutil
    shutil.copytree(good, trunc)
    meta = json.loads((trunc / "meta.json").read_text())
    meta["step"] = 6
    (trunc / "meta.json").write_text(json.dumps(meta))
    with open(trunc / "training_state.pt", "r+b") as f:
        f.truncate(10)
    # unrelated names
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "status.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert mgr.latest() == good
        assert mgr.list() == [good]
    text = caplog.text
    assert "step-00000007" in text and "step-00000008" in text and "step-00000006" in text
    assert text.count("step-00000007") == 1  # warned once


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_failed_save_enospc_safetensors(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep=1)
    good = _save(mgr, 10)
    before = {f: (good / f).read_bytes() for f in ck.REQUIRED_FILES}
    monkeypatch.setattr(safetensors.torch, "save_file", _enospc)   # looked up at the call
    with pytest.raises(CheckpointError) as ei:
        _save(mgr, 20)
    msg = str(ei.value)
    assert "No space left on device" in msg and str(tmp_path / "step-00000020") in msg
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-00000010"]
    assert {f: (good / f).read_bytes() for f in ck.REQUIRED_FILES} == before
    assert mgr.latest() == good


def test_failed_save_enospc_mid_torch_save(tmp_path, monkeypatch):
    """ENOSPC from a low-level write inside torch.save (surfaced by torch as RuntimeError)."""
    mgr = CheckpointManager(tmp_path, keep=1)
    good = _save(mgr, 10)
    real_save = torch.save

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 64:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(b)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, Full(f)))
    with pytest.raises(CheckpointError, match="No space left on device"):
        _save(mgr, 20)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-00000010"]
    assert load(good)[3]["step"] == 10


def test_resave_same_step_is_safe(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep=2)
    p1 = _save(mgr, 10, seed=1)
    w1 = load(p1)[0]["fc.weight"]
    # a failing re-save leaves the first one in place
    monkeypatch.setattr(safetensors.torch, "save_file", _enospc)   # looked up at the call
    with pytest.raises(CheckpointError):
        _save(mgr, 10, seed=2)
    monkeypatch.undo()
    assert torch.equal(load(p1)[0]["fc.weight"], w1)
    # a successful re-save replaces it
    p2 = _save(mgr, 10, seed=2)
    assert p2 == p1
    assert torch.equal(load(p2)[0]["fc.weight"], _model(2)["fc.weight"])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-00000010"]


def test_resave_fallback_without_exchange(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "_exchange", lambda a, b: False)
    mgr = CheckpointManager(tmp_path, keep=2)
    _save(mgr, 10, seed=1)
    p = _save(mgr, 10, seed=3)
    assert torch.equal(load(p)[0]["fc.weight"], _model(3)["fc.weight"])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-00000010"]


def test_cleanup_stale_tmp(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=0)
    good = _save(mgr, 3)
    # a dead pid: spawn and reap a process to get a pid that no longer exists
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = proc.pid
    stale = tmp_path / f".tmp-step-00000004-{dead}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    mine = tmp_path / f".tmp-step-00000005-{os.getpid()}"
    mine.mkdir()
    live = tmp_path / ".tmp-step-00000006-1"  # pid 1 is alive
    live.mkdir()
    # an interrupted re-save: the old complete copy was moved aside, final is gone
    import shutil
    aside = tmp_path / f".tmp-step-00000003-{dead}-old"
    shutil.move(str(good), str(aside))
    removed = mgr.cleanup_stale_tmp()
    assert set(removed) == {stale, mine}
    assert live.exists() and not stale.exists() and not mine.exists()
    assert good.is_dir() and not aside.exists()
    assert mgr.latest() == good


def test_rng_roundtrip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    p = CheckpointManager(tmp_path).save(1, _model(), CONFIG, {"rng": state})
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(load(p)[2]["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_load_incomplete_raises(tmp_path):
    d = tmp_path / "step-00000001"
    d.mkdir()
    with pytest.raises(CheckpointError, match="missing"):
        load(d)
