"""What the benchmark counts as work: the model FLOPs of the target's forward and the drafter's training step
(MFU's numerator, counted as in docs/performance-archive.md, "The benchmark"), and the datasheet peak it is
divided by.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.lab.bench.profile import gpu_name
from trainer.lab.bench.shapes import SHAPES

PEAK_BF16 = {"H200": 989e12, "H100": 989e12}  # dense bf16, datasheet


def peak_flops(n_gpus: int) -> float | None:
    name = gpu_name()
    for k, v in PEAK_BF16.items():
        if k in name:
            return v * n_gpus
    return None


def model_flops_target(lengths, shape: str, layers_run: int) -> float:
    """Forward FLOPs of the first `layers_run` layers over sequences of `lengths`. Hybrid shapes: every 4th
    layer is gated full attention (q_proj also makes the output gate: 2 x heads x head_dim); the others are
    Gated DeltaNet: its projections (qkv, z, a, b, out), the 4-tap conv, and the chunked delta rule counted
    as 6 dk dv + 2 C (dk + dv) per token and value head (C = 64: state read, update and the in-chunk part)."""
    h, n, nh, nkv, hd, mlp, vocab = SHAPES[shape].dims
    lengths = np.asarray(lengths, np.float64)
    lin = SHAPES[shape].linear
    if lin is None:
        per_layer = 2 * (h * nh * hd * 2 + h * nkv * hd * 2) + 2 * 3 * h * mlp
        return float(layers_run * (per_layer * lengths.sum() + 2 * nh * hd * (lengths ** 2).sum()))
    nk, nv = lin["linear_num_key_heads"], lin["linear_num_value_heads"]
    dk, dv, conv = lin["linear_key_head_dim"], lin["linear_value_head_dim"], lin["linear_conv_kernel_dim"]
    full = sum(1 for i in range(layers_run) if (i + 1) % 4 == 0)
    linear = layers_run - full
    mlp_f = 2 * 3 * h * mlp
    full_f = 2 * h * (3 * nh * hd + 2 * nkv * hd) + mlp_f
    lin_f = (2 * h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + 2 * nv * dv * h + 2 * conv * (2 * nk * dk + nv * dv)
             + nv * (6 * dk * dv + 2 * 64 * (dk + dv)) + mlp_f)
    return float((full * full_f + linear * lin_f) * lengths.sum() + full * 2 * nh * hd * (lengths ** 2).sum())


def model_flops_drafter_before(plan, dcfg, soft: bool) -> float:
    """The count the older results used, before attention counted visible pairs only (for comparing
    with them): fc 3x, the LM head on every
    block row 2x, the soft-label logits once per block row."""
    h, vocab, k = dcfg.hidden_size, dcfg.vocab_size, len(dcfg.target_layer_ids)
    rows = sum(len(c.q_seq) for c in plan.chunks)
    ctx = sum(c.c1 - c.c0 for c in plan.chunks)
    soft_useful = (2 * h * vocab * len(plan.final_gather)) if soft and plan.final_gather is not None else 0
    useful = model_flops_drafter(plan, dcfg, soft)
    head_useful = 2 * 2 * h * vocab * sum(int((c.row_weight > 0).sum()) for c in plan.chunks)
    return (useful - soft_useful - head_useful + ctx * 2 * k * h * h     # fc 3x
            + 2 * 2 * h * vocab * rows + (2 * h * vocab * rows if soft else 0))


def model_flops_drafter(plan, dcfg, soft: bool, executed: bool = False) -> float:
    """Training FLOPs of one micro-batch.

    Useful work (executed=False, what MFU counts): 3x forward for the trainable layers; 2x for fc (its
    input, the tapped hidden states, needs no gradient: forward + weight gradient); 2x for the frozen LM
    head on the rows that carry a loss (forward + grad w.r.t. its input); 1x for the soft-label target
    logits once per unique position of the micro-batch (len(plan.final_gather)); attention over the
    visible (query, key) pairs only. An architecture with convolutions around its sublayers (DFlash2,
    dcfg.architecture.sublayer_conv) adds per layer their kernel
    projections (H -> 2 x 2KG on every block row: the input side's and the output side's kernels of the
    attention and the MLP convolution) and, on the rows with a loss, the selector: the K candidates' unary
    scores 2x (frozen head rows; forward + grad w.r.t. the hidden state), its rank-r projection and pair
    scores 3x (dcfg.architecture.selector); the convolutions' and top-K's elementwise work is not counted.
    executed=True: what the code runs. The LM head on plan.loss_rows (all block rows with --no-loss-dedup),
    the soft-label logits on each loss chunk's soft rows (plan.soft_unique: unique per loss chunk, or one
    per row with --no-loss-dedup), attention over the listed FlexAttention tiles (or every pair, SDPA's
    dense mask)."""
    h, nh, nkv, hd, inter, vocab = (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads,
                                    dcfg.head_dim, dcfg.intermediate_size, dcfg.vocab_size)
    k = len(dcfg.target_layer_ids)
    rows = sum(len(c.q_seq) for c in plan.chunks)
    ctx = sum(c.c1 - c.c0 for c in plan.chunks)
    windows = [dcfg.window(i) for i in range(dcfg.num_hidden_layers)]   # sliding layers see fewer pairs
    if executed:
        pairs = sum(_executed_pairs(c, dcfg.block_size, w) for w in windows for c in plan.chunks)
        head_rows = sum(len(c.loss_rows) if c.loss_rows is not None else len(c.q_seq) for c in plan.chunks)
        soft_rows = sum(len(c.soft_unique) if c.soft_unique is not None else len(c.q_seq) for c in plan.chunks)
    else:
        pairs = sum(_visible_pairs(c, dcfg.block_size, w) for w in windows for c in plan.chunks)
        head_rows = sum(int((c.row_weight > 0).sum()) for c in plan.chunks)
        soft_rows = len(plan.final_gather) if plan.final_gather is not None else 0
    layers = (dcfg.num_hidden_layers * (rows * (2 * h * nh * hd * 2 + 2 * 3 * h * inter)
                                        + (rows + ctx) * 2 * h * nkv * hd * 2) + 4 * nh * hd * pairs)
    fc = ctx * 2 * k * h * h
    head = 2 * h * vocab
    selector = 0
    if dcfg.architecture.sublayer_conv:
        kg = 2 * dcfg.conv_kernel_size * (h // dcfg.conv_group_size)
        layers += dcfg.num_hidden_layers * 2 * rows * 2 * h * kg
    if dcfg.architecture.selector:
        top, r = dcfg.selector_top_k, dcfg.selector_rank
        selector = head_rows * (2 * 2 * h * top + 3 * (2 * h * r + 2 * r * top))
    return 3 * layers + 2 * fc + 2 * head * head_rows + (head * soft_rows if soft else 0) + selector


def _visible_pairs(c, block_size: int, window: int | None) -> float:
    """(query, key) pairs a chunk's block rows attend to in one layer: the context before the anchor and the
    whole block; a sliding layer (drafter.py): the context in (p - window, anchor) and the block up to p."""
    if window is None:
        return float(c.q_anchor.sum()) + len(c.q_seq) * block_size
    p, a = c.q_pos.astype(np.float64), c.q_anchor.astype(np.float64)
    return float(np.maximum(0.0, a - np.maximum(0.0, p - window + 1)).sum() + (p - a + 1).sum())


def _executed_pairs(c, block_size: int, window: int | None) -> float:
    """The pairs one layer computes: its FlexAttention tiles (model.flex_tile_lists: a sliding layer's lists
    are cut to its window), or every pair (SDPA's dense mask)."""
    if c.kv_num_blocks is None:
        return float(len(c.q_seq)) * (c.c1 - c.c0 + len(c.q_seq))
    from trainer.model.drafter import PackedMeta, flex_tile_lists
    meta = PackedMeta.from_chunk({k: torch.from_numpy(v) for k, v in c.arrays().items()}, block_size)
    num, _, fnum, _ = flex_tile_lists(meta, window)
    return (int(num.sum()) + (int(fnum.sum()) if fnum is not None else 0)) * 128.0 * 128.0
