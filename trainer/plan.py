"""Host-side planning of one micro-batch: anchors, packed row layout, labels, weights, drafter chunks.

Everything here is numpy on the CPU and deterministic in (seed, epoch, batch index): anchors never
depend on thread timing, so the async pipeline and `--no-async` train on identical examples, and a
resumed run replays exactly what an uninterrupted one would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLEX_BLOCK = 128  # FlexAttention's tile; ctx is padded to a multiple of it


@dataclass
class ChunkPlan:
    """One drafter forward/backward: whole sequences, ctx rows [c0, c1) of the packed buffer."""
    c0: int
    c1: int
    ctx_seq: np.ndarray   # [c1-c0] int64, -1 on pad rows
    ctx_pos: np.ndarray   # [c1-c0] int64
    q_seq: np.ndarray     # [Tq] int64 (chunk-local sequence index)
    q_anchor: np.ndarray  # [Tq]
    q_pos: np.ndarray     # [Tq] anchor + slot
    block_tokens: np.ndarray  # [Tq] token at anchor in slot 0, mask token elsewhere
    labels: np.ndarray    # [Tq] token at anchor+slot, -1 where no loss
    row_weight: np.ndarray  # [Tq] float32 decay weight, 0 where no loss
    soft_index: np.ndarray | None  # [Tq] row of the final-hidden buffer (anchor+slot-1), 0 where unused
    kv_num_blocks: np.ndarray | None
    kv_indices: np.ndarray | None

    @property
    def num_blocks(self) -> int:
        return len(self.q_seq) // max(1, self._bs)

    _bs: int = 1


@dataclass
class MicroPlan:
    num_ctx_rows: int          # rows used in the packed tap buffer (incl. per-chunk padding)
    ctx_gather: np.ndarray     # [num_ctx_rows] flat index into [B*S] target rows (pad rows -> 0)
    final_gather: np.ndarray | None  # [R] flat index of final-normed rows needed for soft labels
    chunks: list[ChunkPlan]
    weight_total: float        # sum of row weights over the micro-batch (loss normaliser)
    pos_counts: np.ndarray     # [B] supervised rows per block slot
    num_tokens: int            # real context tokens
    num_anchors: int


def anchor_candidates(loss_mask: np.ndarray, min_position: int = 0) -> np.ndarray:
    """The anchor rule: positions p >= min_position with loss_mask[p] and loss_mask[p+1] (slot 0 is
    the given token, so a block needs at least one supervised token after its anchor)."""
    m = np.asarray(loss_mask).astype(bool)
    cand = np.nonzero(m[:-1] & m[1:])[0]
    return cand[cand >= min_position] if min_position else cand


def sample_anchors(loss_mask: np.ndarray, max_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform without replacement among :func:`anchor_candidates`; sorted."""
    cand = anchor_candidates(loss_mask)
    if len(cand) > max_anchors:
        cand = np.sort(rng.choice(cand, size=max_anchors, replace=False))
    return cand.astype(np.int64)


def anchor_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, sample_id, 0xDF1A5])


