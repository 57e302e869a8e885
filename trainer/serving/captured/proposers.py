"""What proposes the drafts of the batched speculative loop (eval_decoder.BatchedSpecDecoder), one class per
kind of drafter, all verified by the same target step:

  DrafterProposer  a DFlash drafter (modeling_dflash.DFlashDraftModel): one block [token, MASK ...] drafted from
                   the target's taps, its context K/V in a RowKV of its own; greedy drafts. A DFlash2 drafter
                   (dflash2_eval.DFlash2CachedModel) is the same forward, its drafts the candidate selector's
                   path walked per row from the row's newest token
  NgramProposer    prompt lookup, as vLLM's `ngram` method: the longest suffix of max_n .. min_n tokens that
                   occurs earlier in the row's tokens (its earliest occurrence), the k tokens after it

Each answers `alloc(dec, capacity)` (its buffers, once per capacity), `first(dec, first, taps, lens)` (the
prefill's proposal, eager) and `step(dec, nxt, taps, pos, view)` (inside the captured step: device ops only,
static shapes). A missing draft (the lookup found fewer than k tokens, or none) is -1: the target verifies
token 0 there and the comparison rejects it, so a proposal shorter than the block costs nothing in
correctness.
"""

from __future__ import annotations

import torch

from trainer.serving.captured.kv_cache import RowKV

NO_DRAFT = -1


class DrafterProposer:
    """DFlash's (or DFlash2's) drafter in the batched loop (the former BatchedSpecDecoder._draft)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.block_size = drafter.block_size
        self.taps = [i + 1 for i in drafter.target_layer_ids]   # HF hidden_states index of each tap
        # a drafter that picks its drafts itself (DFlash2's selector: dflash2_eval.DFlash2CachedModel.pick)
        self.pick = getattr(drafter, "pick", None)
        self.cache: RowKV | None = None

    def alloc(self, dec, capacity: int) -> None:
        self.cache = None
        d = self.drafter.config
        head_dim = getattr(d, "head_dim", None) or d.hidden_size // d.num_attention_heads
        kv_heads = getattr(d, "num_key_value_heads", None) or d.num_attention_heads
        dtype = next(self.drafter.parameters()).dtype
        self.cache = RowKV(d.num_hidden_layers, dec.batch, kv_heads, capacity, head_dim, dtype, dec.device,
                           self.block_size)

    def _draft(self, dec, first: torch.Tensor, new_taps: torch.Tensor, position_ids: torch.Tensor,
               mask) -> torch.Tensor:
        """The block [first, MASK ...] -> [rows, B-1] drafts (modeling_dflash `draft_logits`, batched)."""
        d, bs = self.drafter, self.block_size
        block = torch.full((first.shape[0], bs), d.mask_token_id, dtype=torch.long, device=dec.device)
        block[:, 0] = first
        hidden = d(position_ids=position_ids, noise_embedding=dec.embed(block), target_hidden=new_taps,
                   attention_mask=mask, past_key_values=self.cache)[:, 1:]
        h = hidden.to(dec.head.weight.dtype)
        # 2-D: the head over the sliced 3-D view went to a bmm against the weight expanded per row (torch's
        # matmul folds only what it can view), 5x the CPU of this mm at 6 rows x 7 slots (2026-12-06)
        logits = dec.head(h.reshape(-1, h.shape[-1])).float().view(*h.shape[:-1], -1)
        return self.pick(hidden, logits, first) if self.pick is not None else logits.argmax(-1)

    def first(self, dec, first: torch.Tensor, taps: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Row by row: each row's context is its whole prompt."""
        out = torch.empty((len(lens), self.block_size - 1), dtype=torch.long, device=dec.device)
        for i, p in enumerate(lens):
            self.cache.rows = slice(i, i + 1)
            out[i] = self._draft(dec, first[i:i + 1], taps[i:i + 1, :p],
                                 torch.arange(p + self.block_size, device=dec.device)[None], None)[0]
        return out

    def step(self, dec, nxt: torch.Tensor, taps: torch.Tensor, pos: torch.Tensor, view: int) -> torch.Tensor:
        """Context rows = the verified block (positions pos), block rows from each row's new start."""
        c, bs = self.cache, self.block_size
        c.rows, c.view, c.wpos = None, view, pos
        bpos = dec.start[:, None] + dec.slot[None]
        mask = torch.cat([(dec.kv_pos[None, :view] < dec.start[:, None]),
                          torch.ones_like(bpos, dtype=torch.bool)], dim=1)[:, None, None, :]
        return self._draft(dec, nxt, taps, torch.cat([pos, bpos], dim=1), mask.expand(-1, 1, bs, -1))


