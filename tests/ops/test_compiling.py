"""Speed options on the CPU: the compiled paths must compute what the eager ones do, hooks must still
fire around compiled layers, what compiles after the warmup is chosen by the stance and logged, every module
forward of a rank runs on its main thread (what makes a compile after the warmup safe), and the per-step logs
stay bounded."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from trainer.engine.metrics import HeadTailLog, MetricsFile, Profiler
from trainer.ops import compiling as fast
from trainer.ops.loss import dflash_loss, lm_head_chunk


@pytest.fixture(autouse=True)
def _default_stance():
    fast.begin_warmup()
    yield
    fast.begin_warmup()


def _graphs() -> int:
    return fast.compile_counters().get("unique_graphs", 0)


@pytest.mark.slow  # torch.compile on the CPU: 5-45 s
@pytest.mark.parametrize("soft", [False, True])
def test_compiled_lm_head_loss_matches_eager(soft):
    g = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 37, 16, 101
    h = torch.randn(rows, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::5] = -1
    row_w = torch.rand(rows, generator=g) * (labels >= 0)
    soft_rows = torch.randn(rows, hidden, generator=g) if soft else None
    out = {}
    for fused in (False, True):
        h.grad = None
        loss, correct = dflash_loss(h, w, labels, row_w, 3.0, soft_rows=soft_rows, chunk=16, fused=fused)
        loss.backward()
        out[fused] = (loss.detach(), correct, h.grad.clone())
    assert torch.allclose(out[True][0], out[False][0], rtol=1e-5)
    assert torch.equal(out[True][1], out[False][1])
    assert torch.allclose(out[True][2], out[False][2], rtol=1e-4, atol=1e-6)
    # and the chunking itself is exact: one chunk over all rows gives the same loss
    total, _, _ = lm_head_chunk(h.detach(), w, labels, soft_rows, row_w / 3.0)
    assert torch.allclose(out[False][0], total, rtol=1e-5)


@pytest.mark.slow  # torch.compile on the CPU
def test_compiled_loss_covers_every_chunk_shape_with_one_graph():
    """Loss chunks and their unique soft rows vary in size (balanced chunks, tails): the compiled chunk
    function is dynamic in its row counts from the first call, so one graph covers them all and the
    warmup does not need to hit each tail size (frozen, an uncovered shape would run eagerly)."""
    from trainer.ops import loss as M
    M._compiled_chunk = None
    g = torch.Generator().manual_seed(0)
    hidden, vocab = 16, 101
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    before, first = _graphs(), None
    for rows, positions in ((40, 9), (23, 7), (61, 20), (9, 3)):
        h = torch.randn(rows, hidden, generator=g, requires_grad=True)
        labels = torch.randint(0, vocab, (rows,), generator=g)
        row_w = torch.rand(rows, generator=g)
        base = torch.randn(positions, hidden, generator=g)
        soft_rows = base[torch.randint(0, positions, (rows,), generator=g)]
        loss, _ = dflash_loss(h, w, labels, row_w, 2.0, soft_rows=soft_rows, chunk=32, fused=True)
        loss.backward()
        total, grad, _ = lm_head_chunk(h.detach(), w, labels, soft_rows, row_w / 2.0)
        assert torch.allclose(loss.detach(), total, rtol=1e-5)
        assert torch.allclose(h.grad, grad, rtol=1e-4, atol=1e-6)
        first = _graphs() if first is None else first
    # the first call compiles (unless an earlier test's graph already covers it), later shapes reuse it
    assert first - before <= 1 and _graphs() == first


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.silu(self.lin(x)) * x


def test_regional_compile_shares_one_graph_keeps_hooks_and_freezes(monkeypatch):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_Layer() for _ in range(12))
    x = torch.randn(5, 8)
    want = x
    for layer in layers:
        want = layer(want)
    seen = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, i=i: seen.append(i))
    before = _graphs()
    assert fast.compile_layers(layers) == 12
    got = x
    for layer in layers:
        got = layer(got)
    assert torch.allclose(got, want, atol=1e-6)
    assert seen == list(range(12))  # eager hooks around the compiled forward
    # identical layers share compiled code: the first call specialises, the second goes generic,
    # layers 3..12 reuse it (one graph per layer would be 12)
    assert _graphs() - before <= 2
    monkeypatch.setenv(fast.AFTER_WARMUP_ENV, "eager_on_recompile")
    assert fast.end_warmup() == "eager_on_recompile"
    frozen = _graphs()
    y = torch.randn(3, 2, 8)  # a new rank: would need a new graph
    out = layers[0](y)
    assert _graphs() == frozen  # ran eagerly instead of compiling
    assert torch.allclose(out, torch.nn.functional.silu(layers[0].lin(y)) * y, atol=1e-6)


def test_resolve_compile_and_flags():
    from trainer.config.options import ConfigError, parse_args
    assert fast.resolve_compile("auto", on_cpu=True) == "none"
    assert fast.resolve_compile("auto", on_cpu=False) == "all"
    assert fast.resolve_compile("target", on_cpu=True) == "target"
    assert fast.wants("all", "drafter") and not fast.wants("target", "drafter")
    base = ["--target-model", "/x", "--data-dir", "/y", "--output-dir", "/z"]
    cfg = parse_args(base + ["--compile", "drafter", "--sdpa-backend", "flash", "--transport", "world"])
    assert (cfg.compile, cfg.sdpa_backend, cfg.transport) == ("drafter", "flash", "world")
    with pytest.raises(ConfigError, match="--compile"):
        parse_args(base + ["--compile", "everything"])


def test_sdpa_auto_leaves_out_cudnn_on_gpus_only():
    """auto must never let the target's attention reach cuDNN on a GPU (its per-shape plan cache grows
    host memory without limit); 'any' and auto on the CPU leave PyTorch's choice alone."""
    b = torch.backends.cuda
    enabled = lambda: (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
                       b.cudnn_sdp_enabled())
    before = enabled()
    assert before[3], "test needs PyTorch's default: cuDNN attention enabled"
    with fast.sdpa_context("auto", "cuda"):
        assert enabled() == (True, True, True, False)
    with fast.sdpa_context("cudnn", "cuda"):
        assert enabled() == (False, False, False, True)
    for backend, dev in (("any", "cuda"), ("auto", "cpu")):
        with fast.sdpa_context(backend, dev):
            assert enabled() == before
    assert enabled() == before


