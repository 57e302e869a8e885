"""DFlash2's two additions to the drafter, on the packed layout of drafter.py (block rows [Tq, H], block j at
rows j*B .. j*B+B-1), and the candidate selector's training loss.

1. A grouped dynamic depthwise causal convolution around every attention and MLP sublayer
   (GroupedDynamicConv). Output row t of a block is sum over taps k < K of
   (base[k] + dyn[t, k, group]) * x[t - k], where x[t - k] is 0 when t - k falls before the block's slot 0:
   taps never reach into another block (at inference the drafter sees one block at a time, so a tap
   across a boundary would train on something serving never has). base [K, H] is per channel; dyn, one
   value per group of `group_size` channels, is a linear function of the sublayer's input. One
   projection gives the kernels of both convolutions: `prepare` convolves the sublayer's input,
   `finish` its output. Initialised as the identity (tap 0 = 1), so a DFlash2 drafter starts as DFlash.
2. A candidate selector (CandidateSelector): per position the top-K tokens of the drafter's logits;
   candidate c after predecessor p at a position with hidden state h scores
   logit(c) + <pred[p] * (P h), succ[c]> (rank-r codebooks pred, succ and projection P); the path is
   walked left to right from the verified anchor, each step the best candidate after the one chosen
   before it (greedy), or one drawn from softmax(scores / T) at T > 0, whose q over the candidates
   verification needs to stay lossless.

Training (selector_loss): teacher-forced, each position's predecessor is the real token before it. The
candidate set is the drafter's own top-K; where it misses the gold token, the gold token takes the
weakest candidate's place, so every position has a K-way label (serving would have missed it: the
`in_top_k` mask says where). The loss is the K-way cross-entropy of the scores, weighted and normalised
as the unary loss is. Names of the parameters are the public checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def as_dflash2(cfg, **values):
    """A drafter.DFlashConfig made DFlash2's: its entry's keys (trainer/model/architectures.py: the public
    27B-class checkpoint's values, speculators' defaults too) updated by `values`; check_config's ValueError."""
    return cfg.with_architecture("dflash2", **values)