class NgramProposer:
    """Prompt lookup (vLLM's `ngram`: prompt_lookup_max / prompt_lookup_min / num_speculative_tokens): in each
    row's tokens so far (dec.hist, positions 0 .. dec.start), the longest suffix of n tokens, max_n >= n >=
    min_n, that also ends before the newest token; at its earliest occurrence, the (up to) k tokens after it.
    On the device, as a comparison of every window: no host reads, so the step stays one graph."""

    taps: list[int] = []

    def __init__(self, block_size: int, max_n: int = 3, min_n: int = 1, k: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min ({min_n}) <= max ({max_n})")
        k = block_size - 1 if k is None else k
        if not 1 <= k <= block_size - 1:
            raise ValueError(f"n-gram k: need 1 <= k ({k}) <= block size - 1 ({block_size - 1})")
        self.block_size, self.max_n, self.min_n, self.k = block_size, max_n, min_n, k

    def alloc(self, dec, capacity: int) -> None:
        pass

    def lookup(self, hist: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """hist [R, C] (a row's token at each position, valid up to start [R] inclusive) -> drafts [R, B-1]
        (NO_DRAFT past the lookup's tokens)."""
        r, c = hist.shape
        dev = hist.device
        cols = torch.arange(c, device=dev)
        found = torch.zeros(r, dtype=torch.bool, device=dev)
        src = torch.zeros(r, dtype=torch.long, device=dev)      # position of the first proposed token
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > c:
                continue
            suffix = hist.gather(1, (start[:, None] - n + 1 + torch.arange(n, device=dev)).clamp_min(0))
            j = cols[:c - n + 1]
            hit = (hist.unfold(1, n, 1) == suffix[:, None, :]).all(-1)             # [R, C-n+1]
            hit &= (j[None] + n <= start[:, None]) & (start[:, None] >= n)         # earlier, and n tokens exist
            first_j = torch.where(hit, j[None], c).min(-1).values                  # the earliest occurrence
            new = ~found & (first_j < c)
            src = torch.where(new, first_j + n, src)
            found |= new
        take = src[:, None] + torch.arange(self.block_size - 1, device=dev)[None]  # [R, B-1]
        ok = found[:, None] & (take <= start[:, None]) & (take - src[:, None] < self.k)
        return torch.where(ok, hist.gather(1, take.clamp_max(c - 1)), NO_DRAFT)

    def first(self, dec, first: torch.Tensor, taps, lens: list[int]) -> torch.Tensor:
        return self.lookup(dec.hist, dec.start)

    def step(self, dec, nxt: torch.Tensor, taps, pos: torch.Tensor, view: int) -> torch.Tensor:
        return self.lookup(dec.hist, dec.start)


def proposer_for(drafter):
    """A proposer as given; a drafter (DFlash's class, or a wrapper with a batched twin, `cached()`, as
    dflash2_eval.DFlash2Proposer) as DrafterProposer."""
    if hasattr(drafter, "step") and hasattr(drafter, "first"):
        return drafter
    if hasattr(drafter, "cached"):
        drafter = drafter.cached()
    return DrafterProposer(drafter)
