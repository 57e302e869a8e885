"""The compiled drafter's warmup must leave graphs that cover the micro-batches training brings (issue 29).

After the warmup a shape the graphs do not cover compiles mid-run (fast.end_warmup); under the old freeze it
ran eagerly, and eager FlexAttention materializes the whole score matrix (the width-1,024 OOM in
results/log-fp8-parity-wide-failed.txt.gz). There, at --max-anchors 32 with the warmup's 512-token
sequences, every warmup chunk had as many block rows as context rows; dynamo's duck shaping gave both one
symbol, so the graphs were guarded on that equality and every real micro-batch failed the guard.
Dynamo alone (backend "eager") shows the guard on the CPU in a second."""

from __future__ import annotations

import pytest
import torch

from trainer.ops import compiling as fast


@pytest.mark.parametrize("duck", [False, True])
def test_equal_sizes_at_compile_time_do_not_tie_the_graph(duck):
    config = torch.fx.experimental._config
    saved = config.use_duck_shape
    config.use_duck_shape = True
    torch._dynamo.reset()
    assert fast.compile_layers([], dynamic=True) == 0     # what build_drafter calls: it sets the config
    if duck:   # the old behaviour, to show what the test tells apart
        config.use_duck_shape = True
    f = torch.compile(lambda x, ctx: torch.cat([ctx, x]) * x.shape[0], backend="eager", dynamic=True)
    f(torch.ones(512), torch.ones(512))                     # the warmup: block rows == context rows
    torch.compiler.set_stance("fail_on_recompile")
    try:
        if duck:
            with pytest.raises(Exception, match="recompil|Recompil"):
                f(torch.ones(448), torch.ones(512))
        else:
            f(torch.ones(448), torch.ones(512))             # a real micro-batch: covered
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
        config.use_duck_shape = saved


