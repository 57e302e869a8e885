"""The DFlash drafter: taps -> fc + norm -> Qwen3-style layers with KV injection -> target LM head.

Layout used everywhere in this file ("packed"): no batch dimension.
  ctx      [Tc, K*H]  tapped target hidden states of every real context token of a micro-batch,
                      sequences concatenated (Tc padded to a multiple of 128 with rows of seq -1)
  blocks   [Tq, H]    draft blocks, Tq = num_blocks * B; block j occupies rows j*B .. j*B+B-1
Per-row metadata (int32/int64 tensors on the drafter device):
  ctx_seq[Tc], ctx_pos[Tc]             sequence index and position of each context row
  q_seq[Tq], q_anchor[Tq], q_pos[Tq]   sequence, anchor position and position id (anchor + slot) per block row
Attention (training): a block row sees context rows of its own sequence with pos < its anchor
(strictly: `<=` leaks the answer) and every row of its own block; nothing else.
A sliding draft layer (DFlashConfig.layer_types "sliding_attention", window W) is what SGLang and vLLM
build for such a layer: causal attention over the last W positions. Its block row at position p sees
those of the rows above whose position k has k <= p and p - k < W: context rows in (p - W, anchor), and
the rows of its own block up to its own slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from trainer.model.architectures import Architecture, architecture, config_keys, for_config, resolve
from trainer.model.dflash2 import CandidateSelector, GroupedDynamicConv
from trainer.model.identity import tap_layers  # the rule lives with the target identity (torch-free)
from trainer.ops.plan import ATTENTION_ARRAYS, FLEX_BLOCK


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    target_num_hidden_layers: int
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    # per draft layer "full_attention" | "sliding_attention" (None: all full); the sliding ones' window
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # the keys an architecture adds (trainer/model/architectures.py; with_architecture sets them), None where
    # this one does not: DFlash2's convolution taps and channels per dynamic kernel, its selector's rank and
    # candidates per position
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    architectures: list[str] = field(default_factory=lambda: ["DFlashDraftModel"])
    model_type: str = "qwen3"

    @classmethod
    def from_target(cls, target_cfg, *, num_draft_layers: int, block_size: int, mask_token_id: int,
                    target_layer_ids: list[int] | None = None, layer_types: str = "full",
                    sliding_window: int = 2048, num_heads: int = 0, num_kv_heads: int = 0,
                    head_dim: int = 0) -> "DFlashConfig":
        """layer_types: --draft-layer-types' text (auto | full,sliding,...), resolved against the target
        (families.layer_types_for); "full" (the default here): every layer full attention. num_heads,
        num_kv_heads, head_dim: the draft layers' attention (--draft-heads ...; 0: the target's)."""
        from trainer.model.families import layer_types_for
        t = getattr(target_cfg, "text_config", None) or target_cfg
        whole = target_cfg.to_dict() if hasattr(target_cfg, "to_dict") else dict(target_cfg)
        types = (None if layer_types == "full" else
                 layer_types_for(layer_types, num_draft_layers, whole))
        heads = num_heads or t.num_attention_heads
        kv_heads = num_kv_heads or getattr(t, "num_key_value_heads", t.num_attention_heads)
        head_dim = head_dim or getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        rope = getattr(t, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))
        layers = target_layer_ids or tap_layers(t.num_hidden_layers, num_draft_layers)
        return cls(
            hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_hidden_layers=num_draft_layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            vocab_size=t.vocab_size, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=getattr(t, "max_position_embeddings", 32768), block_size=block_size,
            target_layer_ids=list(layers), mask_token_id=mask_token_id,
            target_num_hidden_layers=t.num_hidden_layers,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            layer_types=types, sliding_window=sliding_window if types else None,
        )

    def window(self, layer: int) -> int | None:
        """The attention window of draft layer `layer` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dflash_config"] = {"block_size": self.block_size, "target_layer_ids": self.target_layer_ids,
                              "mask_token_id": self.mask_token_id}
        d["dflash_config"].update({k: getattr(self, k) for k in self.architecture.config_keys})
        return d

    @property
    def architecture(self) -> Architecture:
        """The architecture this config builds (architectures.for_config: its `architectures` class name)."""
        return for_config(self.__dict__)

    def with_architecture(self, name: str, **values) -> "DFlashConfig":
        """This config made --arch `name`'s: its added keys at their defaults updated by `values` (the keys
        of the others cleared), its class name recorded. ValueError naming what does not fit (a key it
        does not add, or what its check refuses)."""
        arch = architecture(name)
        unknown = sorted(set(values) - set(arch.config_keys))
        if unknown:
            raise ValueError(f"{name} has no {', '.join(unknown)} (its keys: {', '.join(arch.config_keys) or 'none'})")
        cfg = dataclasses.replace(self, **{**dict.fromkeys(config_keys()), **arch.config_keys, **values},
                                  architectures=[arch.hf_class])
        if arch.check:
            resolve(arch.check)(cfg)
        return cfg

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})

    def qwen3_config(self) -> Qwen3Config:
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = dict(self.rope_scaling, rope_theta=self.rope_theta)
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=rope, hidden_act=self.hidden_act,
        )


