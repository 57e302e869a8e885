"""The split attention path of trainer/model/drafter.py (bench variant `split`, `--flex-kernel-options
SPLIT_BLOCKS=true`) computes the reference attention, on the CPU (issue 29).

The split path runs FlexAttention over the context keys only (the chunk's tile lists cut to the context
tiles) and the in-block part as a small dense attention, and merges the two by log-sum-exp. Checked here:
- the cut tile lists cover every visible context pair, their full tiles hold only visible pairs, and no
  block tile is left in them;
- no query sees a key the reference mask hides: its output does not move when such a key or value moves
  (gradient exactly zero), including rows that see no context at all;
- forward through eager FlexAttention (the CPU has no FlexAttention backward) equals the dense-mask model;
- loss and every parameter gradient of the drafter equal the dense-mask model's (float64), with the context
  part computed by a dense mask (the structure under test: the block part, the merge, the gradient through
  the log-sum-exp), by autograd (SPLIT_BLOCKS=true) and by BlockMerge's written-out backward (=2). FlexAttention's own gradients with the log-sum-exp are checked on the GPU
  (trainer/lab/gpu/split_attention.py, output in results/).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from trainer.model.drafter import (
    BlockMerge,
    DFlashConfig,
    DFlashDrafter,
    PackedMeta,
    block_attention,
    ctx_attention_dense,
    ctx_attention_flex,
    ctx_flex_lists,
    dense_mask,
    init_drafter_weights,
    merge_attention,
)
from trainer.ops.plan import FLEX_BLOCK, plan_micro_batch


def _plan(lens, block, anchors, seed=0, start_div=4):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens)
    ids = rng.integers(0, 90, size=(len(lens), lens.max()))
    mask = np.zeros(ids.shape, bool)
    for b, n in enumerate(lens):
        mask[b, n // start_div if start_div else 0:n] = True
    return plan_micro_batch(ids, mask, lens, list(range(len(lens))), 0, seed=seed, block_size=block,
                            max_anchors=anchors, mask_token_id=99, gamma=4.0, soft_labels=False,
                            chunk_rows=10**6, flex=True)


def _meta(c, block):
    t = torch.from_numpy
    return PackedMeta.from_chunk({k: t(v) for k, v in c.arrays().items()}, block)


def _tiles(num, idx):
    out = set()
    for qb in range(num.shape[2]):
        for kb in idx[0, 0, qb, :num[0, 0, qb]].tolist():
            out.add((qb, kb))
    return out


CASES = [([300, 77, 150], 8, 20), ([1500, 700, 90], 16, 200), ([2000], 32, 60), ([1200, 900], 128, 4),
         ([700], 256, 3)]


@pytest.mark.parametrize("lens,block,anchors", CASES)
def test_cut_lists_cover_exactly_the_visible_context(lens, block, anchors):
    plan = _plan(lens, block, anchors)
    for c in plan.chunks:
        meta = _meta(c, block)
        tc = len(c.ctx_seq)
        assert tc % FLEX_BLOCK == 0
        ctx_ok = dense_mask(meta)[:, :tc].numpy()
        num, idx = ctx_flex_lists(meta.kv_num_blocks, meta.kv_indices, tc)
        fnum, fidx = ctx_flex_lists(meta.full_kv_num_blocks, meta.full_kv_indices, tc)
        part, full = _tiles(num, idx), _tiles(fnum, fidx)
        assert idx.shape[-1] == tc // FLEX_BLOCK                     # spans the context's key tiles
        assert all(kb < tc // FLEX_BLOCK for _, kb in part | full)    # no block tile is left
        assert not (part & full)
        qi, ki = np.nonzero(ctx_ok)
        assert {(int(a), int(b)) for a, b in zip(qi // FLEX_BLOCK, ki // FLEX_BLOCK)} <= part | full
        for qb, kb in full:                                          # skipped by mask_mod: must be all visible
            tile = ctx_ok[qb * FLEX_BLOCK:(qb + 1) * FLEX_BLOCK, kb * FLEX_BLOCK:(kb + 1) * FLEX_BLOCK]
            assert tile.shape == (FLEX_BLOCK, FLEX_BLOCK) and tile.all()
        # the context tiles of the full lists before the cut are all still there
        before = _tiles(meta.kv_num_blocks, meta.kv_indices) | _tiles(meta.full_kv_num_blocks, meta.full_kv_indices)
        assert {p for p in before if p[1] < tc // FLEX_BLOCK} == part | full


def _reference_attention(q, k, v, mask):
    """Dense-mask attention in float64: q [Tq, nh, hd], k/v [Tk, nkv, hd], mask [Tq, Tk]."""
    r = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(r, 1).transpose(0, 1) for t in (k, v))
    s = q.transpose(0, 1) @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return (p @ vv).transpose(0, 1)


def _split(q, k, v, meta, impl, fused=False):
    tc = meta.num_ctx
    as4 = lambda t: t.transpose(0, 1).unsqueeze(0)   # noqa: E731
    oc, lc = impl(as4(q), as4(k[:tc]), as4(v[:tc]), meta)
    if fused:
        return BlockMerge.apply(oc, lc, q, k[tc:], v[tc:], meta.block_size)
    ob, lb = block_attention(q, k[tc:], v[tc:], meta.block_size)
    return merge_attention(oc, lc, ob, lb)


def _qkv(meta, nh=4, nkv=2, hd=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = len(meta.q_seq), meta.num_ctx + len(meta.q_seq)
    return (torch.randn(tq, nh, hd, generator=g, dtype=dtype), torch.randn(tk, nkv, hd, generator=g, dtype=dtype),
            torch.randn(tk, nkv, hd, generator=g, dtype=dtype))


@pytest.mark.parametrize("fused", [False, True])
def test_no_query_sees_a_key_the_reference_mask_hides(fused):
    """Gradient of each query's output with respect to every key and value row: exactly zero where the
    reference mask hides the pair, nonzero where it shows it. start_div=0 supervises from position 0, so
    some blocks anchor at 0 and see no context (their context log-sum-exp is -inf)."""
    # 8 anchors a sequence: 192 query rows over 448 keys, three sequences, one block without context; each
    # row is one backward (20 anchors gave 480 rows over 736 keys: 23 CPU-s for the two cases, now 3)
    plan = _plan([150, 70, 24], 8, 8, seed=3, start_div=0)
    c = plan.chunks[0]
    meta = _meta(c, 8)
    mask = dense_mask(meta)
    q, k, v = _qkv(meta)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out = _split(q, k, v, meta, ctx_attention_dense, fused)
    assert torch.allclose(out, _reference_attention(q, k, v, mask), atol=1e-12)
    no_ctx = ~mask[:, :meta.num_ctx].any(1)
    assert no_ctx.any() and (~no_ctx).any()          # both kinds of rows are in the test
    for i in range(len(meta.q_seq)):                 # every query row
        gq, gk, gv = torch.autograd.grad(out[i].sum(), (q, k, v), retain_graph=True)
        touched = (gk.abs().sum((1, 2)) + gv.abs().sum((1, 2))) > 0
        assert torch.equal(touched, mask[i]), i
        assert torch.equal(gq.abs().sum((1, 2)) > 0, torch.arange(len(gq)) == i)   # queries do not mix
    # and the whole gradient is the reference's
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    ref = _reference_attention(q, k, v, mask)
    for a, b in zip(torch.autograd.grad((out * up).sum(), (q, k, v)), torch.autograd.grad((ref * up).sum(), (q, k, v))):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def _reference_attention_rows(q, k, v, mask, rows=512):
    """_reference_attention, `rows` queries at a time over the keys any of them may see: the columns the
    mask hides from all of them add exp(-inf) = 0 to each softmax, so dropping them changes nothing (the
    dense [7472, 9776] float64 scores of the largest case cost 7 CPU-s)."""
    out = []
    for r0 in range(0, len(q), rows):
        m = mask[r0:r0 + rows]
        cols = m.any(0).nonzero().squeeze(1)
        out.append(_reference_attention(q[r0:r0 + rows], k[cols], v[cols], m[:, cols]))
    return torch.cat(out)


@pytest.mark.parametrize("lens,block,anchors", CASES[:3])
def test_split_through_flex_equals_the_dense_mask(lens, block, anchors):
    """Eager FlexAttention (tile lists and mask_mod both applied) over the context, forward only."""
    plan = _plan(lens, block, anchors)
    for c in plan.chunks:
        meta = _meta(c, block)
        q, k, v = _qkv(meta, dtype=torch.float32)
        ref = _reference_attention_rows(q.double(), k.double(), v.double(), dense_mask(meta))
        # the split path as _split runs it, its context part kept for the checks below
        as4 = lambda t: t.transpose(0, 1).unsqueeze(0)   # noqa: E731
        tc = meta.num_ctx
        of, lf = ctx_attention_flex(as4(q), as4(k[:tc]), as4(v[:tc]), meta)
        out = merge_attention(of, lf, *block_attention(q, k[tc:], v[tc:], meta.block_size))
        assert (out.double() - ref).abs().max() < 1e-5
        # the context part alone: output and log-sum-exp as the dense computation gives them
        od, ld = ctx_attention_dense(as4(q), as4(k[:tc]), as4(v[:tc]), meta)
        assert torch.equal(torch.isinf(lf), torch.isinf(ld))
        fin = ~torch.isinf(ld)
        assert (lf[fin] - ld[fin]).abs().max() < 1e-4 and (of - od).abs().max() < 1e-5


def _tiny(block, nh=4, nkv=2):
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=nh,
                       num_key_value_heads=nkv, head_dim=8, vocab_size=100, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=4096, block_size=block, target_layer_ids=[0, 1], mask_token_id=99,
                       target_num_hidden_layers=4)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.1)
    return model.double()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("nkv", [1, 2, 4])
@pytest.mark.parametrize("lens,block,anchors,start_div", [([300, 77, 150], 8, 20, 4), ([400, 60], 16, 30, 0)])
def test_split_loss_and_gradients_equal_the_reference(lens, block, anchors, start_div, nkv, fused):
    plan = _plan(lens, block, anchors, start_div=start_div)
    c = plan.chunks[0]
    meta = _meta(c, block)
    ref_model = _tiny(block, nkv=nkv)
    split_model = copy.deepcopy(ref_model)
    for layer in split_model.layers:
        layer.self_attn.split_blocks = "dense"
        layer.self_attn.split_fused = fused
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(len(c.ctx_seq), 64, generator=g, dtype=torch.float64)
    emb = torch.randn(len(c.q_seq), 32, generator=g, dtype=torch.float64)
    proj = torch.randn(len(c.q_seq), 32, generator=g, dtype=torch.float64)
    losses = []
    for m, backend in ((ref_model, "sdpa"), (split_model, "flex")):
        loss = (m(taps, emb, meta, backend=backend) * proj).sum()
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(ref_model.named_parameters(), split_model.parameters()):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12), name


@pytest.mark.parametrize("opts, compile_opt, gpus, refused", [
    ("SPLIT_BLOCKS=2", "all", [0], "needs --compile none or target"),
    ("SPLIT_BLOCKS=2", "drafter", [], "needs --compile none or target"),
    ("SPLIT_BLOCKS=2", "auto", [0], "needs --compile none or target"),   # auto compiles the drafter on GPUs
    ("SPLIT_BLOCKS=2", "auto", [], None),                                # ... and nothing on the CPU
    ("SPLIT_BLOCKS=2", "target", [0], None),
    ("SPLIT_BLOCKS=2", "none", [0], None),
    ("SPLIT_BLOCKS=true", "all", [0], None),                             # the autograd merge compiles right
    ("SPLIT_BLOCKS=3", "none", [], "must be true, false, 0, 1 or 2"),
])
def test_split2_is_refused_where_its_gradients_are_wrong(opts, compile_opt, gpus, refused):
    """SPLIT_BLOCKS=2 inside compiled drafter layers gives wrong gradients on the GPU (relative error 1.0 for
    fc and q_proj in results/h200-split-attention-parity.json, while eager BlockMerge and SPLIT_BLOCKS=1 match
    float64), so the flag check refuses that combination before anything runs, naming the flag; the drafter
    build refuses it too (BadInput: exit 2, no restart loop)."""
    import dataclasses

    from trainer.config.options import ConfigError, TrainConfig, validate_flags
    from trainer.engine.drafter_stage import build_drafter
    from trainer.errors import BadInput
    cfg = dataclasses.replace(TrainConfig(target_model="t", data_dir="d", output_dir="o"), flex_kernel_options=opts,
                              compile=compile_opt, target_gpus=gpus, drafter_gpus=gpus)
    if refused is None:
        validate_flags(cfg, gpu_count=-1)
        return
    with pytest.raises(ConfigError, match=f"^--flex-kernel-options: .*{refused}"):
        validate_flags(cfg, gpu_count=-1)
    rank_cfg = dataclasses.replace(cfg, compile="all" if compile_opt == "auto" else compile_opt)   # resolved
    with pytest.raises(BadInput, match=refused):
        build_drafter(_tiny(8).cfg, rank_cfg, torch.device("cpu"), torch.float32, None)


def test_split_needs_one_shared_context():
    from types import SimpleNamespace

    from trainer.engine.drafter_stage import build_drafter
    from trainer.errors import TrainingFailed
    cfg = SimpleNamespace(split_fc=False, seed=0, fp8="off", flex_kernel_options="SPLIT_BLOCKS=true",
                          flex_ctx_group=16, compile="off")
    with pytest.raises(TrainingFailed, match="flex-ctx-group 0"):   # BadInput, a TrainingFailed that exits 2
        build_drafter(_tiny(8).cfg, cfg, torch.device("cpu"), torch.float32, None)
