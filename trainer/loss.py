"""The drafter's loss: weighted cross-entropy of the block rows through the target's frozen LM head,
against hard labels or the target's own distribution (soft labels), chunked over rows so the fp32
[rows, vocab] logits never exist whole. Rows and chunks come from the plan (plan.loss_layout).
"""

from __future__ import annotations

import numpy as np
import torch

from .plan import LOSS_CHUNK_ROWS, loss_layout


def head_logits(hidden, weight, fp32: bool = True):
    """hidden @ W^T as fp32. fp32=True on CUDA with 16-bit inputs: the GEMM writes fp32 (out_dtype; it
    accumulates in fp32 either way), so the logits are not rounded to bf16 before the softmax.
    fp32=False: a 16-bit output converted afterwards (the old behaviour). Elsewhere: the plain product."""
    if fp32 and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return (hidden @ weight.t()).float()


def lm_head_chunk(hidden, weight, labels, soft_rows, row_weight, soft_local=None, fp32: bool = True):
    """One chunk of rows: weighted CE of (hidden @ W^T) against hard labels (soft_rows None) or the
    softmax of (soft_rows @ W^T); returns (weighted loss sum, d loss / d hidden, correct as float).
    soft_local [rows]: row r's target is soft_rows[soft_local[r]] (soft_rows holds each position once);
    None: soft_rows is one row per row. Pure function of its inputs, so it can be compiled (the
    elementwise passes over the fp32 [rows, vocab] logits fuse, the gather of the target rows into
    them); the GEMMs stay cuBLAS either way."""
    logits = head_logits(hidden, weight, fp32)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    if soft_rows is None:
        safe = labels.clamp(min=0)
        nll = -logp.gather(1, safe[:, None])[:, 0]
        g = p.scatter_add(1, safe[:, None], -torch.ones_like(nll)[:, None])
        ok = logits.argmax(-1) == labels
    else:
        t_logits = head_logits(soft_rows, weight, fp32)
        t_p = torch.softmax(t_logits, dim=-1)
        t_arg = t_logits.argmax(-1)
        if soft_local is not None:
            t_p, t_arg = t_p[soft_local], t_arg[soft_local]
        nll = -(t_p * logp).sum(-1)
        g = p - t_p
        ok = logits.argmax(-1) == t_arg
    grad = ((g * row_weight[:, None]).to(weight.dtype) @ weight).to(hidden.dtype)
    return (nll * row_weight).sum(), grad, ok.float()


_compiled_chunk = None


def _chunk_fn(fused: bool):
    global _compiled_chunk
    if not fused:
        return lm_head_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(lm_head_chunk)
    return _compiled_chunk


def _mark_rows_dynamic(*ts):
    """Row counts vary per loss chunk (balanced chunks, unique soft rows): compile dim 0 symbolic from
    the first call, so one graph covers every chunk shape (the warmup need not hit each tail size)."""
    for t in ts:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Weighted CE of (hidden @ W^T) against hard labels or soft target rows, chunked over rows.

    Forward computes the loss and, chunk by chunk, the gradient w.r.t. hidden (W is frozen), so the
    full [rows, vocab] logits never exist; backward only scales the stored gradient. Only the rows in
    `layout` go through the head (see plan.loss_layout); the others get zero gradient and count as not
    correct. Returns (loss_sum / weight_norm, correct [rows] as float). fused=True runs the compiled
    chunk function.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, soft_rows, row_weight, norm, layout, fused, fp32):
        loss_rows, bounds, soft_local = layout
        n = hidden.shape[0]
        fn = _chunk_fn(fused)
        grad = torch.zeros_like(hidden)
        correct = torch.zeros(n, device=hidden.device, dtype=torch.float32)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for s, e, u0, u1 in bounds:
            rows = loss_rows[s:e]
            h = hidden.index_select(0, rows)
            lab = labels.index_select(0, rows)
            w = row_weight.index_select(0, rows) / norm
            soft = soft_rows[u0:u1] if soft_rows is not None else None
            local = soft_local[s:e] if soft_rows is not None else None
            if fused:
                _mark_rows_dynamic(h, lab, w, soft, local)
            part, g, ok = fn(h, weight, lab, soft, w, local, fp32)
            grad.index_copy_(0, rows, g)
            correct.index_copy_(0, rows, ok)
            total += part
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None, None, None


def dflash_loss(hidden, lm_head_weight, labels, row_weight, norm, soft_rows=None, chunk: int = LOSS_CHUNK_ROWS,
                fused: bool = False, layout=None, fp32_logits: bool = True, dedup: bool = True):
    """Loss over block rows. labels[r] = token id (hard) or -1 (ignored: weight must be 0 there).

    layout = (loss_rows, bounds, soft_local) from the plan (plan.loss_layout, on the device): soft_rows
    is then the plan's soft_unique rows of the final-hidden buffer. Without a layout, soft_rows is one
    row per block row and the layout is built here (reads row_weight back to the host; for tests and
    small callers): zero-weight rows skipped and soft rows made unique per chunk when dedup."""
    if layout is None:
        rw = row_weight.detach().cpu().numpy()
        soft_index = np.arange(len(rw), dtype=np.int64) if soft_rows is not None else None
        if soft_rows is not None and dedup:
            # equal target rows (same position) share one soft row: each row keyed by its first equal row
            _, first, inv = np.unique(soft_rows.detach().cpu().numpy(), axis=0, return_index=True,
                                      return_inverse=True)
            soft_index = first[inv.reshape(-1)].astype(np.int64)
        rows, bounds, uniq, local = loss_layout(rw, soft_index, chunk, dedup)
        dev = hidden.device
        if soft_rows is not None:
            soft_rows = soft_rows[torch.from_numpy(uniq).to(dev)]
            local = torch.from_numpy(local).to(dev)
        layout = (torch.from_numpy(rows).to(dev), bounds, local)
    return ChunkedLMHeadLoss.apply(hidden, lm_head_weight, labels, soft_rows, row_weight, norm, layout, fused,
                                   fp32_logits)
