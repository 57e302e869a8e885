"""The attention the target runs inside the captured decoders, registered in transformers' AttentionInterface
and switched on around a loop's forwards (`decode_attention`, `verify_attention`).

A decode step folds the query heads of one KV head into rows of one query (``[B, kv_heads, group, D]``
against ``[B, kv_heads, L, D]``): keys and values are read once, never repeated as transformers'
`repeat_kv` does; the prefill attends with the keys repeated, through SDPA, as transformers' sdpa does.
`decode_kernel="triton"` is trainer/ops/decode_attn.py's split-KV kernel (its plain-torch reference on the
CPU). The verify step of the speculative loop folds the heads the same way over its block's positions.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

ATTN_NAME = "dflash_decode"   # the decode loop's target attention (registered by register_attention)
DECODE_KERNELS = ("sdpa", "matmul", "triton")
_decode_kernel = ["sdpa"]     # set by `decode_attention` around GraphDecoder's forwards (a switch)
# "triton" (trainer/ops/decode_attn.py): each row's first cached position and the newest one (device tensors,
# so a captured graph follows them); tiles outside [row_start, last] are not read
_decode_ctx: dict = {"row_start": None, "last": None}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with a [B, 1, Q, L] mask (bool, True = attend, or additive); a one-token query groups
    its heads per KV head. Decode kernel "sdpa": PyTorch's SDPA; "matmul": two batched matmuls and an
    fp32 softmax (K and V read once each either way); "triton": the split-KV kernel of
    trainer/ops/decode_attn.py (its plain-torch reference where Triton cannot run)."""
    b, h, q, d = query.shape
    hk = key.shape[1]
    g = h // hk
    if q == 1 and _decode_kernel[0] == "triton":
        from trainer.ops.decode_attn import split_kv_attention

        out = split_kv_attention(query[:, :, 0], key, value, attention_mask, scaling,
                                 _decode_ctx["row_start"], _decode_ctx["last"])
        return out[:, None], None    # [B, 1, H, D], as the transpose below gives it
    if q == 1 and g > 1:   # decode: the g query heads of one KV head are g rows of one attention
        qg = query.reshape(b, hk, g, d)
        if _decode_kernel[0] == "matmul":
            s = torch.matmul(qg, key.transpose(-1, -2)).float() * (scaling or d ** -0.5)
            if attention_mask.dtype == torch.bool:
                s = s.masked_fill(~attention_mask, float("-inf"))
            else:
                s = s + attention_mask
            out = torch.matmul(torch.softmax(s, dim=-1).to(value.dtype), value)
        else:
            out = F.scaled_dot_product_attention(qg, key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(b, h, 1, d)
    else:
        if g > 1:           # transformers' repeat_kv: query head i reads KV head i // g
            key = key.repeat_interleave(g, dim=1)
            value = value.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


VERIFY_ATTN_NAME = "dflash_verify"   # the batched speculative loop's target attention


def _verify_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of several query positions with a bool [B, 1, Q, L] mask, the g query heads of one KV head
    folded into g*Q rows of one attention: keys and values are read once, never repeated (a verify step's
    KV is the largest tensor it reads)."""
    b, h, q, d = query.shape
    hk = key.shape[1]
    g = h // hk
    if g > 1:
        query = query.reshape(b, hk, g * q, d)                   # row gi*Q + j: head gi of the group, position j
        attention_mask = attention_mask.repeat(1, 1, g, 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionInterface.register(VERIFY_ATTN_NAME, _verify_attention)


FULL, SLIDING = "full_attention", "sliding_attention"   # transformers' layer types


def sliding_window(cfg) -> int | None:
    """The window W of the target's sliding-attention layers (a query at position q sees keys k with
    q - W < k <= q, transformers' sliding_window_overlay), or None where no layer slides."""
    w = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not w or (types is not None and SLIDING not in types):
        return None
    return int(w)


def layer_masks(cfg, full: torch.Tensor, keep: torch.Tensor | None = None, linear_ids=(), linear=None,
                convert=None):
    """The attention_mask a captured loop hands the target: `full` (bool, True = attend) for its full-attention
    layers and, where layers slide (sliding_window), `full & keep` for them (`keep`: True inside the window;
    broadcast to `full`); a hybrid's linear-attention layers get `linear`. A dict by layer type where the model
    has layer types, else the one tensor (a model whose every layer slides, e.g. Mistral, reads one mask).
    `convert` (e.g. bool -> additive) is applied to each attention mask."""
    from trainer.model.families import LINEAR
    conv = convert or (lambda m: m)
    window = sliding_window(cfg)
    if window is None and not linear_ids:
        return conv(full)
    if getattr(cfg, "layer_types", None) is None:   # every layer slides
        return conv(full & keep)
    out = {FULL: conv(full)}
    if window is not None:
        out[SLIDING] = conv(full & keep)
    if linear_ids:
        out[LINEAR] = linear
    return out


@contextmanager
def decode_attention(cfg, kernel: str, row_start: torch.Tensor, last: torch.Tensor):
    """While active, the target whose config is `cfg` attends through the decode attention with `kernel`
    (DECODE_KERNELS); `row_start` [B] and `last` [1] (device tensors, so a captured graph follows them):
    each row's first cached position and the newest one, which the "triton" kernel reads."""
    prev, prev_kernel, prev_ctx = cfg._attn_implementation, _decode_kernel[0], dict(_decode_ctx)
    cfg._attn_implementation = ATTN_NAME
    _decode_kernel[0] = kernel
    _decode_ctx.update(row_start=row_start, last=last)
    try:
        yield
    finally:
        cfg._attn_implementation = prev
        _decode_kernel[0] = prev_kernel
        _decode_ctx.update(prev_ctx)


@contextmanager
def verify_attention(cfg):
    """While active, the target whose config is `cfg` attends through the verify attention."""
    prev = cfg._attn_implementation
    cfg._attn_implementation = VERIFY_ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = prev