@dataclass
class PackedMeta:
    """Row metadata of one drafter chunk (see module docstring); all tensors on the drafter device."""
    ctx_seq: torch.Tensor
    ctx_pos: torch.Tensor
    q_seq: torch.Tensor
    q_anchor: torch.Tensor
    q_pos: torch.Tensor
    block_size: int
    kv_num_blocks: torch.Tensor | None = None  # FlexAttention block-sparsity, built on the host
    kv_indices: torch.Tensor | None = None
    full_kv_num_blocks: torch.Tensor | None = None  # fully visible tiles: no mask_mod on them
    full_kv_indices: torch.Tensor | None = None
    # context copies for the flex keys (plan.context_copies), or None
    kv_ctx: torch.Tensor | None = None
    kv_ctx_seq: torch.Tensor | None = None
    q_copy_seq: torch.Tensor | None = None

    @property
    def num_ctx(self) -> int:
        return self.ctx_seq.shape[0]

    @classmethod
    def from_chunk(cls, tensors: dict, block_size: int) -> "PackedMeta":
        """From one chunk's tensors named as in plan.CHUNK_ARRAYS (the absent optional ones None)."""
        return cls(block_size=block_size, **{k: tensors.get(k) for k in ATTENTION_ARRAYS})


if {f.name for f in fields(PackedMeta)} != {"block_size", *ATTENTION_ARRAYS}:   # one list: plan.py's
    raise TypeError("PackedMeta's tensors must be plan.ATTENTION_ARRAYS")


def dense_mask(meta: PackedMeta, window: int | None = None) -> torch.Tensor:
    """[Tq, Tc + Tq] bool: True where a block row may attend. The reference the flex path must match.
    window: a sliding layer's (module docstring): causal, over the last `window` positions."""
    ctx_ok = (meta.ctx_seq[None, :] == meta.q_seq[:, None]) & (meta.ctx_pos[None, :] < meta.q_anchor[:, None])
    tq = meta.q_seq.shape[0]
    row = torch.arange(tq, device=meta.q_seq.device)
    blk = row // meta.block_size
    blk_ok = blk[:, None] == blk[None, :]
    if window is not None:
        ctx_ok &= (meta.q_pos[:, None] - meta.ctx_pos[None, :]) < window
        blk_ok &= (row[None, :] <= row[:, None]) & ((meta.q_pos[:, None] - meta.q_pos[None, :]) < window)
    return torch.cat([ctx_ok, blk_ok], dim=1)


