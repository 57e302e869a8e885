"""The drafter's loss: weighted cross-entropy of the block rows through the target's frozen LM head,
against hard labels or the target's own distribution (soft labels), chunked over rows so the fp32
[rows, vocab] logits never exist whole. Rows and chunks come from the plan (plan.loss_layout).

Row weights: the plan's (exp(-(k-1)/gamma) per slot: `--loss ce`), or with `dpace_alpha` D-PACE's
(`--loss ce+dpace`; D-PACE: Dynamic Position-Aware Cross-Entropy, arXiv 2605.18810, the default of
speculators since its #980): per block, from the drafter's own confidence q_k = exp(-CE_k) in the label,
smoothed q~_k = (1 - alpha) q_k + alpha, w_k = sum over supervised m >= k of prod over supervised
i <= m of q~_i, detached. The plan then gives each supervised row weight 1, so the loss is
sum(w * CE) / (supervised rows).
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.ops.plan import LOSS_CHUNK_ROWS, loss_layout


def head_logits(hidden, weight, fp32: bool = True):
    """hidden @ W^T as fp32. fp32=True on CUDA with 16-bit inputs: the GEMM writes fp32 (out_dtype; it
    accumulates in fp32 either way), so the logits are not rounded to bf16 before the softmax.
    fp32=False: a 16-bit output converted afterwards (the old behaviour). Elsewhere: the plain product."""
    if fp32 and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return (hidden @ weight.t()).float()


def _rows_ce(hidden, weight, labels, soft_rows, soft_local, fp32):
    """Per row: (CE [rows] fp32, d CE / d logits [rows, vocab] fp32, argmax agrees [rows] bool, the logits,
    the gold token [rows]: the label, or the target's argmax under soft labels)."""
    logits = head_logits(hidden, weight, fp32)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    if soft_rows is None:
        safe = labels.clamp(min=0)
        nll = -logp.gather(1, safe[:, None])[:, 0]
        g = p.scatter_add(1, safe[:, None], -torch.ones_like(nll)[:, None])
        gold = labels
    else:
        t_logits = head_logits(soft_rows, weight, fp32)
        t_p = torch.softmax(t_logits, dim=-1)
        t_arg = t_logits.argmax(-1)
        if soft_local is not None:
            t_p, t_arg = t_p[soft_local], t_arg[soft_local]
        nll = -(t_p * logp).sum(-1)
        g = p - t_p
        gold = t_arg
    return nll, g, logits.argmax(-1) == gold, logits, gold


def lm_head_chunk(hidden, weight, labels, soft_rows, row_weight, soft_local=None, fp32: bool = True):
    """One chunk of rows: weighted CE of (hidden @ W^T) against hard labels (soft_rows None) or the
    softmax of (soft_rows @ W^T); returns (weighted loss sum, d loss / d hidden, correct as float).
    soft_local [rows]: row r's target is soft_rows[soft_local[r]] (soft_rows holds each position once);
    None: soft_rows is one row per row. Pure function of its inputs, so it can be compiled (the
    elementwise passes over the fp32 [rows, vocab] logits fuse, the gather of the target rows into
    them); the GEMMs stay cuBLAS either way."""
    nll, g, ok, _, _ = _rows_ce(hidden, weight, labels, soft_rows, soft_local, fp32)
    grad = ((g * row_weight[:, None]).to(weight.dtype) @ weight).to(hidden.dtype)
    return (nll * row_weight).sum(), grad, ok.float()


def lm_head_chunk_rows(hidden, weight, labels, soft_rows, row_weight, soft_local=None, fp32: bool = True,
                       top_k: int = 0):
    """lm_head_chunk with the CE per row: (CE [rows], d (w CE) / d hidden [rows, H], correct as float,
    the top_k token ids of the drafter's logits [rows, top_k] (descending), the gold token [rows]).
    For weights that depend on the CE itself (D-PACE, detached: each row's gradient is its own CE's, scaled
    once the weights are known; pass row_weight 1) and for DFlash2's candidate selector (top_k > 0)."""
    nll, g, ok, logits, gold = _rows_ce(hidden, weight, labels, soft_rows, soft_local, fp32)
    grad = ((g * row_weight[:, None]).to(weight.dtype) @ weight).to(hidden.dtype)
    cands = torch.topk(logits, top_k, dim=-1).indices if top_k else labels.new_zeros((labels.shape[0], 0))
    return nll, grad, ok.float(), cands, gold


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE's per-position weights (detached) for rows laid out in whole blocks of `block_size`:
    ce [rows] the CE of each row in its label, supervised [rows] bool. Per block, with q~ = (1 - alpha)
    exp(-ce) + alpha on supervised rows and 1 elsewhere: w_k = supervised_k * sum_{m >= k} supervised_m *
    prod_{i <= m} q~_i (the expected accepted length a position still carries). 0 on unsupervised rows."""
    with torch.no_grad():
        sup = supervised.view(-1, block_size)
        q = (1.0 - alpha) * torch.exp(-ce.float().view(-1, block_size)) + alpha
        prefix = torch.cumprod(torch.where(sup, q, torch.ones_like(q)), dim=-1) * sup
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)
        return (suffix * sup).view(-1)


_compiled: dict = {}


def _chunk_fn(fused: bool, fn=lm_head_chunk):
    """fn itself, or (fused) its compiled form, compiled once."""
    if not fused:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


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
    chunk function. dpace = (alpha, block_size): the row weights are multiplied by D-PACE's (dpace_weights),
    computed from every row's CE once all chunks are through (hard labels only). top_k > 0 (DFlash2's
    selector): also returns each loss row's top_k token ids [rows, top_k] and gold token [rows] (0 elsewhere).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, soft_rows, row_weight, norm, layout, fused, fp32, dpace=None,
                top_k=0):
        if dpace is not None or top_k:
            return ChunkedLMHeadLoss._forward_rows(ctx, hidden, weight, labels, soft_rows, row_weight, norm, layout,
                                                   fused, fp32, dpace, top_k)
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
    def _forward_rows(ctx, hidden, weight, labels, soft_rows, row_weight, norm, layout, fused, fp32, dpace, top_k):
        loss_rows, bounds, soft_local = layout
        n = hidden.shape[0]
        fn = _chunk_fn(fused, lm_head_chunk_rows)
        grad = torch.zeros_like(hidden)
        ce = torch.zeros(n, device=hidden.device, dtype=torch.float32)
        correct = torch.zeros(n, device=hidden.device, dtype=torch.float32)
        cands = torch.zeros((n, top_k), device=hidden.device, dtype=torch.long)
        gold = torch.zeros(n, device=hidden.device, dtype=torch.long)
        for s, e, u0, u1 in bounds:
            rows = loss_rows[s:e]
            h = hidden.index_select(0, rows)
            lab = labels.index_select(0, rows)
            # D-PACE: unit weights here, its own once every row's CE is known
            w = torch.ones_like(rows, dtype=row_weight.dtype) if dpace else row_weight.index_select(0, rows) / norm
            soft = soft_rows[u0:u1] if soft_rows is not None else None
            local = soft_local[s:e] if soft_rows is not None else None
            if fused:
                _mark_rows_dynamic(h, lab, w, soft, local)
            part, g, ok, top, gd = fn(h, weight, lab, soft, w, local, fp32, top_k)
            ce.index_copy_(0, rows, part)
            grad.index_copy_(0, rows, g)
            correct.index_copy_(0, rows, ok)
            cands.index_copy_(0, rows, top)
            gold.index_copy_(0, rows, gd.long())
        if dpace:
            alpha, block_size = dpace
            w = dpace_weights(ce, row_weight > 0, block_size, alpha) * row_weight.float() / norm
            grad.mul_(w.to(grad.dtype)[:, None])
        else:
            w = row_weight.float() / norm
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct, cands, gold)
        return (w * ce).sum(), correct, cands, gold

    @staticmethod
    def backward(ctx, grad_total, *_):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None, None, None, None, None


def dflash_loss(hidden, lm_head_weight, labels, row_weight, norm, soft_rows=None, chunk: int = LOSS_CHUNK_ROWS,
                fused: bool = False, layout=None, fp32_logits: bool = True, dedup: bool = True,
                dpace_alpha: float | None = None, block_size: int | None = None, top_k: int = 0):
    """Loss over block rows. labels[r] = token id (hard) or -1 (ignored: weight must be 0 there).
    dpace_alpha (with block_size; hidden's rows are whole blocks): D-PACE weights times row_weight (the
    plan's 0/1 supervision under --loss ce+dpace); hard labels only. Returns (loss, correct), and with
    top_k > 0 also (top_k candidate ids [rows, top_k], gold token [rows]) for DFlash2's selector.

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
    dpace = None
    if dpace_alpha is not None:
        if soft_rows is not None or not block_size:
            raise ValueError("D-PACE weights need hard labels and the block size")
        dpace = (float(dpace_alpha), int(block_size))
    out = ChunkedLMHeadLoss.apply(hidden, lm_head_weight, labels, soft_rows, row_weight, norm, layout, fused,
                                  fp32_logits, dpace, int(top_k))
    return out if top_k else out[:2]