def test_head_tail_log_is_bounded_and_ordered():
    log = HeadTailLog(keep=3)
    for i in range(10):
        log.append(i)
    assert log.entries() == [0, 1, 2, 7, 8, 9] and log.total == 10 and log[-1] == 9 and log[0] == 0
    short = HeadTailLog(keep=3)
    for i in range(4):
        short.append(i)
    assert list(short) == [0, 1, 2, 3]


def test_profiler_folds_finished_event_pairs_as_it_goes():
    from trainer.distributed.transport import HostEvent as _HostEvent
    p = Profiler()
    for _ in range(1000):
        a, b = _HostEvent(), _HostEvent()
        a.record()
        b.record()
        p.add_events("stage", a, b)
    assert len(p.pending) < 64
    assert p.snapshot()["stage"]["count"] == 1000


def test_metrics_file_on_a_full_disk_warns_once_and_goes_on(caplog, tmp_path):
    """metrics.jsonl is a record: a write that fails (ENOSPC) must not end the run (the checkpoint save
    decides that, with its own message); the trainer warns once and recovers when space returns."""
    import errno
    import io

    class Disk(io.StringIO):
        full = True
        name = "/out/metrics.jsonl"

        def flush(self):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().flush()

    mf = MetricsFile(tmp_path / "metrics.jsonl", None)
    mf.f.close()
    mf.f, mf.path = Disk(), "/out/metrics.jsonl"
    with caplog.at_level("WARNING", logger="trainer"):
        mf.write(['{"step": 1}\n'])
        mf.write(['{"step": 2}\n'])
    warned = [r for r in caplog.records if "could not write /out/metrics.jsonl" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0].getMessage()
    mf.f.full = False
    mf.write(['{"step": 3}\n'])
    assert not mf.error
    assert mf.f.getvalue().splitlines() == ['{"step": 1}', '{"step": 2}', '{"step": 3}']


