"""Sliding-window draft layers (issue 39 item 4): the drafter the field ships for Qwen3.5/3.6 targets.

A "sliding_attention" draft layer is what SGLang (AttentionType.DECODER, window_left = sliding_window - 1)
and vLLM (causal, per-layer sliding window) build for it: causal attention over the last W positions.
In training that is: a block row at position p sees the context rows of its sequence before its anchor
whose position k has p - k < W, and the rows of its own block up to its own slot. Every path of the
trainer (dense mask, FlexAttention with the plan's tiles, the split path, the exported modelling file)
must compute exactly that; the export must tell the engines.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trainer.model.drafter import (
    BlockMerge,
    DFlashConfig,
    DFlashDrafter,
    PackedMeta,
    _flex_mask_mod,
    block_attention,
    ctx_attention_dense,
    ctx_attention_flex,
    dense_mask,
    flex_tile_lists,
    init_drafter_weights,
    merge_attention,
)
from trainer.ops.plan import plan_micro_batch

W = 24   # shorter than the sequences, longer than a block: the window cuts the context, not the block


def _plan(lens, block, anchors, seed=0, ctx_group=0):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens)
    ids = rng.integers(0, 90, size=(len(lens), lens.max()))
    mask = np.zeros(ids.shape, bool)
    for b, n in enumerate(lens):
        mask[b, n // 4:n] = True
    return plan_micro_batch(ids, mask, lens, list(range(len(lens))), 0, seed=seed, block_size=block,
                            max_anchors=anchors, mask_token_id=99, gamma=4.0, soft_labels=False,
                            chunk_rows=10**6, flex=True, ctx_group=ctx_group)


def _meta(c, block):
    t = torch.from_numpy
    return PackedMeta.from_chunk({k: t(v) for k, v in c.arrays().items()}, block)


def _definition(meta: PackedMeta, window: int | None) -> np.ndarray:
    """The mask written out pair by pair from the definition (module docstring)."""
    cs, cp = meta.ctx_seq.numpy(), meta.ctx_pos.numpy()
    qs, qa, qp = meta.q_seq.numpy(), meta.q_anchor.numpy(), meta.q_pos.numpy()
    tc, tq, bs = len(cs), len(qs), meta.block_size
    out = np.zeros((tq, tc + tq), bool)
    for i in range(tq):
        for j in range(tc):
            out[i, j] = cs[j] == qs[i] and cp[j] < qa[i] and (window is None or qp[i] - cp[j] < window)
        for j in range(tq):
            out[i, tc + j] = j // bs == i // bs and (window is None or (j <= i and qp[i] - qp[j] < window))
    return out


@pytest.fixture(scope="module")
def plan():
    return _plan([90, 40, 61], 4, 12)


def test_window_mask_equals_its_definition(plan):
    """dense_mask and the FlexAttention mask_mod, evaluated on every pair, are the definition; the window
    really cuts (some context before the anchor is hidden, some block rows are hidden by causality)."""
    c = plan.chunks[0]
    meta = _meta(c, 4)
    want = _definition(meta, W)
    assert np.array_equal(dense_mask(meta, W).numpy(), want)
    assert np.array_equal(dense_mask(meta).numpy(), _definition(meta, None))
    tc = meta.num_ctx
    assert (dense_mask(meta)[:, :tc] & ~dense_mask(meta, W)[:, :tc]).any()       # the window hides context
    assert (dense_mask(meta)[:, tc:] & ~dense_mask(meta, W)[:, tc:]).any()       # causal inside the block
    q = torch.arange(len(meta.q_seq))[:, None]
    kv = torch.arange(tc + len(meta.q_seq))[None, :]
    for window in (W, None):
        got = _flex_mask_mod(meta, window)(0, 0, q, kv).numpy()
        assert np.array_equal(got, _definition(meta, window)), window


def test_window_mask_with_context_copies_is_the_same_attention():
    """--flex-ctx-group: the keys are per-group copies of the context; the window must follow the copies."""
    c = _plan([300, 150], 8, 20, ctx_group=1).chunks[0]
    meta = _meta(c, 8)
    kv_ctx = meta.kv_ctx.numpy()
    q = torch.arange(len(meta.q_seq))[:, None]
    kv = torch.arange(len(kv_ctx) + len(meta.q_seq))[None, :]
    got = _flex_mask_mod(meta, W)(0, 0, q, kv).numpy()
    plain = PackedMeta(meta.ctx_seq, meta.ctx_pos, meta.q_seq, meta.q_anchor, meta.q_pos, 8)
    ref = dense_mask(plain, W).numpy()
    copies_of_ctx = got[:, :len(kv_ctx)]
    # a query sees a copy only when it sees the source row, and sees each row it may see through one copy
    seen = np.zeros((len(meta.q_seq), meta.num_ctx), int)
    for j, src in enumerate(kv_ctx):
        seen[:, src] += copies_of_ctx[:, j]
    assert np.array_equal(seen > 0, ref[:, :meta.num_ctx]) and seen.max() <= 1
    assert np.array_equal(got[:, len(kv_ctx):], ref[:, meta.num_ctx:])
    num, idx, _, _ = flex_tile_lists(meta, W)     # the window's tile lists over the copies still hold every pair
    qi, ki = np.nonzero(got)
    assert {(int(a), int(b)) for a, b in zip(qi // 128, ki // 128)} <= _tiles(num, idx)
    assert _tiles(num, idx) <= _tiles(meta.kv_num_blocks, meta.kv_indices)


def _tiny(block, layer_types, window=W, nh=4, nkv=2):
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
                       num_attention_heads=nh, num_key_value_heads=nkv, head_dim=8, vocab_size=100,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096, block_size=block,
                       target_layer_ids=[0, 1], mask_token_id=99, target_num_hidden_layers=4,
                       layer_types=layer_types, sliding_window=window)
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    init_drafter_weights(m, std=0.2)
    return cfg, m.eval().requires_grad_(False)


def test_flex_path_with_the_plans_tiles_equals_the_dense_windowed_mask():
    """The GPU path: FlexAttention with the plan's tile lists, eager on the CPU. The plan's fully visible
    tiles are not fully visible in a sliding layer; passing them (they skip mask_mod) would leak context
    outside the window, so a sliding layer leaves them out."""
    c = _plan([600, 50], 8, 40).chunks[0]   # anchors from position 150 on: the first context tile is full
    meta = _meta(c, 8)
    assert meta.full_kv_num_blocks is not None and int(meta.full_kv_num_blocks.sum()) > 0
    _, model = _tiny(8, ["sliding_attention", "full_attention"])
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(meta.num_ctx, 64, generator=g)
    emb = torch.randn(len(meta.q_seq), 32, generator=g)
    ref = model(taps, emb, meta, backend="sdpa")
    out = model(taps, emb, meta, backend="flex")
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    # eager FlexAttention applies mask_mod to every tile, full or not; on the GPU the full tiles skip it, so
    # the lists themselves must be right: each visible pair in a listed tile, each full tile all visible
    for window in (W, None):
        dm = dense_mask(meta, window).numpy()
        num, idx, fnum, fidx = flex_tile_lists(meta, window)
        listed = _tiles(num, idx) | (_tiles(fnum, fidx) if fnum is not None else set())
        qi, ki = np.nonzero(dm)
        assert {(int(a), int(b)) for a, b in zip(qi // 128, ki // 128)} <= listed
        for qb, kb in (_tiles(fnum, fidx) if fnum is not None else ()):
            assert dm[qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128].all(), (window, qb, kb)
    # and the window's lists drop the tiles it hides entirely (the work it saves)
    num, idx, _, _ = flex_tile_lists(meta, W)
    plan_tiles = _tiles(meta.kv_num_blocks, meta.kv_indices) | _tiles(meta.full_kv_num_blocks, meta.full_kv_indices)
    assert _tiles(num, idx) < plan_tiles
    # the window matters here: the same weights with both layers full give another output
    _, full = _tiny(8, ["full_attention", "full_attention"])
    assert not torch.allclose(full(taps, emb, meta, backend="sdpa"), ref, atol=1e-3)


def _tiles(num, idx):
    return {(qb, kb) for qb in range(num.shape[2]) for kb in idx[0, 0, qb, :num[0, 0, qb]].tolist()}


def _reference_attention(q, k, v, mask):
    r = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(r, 1).transpose(0, 1) for t in (k, v))
    s = q.transpose(0, 1) @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return (p @ vv).transpose(0, 1)


@pytest.mark.parametrize("fused", [False, True])
def test_split_path_computes_the_windowed_attention_and_its_gradient(plan, fused):
    """SPLIT_BLOCKS: the context part with the window, the in-block part causal (block_attention, or
    BlockMerge and its written-out backward), merged: the dense windowed reference, value and gradient."""
    meta = _meta(plan.chunks[0], 4)
    g = torch.Generator().manual_seed(1)
    tq, tk = len(meta.q_seq), meta.num_ctx + len(meta.q_seq)
    q = torch.randn(tq, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    tc = meta.num_ctx
    as4 = lambda t: t.transpose(0, 1).unsqueeze(0)   # noqa: E731
    oc, lc = ctx_attention_dense(as4(q), as4(k[:tc]), as4(v[:tc]), meta, window=W)
    if fused:
        out = BlockMerge.apply(oc, lc, q, k[tc:], v[tc:], 4, True)
    else:
        out = merge_attention(oc, lc, *block_attention(q, k[tc:], v[tc:], 4, causal=True))
    ref = _reference_attention(q, k, v, dense_mask(meta, W))
    assert torch.allclose(out, ref, atol=1e-12)
    up = torch.randn(out.shape, generator=g, dtype=out.dtype)
    for a, b in zip(torch.autograd.grad((out * up).sum(), (q, k, v)), torch.autograd.grad((ref * up).sum(), (q, k, v))):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    # the flex context part (eager, forward) with the window agrees with the dense one
    with torch.no_grad():
        of, lf = ctx_attention_flex(as4(q.float()), as4(k[:tc].float()), as4(v[:tc].float()), meta, window=W)
    fin = ~torch.isinf(lc.detach())
    assert torch.equal(torch.isinf(lf), ~fin)
    assert (lf[fin] - lc.detach()[fin].float()).abs().max() < 1e-4 and (of - oc.detach().float()).abs().max() < 1e-5


def test_layer_types_default_follows_the_target_and_bad_values_exit_2(tiny_small_dir, tiny_hybrid_dir, tmp_path,
                                                                      capsys):
    """auto: [sliding] * (n - 1) + [full] with window 2048 for a hybrid Qwen3.5/3.6 target (the layout of
    z-lab/Qwen3.6-27B-DFlash), all full for a dense one; a wrong list or a window shorter than a block
    exits 2 naming the flag."""
    from transformers import AutoConfig

    from trainer.__main__ import main as train_main
    hybrid = AutoConfig.from_pretrained(tiny_hybrid_dir / "target")
    cfg = DFlashConfig.from_target(hybrid, num_draft_layers=5, block_size=16, mask_token_id=3, layer_types="auto")
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    assert [cfg.window(i) for i in range(5)] == [2048] * 4 + [None]
    dense = AutoConfig.from_pretrained(tiny_small_dir / "target")
    assert DFlashConfig.from_target(dense, num_draft_layers=5, block_size=16, mask_token_id=3,
                                    layer_types="auto").layer_types is None
    given = DFlashConfig.from_target(dense, num_draft_layers=2, block_size=16, mask_token_id=3,
                                     layer_types="full,sliding", sliding_window=64)
    assert given.layer_types == ["full_attention", "sliding_attention"] and given.window(1) == 64
    base = ["--target-model", str(tiny_hybrid_dir / "target"), "--data-dir", str(tiny_hybrid_dir / "data"),
            "--output-dir", str(tmp_path / "o"), "--target-gpus", "cpu", "--drafter-gpus", "cpu",
            "--num-draft-layers", "2", "--block-size", "8", "--check-config"]
    for extra, needle in ((["--draft-layer-types", "sliding"], "--draft-layer-types"),
                          (["--draft-layer-types", "full,window"], "--draft-layer-types"),
                          (["--sliding-window", "4"], "--sliding-window")):
        assert train_main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    assert train_main(base) == 0


# ------------------------------------------------------------------------------ the export


def _save(out, cfg, model):
    from trainer.model.checkpoint_format import CheckpointManager
    return CheckpointManager(out).save(3, model.state_dict(), cfg.to_dict(), {})


@pytest.fixture(scope="module")
def sliding_export(tiny_hybrid_dir, tmp_path_factory):
    """A drafter of the tiny hybrid with 2 sliding layers and a full one (window 6, block 4), exported."""
    from transformers import AutoConfig

    from trainer.serving.export import export_drafter
    tcfg = AutoConfig.from_pretrained(tiny_hybrid_dir / "target")
    cfg = DFlashConfig.from_target(tcfg, num_draft_layers=3, block_size=4, mask_token_id=3, layer_types="auto",
                                   sliding_window=6)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.1, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    root = tmp_path_factory.mktemp("sliding-export")
    _save(root / "run", cfg, model)
    dst = export_drafter(root / "run" / "step-00000003", root / "drafter", target_model=str(tiny_hybrid_dir / "target"))
    return dst, cfg


def test_export_tells_sglang_and_vllm_the_sliding_layers(sliding_export):
    """config.json: layer_types per layer, sliding_window, use_sliding_window (what SGLang's
    get_dflash_layer_types / get_dflash_attention_sliding_window_size and vLLM's _resolve_layer_attention
    read); the drafter's own rope is full (the target's partial mRoPE is not the drafter's); read back it is
    the same drafter."""
    from trainer.serving.export import drafter_config_from_json
    dst, cfg = sliding_export
    c = json.loads((dst / "config.json").read_text())
    assert c["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert c["sliding_window"] == 6 and c["use_sliding_window"] is True
    assert c["head_dim"] == 32 and c["num_attention_heads"] == 4 and c["num_key_value_heads"] == 2
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    back = drafter_config_from_json(c)
    assert back.layer_types == cfg.layer_types and back.sliding_window == 6


def test_exported_model_and_the_reference_class_compute_the_trainers_windowed_forward(sliding_export):
    """AutoModel(trust_remote_code) on the export equals the trainer's packed forward with windows that cut
    the context, from scratch and with the context fed through the cache in pieces; the z-lab reference class
    loads every weight and reads each layer's window, and given the engines' mask (causal, last W positions:
    its own forward passes one mask to every layer) agrees on an all-sliding stack."""
    from transformers import AutoModel, DynamicCache

    from trainer.model.modeling_dflash import crop_cache
    from trainer.serving.export import drafter_config_from_json
    dst, cfg = sliding_export
    hf = AutoModel.from_pretrained(dst, trust_remote_code=True, dtype=torch.float32).eval()
    assert [layer.self_attn.sliding_window for layer in hf.layers] == [6, 6, None]
    ours = DFlashDrafter(drafter_config_from_json(json.loads((dst / "config.json").read_text())))
    import safetensors.torch
    ours.load_state_dict(safetensors.torch.load_file(str(dst / "model.safetensors")), strict=True)
    ours.float().eval()
    g = torch.Generator().manual_seed(0)
    n, bs, k = 23, cfg.block_size, len(cfg.target_layer_ids)
    taps = torch.randn(n, k * cfg.hidden_size, generator=g)
    anchors = torch.tensor([3, 11, 19])
    emb = torch.randn(len(anchors) * bs, cfg.hidden_size, generator=g)
    q_anchor = anchors.repeat_interleave(bs)
    meta = PackedMeta(torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros_like(q_anchor), q_anchor,
                      (anchors[:, None] + torch.arange(bs)).reshape(-1), bs)
    with torch.no_grad():
        packed = ours(taps, emb, meta, backend="sdpa").view(len(anchors), bs, -1)
        for j, a in enumerate(anchors.tolist()):
            out = hf(position_ids=torch.arange(a + bs)[None], noise_embedding=emb[j * bs:(j + 1) * bs][None],
                     target_hidden=taps[:a][None])
            assert torch.allclose(out[0], packed[j], atol=1e-5), (a, (out[0] - packed[j]).abs().max())
            cache = DynamicCache()   # the generation loop's way: context rows in pieces through the cache
            for lo, hi in ((0, a // 2), (a // 2, a)):
                inc = hf(position_ids=torch.arange(lo, hi + bs)[None], noise_embedding=emb[j * bs:(j + 1) * bs][None],
                         target_hidden=taps[lo:hi][None], past_key_values=cache)
                crop_cache(cache, hi)
            assert torch.allclose(inc[0], packed[j], atol=1e-5), a

    from tests.serving.test_export import _reference_module
    ref_mod = _reference_module(dst.parent)
    ref, info = ref_mod.DFlashDraftModel.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert [layer.self_attn.sliding_window for layer in ref.layers] == [6, 6, None]
    # an all-sliding stack: one mask serves every layer of the reference's forward
    with torch.no_grad():
        hf.layers[2].self_attn.sliding_window = 6   # the full layer made sliding too
        a = 13
        pos = torch.arange(a + bs)
        d = pos[-bs:, None] - pos[None, :]
        mask = ((d >= 0) & (d < 6))[None, None]
        want = hf(position_ids=pos[None], noise_embedding=emb[:bs][None], target_hidden=taps[:a][None])
        got = ref(position_ids=pos[None], noise_embedding=emb[:bs][None], target_hidden=taps[:a][None],
                  attention_mask=mask)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_bench_counts_the_pairs_a_sliding_layer_sees_and_computes(plan):
    """The benchmark's MFU counts the pairs each layer attends to (fewer in a sliding layer) and its executed
    work the tiles it runs (the window's cut lists)."""
    from trainer.lab.bench.flops import _executed_pairs, _visible_pairs
    c = plan.chunks[0]
    meta = _meta(c, 4)
    for window in (W, None):
        assert _visible_pairs(c, 4, window) == float(dense_mask(meta, window).sum())
        num, _, fnum, _ = flex_tile_lists(meta, window)
        assert _executed_pairs(c, 4, window) == (int(num.sum()) + (int(fnum.sum()) if fnum is not None else 0)) * 128 ** 2
    assert _visible_pairs(c, 4, W) < _visible_pairs(c, 4, None)


class _BufferCache:
    """A preallocated KV buffer as the batched decoder keeps one (trainer/serving/captured/kv_cache.py): the context rows are
    written at their positions, the first `view` slots are attended, the block rows appended after them."""

    def __init__(self, layers, kv_heads, head_dim, capacity):
        self.k = [torch.zeros(1, kv_heads, capacity, head_dim) for _ in range(layers)]
        self.v = [torch.zeros(1, kv_heads, capacity, head_dim) for _ in range(layers)]
        self.wpos, self.view = None, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n = self.wpos.shape[0]
        self.k[layer_idx][:, :, self.wpos] = key_states[:, :, :n]
        self.v[layer_idx][:, :, self.wpos] = value_states[:, :, :n]
        return (torch.cat([self.k[layer_idx][:, :, :self.view], key_states[:, :, n:]], dim=2),
                torch.cat([self.v[layer_idx][:, :, :self.view], value_states[:, :, n:]], dim=2))

    def get_seq_length(self, layer_idx=0):
        return 0


def test_exported_sliding_layers_follow_positions_in_a_preallocated_buffer(sliding_export):
    """The batched decoder's cache layout (keys at their positions in a buffer, block rows after its view):
    the window is placed by position there too, so the drafts equal a full recompute's."""
    from transformers import AutoModel
    dst, cfg = sliding_export
    hf = AutoModel.from_pretrained(dst, trust_remote_code=True, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    bs, width = cfg.block_size, len(cfg.target_layer_ids) * cfg.hidden_size
    taps = torch.randn(1, 21, width, generator=g)
    noise = torch.randn(1, bs, cfg.hidden_size, generator=g)
    cache = _BufferCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64)
    with torch.no_grad():
        for prev, start in ((0, 9), (9, 21)):
            cache.wpos, cache.view = torch.arange(prev, start), start
            inc = hf(position_ids=torch.arange(prev, start + bs)[None], noise_embedding=noise,
                     target_hidden=taps[:, prev:start], past_key_values=cache)
            full = hf(position_ids=torch.arange(start + bs)[None], noise_embedding=noise, target_hidden=taps[:, :start])
            assert torch.allclose(inc, full, atol=1e-5), (start, (inc - full).abs().max())


def test_draft_attention_geometry_can_be_the_published_drafters(tiny_hybrid_dir, tmp_path, capsys):
    """z-lab's Qwen3.5-27B drafter does not copy the target's attention (24 x 256 heads, 4 KV): it uses
    32 x 128 and 8 KV heads at the target's width. --draft-heads / --draft-kv-heads / --draft-head-dim set
    that (0: the target's); the export says it; a geometry that cannot be built exits 2 naming the flag."""
    from transformers import AutoConfig

    from trainer.__main__ import main as train_main
    from trainer.serving.export import hf_config_dict
    hybrid = AutoConfig.from_pretrained(tiny_hybrid_dir / "target")
    own = DFlashConfig.from_target(hybrid, num_draft_layers=2, block_size=4, mask_token_id=3)
    assert (own.num_attention_heads, own.num_key_value_heads, own.head_dim) == (4, 2, 32)   # the target's
    cfg = DFlashConfig.from_target(hybrid, num_draft_layers=2, block_size=4, mask_token_id=3, num_heads=8,
                                   num_kv_heads=4, head_dim=16)
    model = DFlashDrafter(cfg)
    assert model.layers[0].self_attn.q_proj.weight.shape == (8 * 16, 64)
    assert model.layers[0].self_attn.k_proj.weight.shape == (4 * 16, 64)
    c = hf_config_dict(cfg)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["hidden_size"]) == (8, 4, 16, 64)
    base = ["--target-model", str(tiny_hybrid_dir / "target"), "--data-dir", str(tiny_hybrid_dir / "data"),
            "--output-dir", str(tmp_path / "o"), "--target-gpus", "cpu", "--drafter-gpus", "cpu",
            "--num-draft-layers", "2", "--block-size", "8", "--sliding-window", "16", "--check-config"]
    assert train_main(base + ["--draft-heads", "8", "--draft-kv-heads", "3"]) == 2
    err = capsys.readouterr().err
    assert "--draft-kv-heads: 3 must divide the draft layers' 8 query heads" in err and "Traceback" not in err
    assert train_main(base + ["--draft-heads", "8", "--draft-kv-heads", "4", "--draft-head-dim", "16"]) == 0
