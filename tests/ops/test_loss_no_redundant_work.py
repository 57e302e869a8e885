"""The drafter does no redundant work and computes the same loss (trainer/ops/loss.py and
trainer/ops/plan.py; issue 15), on the CPU:

- soft labels once per unique position of a loss chunk, zero-weight rows skipped: the loss and its
  gradient equal the per-row reference (float64, and float32 within rounding);
- FlexAttention's full-block lists: exactly the complete, fully visible tiles (brute force), disjoint
  from the partial list, which together with them still covers every visible pair;
- a short training run with the switches off logs the same losses and reaches the same tau.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import learning_run_args
from tests.engine.test_trainer import losses, records
from trainer.__main__ import main as train_main
from trainer.ops.loss import dflash_loss, lm_head_chunk
from trainer.ops.plan import FLEX_BLOCK, flex_block_sparsity, loss_layout, plan_micro_batch


def _batch(lens, block, anchors, seed=0, soft=True, flex=False, **kw):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens)
    ids = rng.integers(0, 90, size=(len(lens), lens.max()))
    mask = np.zeros(ids.shape, bool)
    for b, n in enumerate(lens):
        mask[b, n // 4:n] = True
    plan = plan_micro_batch(ids, mask, lens, list(range(len(lens))), 0, seed=seed, block_size=block,
                            max_anchors=anchors, mask_token_id=99, gamma=4.0, soft_labels=soft,
                            chunk_rows=kw.pop("chunk_rows", 10**6), flex=flex, **kw)
    return ids, plan


def _reference_loss(hidden, final, weight, plan_chunk, norm):
    """The straightforward per-row loss: every block row through the head, its own soft row."""
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    w = torch.from_numpy(plan_chunk.row_weight).to(hidden.dtype)
    if final is None:
        ce = -logp.gather(1, torch.from_numpy(plan_chunk.labels).clamp(min=0)[:, None])[:, 0]
    else:
        t_p = torch.softmax(final[torch.from_numpy(plan_chunk.soft_index)] @ weight.t(), -1)
        ce = -(t_p * logp).sum(-1)
    return (ce * w).sum() / norm


def _run(plan_chunk, hidden, final, weight, norm, dtype=torch.float64):
    h = hidden.detach().clone().to(dtype).requires_grad_(True)
    c = plan_chunk
    soft = final[torch.from_numpy(c.soft_unique)].to(dtype) if final is not None else None
    local = torch.from_numpy(c.soft_local) if final is not None else None
    layout = (torch.from_numpy(c.loss_rows), c.loss_bounds, local)
    loss, correct = dflash_loss(h, weight.to(dtype), torch.from_numpy(c.labels),
                                torch.from_numpy(c.row_weight).to(dtype), norm, soft_rows=soft, layout=layout)
    loss.backward()
    return loss.detach(), correct, h.grad


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("block,anchors", [(8, 40), (4, 200)])
def test_dedup_loss_and_grad_equal_the_per_row_reference(soft, block, anchors):
    _, plan = _batch([300, 77, 150], block, anchors, soft=soft, loss_chunk_rows=37)
    _, old = _batch([300, 77, 150], block, anchors, soft=soft, loss_chunk_rows=37, dedup=False)
    c, o = plan.chunks[0], old.chunks[0]
    g = torch.Generator().manual_seed(0)
    tq, hdim, vocab = len(c.q_seq), 16, 90
    hidden = torch.randn(tq, hdim, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hdim, generator=g, dtype=torch.float64)
    final = torch.randn(len(plan.final_gather), hdim, generator=g, dtype=torch.float64) if soft else None
    norm = plan.weight_total / 0.5

    # the dedup layout does less work
    assert len(c.loss_rows) == int((c.row_weight > 0).sum()) < tq
    assert len(o.loss_rows) == tq
    if soft:
        assert len(c.soft_unique) < len(c.loss_rows)
        assert len(np.unique(c.soft_index[c.row_weight > 0])) <= len(c.soft_unique)
        # every row's target is its own position's row
        for s, e, u0, u1 in c.loss_bounds:
            assert (c.soft_unique[u0:u1][c.soft_local[s:e]] == c.soft_index[c.loss_rows[s:e]]).all()

    h_ref = hidden.clone().requires_grad_(True)
    ref = _reference_loss(h_ref, final, weight, c, norm)
    ref.backward()
    scale = float(h_ref.grad.abs().max())
    grads = []
    for p in (c, o):
        loss, correct, grad = _run(p, hidden, final, weight, norm)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # the total accumulates in fp32
        assert torch.allclose(grad, h_ref.grad, rtol=1e-5, atol=1e-6 * scale)
        assert (grad[torch.from_numpy(c.row_weight == 0)] == 0).all()
        grads.append(grad)
    # the dedup path and the per-row path compute the same float64 numbers
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-15 * scale)
    # the accuracy counts agree on the rows with a loss
    _, c_new, _ = _run(c, hidden, final, weight, norm)
    _, c_old, _ = _run(o, hidden, final, weight, norm)
    valid = torch.from_numpy(c.row_weight > 0)
    assert torch.equal(c_new[valid], c_old[valid])
    # float32 within rounding
    loss32, _, grad32 = _run(c, hidden, final, weight, norm, torch.float32)
    assert loss32.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(grad32.double(), h_ref.grad, rtol=1e-4, atol=1e-5 * scale)


def test_loss_layout_balances_chunks_and_keeps_every_loss_row_once():
    rw = np.zeros(100, np.float32)
    rw[np.arange(100) % 4 != 0] = 1.0       # 75 rows with a loss
    soft = (np.arange(100) // 4 + np.arange(100) % 4).astype(np.int64)
    rows, bounds, uniq, local = loss_layout(rw, soft, 32, dedup=True)
    assert sorted(rows.tolist()) == [r for r in range(100) if r % 4]
    sizes = [e - s for s, e, _, _ in bounds]
    assert len(sizes) == 3 and max(sizes) - min(sizes) <= 1 and sum(sizes) == 75
    assert bounds[-1][3] == len(uniq)
    for s, e, u0, u1 in bounds:
        assert (uniq[u0:u1][local[s:e]] == soft[rows[s:e]]).all()
        assert len(np.unique(uniq[u0:u1])) == u1 - u0
    rows, bounds, uniq, local = loss_layout(rw, soft, 32, dedup=False)
    assert rows.tolist() == list(range(100)) and [b[:2] for b in bounds] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    rows, bounds, uniq, local = loss_layout(np.zeros(8, np.float32), None, 32)
    assert len(rows) == 0 and bounds == () and uniq is None


def test_layout_free_call_equals_the_per_row_loss():
    """dflash_loss without a plan layout (tests, small callers) still gives the per-row loss."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20, 8, generator=g, dtype=torch.float64)
    base = torch.randn(5, 8, generator=g, dtype=torch.float64)
    soft_rows = base[torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 0, 1])]  # repeated positions
    w = torch.rand(12, generator=g, dtype=torch.float64)
    w[[0, 5]] = 0
    labels = torch.zeros(12, dtype=torch.long)
    loss, _ = dflash_loss(hidden, weight, labels, w, 3.0, soft_rows=soft_rows, chunk=5)
    loss.backward()
    total, grad, _ = lm_head_chunk(hidden.detach(), weight, labels, soft_rows, w / 3.0)
    assert loss.item() == pytest.approx(total.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, grad, rtol=1e-10, atol=1e-15)


