"""Host-side planning of one micro-batch: anchors, packed row layout, labels, weights, drafter chunks.

Everything here is numpy on the CPU and deterministic in (seed, epoch, batch index): anchors never
depend on thread timing, so the async pipeline and `--no-async` train on identical examples, and a
resumed run replays exactly what an uninterrupted one would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLEX_BLOCK = 128  # FlexAttention's tile; ctx is padded to a multiple of it
LOSS_CHUNK_ROWS = 4096  # LM-head rows per loss chunk (bounds the fp32 [rows, vocab] logits)


# The per-chunk arrays the drafter's device gets, by ChunkPlan field name: one list that the feed (pinned
# host copies), the drafter stage (device copies) and drafter.PackedMeta (the attention's, checked there)
# read. The optional ones are None in a chunk that does not use them and are then not sent.
ATTENTION_ARRAYS = ("ctx_seq", "ctx_pos", "q_seq", "q_anchor", "q_pos", "kv_num_blocks", "kv_indices",
                    "full_kv_num_blocks", "full_kv_indices", "kv_ctx", "kv_ctx_seq", "q_copy_seq")
LOSS_ARRAYS = ("block_tokens", "labels", "row_weight", "loss_rows", "soft_unique", "soft_local", "prev_tokens")
CHUNK_ARRAYS = ATTENTION_ARRAYS + LOSS_ARRAYS


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
    full_kv_num_blocks: np.ndarray | None = None  # fully visible tiles (FlexAttention skips mask_mod)
    full_kv_indices: np.ndarray | None = None
    # context copies (context_copies), or None: the flex keys' ctx rows, and sequence ids that tell copies apart
    kv_ctx: np.ndarray | None = None      # [Tc'] ctx row held by each copied key row
    kv_ctx_seq: np.ndarray | None = None  # [Tc'] (sequence, copy) id of each copied key row, -1 on pad rows
    q_copy_seq: np.ndarray | None = None  # [Tq] (sequence, copy) id of each query row: the copy it may see
    # LM-head layout (see loss_layout): the rows that go through the head, the loss chunks over them,
    # and the soft-label target rows once per unique position of each loss chunk
    loss_rows: np.ndarray | None = None    # [N] int64 rows of this chunk with a loss (all rows if dedup off)
    loss_bounds: tuple = ()                # per loss chunk (s, e, u0, u1): loss_rows[s:e], soft_unique[u0:u1]
    soft_unique: np.ndarray | None = None  # [U] int64 rows of the final-hidden buffer, per loss chunk unique
    soft_local: np.ndarray | None = None   # [N] int64 index into its loss chunk's soft_unique slice
    # DFlash2's selector (plan_micro_batch(selector=True)): the real token before each row (slot 0: its own)
    prev_tokens: np.ndarray | None = None  # [Tq] int64, 0 past the sequence's end

    def arrays(self) -> dict[str, np.ndarray]:
        """This chunk's CHUNK_ARRAYS, the ones it has."""
        return {k: v for k in CHUNK_ARRAYS if (v := getattr(self, k)) is not None}

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
                     gamma: float, soft_labels: bool, chunk_rows: int, flex: bool, dedup: bool = True,
                     full_blocks: bool = True, loss_chunk_rows: int = LOSS_CHUNK_ROWS,
                     ctx_group: int = 0, loss: str = "ce", selector: bool = False) -> MicroPlan:
    """input_ids/loss_mask [B, S] (right padded), lengths [B]. chunk_rows bounds block rows per drafter chunk.
    dedup: only rows with a loss go through the LM head, and the soft-label target distribution is computed
    once per unique position of a loss chunk (off: every row, per row; the same loss). full_blocks: list the
    fully visible FlexAttention tiles separately (they skip mask_mod). ctx_group > 0: each group of that many
    128-row query tiles attends to its own copy of the context tiles it needs (context_copies).
    loss "ce": row weights exp(-(k-1)/gamma) for slot k >= 1; "ce+dpace": 1 on every supervised row (the
    drafter multiplies them by D-PACE's, which need its own CE: loss.dpace_weights), so weight_total counts
    the supervised rows. Anchors are counted per sequence, which is one document (speculators #1071).
    selector: each chunk carries prev_tokens, the teacher-forced predecessors of DFlash2's selector."""
    bsz, seqlen = input_ids.shape
    slot = np.arange(block_size)
    if loss == "ce+dpace":
        w_slot = np.ones(block_size, np.float32)
    elif loss == "ce":
        w_slot = np.exp(-(slot - 1) / gamma).astype(np.float32)
    else:
        raise ValueError(f"unknown loss {loss!r}")
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
        qs, qa, qp, bt, lab, rw, si, pv = [], [], [], [], [], [], [], []
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
            if selector:   # slot k's predecessor is the token at anchor + k - 1; slot 0 (no loss) its own
                pv.append(np.maximum(np.concatenate([tok[:, :1], tok[:, :-1]], axis=1), 0).reshape(-1))
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
                       prev_tokens=cat(pv) if selector else None,
                       _bs=block_size)
        if len(q_seq) == 0:
            continue  # context only, nothing to train on
        if flex:
            sp = flex_block_sparsity(np.asarray(starts, np.int64), q_seq, q_anchor, row - c0, len(q_seq),
                                     block_size, full=full_blocks)
            if ctx_group:
                ch.kv_ctx, ch.kv_ctx_seq, ch.q_copy_seq, sp = context_copies(sp, ch.ctx_seq, q_seq, ctx_group)
            ch.kv_num_blocks, ch.kv_indices = sp[0], sp[1]
            if full_blocks:
                ch.full_kv_num_blocks, ch.full_kv_indices = sp[2], sp[3]
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
    for c in chunks:
        c.loss_rows, c.loss_bounds, c.soft_unique, c.soft_local = loss_layout(
            c.row_weight, c.soft_index, loss_chunk_rows, dedup)
    gather = np.concatenate(ctx_gather).astype(np.int64) if ctx_gather else np.zeros(0, np.int64)
    return MicroPlan(num_ctx_rows=row, ctx_gather=gather,
                     final_gather=final_gather,
                     chunks=chunks, weight_total=weight_total, pos_counts=pos_counts,
                     num_tokens=int(np.sum(lengths)), num_anchors=n_anchor)


