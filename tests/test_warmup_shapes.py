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
    from trainer.ops.plan import FLEX_BLOCK, plan_micro_batch
    from trainer.engine.compile_warmup import warmup_batches
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