# ----------------------------------------------------------------------------- flex full blocks

def _dense(c, block):
    ctx_seq, ctx_pos, q_seq, q_anchor = c.ctx_seq, c.ctx_pos, c.q_seq, c.q_anchor
    ctx_ok = (ctx_seq[None, :] == q_seq[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
    blk = np.arange(len(q_seq)) // block
    return np.concatenate([ctx_ok, blk[:, None] == blk[None, :]], axis=1)


def _tile(c, block, i, j):
    """Tile (i, j) of `_dense(c, block)` (FLEX_BLOCK square, cut at the edges), built alone."""
    nc = len(c.ctx_seq)
    r = np.arange(i * FLEX_BLOCK, min((i + 1) * FLEX_BLOCK, len(c.q_seq)))
    k = np.arange(j * FLEX_BLOCK, min((j + 1) * FLEX_BLOCK, nc + len(c.q_seq)))
    kc, kq = k[k < nc], k[k >= nc] - nc
    ctx_ok = (c.ctx_seq[kc][None, :] == c.q_seq[r][:, None]) & (c.ctx_pos[kc][None, :] < c.q_anchor[r][:, None])
    return np.concatenate([ctx_ok, (r // block)[:, None] == (kq // block)[None, :]], axis=1)


def _visible(c, block) -> int:
    """`_dense(c, block).sum()` without the dense mask: per query row, the context rows of its sequence before its
    anchor (a sorted search per sequence), and its own block's rows."""
    n = 0
    for s in np.unique(c.q_seq):
        n += int(np.searchsorted(np.sort(c.ctx_pos[c.ctx_seq == s]), c.q_anchor[c.q_seq == s]).sum())
    return n + int((np.bincount(np.arange(len(c.q_seq)) // block) ** 2).sum())


def _tiles(num, idx):
    out = set()
    for qb in range(num.shape[2]):
        for kb in idx[0, 0, qb, :num[0, 0, qb]]:
            out.add((qb, int(kb)))
    return out


@pytest.mark.parametrize("lens,block,anchors", [([300, 77, 150], 8, 20), ([1500, 700, 90], 16, 200),
                                                 ([2000], 32, 60), ([1200, 900], 128, 4), ([700], 256, 3)])
def test_full_block_lists_match_a_brute_force_tile_scan(lens, block, anchors):
    _, plan = _batch(lens, block, anchors, soft=False, flex=True)
    for c in plan.chunks:
        dm = _dense(c, block)
        tq, tk = dm.shape
        nqb, nkb = -(-tq // FLEX_BLOCK), -(-tk // FLEX_BLOCK)
        want_full, want_any = set(), set()
        for i in range(nqb):
            for j in range(nkb):
                t = dm[i * FLEX_BLOCK:(i + 1) * FLEX_BLOCK, j * FLEX_BLOCK:(j + 1) * FLEX_BLOCK]
                if t.any():
                    want_any.add((i, j))
                if t.shape == (FLEX_BLOCK, FLEX_BLOCK) and t.all():
                    want_full.add((i, j))
        full = _tiles(c.full_kv_num_blocks, c.full_kv_indices)
        part = _tiles(c.kv_num_blocks, c.kv_indices)
        assert full == want_full
        assert not (full & part)
        assert want_any <= (full | part)
        # no worse than the old list: the same tiles, split
        old_num, old_idx = flex_block_sparsity(
            np.concatenate([[0], np.nonzero(np.diff(c.ctx_seq[c.ctx_seq >= 0]))[0] + 1]),
            c.q_seq, c.q_anchor, len(c.ctx_seq), tq, block)
        assert (full | part) == _tiles(old_num, old_idx)
        assert c.full_kv_indices.shape == c.kv_indices.shape
    if block <= 32 and lens[0] >= 1500:
        assert sum(c.full_kv_num_blocks.sum() for c in plan.chunks) > 0  # the point of the lists


def test_full_blocks_off_leaves_the_old_lists():
    _, plan = _batch([1500, 700], 16, 200, soft=False, flex=True, full_blocks=False)
    assert all(c.full_kv_num_blocks is None for c in plan.chunks)


def test_a_short_run_without_the_issue15_switches_trains_the_same(tiny_learning_run, tiny_small_dir, tmp_path):
    """Issue 15's training result: the same short run with soft labels per row and the LM head on every
    row (--no-loss-dedup, the code before) and per position (the default) logs the same losses step by
    step and reaches the same tau (the real generation-loop eval at the end)."""
    out = tmp_path / "per_row"
    assert train_main(learning_run_args(tiny_small_dir, out, "--no-loss-dedup", "--no-fp32-logits")) == 0
    # per position: the session's learning run (tests/conftest.py), the same flags without these two
    (la, ea), (lb, eb) = ((losses(d), records(d, "eval")[-1]) for d in (tiny_learning_run, out))
    assert la.keys() == lb.keys() == set(range(1, 7))
    for s in la:
        assert la[s] == pytest.approx(lb[s], rel=1e-4), (s, la[s], lb[s])
    assert la[6] < la[1], "the run must learn, or equal losses say little"
    assert ea["tau"] == pytest.approx(eb["tau"], abs=0.05), json.dumps([ea, eb])


# ----------------------------------------------------------------------------- context copies

@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("lens,block,anchors", [([300, 77, 150], 8, 20), ([1500, 700, 90], 16, 200),
                                                 ([2000], 32, 60), ([1200, 900], 128, 4)])
def test_context_copies_keep_every_pair_and_bound_the_key_tiles_fan_in(lens, block, anchors, group):
    """Per query tile the same (query, key) pairs and the same tiles (full or partial) as one shared
    context; no context tile of the new layout is listed by more than `group` query tiles."""
    _, shared = _batch(lens, block, anchors, soft=False, flex=True)
    _, plan = _batch(lens, block, anchors, soft=False, flex=True, ctx_group=group)
    assert len(plan.chunks) == len(shared.chunks)
    for c, s in zip(plan.chunks, shared.chunks):
        nct = len(c.ctx_seq) // FLEX_BLOCK
        ncopy = len(c.kv_ctx) // FLEX_BLOCK
        assert len(c.kv_ctx) % FLEX_BLOCK == 0 and (c.kv_ctx < len(c.ctx_seq)).all()
        # the mask of the copied layout, from the copied rows' sequence and position; its tiles built one by one
        # (the dense mask, which the copies widen to some 3,200 x 50,000 at group 1, cost seconds a case)
        copied = type(c)(**{**c.__dict__, "ctx_seq": c.kv_ctx_seq, "ctx_pos": c.ctx_pos[c.kv_ctx],
                            "q_seq": c.q_copy_seq})
        tk = len(copied.ctx_seq) + len(copied.q_seq)
        full = _tiles(c.full_kv_num_blocks, c.full_kv_indices)
        part = _tiles(c.kv_num_blocks, c.kv_indices)
        assert not (full & part)

        def back(j):  # the shared layout's key tile that copied tile j holds
            return int(c.kv_ctx[j * FLEX_BLOCK]) // FLEX_BLOCK if j < ncopy else j - ncopy + nct
        tiles = {(i, j): _tile(copied, block, i, j) for i, j in full | part}
        for (i, j), t in tiles.items():  # a listed tile sees what its shared original sees (a copy is whole tiles)
            assert (t == _tile(s, block, i, back(j))).all()
        # and the mask alone says the same: no visible pair outside the listed tiles (eager FlexAttention
        # applies only the mask, the kernels only the listed tiles plus the mask): the listed tiles hold every
        # pair the whole mask lets see, as many as the shared layout's mask does
        seen = _visible(copied, block)
        assert sum(int(t.sum()) for t in tiles.values()) == seen
        assert seen == _visible(s, block)
        for i, j in full:
            assert tiles[i, j].shape == (FLEX_BLOCK, FLEX_BLOCK) and tiles[i, j].all()
        # the same tiles as the shared layout, each once: every visible pair is computed exactly once
        assert sorted((i, back(j)) for i, j in full) == sorted(_tiles(s.full_kv_num_blocks, s.full_kv_indices))
        assert sorted((i, back(j)) for i, j in part) == sorted(_tiles(s.kv_num_blocks, s.kv_indices))
        fan_in = np.bincount([j for _, j in full | part if j < ncopy], minlength=ncopy)
        assert fan_in.max() <= group
        assert c.kv_indices.shape[-1] >= -(-tk // FLEX_BLOCK)  # FlexAttention wants every key tile in range