def test_warmup_brings_a_one_query_tile_chunk():
    """A micro-batch's tail chunk can hold a single 128-row query tile: a size-1 dimension of the FlexAttention
    tile lists, which dynamo specializes even in a dynamic graph. The warmup brings one."""
    import numpy as np

    from trainer.config.options import parse_args
    from trainer.engine.compile_warmup import warmup_batches
    from trainer.ops.plan import FLEX_BLOCK, plan_micro_batch
    for bs in (16, 32):
        cfg = parse_args(["--target-model", "/x", "--data-dir", "/y", "--output-dir", "/z", "--token-budget", "4096",
                          "--max-seq-len", "512", "--block-size", str(bs), "--max-anchors", "64", "--compile", "all"])
        tiles = set()
        for lens in warmup_batches(cfg):
            n, s = len(lens), max(lens)
            lengths = np.array(lens)
            mask = np.arange(s)[None, :] < lengths[:, None]
            mask[:, 0] = False
            plan = plan_micro_batch(np.ones((n, s), np.int64), mask, lengths, list(range(n)), 0, seed=0,
                                    block_size=bs, max_anchors=64, mask_token_id=5, gamma=7.0, soft_labels=False,
                                    chunk_rows=cfg.drafter_chunk_rows, flex=True)
            tiles |= {-(-len(c.q_seq) // FLEX_BLOCK) for c in plan.chunks}
        assert 1 in tiles and max(tiles) > 1, tiles


# ----------------------------------------------------------------------- the compiled target (issue 54)

def _cfg(*extra):
    from trainer.config.options import parse_args
    return parse_args(["--target-model", "/x", "--data-dir", "/y", "--output-dir", "/z", *extra])


OLD_TARGET_SHAPES = [(6, 8192), (64, 256)]   # the warmup before issue 54: no one-sequence batch


@pytest.mark.parametrize("shapes", ["old", "new"])
def test_the_compiled_target_warms_a_one_sequence_batch(shapes):
    """A layer compiled the way compile_layers compiles the target's (dynamic=None), warmed at the target's
    warmup shapes, then frozen (fail_on_recompile): every batch row count the planner can make, one
    sequence included, runs without a compile. Dynamo specializes size 1, so the old shapes fail there."""
    cfg = _cfg("--compile", "target")
    warm = OLD_TARGET_SHAPES if shapes == "old" else fast_shapes(cfg)
    hidden = 8
    w = torch.randn(hidden, hidden)

    def layer(x):   # a decoder layer's batch and sequence handling: flatten, project, norm, back
        b, s, h = x.shape
        y = (x.reshape(b * s, h) @ w).reshape(b, s, h)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)

    torch._dynamo.reset()
    f = torch.compile(layer, backend="eager", dynamic=None)
    try:
        for b, s in warm:   # lengths scaled down: the CPU's time, the same size regimes
            f(torch.randn(b, max(2, s // 64), hidden))
        torch.compiler.set_stance("fail_on_recompile")
        rows = range(1, cfg.max_batch_size + 1)
        if shapes == "old":
            with pytest.raises(Exception, match="recompil|Recompil"):
                f(torch.randn(1, 40, hidden))
        else:
            from trainer.engine.compile_warmup import batch_rows_unwarmed
            assert warm[-1] == (1, min(cfg.max_seq_len, cfg.token_budget))
            assert batch_rows_unwarmed(rows, warm) == []
            for b in rows:
                for s in (3, 40, 128):
                    f(torch.randn(b, s, hidden))
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()


def fast_shapes(cfg):
    from trainer.engine.compile_warmup import target_warmup_shapes
    return target_warmup_shapes(cfg)


@pytest.mark.parametrize("args", [(), ("--max-batch-size", "2"), ("--max-batch-size", "3"),
                                  ("--token-budget", "8192", "--max-seq-len", "8192"),
                                  ("--token-budget", "1024", "--max-seq-len", "256", "--max-batch-size", "4")])
def test_the_target_warmup_covers_every_row_count_the_planner_can_make(args):
    from trainer.engine.compile_warmup import batch_rows_unwarmed, target_warmup_shapes
    cfg = _cfg(*args)
    shapes = target_warmup_shapes(cfg)
    assert shapes[-1] == (1, min(cfg.max_seq_len, cfg.token_budget))
    assert batch_rows_unwarmed(range(1, cfg.max_batch_size + 1), shapes) == []
    assert all(b * s <= max(cfg.token_budget, s) for b, s in shapes)


def test_a_planned_row_count_the_warmup_does_not_cover_is_found_before_the_run(monkeypatch):
    """check_target_coverage reads the planner's batches (host-side) and names a row count the compiled
    target's warmup misses; the Trainer turns it into bad input (exit 2) before the warmup."""
    import numpy as np

    from trainer.data.dataset import BatchPlanner
    from trainer.engine import compile_warmup as cw
    cfg = _cfg("--compile", "target", "--token-budget", "1024", "--max-seq-len", "512", "--max-batch-size", "8")
    lengths = np.array([500] * 3 + [100] * 40)     # 500-token sequences make one- and two-sequence batches
    planner = BatchPlanner(lengths, cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size, seed=0)
    planned = cw.planned_batch_rows(planner)
    assert 1 in planned or 2 in planned
    assert cw.check_target_coverage(cfg, planner) == cw.target_warmup_shapes(cfg)
    monkeypatch.setattr(cw, "target_warmup_shapes", lambda c: [(2, 512), (8, 128)])
    if 1 in planned:
        with pytest.raises(ValueError, match=r"batches of \[1\] sequences"):
            cw.check_target_coverage(cfg, planner)
    cfg.compile = "drafter"     # an eager target compiles nothing mid-step: nothing to check
    cw.check_target_coverage(cfg, planner)


def test_compile_auto_compiles_only_the_drafter_on_a_hybrid_target(tiny_hybrid_dir, tiny_small_dir):
    from trainer.engine.compile_warmup import hybrid_target, startup_bounds
    hybrid = _cfg()
    hybrid.target_model = str(tiny_hybrid_dir / "target") if (tiny_hybrid_dir / "target").is_dir() \
        else str(tiny_hybrid_dir)
    dense = _cfg()
    dense.target_model = str(tiny_small_dir / "target")
    assert hybrid_target(hybrid) and not hybrid_target(dense)
    assert fast.resolve_compile("auto", on_cpu=False, hybrid=True) == "drafter"
    assert fast.resolve_compile("auto", on_cpu=False, hybrid=False) == "all"
    assert fast.resolve_compile("auto", on_cpu=True, hybrid=True) == "none"
    assert fast.resolve_compile("all", on_cpu=False, hybrid=True) == "all"
    why = fast.compile_reason("auto", on_cpu=False, hybrid=True)
    assert why.startswith("--compile auto -> drafter") and "hybrid" in why and "\n" not in why
    hybrid.target_gpus, hybrid.drafter_gpus = [0], [1]
    assert "--compile drafter" in startup_bounds(hybrid).why


def test_a_compile_after_the_warmup_is_logged_with_its_seconds_beside_its_guard(monkeypatch, caplog):
    """Issue 61, item 3: a compile after the warmup holds the step while the peers' receives count against the
    NCCL timeout; its line says how long it took, with the guard that failed."""
    import logging
    import re

    import torch

    from trainer.ops import compiling
    monkeypatch.delenv(compiling.AFTER_WARMUP_ENV, raising=False)
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.cos(x) * x.shape[0], backend="eager", dynamic=True)
    compiling.begin_warmup()
    f(torch.ones(3, 4))
    compiling.end_warmup()
    with caplog.at_level(logging.WARNING, logger=compiling.log.name):
        f(torch.ones(1, 4))                  # size 1: specialized, a new graph
        assert compiling.note_new_graphs(7) == 1
    line = next(ln for ln in caplog.text.splitlines() if "step 7:" in ln)
    assert re.search(r"compiled after the warmup in \d+\.\ds, 1 in all", line), line
    assert "x.size()[0]" in line, line
    compiling.begin_warmup()
    torch._dynamo.reset()