def loss_layout(row_weight: np.ndarray, soft_index: np.ndarray | None, chunk: int, dedup: bool = True):
    """Which rows of a drafter chunk go through the LM head, in loss chunks of at most `chunk` rows.

    dedup: only rows with weight > 0 (slot 0 and rows past a sequence's end need no logits), the chunks
    balanced (ceil(N/chunk) chunks of nearly equal size: no 1-row tail), and per chunk the sorted unique
    final-hidden rows of its soft labels with each row's index into them (blocks overlap, so a position's
    target distribution is computed once per chunk, not once per block row). dedup off: every row in
    chunks of `chunk`, one soft row per block row (the old per-row work; the same loss).
    Returns (loss_rows [N], bounds ((s, e, u0, u1), ...), soft_unique [U] or None, soft_local [N] or None)."""
    n_all = len(row_weight)
    rows = np.nonzero(row_weight > 0)[0].astype(np.int64) if dedup else np.arange(n_all, dtype=np.int64)
    n = len(rows)
    if n == 0:
        cuts = [0]
    elif dedup:
        k = -(-n // chunk)
        cuts = [int(round(i * n / k)) for i in range(k + 1)]
    else:
        cuts = list(range(0, n, chunk)) + [n]
    uniq, local, bounds, u = [], [], [], 0
    for s, e in zip(cuts[:-1], cuts[1:]):
        if soft_index is None:
            bounds.append((s, e, 0, 0))
            continue
        keys = soft_index[rows[s:e]]
        if dedup:
            un, inv = np.unique(keys, return_inverse=True)
        else:
            un, inv = keys, np.arange(e - s)
        uniq.append(un)
        local.append(inv.reshape(-1))
        bounds.append((s, e, u, u + len(un)))
        u += len(un)
    if soft_index is None:
        return rows, tuple(bounds), None, None
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    return rows, tuple(bounds), cat(uniq), cat(local)


def flex_block_sparsity(ctx_seq_start, q_seq, q_anchor, num_ctx: int, num_q: int, block_size: int,
                        full: bool = False):
    """Host-side (numpy) kv_num_blocks / kv_indices for FlexAttention: per 128-row query tile, the context
    tiles from its sequences' first row up to its largest anchor, plus the tiles holding its own blocks.

    full=True also returns full_kv_num_blocks / full_kv_indices: the tiles every (query, key) pair of
    which is visible, left out of the first list (FlexAttention skips mask_mod on them). Only complete
    query tiles (128 rows inside num_q) get full tiles. A context tile is full when it lies inside every
    query's visible range [first row of its sequence, anchor); a tile of the block part only when the
    query tile and the key tile lie inside one block (block_size >= 128)."""
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
    if not full:
        return counts.astype(np.int32)[None, None], idx[None, None]
    complete = (ends - starts) == FLEX_BLOCK
    f_lo = -(-np.maximum.reduceat(seq_start_q, starts) // FLEX_BLOCK)  # first tile starting at/after every start
    f_hi = np.minimum.reduceat(anchor_abs, starts) // FLEX_BLOCK        # tiles ending at/before every anchor
    f_hi = np.where(complete & (f_hi > f_lo), f_hi, f_lo)
    n_full = f_hi - f_lo
    # partial context tiles: [lo, f_lo) then [f_hi, hi) (all of [lo, hi) when there is no full tile)
    a_len = f_lo - lo
    b_len = hi - f_hi
    n_part_ctx = np.where(n_full > 0, a_len + b_len, n_ctx)
    blk_full = np.zeros((nqb, width), bool)
    if block_size >= FLEX_BLOCK:
        for i in np.nonzero(complete)[0]:
            qb = starts[i] // block_size
            if (ends[i] - 1) // block_size != qb:
                continue
            for u in range(qlo[i], qhi[i]):
                r0 = u * FLEX_BLOCK - num_ctx
                r1 = r0 + FLEX_BLOCK
                if r0 >= 0 and r1 <= num_q and r0 // block_size == qb and (r1 - 1) // block_size == qb:
                    blk_full[i, u] = True
    nb_full = blk_full.sum(1)
    # block-part tiles that are not full, in order
    blk_tiles = qlo[:, None] + col
    in_blk = col < (qhi - qlo)[:, None]
    blk_is_full = np.take_along_axis(blk_full, np.minimum(blk_tiles, width - 1), 1) & in_blk
    part_idx = np.zeros((nqb, width), np.int32)
    full_idx = np.zeros((nqb, width), np.int32)
    p_counts = np.zeros(nqb, np.int64)
    f_counts = np.zeros(nqb, np.int64)
    for i in range(nqb):
        if n_full[i] > 0:
            ctx_p = np.concatenate([np.arange(lo[i], f_lo[i]), np.arange(f_hi[i], hi[i])])
        else:
            ctx_p = np.arange(lo[i], hi[i])
        blk_p = blk_tiles[i][in_blk[i] & ~blk_is_full[i]]
        p = np.concatenate([ctx_p, blk_p])
        f = np.concatenate([np.arange(f_lo[i], f_hi[i]), blk_tiles[i][blk_is_full[i]]])
        part_idx[i, :len(p)] = p
        full_idx[i, :len(f)] = f
        p_counts[i], f_counts[i] = len(p), len(f)
    assert (p_counts == n_part_ctx + (qhi - qlo) - nb_full).all()
    return (p_counts.astype(np.int32)[None, None], part_idx[None, None],
            f_counts.astype(np.int32)[None, None], full_idx[None, None])


def context_copies(sp: tuple, ctx_seq: np.ndarray, q_seq: np.ndarray, group: int) -> tuple:
    """Give each group of `group` query tiles its own copy of the context tiles it attends to.

    sp: flex_block_sparsity's arrays, for keys laid out as [ctx (len(ctx_seq) rows), block rows].
    Returns (kv_ctx, kv_ctx_seq, q_copy_seq, sp'):
    - kv_ctx [Tc']: per copy, the ctx rows it holds (whole 128-row tiles, one contiguous range per group);
    - kv_ctx_seq [Tc'] and q_copy_seq [Tq]: sequence ids made unique per copy, so that the mask (which
      compares sequence ids) lets a query see its own group's copy only;
    - sp': the block sparsity for keys laid out as [ctx[kv_ctx], block rows].
    Every (query, key) pair is computed once, as before, and every tile keeps its full/partial kind.

    Why: FlexAttention's backward gives each key tile one program, which loops over every query tile that
    sees it. Every block of a sequence sees that sequence's first context tiles, so at block 32 with 1,024
    anchors one program walks all 256 query tiles of the chunk while most finish after a few; the
    kernel waits on its longest programs. With copies no key tile is seen by more than `group` query
    tiles. The copies cost a gather of K and V per layer (fp32 scatter-add in the backward)."""
    num_ctx, num_q = len(ctx_seq), len(q_seq)
    n_ctx_t = num_ctx // FLEX_BLOCK
    nqb = sp[0].shape[-1]
    lists = [(sp[k][0, 0], sp[k + 1][0, 0].astype(np.int64)) for k in range(0, len(sp), 2)]  # (counts, indices)
    col = np.arange(sp[1].shape[-1])[None, :]
    used = [(idx < n_ctx_t) & (col < num[:, None]) for num, idx in lists]  # context entries in use
    grp = np.arange(nqb) // group
    n_grp = int(grp[-1]) + 1 if nqb else 0
    lo = np.full(n_grp, np.iinfo(np.int64).max)
    hi = np.zeros(n_grp, np.int64)
    for (num, idx), u in zip(lists, used):
        big = np.where(u, idx, np.iinfo(np.int64).max).min(1)
        top = np.where(u, idx + 1, 0).max(1)
        np.minimum.at(lo, grp, big)
        np.maximum.at(hi, grp, top)
    lo = np.where(hi > 0, lo, 0)  # a group with no context gets no copy
    size = hi - lo
    base = np.concatenate([[0], np.cumsum(size)[:-1]])
    n_copy_t = int(size.sum())
    width = n_copy_t + (num_q + FLEX_BLOCK - 1) // FLEX_BLOCK
    offset = (base - lo)[grp][:, None]
    out = []
    for (num, idx), u in zip(lists, used):
        new = np.where(idx < n_ctx_t, idx + offset, idx - n_ctx_t + n_copy_t)
        new = np.where(col < num[:, None], new, 0).astype(np.int32)
        w = min(width, new.shape[1])
        full = np.zeros((nqb, width), np.int32)
        full[:, :w] = new[:, :w]
        out += [num[None, None], full[None, None]]
    tiles = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if n_grp else np.zeros(0, np.int64)
    kv_ctx = (tiles[:, None] * FLEX_BLOCK + np.arange(FLEX_BLOCK)[None, :]).reshape(-1).astype(np.int64)
    owner = np.repeat(np.arange(n_grp), size * FLEX_BLOCK)  # the group each copied key row belongs to
    seqs = int(max(ctx_seq.max(initial=0), q_seq.max(initial=0))) + 1
    kv_ctx_seq = np.where(ctx_seq[kv_ctx] >= 0, owner * seqs + ctx_seq[kv_ctx], -1)
    q_copy_seq = (np.arange(num_q) // (FLEX_BLOCK * group)) * seqs + q_seq
    return kv_ctx, kv_ctx_seq.astype(np.int64), q_copy_seq.astype(np.int64), tuple(out)