def plan_micro_batch(input_ids: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, sample_ids,
                     epoch: int, *, seed: int, block_size: int, max_anchors: int, mask_token_id: int,
                     gamma: float, soft_labels: bool, chunk_rows: int, flex: bool) -> MicroPlan:
    """input_ids/loss_mask [B, S] (right padded), lengths [B]. chunk_rows bounds block rows per drafter chunk."""
    bsz, seqlen = input_ids.shape
    slot = np.arange(block_size)
    w_slot = np.exp(-(slot - 1) / gamma).astype(np.float32)
    w_slot[0] = 0.0

    per_seq = []
    for b in range(bsz):
        n = int(lengths[b])
        anchors = sample_anchors(loss_mask[b, :n], max_anchors, anchor_rng(seed, epoch, int(sample_ids[b])))
        per_seq.append((b, n, anchors))

    # group whole sequences into chunks of at most chunk_rows block rows (a long one gets its own)
    groups, cur, cur_rows = [], [], 0
    for item in per_seq:
        rows = len(item[2]) * block_size
        if cur and cur_rows + rows > chunk_rows:
            groups.append(cur)
            cur, cur_rows = [], 0
        cur.append(item)
        cur_rows += rows
    if cur:
        groups.append(cur)

    ctx_gather = []
    chunks, row = [], 0
    weight_total, pos_counts, n_anchor = 0.0, np.zeros(block_size, np.int64), 0
    for group in groups:
        c0 = row
        cs, cp, starts = [], [], []
        qs, qa, qp, bt, lab, rw, si = [], [], [], [], [], [], []
        for local, (b, n, anchors) in enumerate(group):
            starts.append(row - c0)
            ctx_gather.append(b * seqlen + np.arange(n))
            cs.append(np.full(n, local))
            cp.append(np.arange(n))
            row += n
            if len(anchors) == 0:
                continue
            n_anchor += len(anchors)
            pos = anchors[:, None] + slot[None, :]                        # [A, B]
            inside = pos < n
            tok = np.where(inside, input_ids[b, np.minimum(pos, n - 1)], -1)
            sup = inside & loss_mask[b, np.minimum(pos, n - 1)].astype(bool)
            sup[:, 0] = False
            labels = np.where(sup, tok, -1)
            weights = np.where(sup, w_slot[None, :], 0.0).astype(np.float32)
            blocks = np.full_like(pos, mask_token_id)
            blocks[:, 0] = input_ids[b, anchors]
            qs.append(np.full(pos.size, local))
            qa.append(np.repeat(anchors, block_size))
            qp.append(pos.reshape(-1))
            bt.append(blocks.reshape(-1))
            lab.append(labels.reshape(-1))
            rw.append(weights.reshape(-1))
            weight_total += float(weights.sum())
            pos_counts += sup.sum(0)
            if soft_labels:
                # the target's distribution for slot k lives at its final hidden row anchor+k-1;
                # keys are flat [B*S] rows, mapped to a compact buffer once the batch is planned
                si.append(np.where(sup, b * seqlen + pos - 1, -1).reshape(-1))
        pad = (-(row - c0)) % FLEX_BLOCK if flex else 0
        if pad:
            ctx_gather.append(np.zeros(pad, np.int64))
            cs.append(np.full(pad, -1))
            cp.append(np.zeros(pad, np.int64))
            row += pad
        cat = (lambda xs, dt=np.int64: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
        q_seq, q_anchor = cat(qs), cat(qa)
        ch = ChunkPlan(c0=c0, c1=row, ctx_seq=cat(cs), ctx_pos=cat(cp), q_seq=q_seq, q_anchor=q_anchor,
                       q_pos=cat(qp), block_tokens=cat(bt), labels=cat(lab), row_weight=cat(rw, np.float32),
                       soft_index=cat(si) if soft_labels else None, kv_num_blocks=None, kv_indices=None,
                       _bs=block_size)
        if len(q_seq) == 0:
            continue  # context only, nothing to train on
        if flex:
            ch.kv_num_blocks, ch.kv_indices = flex_block_sparsity(
                np.asarray(starts, np.int64), q_seq, q_anchor, row - c0, len(q_seq), block_size)
        chunks.append(ch)

    final_gather = None
    if soft_labels:
        keys = np.concatenate([c.soft_index for c in chunks]) if chunks else np.zeros(0, np.int64)
        final_gather, inverse = np.unique(np.where(keys >= 0, keys, np.iinfo(np.int64).max), return_inverse=True)
        if len(final_gather) and final_gather[-1] == np.iinfo(np.int64).max:
            final_gather = final_gather[:-1]
        inverse = np.where(keys >= 0, inverse, 0)
        off = 0
        for c in chunks:
            n = len(c.soft_index)
            c.soft_index = inverse[off:off + n].astype(np.int64)
            off += n
    gather = np.concatenate(ctx_gather).astype(np.int64) if ctx_gather else np.zeros(0, np.int64)
    return MicroPlan(num_ctx_rows=row, ctx_gather=gather,
                     final_gather=final_gather,
                     chunks=chunks, weight_total=weight_total, pos_counts=pos_counts,
                     num_tokens=int(np.sum(lengths)), num_anchors=n_anchor)


def flex_block_sparsity(ctx_seq_start, q_seq, q_anchor, num_ctx: int, num_q: int, block_size: int):
    """Host-side (numpy) kv_num_blocks / kv_indices for FlexAttention: per 128-row query tile, the context
    tiles from its sequences' first row up to its largest anchor, plus the tiles holding its own blocks."""
    nqb = (num_q + FLEX_BLOCK - 1) // FLEX_BLOCK
    starts = np.arange(nqb) * FLEX_BLOCK
    ends = np.minimum(starts + FLEX_BLOCK, num_q)
    seq_start_q = ctx_seq_start[q_seq]  # first ctx row of each query's sequence
    anchor_abs = seq_start_q + q_anchor  # ctx rows < anchor_abs are visible
    lo = np.minimum.reduceat(seq_start_q, starts) // FLEX_BLOCK
    hi = (np.maximum.reduceat(anchor_abs, starts) + FLEX_BLOCK - 1) // FLEX_BLOCK  # exclusive
    hi = np.maximum(hi, lo)
    blk_lo = (starts // block_size) * block_size
    blk_hi = ((ends - 1) // block_size + 1) * block_size
    qlo = (num_ctx + blk_lo) // FLEX_BLOCK
    qhi = (num_ctx + blk_hi - 1) // FLEX_BLOCK + 1
    n_ctx = hi - lo
    counts = n_ctx + (qhi - qlo)
    # FlexAttention expects the last dim to span every KV tile (unused entries are ignored)
    width = (num_ctx + num_q + FLEX_BLOCK - 1) // FLEX_BLOCK
    idx = np.zeros((nqb, width), dtype=np.int32)
    col = np.arange(width)[None, :]
    ctx_part = lo[:, None] + col
    blk_part = qlo[:, None] + (col - n_ctx[:, None])
    idx[:] = np.where(col < n_ctx[:, None], ctx_part, np.where(col < counts[:, None], blk_part, 0))
    return counts.astype(np.int32)[None, None], idx[None, None]
