"""Which target rank computes, and which drafter rank trains on, each micro-batch: the dispatch plan
every rank computes alike from the batch plan (no messages). Pure numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def eligible_anchors(dataset, max_seq_len: int) -> np.ndarray:
    """Per sequence: positions p (within the first max_seq_len tokens) where p and p+1 are supervised,
    i.e. the anchor candidates plan.sample_anchors draws from. Pure numpy, computed once."""
    m = (np.asarray(dataset.mask) != 0)
    pair = np.zeros(len(m) + 1, np.int64)
    if len(m) > 1:
        pair[1:len(m)] = np.cumsum(m[:-1] & m[1:])
        pair[len(m)] = pair[len(m) - 1]
    starts = np.asarray(dataset.offsets[:len(dataset.lengths)], np.int64)
    n = np.minimum(np.asarray(dataset.lengths, np.int64), max_seq_len)
    last = np.maximum(starts + n - 1, starts)            # pairs (p, p+1) with p in [start, start+n-2]
    return np.where(n >= 2, pair[last] - pair[starts], 0)


@dataclass(frozen=True)
class Assignment:
    seq: int          # global micro-batch number
    step: int         # optimizer step it belongs to
    target: int       # index among target ranks
    drafter: int      # index among drafter ranks
    rows: int         # planned block rows (drafter work)
    tokens: int       # padded tokens (target work)
    real_tokens: int  # tokens of the sequences (what tokens/s counts)


class DispatchPlan:
    """Which target rank computes, and which drafter rank trains on, each micro-batch. Every rank
    computes the same plan from the batch plan alone (no messages): per optimizer step, the step's
    micro-batches go to the drafter ranks by longest-processing-time-first over their planned block
    rows (each drafter rank gets at least one), and to the target ranks the same way by padded
    tokens. Each rank then works through its micro-batches in increasing sequence number, so the
    point-to-point operations are posted in the same order at both ends."""

    def __init__(self, planner, dataset, cfg, num_targets: int, num_drafters: int):
        self.planner, self.dataset, self.cfg = planner, dataset, cfg
        self.T, self.D = num_targets, num_drafters
        self.per_step = num_drafters * cfg.grad_accum
        self.elig = eligible_anchors(dataset, cfg.max_seq_len)
        self._cache: dict[int, list[Assignment]] = {}

    def _work(self, seq: int) -> tuple[int, int, int]:
        n = self.planner.num_batches
        idx = np.asarray(self.planner.batch(seq // n, seq % n), np.int64)
        rows = int(np.minimum(self.elig[idx], self.cfg.max_anchors).sum()) * self.cfg.block_size
        lens = np.minimum(np.asarray(self.dataset.lengths)[idx], self.cfg.max_seq_len)
        pm = self.cfg.pad_multiple
        tokens = len(idx) * (-(-int(lens.max()) // pm) * pm)
        return rows, tokens, int(lens.sum())

    @staticmethod
    def _lpt(work: list[int], bins: int) -> list[int]:
        """Longest processing time first; ties in load go to the bin with fewer items, so with at least
        as many items as bins every bin gets one even when items weigh nothing (a micro-batch with no
        anchors): a drafter rank with no micro-batch would skip the step's FSDP collectives."""
        order = sorted(range(len(work)), key=lambda i: (-work[i], i))
        load = [0] * bins
        count = [0] * bins
        out = [0] * len(work)
        for i in order:
            b = min(range(bins), key=lambda j: (load[j], count[j], j))
            out[i] = b
            load[b] += work[i]
            count[b] += 1
        return out

    def step(self, step: int) -> list[Assignment]:
        # the main and prefetch threads both ask: one read of the cache, the answer kept in a local, and a
        # full cache replaced rather than cleared, so no thread loses an entry it has just looked up
        cached = self._cache.get(step)
        if cached is None:
            seq0 = step * self.per_step
            work = [self._work(s) for s in range(seq0, seq0 + self.per_step)]
            d = self._lpt([w[0] for w in work], self.D)
            t = self._lpt([w[1] for w in work], self.T)
            cached = [Assignment(seq0 + i, step, t[i], d[i], *w) for i, w in enumerate(work)]
            if len(self._cache) > 64:
                self._cache = {}
            self._cache[step] = cached
        return cached

    def for_target(self, index: int, step: int) -> list[Assignment]:
        return [a for a in self.step(step) if a.target == index]

    def for_drafter(self, index: int, step: int) -> list[Assignment]:
        return [a for a in self.step(step) if a.drafter == index]