def test_metrics_file_drops_records_after_the_resumed_checkpoint(tmp_path):
    """A kill after step 5 with the last checkpoint at step 3: on resume, steps 4-5 (and a torn line)
    go, so steps 4-5 are not in the file twice once the run has redone them."""
    import json
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    mf = MetricsFile(path, resume_step=3)
    mf.write([json.dumps({"step": 4}) + "\n"])
    mf.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.parametrize("budget,max_len,chunk", [(49152, 8192, 16384), (49152, 8192, 32768), (2048, 512, 1024)])
def test_compiled_warmup_brings_every_chunk_kind_a_step_can(budget, max_len, chunk):
    """After the warmup the graphs are frozen and an uncovered shape runs eagerly (eager FlexAttention
    materializes the whole score matrix: the 27B-width OOM). Dynamo specializes sizes 0 and 1, so the
    warmup must plan chunks with one sequence, full chunks with several, and a partial tail chunk."""
    import numpy as np

    from trainer.config.options import parse_args
    from trainer.engine.compile_warmup import warmup_batches
    from trainer.ops.plan import plan_micro_batch
    base = ["--target-model", "/x", "--data-dir", "/y", "--output-dir", "/z", "--token-budget", str(budget),
            "--max-seq-len", str(max_len), "--block-size", "16", "--max-anchors", "512",
            "--drafter-chunk-rows", str(chunk)]
    assert warmup_batches(parse_args(base + ["--compile", "none"])) == [[max_len]]
    seqs_per_chunk, full, partial = set(), False, False
    for lens in warmup_batches(parse_args(base + ["--compile", "all"])):
        assert sum(lens) <= budget and max(lens) <= max_len
        n, s = len(lens), max(lens)
        lengths = np.array(lens)
        mask = np.arange(s)[None, :] < lengths[:, None]
        mask[:, 0] = False
        plan = plan_micro_batch(np.ones((n, s), np.int64), mask, lengths, list(range(n)), 0, seed=0, block_size=16,
                                max_anchors=min(512, chunk // 16), mask_token_id=5, gamma=7.0, soft_labels=True,
                                chunk_rows=chunk, flex=True)
        for c in plan.chunks:
            seqs_per_chunk.add(min(2, len(np.unique(c.q_seq))))
            full |= len(c.q_seq) == chunk
            partial |= len(c.q_seq) < chunk
    assert seqs_per_chunk == {1, 2} and full and partial


@pytest.mark.parametrize("stance", ["default", "eager_on_recompile", "fail_on_recompile"])
def test_after_the_warmup_an_uncovered_shape_follows_the_stance(stance, monkeypatch, caplog):
    """default: it compiles once and the step is logged; eager_on_recompile: it runs eagerly; fail_on_recompile:
    an error naming the guard. The tau eval (no_new_graphs) never compiles, whatever the stance."""
    if stance == "default":
        monkeypatch.delenv(fast.AFTER_WARMUP_ENV, raising=False)
    else:
        monkeypatch.setenv(fast.AFTER_WARMUP_ENV, stance)
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sin(x) * x.shape[0], backend="eager", dynamic=True)
    fast.begin_warmup()
    f(torch.ones(3, 4))                                  # the warmup's shape
    assert fast.end_warmup() == stance and fast.note_new_graphs(1) == 0
    f(torch.ones(6, 4))                                  # covered: the graph is dynamic
    assert fast.note_new_graphs(2) == 0
    with fast.no_new_graphs():                           # the eval: another dtype, run eagerly
        before = _graphs()
        x64 = torch.ones(2, 2, dtype=torch.float64)
        assert torch.allclose(f(x64), torch.sin(x64) * 2)
        assert _graphs() == before
    uncovered = torch.ones(1, 4)                         # dynamo specializes size 1: not covered
    with caplog.at_level(logging.WARNING, logger="trainer.fast"):
        if stance == "fail_on_recompile":
            with pytest.raises(RuntimeError, match="[Rr]ecompil"):
                f(uncovered)
        else:
            assert torch.equal(f(uncovered), torch.sin(uncovered))
        new = fast.note_new_graphs(3)
    assert new == (1 if stance == "default" else 0)
    assert ("step 3: 1 graph(s) compiled after the warmup" in caplog.text) == (stance == "default")
    if stance == "default":    # with dynamo's reason: the function and the guard it failed, on the one line
        line = next(ln for ln in caplog.text.splitlines() if "step 3:" in ln)
        assert "<lambda> (test_compiling.py:" in line and "x.size()[0]" in line and "  # " not in line, line
    caplog.clear()
    f(uncovered) if stance != "fail_on_recompile" else None
    assert fast.note_new_graphs(4) == new and not caplog.text     # each new graph is logged once
    torch._dynamo.reset()