def _flex_mask_mod(meta: PackedMeta, window: int | None = None):
    # lengths come from tensor shapes (symbolic under torch.compile(dynamic=True)), not Python ints,
    # so a new batch shape does not force a recompile; only the block size (and a window) are constants
    bs = meta.block_size
    ctx_seq, ctx_pos, q_seq, q_anchor, q_pos = meta.ctx_seq, meta.ctx_pos, meta.q_seq, meta.q_anchor, meta.q_pos
    if meta.kv_ctx is not None:  # keys are [ctx[kv_ctx], block rows]; a query sees its group's copy only
        ctx_seq, ctx_pos, q_seq = meta.kv_ctx_seq, ctx_pos[meta.kv_ctx], meta.q_copy_seq

    def mask_mod(b, h, q, kv):
        tc, tq = ctx_seq.shape[0], q_seq.shape[0]
        kc = torch.clamp(kv, max=tc - 1)
        ctx_ok = (ctx_seq[kc] == q_seq[q]) & (ctx_pos[kc] < q_anchor[q])
        kb = torch.clamp(kv - tc, min=0, max=tq - 1)
        blk_ok = (kb // bs) == (q // bs)
        return torch.where(kv < tc, ctx_ok, blk_ok & (kv - tc < tq))

    def windowed_mask_mod(b, h, q, kv):   # a sliding layer: causal, the last `window` positions
        tc, tq = ctx_seq.shape[0], q_seq.shape[0]
        kc = torch.clamp(kv, max=tc - 1)
        ctx_ok = (ctx_seq[kc] == q_seq[q]) & (ctx_pos[kc] < q_anchor[q]) & (q_pos[q] - ctx_pos[kc] < window)
        kb = torch.clamp(kv - tc, min=0, max=tq - 1)
        blk_ok = ((kb // bs) == (q // bs)) & (kb <= q) & (q_pos[q] - q_pos[kb] < window)
        return torch.where(kv < tc, ctx_ok, blk_ok & (kv - tc < tq))

    return mask_mod if window is None else windowed_mask_mod


def flex_tile_lists(meta: PackedMeta, window: int | None = None):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of a layer's BlockMask: the plan's
    lists. A sliding layer's window cuts into tiles the plan found fully visible (FlexAttention skips
    mask_mod on those), so it gets no full tiles: every listed tile goes through its mask_mod; and a listed
    tile whose every key lies `window` or more positions before every query of its query tile is dropped
    (nothing in it is visible), so the window saves the work it hides."""
    if window is None:
        return meta.kv_num_blocks, meta.kv_indices, meta.full_kv_num_blocks, meta.full_kv_indices
    num, idx = meta.kv_num_blocks, meta.kv_indices
    if num is None:
        return None, None, None, None
    ctx_pos = meta.ctx_pos if meta.kv_ctx is None else meta.ctx_pos[meta.kv_ctx]
    q_first = _tile_reduce(meta.q_pos, num.shape[-1], torch.amin)            # [query tiles]
    k_last = _tile_reduce(torch.cat([ctx_pos, meta.q_pos]), idx.shape[-1], torch.amax)   # [key tiles]
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    keep = listed & ((q_first[:, None] - k_last[idx.long()]) < window)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)      # kept tiles first, in order
    return keep.sum(-1, dtype=torch.int32), idx.gather(-1, order).contiguous(), None, None


def _tile_reduce(pos: torch.Tensor, tiles: int, op) -> torch.Tensor:
    """op (amin / amax) of `pos` over each FLEX_BLOCK-row tile, for `tiles` tiles (rows past the end pad with
    the value that changes nothing: the last row's)."""
    n = tiles * FLEX_BLOCK
    pad = pos.new_full((max(n - pos.shape[0], 0),), 0) + (pos[-1] if pos.shape[0] else 0)
    return op(torch.cat([pos, pad])[:n].view(tiles, FLEX_BLOCK), dim=-1)


_compiled_flex = None


def flex_attention_fn(device: torch.device):
    """Compiled FlexAttention on CUDA; eager on the CPU (forward only: used to check the mask there)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention  # inside a compiled layer (--compile drafter) the layer's graph holds it
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def context_copies(t: torch.Tensor, tc: int, kv_ctx: torch.Tensor) -> torch.Tensor:
    """Keys or values [Tc + Tq, heads, hd] -> [Tc' + Tq, heads, hd]: the context part replaced by its copies
    (rows kv_ctx). The gather runs in fp32, so its backward sums the copies' gradients in fp32 and rounds
    once, as the attention kernel accumulates a key's gradient."""
    return torch.cat([t[:tc].float().index_select(0, kv_ctx).to(t.dtype), t[tc:]], dim=0)


def ctx_flex_lists(num: torch.Tensor, idx: torch.Tensor | None, tc: int):
    """A chunk's tile lists (plan.flex_block_sparsity: per query tile its context tiles first, then the tiles
    of its own blocks) cut to the context tiles (index < tc / FLEX_BLOCK): the lists of the context-only
    mask of the split path. The context prefix of each list stays as it was; the block tiles drop out."""
    if num is None:
        return None, None
    n = tc // FLEX_BLOCK
    idx = idx[..., :n]
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    return (listed & (idx < n)).sum(-1, dtype=torch.int32), idx


def _ctx_mask_mod(meta: PackedMeta, window: int | None = None):
    """Context-only mask of the split path: a block row sees context rows of its sequence before its anchor
    (a sliding layer: those in its window too)."""
    ctx_seq, ctx_pos, q_seq, q_anchor, q_pos = meta.ctx_seq, meta.ctx_pos, meta.q_seq, meta.q_anchor, meta.q_pos

    def mask_mod(b, h, q, kv):
        kc = torch.clamp(kv, max=ctx_seq.shape[0] - 1)
        return (ctx_seq[kc] == q_seq[q]) & (ctx_pos[kc] < q_anchor[q])

    def windowed_mask_mod(b, h, q, kv):
        kc = torch.clamp(kv, max=ctx_seq.shape[0] - 1)
        return (ctx_seq[kc] == q_seq[q]) & (ctx_pos[kc] < q_anchor[q]) & (q_pos[q] - ctx_pos[kc] < window)

    return mask_mod if window is None else windowed_mask_mod


def ctx_attention_flex(q, k, v, meta: PackedMeta, kernel_options=None, window: int | None = None):
    """Context part of the split path through FlexAttention: q [1, nh, Tq, hd], k/v [1, nkv, Tc, hd] ->
    (out [Tq, nh, hd] in q's dtype, lse [Tq, nh] fp32; -inf for a row that sees no context, its out 0).
    window: a sliding layer's; the plan's fully visible tiles are not fully visible then (none are passed)."""
    from torch.nn.attention.flex_attention import BlockMask
    tq, tc = q.shape[2], k.shape[2]
    lists = flex_tile_lists(meta, window)
    num, idx = ctx_flex_lists(*lists[:2], tc)
    fnum, fidx = ctx_flex_lists(*lists[2:], tc)
    block_mask = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=FLEX_BLOCK,
                                          mask_mod=_ctx_mask_mod(meta, window), seq_lengths=(tq, tc))
    out, lse = _flex_with_lse(flex_attention_fn(q.device), q, k, v, block_mask, q.shape[1] != k.shape[1],
                              kernel_options)
    return out[0].transpose(0, 1), _acc(lse[0].transpose(0, 1))


def _flex_with_lse(fn, q, k, v, block_mask, gqa, kernel_options):
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:   # torch < 2.9
        return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=kernel_options, return_lse=True)
    out, aux = fn(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=kernel_options,
                  return_aux=AuxRequest(lse=True))
    return out, aux.lse


def ctx_attention_dense(q, k, v, meta: PackedMeta, kernel_options=None, window: int | None = None):
    """The same as ctx_attention_flex by a dense mask in fp32 (the CPU reference; FlexAttention has no
    backward on the CPU)."""
    nh, nkv = q.shape[1], k.shape[1]
    qf, kf, vf = (_acc(t[0]) for t in (q, k, v))
    kf, vf = (t.repeat_interleave(nh // nkv, 0) for t in (kf, vf))
    ctx_ok = dense_mask(meta, window)[:, :meta.ctx_seq.shape[0]]
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    m = s.masked_fill(~ctx_ok, float("-inf")).amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)) * ctx_ok
    den = p.sum(-1)                                                # [nh, Tq]; 0 where no context is visible
    seen = den > 0
    safe = torch.where(seen, den, 1.0)
    lse = torch.where(seen, torch.log(safe) + m[..., 0], float("-inf"))
    return (p @ vf / safe[..., None]).transpose(0, 1).to(q.dtype), lse.transpose(0, 1)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp16/fp32 work, float64 stays float64 (the tests' references)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def block_attention(q, k, v, block_size: int, causal: bool = False):
    """In-block part of the split path: every row of a block sees every row of its block (bidirectional;
    causal: the rows up to its own, a sliding layer's), nothing else. q [Tq, nh, hd], k/v [Tq, nkv, hd] of
    the block rows -> (out [Tq, nh, hd], lse [Tq, nh]), both fp32. A block is a tiny dense attention
    (block_size^2 scores per head), batched over blocks. (A window shorter than the block is not supported
    here: validate refuses it.)"""
    tq, nh, hd = q.shape
    nkv = k.shape[1]
    qb = _acc(q).view(-1, block_size, nkv, nh // nkv, hd)          # head h uses kv head h // (nh / nkv)
    kb, vb = (_acc(t).view(-1, block_size, nkv, hd) for t in (k, v))
    s = torch.einsum("bqgrd,bkgd->bgrqk", qb, kb) * hd ** -0.5
    if causal:
        s = s.masked_fill(~_causal(block_size, s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)                                   # [nb, nkv, r, B]
    o = torch.einsum("bgrqk,bkgd->bqgrd", torch.exp(s - lse[..., None]), vb)
    return o.reshape(tq, nh, hd), lse.permute(0, 3, 1, 2).reshape(tq, nh)


def _causal(block_size: int, device) -> torch.Tensor:
    """[B, B] bool: key slot <= query slot."""
    r = torch.arange(block_size, device=device)
    return r[None, :] <= r[:, None]


def merge_attention(o1, lse1, o2, lse2):
    """Attention over the union of two disjoint key sets from each set's normalised output and log-sum-exp
    ([T, nh, hd], [T, nh]). lse1 may be -inf (no key in the first set): its weight is then 0."""
    lse = torch.logaddexp(lse1, lse2)
    return _acc(o1) * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]


CTX_ATTENTION = {"flex": ctx_attention_flex, "dense": ctx_attention_dense}


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched) accumulated and returned in fp32 (float64 stays float64): bf16 inputs go through the
    tensor cores as they are on CUDA, with no fp32 copy of the operands."""
    if a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(_acc(a), _acc(b))


class BlockMerge(torch.autograd.Function):
    """The in-block part of the split path and its log-sum-exp merge with the context part, with a backward
    written out (SPLIT_BLOCKS=2): what `block_attention` + `merge_attention` compute, in bf16 layouts
    (fp32 only for the [blocks, kv heads, B x heads-per-kv, B] scores and the merge's arithmetic).

    forward(oc [Tq, nh, hd], lc [Tq, nh], q [Tq, nh, hd], k/v [Tq, nkv, hd] of the block rows, B) -> out
    [Tq, nh, hd] in q's dtype. With O the merged output, g its gradient, wc/wb the merge weights
    exp(lc - lse)/exp(lb - lse), p the in-block probabilities: the context side gets g_oc = wc g and
    g_lc = wc <g, oc - O> (what autograd through the merge gives); the block side gets the attention
    backward with dO = wb g and D = <dO, O> (the merged output, not the block's own), which folds the
    gradient through the block's log-sum-exp in: dS = p (dO v - D) = P_full (g v - <g, O>)."""

    @staticmethod
    def forward(ctx, oc, lc, q, k, v, block_size: int, causal: bool = False):
        tq, nh, hd = q.shape
        nkv = k.shape[1]
        r = nh // nkv
        # [blocks * kv heads, r * B, hd]: the query heads of one kv head stacked over the block's rows
        qg = q.view(-1, block_size, nkv, r, hd).permute(0, 2, 3, 1, 4).reshape(-1, r * block_size, hd)
        kg, vg = (t.view(-1, block_size, nkv, hd).transpose(1, 2).reshape(-1, block_size, hd) for t in (k, v))
        s = _bmm_f32(qg, kg.transpose(1, 2)) * hd ** -0.5                 # [nb * nkv, r * B, B]
        if causal:   # a sliding layer (p = 0 where masked, so the backward below needs nothing more)
            s = s.masked_fill(~_causal(block_size, s.device).repeat(r, 1), float("-inf"))
        lb = torch.logsumexp(s, -1, keepdim=True)
        p = torch.exp(s - lb)
        ob = _bmm_f32(p.to(vg.dtype), vg)                                  # [nb * nkv, r * B, hd]
        # back to [Tq, nh, hd] / [Tq, nh]
        ob = ob.view(-1, nkv, r, block_size, hd).permute(0, 3, 1, 2, 4).reshape(tq, nh, hd)
        lb = lb.view(-1, nkv, r, block_size).permute(0, 3, 1, 2).reshape(tq, nh)
        lse = torch.logaddexp(lc, lb)
        wc, wb = torch.exp(lc - lse), torch.exp(lb - lse)
        out = (_acc(oc) * wc[..., None] + ob * wb[..., None]).to(q.dtype)
        ctx.save_for_backward(oc, out, wc, wb, p, qg, kg, vg)
        ctx.shape = (tq, nh, nkv, r, hd, block_size)
        return out

    @staticmethod
    def backward(ctx, g):
        oc, out, wc, wb, p, qg, kg, vg = ctx.saved_tensors
        tq, nh, nkv, r, hd, bs = ctx.shape
        gf = _acc(g)
        g_oc = (gf * wc[..., None]).to(oc.dtype)
        g_lc = wc * (gf * (_acc(oc) - _acc(out))).sum(-1)
        d_o = gf * wb[..., None]                                           # the block's dO, fp32
        dd = (d_o * _acc(out)).sum(-1)                                     # D = <dO, O>, [Tq, nh]
        # into the block layout of the forward
        d_og = d_o.to(qg.dtype).view(-1, bs, nkv, r, hd).permute(0, 2, 3, 1, 4).reshape(-1, r * bs, hd)
        ddg = dd.view(-1, bs, nkv, r).permute(0, 2, 3, 1).reshape(-1, r * bs, 1)
        dp = _bmm_f32(d_og, vg.transpose(1, 2))                             # [nb * nkv, r * B, B]
        ds = (p * (dp - ddg) * hd ** -0.5).to(qg.dtype)
        dqg = _bmm_f32(ds, kg)                                             # [nb * nkv, r * B, hd]
        dkg = _bmm_f32(ds.transpose(1, 2), qg)                             # [nb * nkv, B, hd]
        dvg = _bmm_f32(p.to(d_og.dtype).transpose(1, 2), d_og)
        dq = dqg.view(-1, nkv, r, bs, hd).permute(0, 3, 1, 2, 4).reshape(tq, nh, hd).to(qg.dtype)
        dk, dv = (t.view(-1, nkv, bs, hd).transpose(1, 2).reshape(tq, nkv, hd).to(qg.dtype) for t in (dkg, dvg))
        return g_oc, g_lc, dq, dk, dv, None, None


class DFlashAttention(nn.Module):
    """Qwen3 attention whose K/V are cat(proj(ctx), proj(block)): context injected as keys and values."""

    def __init__(self, cfg: DFlashConfig, layer: int = 0):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.window = cfg.window(layer)   # a sliding layer's window (module docstring); None: full attention
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.kernel_options: dict | None = None  # FlexAttention's (--flex-kernel-options, set by build_drafter)
        # SPLIT_BLOCKS (set by build_drafter): with the flex backend, FlexAttention over the context keys
        # only and the in-block part apart, merged by log-sum-exp. "dense": the context part by a dense mask
        # (the CPU's stand-in; FlexAttention has no backward there). None: one FlexAttention over both.
        self.split_blocks: str | None = None
        self.split_fused: bool = False   # SPLIT_BLOCKS=2: the in-block part and the merge as BlockMerge

    def forward(self, x, ctx, rope_q, rope_ctx, meta: PackedMeta, backend: str):
        tq, tc = x.shape[0], ctx.shape[0]
        q = self.q_norm(self.q_proj(x).view(tq, self.nh, self.hd))
        kv_in = torch.cat([ctx, x], dim=0)
        k = self.k_norm(self.k_proj(kv_in).view(tc + tq, self.nkv, self.hd))
        v = self.v_proj(kv_in).view(tc + tq, self.nkv, self.hd)
        cos_q, sin_q = rope_q
        cos_k, sin_k = rope_ctx
        # [T, heads, hd] layout: rope broadcast over heads (unsqueeze_dim=1)
        q, _ = apply_rotary_pos_emb(q, q, cos_q, sin_q, unsqueeze_dim=1)
        k, _ = apply_rotary_pos_emb(k, k, cos_k, sin_k, unsqueeze_dim=1)
        if backend == "flex" and self.split_blocks:
            if meta.kv_ctx is not None:
                raise ValueError("SPLIT_BLOCKS needs --flex-ctx-group 0")
            as4 = lambda t: t.transpose(0, 1).unsqueeze(0)   # noqa: E731  [T, heads, hd] -> [1, heads, T, hd]
            oc, lc = CTX_ATTENTION[self.split_blocks](as4(q), as4(k[:tc]), as4(v[:tc]), meta, self.kernel_options,
                                                      window=self.window)
            causal = self.window is not None
            if self.split_fused:
                out = BlockMerge.apply(oc, lc, q, k[tc:], v[tc:], meta.block_size, causal)
            else:
                ob, lb = block_attention(q, k[tc:], v[tc:], meta.block_size, causal)
                out = merge_attention(oc, lc, ob, lb).to(q.dtype)
            return self.o_proj(out.reshape(tq, self.nh * self.hd))
        if backend == "flex" and meta.kv_ctx is not None:
            k, v = (context_copies(t, tc, meta.kv_ctx) for t in (k, v))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, hd]
        if backend == "flex":
            from torch.nn.attention.flex_attention import BlockMask
            block_mask = BlockMask.from_kv_blocks(
                *flex_tile_lists(meta, self.window),
                BLOCK_SIZE=FLEX_BLOCK, mask_mod=_flex_mask_mod(meta, self.window), seq_lengths=(tq, k.shape[2]))
            out = flex_attention_fn(q.device)(q, k, v, block_mask=block_mask, enable_gqa=self.nkv != self.nh,
                                              kernel_options=self.kernel_options)
        else:
            mask = dense_mask(meta, self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=self.nkv != self.nh)
        out = out[0].transpose(0, 1).reshape(tq, self.nh * self.hd)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg.qwen3_config())
        self.attention_conv = self.mlp_conv = None   # a convolution around each sublayer (DFlash2's)
        if cfg.architecture.sublayer_conv:
            self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, ctx, rope_q, rope_ctx, meta, backend):
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_ctx, meta, backend)
            return x + self.mlp(self.post_attention_layernorm(x))
        bs = meta.block_size
        h, out_kernel = self.attention_conv.prepare(self.input_layernorm(x), bs)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope_q, rope_ctx, meta, backend), out_kernel, bs)
        h, out_kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), bs)
        return x + self.mlp_conv.finish(self.mlp(h), out_kernel, bs)