def check_config(cfg) -> None:
    """ValueError naming what in a DFlash2 drafter.DFlashConfig does not fit the drafter: a group size that
    does not divide the width, more taps than a block has slots, more candidates than the vocabulary."""
    if cfg.hidden_size % cfg.conv_group_size:
        raise ValueError(f"the hidden size {cfg.hidden_size} is not a multiple of the conv group size "
                         f"{cfg.conv_group_size}")
    if not 1 <= cfg.conv_kernel_size <= cfg.block_size:
        raise ValueError(f"conv kernel size {cfg.conv_kernel_size} must be in [1, block size {cfg.block_size}]")
    if not 1 <= cfg.selector_top_k <= cfg.vocab_size:
        raise ValueError(f"selector top-k {cfg.selector_top_k} must be in [1, vocabulary {cfg.vocab_size}]")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """fp32 for 16-bit and fp32 tensors; float64 stays float64 (the tests' references)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def block_causal_conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, block_size: int,
                      group_size: int) -> torch.Tensor:
    """x [T, H] (T whole blocks), dyn [T, K, H / group_size], base [K, H] -> [T, H]: see the module docstring."""
    t, h = x.shape
    taps, groups = base.shape[0], h // group_size
    xb = x.view(t // block_size, block_size, groups, group_size)
    db = dyn.reshape(t // block_size, block_size, taps, groups, 1)
    out = None
    for k in range(taps):
        # shift by k slots inside each block; the first k slots get zeros, never the previous block's rows
        shifted = xb if k == 0 else F.pad(xb[:, :-k], (0, 0, 0, 0, k, 0))
        term = base[k].to(x.dtype).view(groups, group_size) * shifted
        out = term if out is None else out + term
        out = out + db[:, :, k] * shifted
    return out.view(t, h)


class GroupedDynamicConv(nn.Module):
    """The two convolutions around one sublayer: base_kernel [2, K, H] (input side, output side) and
    kernel_projection H -> 2*K*G, its output read as [2, K, G]."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of the conv group size {group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 is 1, every other tap and the dynamic part 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input [T, H] -> (its convolution, the output side's dynamic kernel [T, K, G])."""
        dyn = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        return (block_causal_conv(x, dyn[:, 0], self.base_kernel[0], block_size, self.group_size), dyn[:, 1])

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, block_size: int) -> torch.Tensor:
        return block_causal_conv(y, dyn, self.base_kernel[1], block_size, self.group_size)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector top-k {top_k} must be in [1, vocabulary {vocab_size}]")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair_scores(self, hidden: torch.Tensor, prev_ids: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev_ids [...], cand_ids [..., K] -> the bilinear term [..., K] (fp32)."""
        ctx = F.embedding(prev_ids.long(), self.predecessor_codebook) * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        return _acc((ctx.unsqueeze(-2) * F.embedding(cand_ids.long(), self.successor_codebook)).sum(-1))

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float = 0.0,
             generator: torch.Generator | None = None):
        """hidden [n, L, H], logits [n, L, V] of the L draft positions after the anchor, anchor_ids [n] ->
        (path [n, L], candidates [n, L, K], q [n, L, K] fp32 at T > 0 else None)."""
        unary, cand = torch.topk(_acc(logits), self.top_k, dim=-1)
        prev, path, qs = anchor_ids, [], []
        for pos in range(hidden.shape[1]):
            scores = unary[:, pos] + self.pair_scores(hidden[:, pos], prev, cand[:, pos])
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                pick = torch.multinomial(q, 1, generator=generator)[:, 0]
                qs.append(q)
            else:
                pick = scores.argmax(-1)
            prev = cand[:, pos].gather(-1, pick[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, 1), cand, (torch.stack(qs, 1) if qs else None)


def training_candidates(cand_ids: torch.Tensor, gold: torch.Tensor):
    """cand_ids [n, K] in descending logit order, gold [n] -> (ids [n, K], label [n] = gold's place in ids,
    in_top_k [n] bool). Where the top-K misses the gold token it replaces the K-th (weakest) candidate."""
    hit = cand_ids == gold[:, None]
    in_top_k = hit.any(-1)
    label = torch.where(in_top_k, hit.int().argmax(-1), cand_ids.shape[1] - 1)
    ids = cand_ids.clone()
    ids[:, -1] = torch.where(in_top_k, ids[:, -1], gold)
    return ids, label, in_top_k


class CandidateLogits(torch.autograd.Function):
    """hidden [n, H], the frozen LM head W [V, H], ids [n, K] -> fp32 [n, K] = hidden[r] . W[ids[r, k]]
    (float64 for float64 hidden):
    the unary scores of the candidates with their gradient into hidden, without an [n, K, H] copy of W
    kept for backward (rows in chunks of `chunk`)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, chunk: int = 1024):   # 1024 x 16 x 5120 fp32: 335 MB a chunk
        out = torch.empty(ids.shape, device=hidden.device, dtype=_acc(hidden).dtype)
        for s in range(0, hidden.shape[0], chunk):
            w = weight[ids[s:s + chunk]].to(out.dtype)                 # [c, K, H]
            out[s:s + chunk] = torch.einsum("ch,ckh->ck", hidden[s:s + chunk].to(out.dtype), w)
        ctx.save_for_backward(weight, ids)
        ctx.chunk, ctx.dtype = chunk, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        weight, ids = ctx.saved_tensors
        grad = torch.empty((ids.shape[0], weight.shape[1]), device=g.device, dtype=g.dtype)
        for s in range(0, ids.shape[0], ctx.chunk):
            grad[s:s + ctx.chunk] = torch.einsum("ck,ckh->ch", g[s:s + ctx.chunk], weight[ids[s:s + ctx.chunk]].to(g.dtype))
        return grad.to(ctx.dtype), None, None, None


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, head_weight: torch.Tensor, cand_ids: torch.Tensor,
                  gold: torch.Tensor, prev_ids: torch.Tensor, row_weight: torch.Tensor, norm, rows: torch.Tensor,
                  block_size: int | None = None, dpace_alpha: float | None = None):
    """The selector's teacher-forced K-way loss over block rows `rows` (those with a loss).
    hidden [Tq, H] the drafter's final-normed rows; cand_ids [Tq, K] its top-K (descending); gold [Tq] the
    label token; prev_ids [Tq] the real token before each row; row_weight/norm as for the unary loss.
    dpace_alpha: D-PACE weights from this loss's own CE (with block_size), times row_weight.
    Returns (loss, correct [Tq] float: the selector's pick is gold and gold was in the top-K)."""
    ids, label, in_top_k = training_candidates(cand_ids[rows], gold[rows])
    h = hidden.index_select(0, rows)
    scores = CandidateLogits.apply(h, head_weight, ids) + selector.pair_scores(h, prev_ids[rows], ids)
    ce = F.cross_entropy(scores, label, reduction="none")
    w = _acc(row_weight[rows])
    if dpace_alpha is not None:
        from trainer.ops.loss import dpace_weights
        full = torch.zeros(hidden.shape[0], device=ce.device, dtype=ce.dtype).index_copy(0, rows, ce.detach())
        w = w * dpace_weights(full, row_weight > 0, block_size, dpace_alpha)[rows]
    correct = torch.zeros(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    correct[rows] = ((scores.detach().argmax(-1) == label) & in_top_k).float()
    return (w * ce).sum() / norm, correct