def test_a_recompile_on_any_rank_is_counted_in_status_json(tmp_path, monkeypatch, capsys):
    """Each rank's count of graphs compiled after the warmup (compiling.note_new_graphs) travels in the stop
    vote; rank 0's status.json shows the job's total and each rank's, and dflash-status names it. Here the
    target rank (rank 1) compiled two: rank 0 alone could never have seen them."""
    from types import SimpleNamespace

    import numpy as np

    from trainer.config.options import parse_args
    from trainer.distributed.groups import StopVote
    from trainer.distributed.topology import LocalRole, Topology
    from trainer.engine.report import Reporter
    from trainer.status import read_status
    from trainer.status.cli import main as status_main
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    cfg = parse_args(["--target-model", "t", "--data-dir", "d", "--output-dir", str(tmp_path), "--target-gpus", "cpu",
                      "--drafter-gpus", "cpu"])
    roles = [LocalRole(False, True, "cpu"), LocalRole(True, False, "cpu")]
    vote = SimpleNamespace(last=None)
    rep = Reporter(cfg, Topology(0, 2, 0, roles[0], "h", roles, ["h", "h"]), "r1", torch.device("cpu"), Profiler(),
                   SimpleNamespace(batch_shapes=set()), vote)
    rep.status.min_interval = 0.0
    written = []
    rep.sinks = [SimpleNamespace(write=lambda step, scalars: written.append((step, scalars)))]
    rep.begin(0, 10, None, None)
    rep.after_step(1, 0, 100)
    assert read_status(cfg.status_file).get("recompiles") is None       # no stop vote read yet
    row = [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    vote.last = np.array([row + [0.0], row + [2.0]])
    assert len(StopVote.FIELDS) == vote.last.shape[1]
    time.sleep(0.01)
    rep.after_step(2, 0, 200)
    st = read_status(cfg.status_file)
    assert st["recompiles"] == 2 and [r["recompiles"] for r in st["ranks"]] == [0, 2]
    assert written == [(2, {"recompiles": 2})]
    status_main(["--status-file", cfg.status_file, "--no-pid-check"])
    assert "2 graph(s) compiled after the warmup" in capsys.readouterr().out
    rep.end()


def test_an_unknown_after_warmup_stance_names_the_variable(monkeypatch):
    monkeypatch.setenv(fast.AFTER_WARMUP_ENV, "frozen")
    with pytest.raises(ValueError, match=fast.AFTER_WARMUP_ENV):
        fast.end_warmup()


def test_a_rank_runs_every_module_forward_on_its_main_thread(tiny_small_dir, tmp_path, monkeypatch):
    """fast.end_warmup lets a new shape compile mid-run. Compiling traces with FX, which patches
    nn.Module.__call__ process-wide: safe only while no other thread of the rank runs a module (the old
    thread-per-replica engine's race). A whole rank in-process (world size 1, target and drafter on the CPU,
    the async pipeline on): every module call is on the main thread, while the prefetch thread does run."""
    import signal

    from tests.engine.test_trainer import tiny_args
    from trainer.__main__ import main as train_main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DFLASH_SUPERVISOR_PID", raising=False)
    threads: set[str] = set()
    call = torch.nn.Module.__call__

    def recording_call(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return call(self, *args, **kwargs)
    seen_prefetch = []
    start = threading.Thread.start

    def recording_start(self):
        seen_prefetch.append(self.name)
        return start(self)
    monkeypatch.setattr(torch.nn.Module, "__call__", recording_call)
    monkeypatch.setattr(threading.Thread, "start", recording_start)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = train_main(tiny_args(tiny_small_dir, tmp_path / "out", "--max-steps", "3", "--grad-accum", "1"))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert rc == 0
    assert "prefetch" in seen_prefetch
    assert threads == {threading.main_thread().name}, threads