class DFlashDrafter(nn.Module):
    """Trainable part of the drafter. Embedding and LM head are the target's, frozen, passed in."""

    def __init__(self, cfg: DFlashConfig, split_fc: bool = False):
        super().__init__()
        self.cfg = cfg
        self.split_fc = split_fc
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg.qwen3_config())
        if cfg.architecture.selector:   # used by the loss (dflash2.selector_loss) and at inference, not in forward
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                        cfg.selector_top_k)

    def fuse_context(self, taps: torch.Tensor) -> torch.Tensor:
        """[Tc, K*H] -> [Tc, H]. split_fc: per-tap matmuls summed (same math, no K*H-wide GEMM input)."""
        if not self.split_fc:
            return self.hidden_norm(self.fc(taps))
        h = self.cfg.hidden_size
        w = self.fc.weight
        acc = None
        for i in range(taps.shape[1] // h):
            part = taps[:, i * h:(i + 1) * h] @ w[:, i * h:(i + 1) * h].t()
            acc = part if acc is None else acc + part
        return self.hidden_norm(acc)

    def forward(self, taps: torch.Tensor, block_embeds: torch.Tensor, meta: PackedMeta,
                backend: str = "sdpa") -> torch.Tensor:
        """taps [Tc, K*H], block_embeds [Tq, H] -> final-normed hidden [Tq, H] (feed to the LM head)."""
        ctx = self.fuse_context(taps)
        x = block_embeds.to(ctx.dtype)
        rope_q = self.rotary_emb(x, meta.q_pos[None].long())
        rope_c = self.rotary_emb(x, torch.cat([meta.ctx_pos, meta.q_pos])[None].long())
        rope_q = tuple(t[0] for t in rope_q)
        rope_c = tuple(t[0] for t in rope_c)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_c, meta, backend)
        return self.norm(x)


def init_drafter_weights(model: DFlashDrafter, std: float = 0.02, seed: int = 0) -> None:
    """Normal(0, std) matrices, unit norms; drawn on the parameters' own device (fast for 1B params)."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32) * std)
            elif "norm" in name:
                p.fill_(1.0)
        for m in model.modules():   # DFlash2's convolutions start as the identity: the drafter starts as DFlash
            if isinstance(m, GroupedDynamicConv):
                m.reset_parameters()
