"""The drafter stage's per-step metric vector is read and written on the stage's own stream only.

On a GPU the vector is accumulated by micro_step, read by step_vector (both on DrafterStage.stream) and then
zeroed for the next step by reset_counters, which Trainer.optimizer_step calls after leaving the stream's
context. Zeroed on the caller's stream instead, the zero_ can run before step_vector's read of the vector:
the H200 runs with --no-async --compile none recorded loss 0.0 for 43-118 of 250 steps
(results/h200-fp8-parity-wide-3.json). CUDA streams are not there on the CPU, so this test stands in a
marker object for the stream and checks which stream was current at every op on the vector."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from trainer.engine import drafter_stage as drafter_mod


def test_metric_vector_ops_all_on_the_stage_stream(monkeypatch):
    current = [None]          # the stream a GPU op would be issued on (None: the caller's default stream)

    @contextlib.contextmanager
    def fake_stream_ctx(stream):
        prev, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = prev

    monkeypatch.setattr(drafter_mod, "stream_ctx", fake_stream_ctx)
    cfg, dcfg = SimpleNamespace(compile="none"), SimpleNamespace(block_size=4)
    stage = drafter_mod.DrafterStage(None, torch.device("cpu"), None, None, cfg, dcfg, "sdpa")
    stage.stream = object()   # the stage's stream, not the caller's
    seen = []

    class Tracked(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append((getattr(func, "__name__", str(func)), current[0]))
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    stage.metric = stage.metric.as_subclass(Tracked)
    with torch._C.DisableTorchFunctionSubclass():
        stage.metric[0] += 2.5           # a micro-batch's loss sum (micro_step, on the stage's stream)
    stage.tokens, stage.weight = 10, 2.0
    with fake_stream_ctx(stage.stream):  # Trainer.optimizer_step: step_vector inside the stream's context
        vec = stage.step_vector()
    stage.reset_counters()               # ... and reset_counters after it, outside
    names = [n for n, _ in seen]
    assert "zero_" in names and any("cat" in n or "getitem" in n for n in names), names
    wrong = [(n, s) for n, s in seen if s is not stage.stream]
    assert not wrong, f"ops on the metric vector issued off the stage's stream: {wrong}"
    assert float(vec[0]) == 2.5 and float(stage.metric.sum()) == 0.0 and stage.tokens == 0
