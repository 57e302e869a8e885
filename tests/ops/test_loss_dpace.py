"""`--loss ce+dpace` against D-PACE's definition (arXiv 2605.18810, Eq. 7-9; speculators #980's default).

Per block, with the drafter's confidence in the label q_k = exp(-CE_k), smoothed q~_k = (1 - a) q_k + a:
the weight of a supervised position k is sum over supervised m >= k of prod over supervised i <= m of
q~_i, detached; the loss is sum(w * CE) / (supervised positions). The reference below is that
sentence, position by position, with autograd for the gradient; the trainer's chunked loss must equal
it in value and gradient, with blocks cut across loss chunks and a hole in a block's supervision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.config.options import ConfigError, parse_args, validate_flags
from trainer.ops.loss import dflash_loss, dpace_weights
from trainer.ops.plan import plan_micro_batch

B = 5  # block size


def _reference(hidden, weight, labels, supervised, alpha):
    ce = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels.clamp(min=0), reduction="none")
    q = torch.exp(-ce.detach())
    w = torch.zeros_like(ce)
    for blk in range(len(labels) // B):
        rows = range(blk * B, blk * B + B)
        for k in rows:
            if not supervised[k]:
                continue
            total = 0.0
            for m in rows:
                if m < k or not supervised[m]:
                    continue
                total += math.prod((1 - alpha) * q[i].item() + alpha for i in rows if i <= m and supervised[i])
            w[k] = total
    return (w * ce).sum() / supervised.sum()


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 4 * B
    hidden = torch.randn(n, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(13, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 13, (n,), generator=g)
    supervised = torch.ones(n, dtype=torch.bool)
    supervised[::B] = False          # slot 0 is the anchor: no loss
    supervised[B + 2] = False        # a hole inside block 1 (an unsupervised token)
    supervised[3 * B + 3:] = False   # block 3 runs past its sequence's end
    labels[~supervised] = -1
    return hidden, weight, labels, supervised


@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_chunked_ce_dpace_equals_the_definition_in_value_and_gradient(alpha):
    hidden, weight, labels, supervised = _case()
    h_ref = hidden.clone().requires_grad_(True)
    ref = _reference(h_ref, weight, labels, supervised, alpha)
    ref.backward()
    h = hidden.clone().requires_grad_(True)
    row_weight = supervised.double()            # what the plan gives under ce+dpace
    loss, correct = dflash_loss(h, weight, labels, row_weight, row_weight.sum(), chunk=3,   # blocks cut across chunks
                                dpace_alpha=alpha, block_size=B)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)    # the head's logits are fp32 by design
    assert torch.allclose(h.grad, h_ref.grad, rtol=1e-5, atol=1e-7)
    assert (h.grad[~supervised] == 0).all()
    assert correct.tolist() == ((hidden @ weight.t()).argmax(-1) == labels).double().tolist()


def test_dpace_is_not_the_decay_and_alpha_1_is_the_remaining_supervised_count():
    """The weights follow the confidence: a confident early slot lifts the later ones; alpha = 1 (no
    confidence) gives each position the number of supervised positions from it to the block's end."""
    sup = torch.tensor([False, True, True, False, True])
    ce = torch.tensor([0.0, 0.1, 3.0, 0.0, 0.5])
    assert dpace_weights(ce, sup, 5, 1.0).tolist() == [0.0, 3.0, 2.0, 0.0, 1.0]
    w = dpace_weights(ce, sup, 5, 0.5)
    q = lambda c: 0.5 * math.exp(-c) + 0.5   # noqa: E731
    want = [0.0, q(0.1) + q(0.1) * q(3.0) + q(0.1) * q(3.0) * q(0.5),
            q(0.1) * q(3.0) + q(0.1) * q(3.0) * q(0.5), 0.0, q(0.1) * q(3.0) * q(0.5)]
    assert w.tolist() == pytest.approx(want, rel=1e-6)
    sure = dpace_weights(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0]), sup, 5, 0.5)
    assert sure[4] > w[4] * 1.5   # a confident prefix carries more weight to the tail


def test_the_plan_gives_supervised_rows_weight_one_under_ce_dpace():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 90, size=(2, 40))
    mask = np.zeros(ids.shape, bool)
    mask[:, 10:] = True
    lens = np.array([40, 31])
    kw = dict(seed=0, block_size=B, max_anchors=6, mask_token_id=99, gamma=2.0, soft_labels=False,
              chunk_rows=10**6, flex=False)
    dp = plan_micro_batch(ids, mask, lens, [0, 1], 0, loss="ce+dpace", **kw)
    ce = plan_micro_batch(ids, mask, lens, [0, 1], 0, loss="ce", **kw)
    (c_dp,), (c_ce,) = dp.chunks, ce.chunks
    assert (c_dp.labels == c_ce.labels).all()                    # same anchors and labels
    assert set(np.unique(c_dp.row_weight)) == {0.0, 1.0}
    assert ((c_dp.row_weight > 0) == (c_ce.row_weight > 0)).all()
    assert dp.weight_total == (c_dp.labels >= 0).sum()
    with pytest.raises(ValueError, match="unknown loss"):
        plan_micro_batch(ids, mask, lens, [0, 1], 0, loss="dpace", **kw)


PATHS = ["--target-model", "t", "--data-dir", "d", "--output-dir", "o"]


def test_ce_dpace_with_soft_labels_or_alpha_out_of_range_is_refused_naming_the_flag():
    validate_flags(parse_args(PATHS + ["--loss", "ce+dpace", "--no-use-soft-labels"]), gpu_count=-1)
    assert parse_args(PATHS).loss == "ce+dpace"                     # today's default (2026-12-06), on hard labels
    validate_flags(parse_args(PATHS), gpu_count=-1)
    with pytest.raises(ConfigError, match="^--loss: ce\\+dpace is defined on hard labels"):
        validate_flags(parse_args(PATHS + ["--loss", "ce+dpace", "--use-soft-labels"]), gpu_count=-1)
    with pytest.raises(ConfigError, match="^--loss: the default ce\\+dpace is defined on hard labels: "
                                          "--use-soft-labels needs --loss ce too"):
        validate_flags(parse_args(PATHS + ["--use-soft-labels"]), gpu_count=-1)
    with pytest.raises(ConfigError, match="^--dpace-alpha: must be in"):
        validate_flags(parse_args(PATHS + ["--dpace-alpha", "1.5"]), gpu_count=-1)
