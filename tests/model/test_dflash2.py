"""DFlash2 (issue 43) against the reference `dflash` package 0.1.0 (a test-only dependency: pip install -e .[test]).

- the grouped dynamic causal convolution on packed blocks equals the reference's on each block alone, and
  its taps never cross a block boundary;
- the candidate selector's greedy path equals the reference's, and at T > 0 its q over the candidates
  equals the reference's at every step of the reference's sampled path;
- the selector's training loss equals its definition (gold injected in place of the weakest candidate,
  teacher-forced predecessors, K-way CE) in value and gradient;
- training is bit-deterministic on the CPU with more than one intra-op thread: two runs end with the same
  weights, bit for bit.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import perturb_dflash2
from trainer.model.dflash2 import CandidateSelector, GroupedDynamicConv, selector_loss, training_candidates

ref = pytest.importorskip("dflash.model", reason="the reference package: pip install -e .[test]")

H, GS, K, B = 32, 8, 2, 4


def _conv_pair(seed=0):
    torch.manual_seed(seed)
    theirs = ref.GroupedDynamicCausalConv(H, K, GS).double()
    with torch.no_grad():
        theirs.base_kernel.normal_()
        theirs.kernel_projection.weight.normal_()
    ours = GroupedDynamicConv(H, K, GS).double()
    ours.load_state_dict(theirs.state_dict())          # the same parameter names
    return ours, theirs

def test_conv_on_packed_blocks_equals_the_reference_on_each_block_alone():
    ours, theirs = _conv_pair()
    x = torch.randn(3 * B, H, dtype=torch.float64)
    y, dyn = ours.prepare(x, B)
    y_ref, dyn_ref = theirs.prepare(x.view(3, B, H))      # a batch of 3 separate blocks
    assert torch.allclose(y, y_ref.reshape(3 * B, H), rtol=1e-12, atol=1e-12)
    o = torch.randn(3 * B, H, dtype=torch.float64)
    assert torch.allclose(ours.finish(o, dyn, B), theirs.finish(o.view(3, B, H), dyn_ref).reshape(3 * B, H),
                          rtol=1e-12, atol=1e-12)


def test_conv_taps_reach_the_previous_slot_but_never_the_previous_block():
    ours, _ = _conv_pair(1)
    x = torch.randn(2 * B, H, dtype=torch.float64)
    y, _ = ours.prepare(x, B)
    x2 = x.clone()
    x2[B - 1] += 1.0                                   # the last slot of block 0
    y2, _ = ours.prepare(x2, B)
    assert torch.equal(y2[B:], y[B:])                  # block 1 does not see it
    x3 = x.clone()
    x3[B] += 1.0                                       # slot 0 of block 1
    y3, _ = ours.prepare(x3, B)
    assert not torch.allclose(y3[B + 1], y[B + 1])     # slot 1 does
    assert torch.equal(y3[B + 2:], y[B + 2:])          # two taps: slot 2 does not


def test_a_new_conv_is_the_identity():
    conv = GroupedDynamicConv(H, K, GS)
    x = torch.randn(2 * B, H)
    y, dyn = conv.prepare(x, B)
    assert torch.equal(y, x) and torch.equal(conv.finish(x, dyn, B), x)


V, R, TOPK = 50, 6, 5


def _selectors(seed=0):
    torch.manual_seed(seed)
    cfg = SimpleNamespace(vocab_size=V, hidden_size=H, dflash_config={"selector_rank": R, "selector_top_k": TOPK})
    theirs = ref.CandidateSelector(cfg).double()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = CandidateSelector(V, H, R, TOPK).double()
    ours.load_state_dict({k.removesuffix(".weight") if "codebook" in k else k: v for k, v in theirs.state_dict().items()})
    return ours, theirs


def test_greedy_path_equals_the_reference_selector():
    ours, theirs = _selectors()
    n, L = 3, B - 1
    hidden = torch.randn(n, L, H, dtype=torch.float64)
    logits = torch.randn(n, L, V, dtype=torch.float64) * 2
    anchor = torch.randint(0, V, (n,))
    path, cand, q = ours.walk(hidden, logits, anchor)
    path_ref, cand_ref, q_ref = theirs.select(hidden, logits, anchor, 0.0)
    assert q is None and q_ref is None
    assert torch.equal(path, path_ref)
    assert torch.equal(cand.sort(-1).values, cand_ref.sort(-1).values)
    unary = logits.argmax(-1)                            # the selector changes the path (the test can fail)
    assert not torch.equal(path, unary)


def test_sampled_q_over_candidates_equals_the_reference_along_its_path():
    ours, theirs = _selectors(1)
    n, L, T = 4, B - 1, 0.7
    hidden = torch.randn(n, L, H, dtype=torch.float64)
    logits = torch.randn(n, L, V, dtype=torch.float64)
    anchor = torch.randint(0, V, (n,))
    torch.manual_seed(5)
    path_ref, cand_ref, q_ref = theirs.select(hidden, logits, anchor, T)
    prev = torch.cat([anchor[:, None], path_ref[:, :-1]], 1)
    for pos in range(L):   # ours teacher-forced on the reference's draws: the same q per candidate token
        c = cand_ref[:, pos]
        scores = logits[:, pos].gather(-1, c) + ours.pair_scores(hidden[:, pos], prev[:, pos], c).double()
        assert torch.allclose(torch.softmax(scores / T, -1), q_ref[:, pos].double(), rtol=1e-6, atol=1e-7)  # its q is fp32
    g = torch.Generator().manual_seed(0)
    path, cand, q = ours.walk(hidden, logits, anchor, T, generator=g)
    assert q.shape == (n, L, TOPK) and torch.allclose(q.sum(-1), torch.ones(n, L, dtype=q.dtype))
    assert (cand.gather(-1, q.argmax(-1, keepdim=True)) >= 0).all() and (path[..., None] == cand).any(-1).all()


def test_the_gold_token_takes_the_weakest_candidates_place_only_when_missing():
    cand = torch.tensor([[7, 3, 9, 1], [7, 3, 9, 1]])
    ids, label, hit = training_candidates(cand, torch.tensor([9, 4]))
    assert ids.tolist() == [[7, 3, 9, 1], [7, 3, 9, 4]]
    assert label.tolist() == [2, 3] and hit.tolist() == [True, False]


def test_selector_loss_equals_its_definition_in_value_and_gradient():
    ours, _ = _selectors(2)
    tq = 3 * B
    hidden = torch.randn(tq, H, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, dtype=torch.float64)
    gold = torch.randint(0, V, (tq,))
    prev = torch.randint(0, V, (tq,))
    weight = torch.rand(tq, dtype=torch.float64)
    weight[::B] = 0
    rows = torch.nonzero(weight > 0)[:, 0]
    logits = (hidden @ head.t()).detach()
    cand = logits.topk(TOPK, -1).indices
    loss, correct = selector_loss(ours, hidden, head, cand, gold, prev, weight, 2.0, rows)
    loss.backward()
    got = [hidden.grad.clone()] + [p.grad.clone() for p in ours.parameters()]
    hidden.grad = None
    ours.zero_grad()
    # the definition, row by row over the full logits
    total = 0.0
    for r in rows.tolist():
        ids = cand[r].clone()
        if gold[r] not in ids:
            ids[-1] = gold[r]
        label = (ids == gold[r]).nonzero()[0, 0]
        pair = (ours.predecessor_codebook[prev[r]] * ours.hidden_projection(hidden[r]))
        scores = (hidden[r] @ head.t())[ids] + (pair * ours.successor_codebook[ids]).sum(-1)
        total = total + weight[r] * torch.nn.functional.cross_entropy(scores[None], label[None])
    want = total / 2.0
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-10)
    for a, b in zip(got, [hidden.grad] + [p.grad for p in ours.parameters()]):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-12)
    assert any(g not in c for g, c in zip(gold[rows].tolist(), cand[rows].tolist()))   # an injection happened
    assert correct[weight == 0].sum() == 0


def test_the_selectors_gradients_are_the_same_on_every_run_with_two_threads():
    """The codebooks' gradients gather the same rows many times over (repeated previous tokens and candidates).
    Indexing's backward accumulates those rows in a thread-dependent order on the CPU, so two runs of one
    step differed in the last bits and a resumed run no longer equalled an uninterrupted one; the embedding
    lookup's backward sums each row in one order whatever the threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        V, H, T = 4000, 256, 600
        sel = CandidateSelector(V, H, 64, 16)
        for p in sel.parameters():
            torch.nn.init.normal_(p, std=0.02)
        head = torch.randn(V, H) * 0.02
        hidden = torch.randn(T, H, requires_grad=True)
        cand, gold, prev = torch.randint(0, V, (T, 16)), torch.randint(0, V, (T,)), torch.randint(0, V, (T,))

        def grads():
            sel.zero_grad()
            hidden.grad = None
            loss, _ = selector_loss(sel, hidden, head, cand, gold, prev, torch.ones(T), float(T), torch.arange(T))
            loss.backward()
            return [hidden.grad.clone()] + [p.grad.clone() for p in sel.parameters()]

        first = grads()
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.slow   # two short CPU runs on the tiny target (one of them the session's)
def test_dflash2_training_on_the_cpu_is_bit_deterministic_with_two_threads(tiny_dflash2_run, tiny_small_dir,
                                                                            tmp_path):
    """Two runs of the same DFlash2 training (world size 1, CE + D-PACE, hard labels; tests/conftest.py's
    dflash2_run_args) with OMP_NUM_THREADS=2 end with the same weights, bit for bit, every tensor. With the
    codebooks read by indexing, whose CPU backward accumulates repeated rows in a thread-dependent order, most
    weights differed in their last bits after three steps (the lookup is F.embedding now, whose backward sums
    each row in one order). CI runs with OMP_NUM_THREADS=1, which hides such an op, so each run's rank starts
    with the variable set: a process of its own, which the launcher gives this process's environment
    (torch.set_num_threads in the test's own process did not bring the old failure back). The first run is the
    session's (tiny_dflash2_run); this process supervises the second."""
    import safetensors.torch

    from tests.conftest import dflash2_run_args
    from tests.engine.test_trainer import losses
    from trainer.__main__ import main as train_main

    again = tmp_path / "again"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "2")
        assert train_main(dflash2_run_args(tiny_small_dir, again)) == 0
    weights, curves = [], []
    for out in (tiny_dflash2_run, again):
        curves.append(losses(out))
        weights.append(safetensors.torch.load_file(str(sorted(out.glob("step-*"))[-1] / "model.safetensors")))
    a, b = weights
    assert a.keys() == b.keys() and a["layers.0.attention_conv.base_kernel"].dtype == torch.float32
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert curves[0] == curves[1]


@pytest.mark.parametrize("soft", [False, True])
def test_the_chunked_loss_hands_the_selector_its_top_k_and_gold_without_changing_the_loss(soft):
    """DFlash2's selector needs each row's top-K drafter tokens and its gold token (the label, or the
    target's argmax under soft labels) from the LM-head pass that never holds all logits at once."""
    from trainer.ops.loss import dflash_loss
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(12, 8, generator=g, dtype=torch.float64)
    head = torch.randn(30, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (12,), generator=g)
    w = torch.rand(12, generator=g, dtype=torch.float64)
    w[[0, 6]] = 0
    labels[[0, 6]] = -1
    soft_rows = torch.randn(12, 8, generator=g, dtype=torch.float64) if soft else None
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    base, correct = dflash_loss(h1, head, labels, w, 2.0, soft_rows=soft_rows, chunk=5)
    loss, correct2, cands, gold = dflash_loss(h2, head, labels, w, 2.0, soft_rows=soft_rows, chunk=5, top_k=4)
    base.backward()
    loss.backward()
    assert loss.item() == pytest.approx(base.item(), rel=1e-6)
    assert torch.allclose(h1.grad, h2.grad) and torch.equal(correct, correct2)
    rows = w > 0
    assert torch.equal(cands[rows], (hidden @ head.t()).topk(4, -1).indices[rows])
    want = (soft_rows @ head.t()).argmax(-1) if soft else labels
    assert torch.equal(gold[rows], want[rows])


# ----------------------------------------------------------------------------- the drafter and its export

def _tiny_dflash2(seed=0):
    """A DFlash2 drafter for a tiny Qwen3 target (config only: the drafter ships no embedding or head),
    every weight random, the convolutions' too (a fresh one is the identity, which would hide them)."""
    from transformers import Qwen3Config

    from trainer.model.dflash2 import as_dflash2
    from trainer.model.drafter import DFlashConfig, DFlashDrafter, init_drafter_weights
    target = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=60, max_position_embeddings=256)
    cfg = as_dflash2(DFlashConfig.from_target(target, num_draft_layers=2, block_size=B, mask_token_id=59),
                     selector_rank=8, selector_top_k=5, conv_group_size=8)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.2, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "conv" in n or p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return cfg, model


def test_dflash2_export_loads_in_the_reference_class_and_its_forward_and_path_equal_ours(tmp_path):
    import json

    import safetensors.torch

    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.model.drafter import DFlashDrafter, PackedMeta
    from trainer.serving.export import export_drafter, read_checkpoint

    cfg, model = _tiny_dflash2()
    ckpt = CheckpointManager(tmp_path / "run").save(3, model.state_dict(), cfg.to_dict(), {"step": 3})
    out = export_drafter(ckpt, tmp_path / "export")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in c
    assert {k: c["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k", "block_size", "mask_token_id")} == {
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 5, "block_size": B,
        "mask_token_id": 59}
    names = set(safetensors.torch.load_file(str(out / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names   # the public checkpoint's names

    theirs, info = ref.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    rcfg, state, _ = read_checkpoint(out)                       # ours, from the same bf16 weights
    ours = DFlashDrafter(rcfg)
    ours.load_state_dict({k: v.float() for k, v in state.items()})
    theirs.eval()
    ours.eval()

    g = torch.Generator().manual_seed(4)
    n_ctx, width, h = 12, len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size
    taps = torch.randn(n_ctx, width, generator=g)
    anchors = [5, 9]
    noise = torch.randn(len(anchors) * B, h, generator=g)
    meta = PackedMeta(ctx_seq=torch.zeros(n_ctx, dtype=torch.long), ctx_pos=torch.arange(n_ctx),
                      q_seq=torch.zeros(len(anchors) * B, dtype=torch.long),
                      q_anchor=torch.tensor(anchors).repeat_interleave(B),
                      q_pos=torch.cat([torch.arange(a, a + B) for a in anchors]), block_size=B)
    head = torch.nn.Linear(h, cfg.vocab_size, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0, generator=g)
    with torch.no_grad():
        hidden = ours(taps, noise, meta, backend="sdpa")
        for j, a in enumerate(anchors):   # the reference, one block at a time with the context before it
            want = theirs(position_ids=torch.arange(a + B)[None], noise_embedding=noise[j * B:(j + 1) * B][None],
                          target_hidden=taps[:a][None], is_causal=False)
            got = hidden[j * B:(j + 1) * B]
            assert torch.allclose(got, want[0], atol=2e-5), (got - want[0]).abs().max()
            anchor_tok = torch.tensor([7 + j])
            path_ref, _, _ = theirs.propose(want[:, 1:], anchor_tok, head, 0.0)
            path, _, _ = ours.candidate_selector.walk(got[None, 1:], head(got[None, 1:]), anchor_tok)
            assert torch.equal(path, path_ref)


@pytest.mark.slow   # about 6 CPU-s and the tiny target
def test_dflash2_trains_on_the_cpu_and_exports_what_the_reference_loads(tiny_dflash2_run, tiny_small_dir, tmp_path,
                                                                        capsys):
    """--arch dflash2 --loss ce+dpace at world size 1 (FSDP2 on gloo; the session's run, tests/conftest.py's
    dflash2_run_args): the steps are finite, the selector and the convolutions learn (they start as the identity
    and at the init draw), tau is evaluated during the run and at its end in dflash-eval's batched loop, the
    in-training eval's (--eval-data-dir; evaltrain.py eval_loop), and the checkpoint exports into the
    reference class with no missing or unexpected keys."""

    import safetensors.torch

    from tests.engine.test_trainer import losses, records
    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.serving.export import export_drafter

    out = tiny_dflash2_run
    seen = losses(out)
    assert sorted(seen) == [1, 2, 3] and all(math.isfinite(v) for v in seen.values())
    evals = records(out, "eval")
    assert [r["step"] for r in evals] == [2, 3] and all(1 <= r["tau"] <= 8 for r in evals), evals
    assert json.loads((out / "eval.json").read_text())["loop"] == "batched"
    step = CheckpointManager(out).latest()
    dst = export_drafter(step, tmp_path / "export")
    w = safetensors.torch.load_file(str(dst / "model.safetensors"))
    base = w["layers.0.attention_conv.base_kernel"].float()
    assert not torch.equal(base[:, 1:], torch.zeros_like(base[:, 1:]))           # moved off the identity
    assert w["layers.0.mlp_conv.kernel_projection.weight"].abs().sum() > 0
    from trainer.model.drafter import DFlashDrafter, init_drafter_weights
    from trainer.serving.export import read_checkpoint
    fresh = DFlashDrafter(read_checkpoint(dst)[0])
    init_drafter_weights(fresh, seed=0)                       # the run's init (--seed 0)
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight"):   # used outside forward, still trained
        assert not torch.allclose(w[name].float(), fresh.state_dict()[name].bfloat16().float(), rtol=0.01), name
    _, info = ref.DFlash2DraftModel.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # dflash-eval on the export: the selector's sampled loop (single), and greedy in the batched loop with the
    # speed table and its lossless check
    from trainer.serving.evaluate import main as eval_main
    args = ["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(dst), "--data-dir",
            str(tiny_small_dir / "heldout"), "--device", "cpu", "--max-prompts", "2", "--max-new-tokens", "12"]
    capsys.readouterr()
    assert eval_main(args + ["--temperature", "0.7", "--json", "--no-block-accuracy"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["loop"] == "single" and res["temperature"] == 0.7 and 1 <= res["tau"] <= 8
    assert eval_main(args + ["--loop", "batched", "--json", "--no-block-accuracy", "--speed-batch", "2"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["loop"] == "batched" and res["speed"]["lossless"]["ok"]
    assert [r["drafter"] for r in res["speed"]["rows"]] == ["target", "dflash2", "ngram"]


def test_the_plan_gives_each_block_row_its_real_predecessor_and_eval_of_dflash2_is_accepted():
    import numpy as np

    from trainer.config.options import parse_args, validate_flags
    from trainer.ops.plan import plan_micro_batch
    ids = np.arange(100, 130)[None]
    mask = np.zeros(ids.shape, bool)
    mask[0, 4:] = True
    plan = plan_micro_batch(ids, mask, np.array([30]), [0], 0, seed=0, block_size=B, max_anchors=5, mask_token_id=1,
                            gamma=4.0, soft_labels=False, chunk_rows=10**6, flex=False, selector=True)
    (c,) = plan.chunks
    pos = c.q_pos
    want = 100 + np.maximum(pos - 1, c.q_anchor)   # the token before each row; slot 0: the anchor's own
    want[pos - 1 >= 30] = 0                          # past the sequence's end
    assert (pos - 1 >= 30).any()
    assert (c.prev_tokens == want).all()
    paths = ["--target-model", "t", "--data-dir", "d", "--output-dir", "o"]
    validate_flags(parse_args(paths + ["--arch", "dflash2", "--eval-data-dir", "h"]), gpu_count=-1)   # dflash2_eval


# ----------------------------------------------------------------------------- dflash-eval's selector loop

def _proposer_recording(model):
    """dflash2_eval.DFlash2Proposer that counts the positions where the selector left the unary argmax."""
    from trainer.serving.dflash2_eval import DFlash2Proposer

    class Recording(DFlash2Proposer):
        moved = 0

        def propose(self, *a, **k):
            path, cand, q = super().propose(*a, **k)
            Recording.moved += int((path != cand[:, 0]).sum())   # top-K is sorted: column 0 is the argmax
            return path, cand, q
    return Recording(model)


@pytest.mark.slow   # about 10 CPU-s: a DFlash drafter trained 3 epochs, made DFlash2
def test_dflash2_eval_greedy_accept_lengths_equal_the_reference_loops(tiny_small_dir, tmp_path, monkeypatch):
    """dflash-eval's DFlash2 loop (trainer/serving/dflash2_eval.py) against the reference package's dflash_generate
    on the export of the same weights: the same tokens and, step by step, the same accept lengths (the
    last step aside: near the token budget the reference shortens its block, which changes the drafts).
    The drafter: a DFlash drafter trained briefly, its convolutions moved off the identity and its
    selector's codebooks drawn so that the selector's path leaves the unary argmax."""

    import time

    from tests.serving.test_evaluate import train_drafter
    from trainer.data.dataset import load_dataset
    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.model.dflash2 import as_dflash2
    from trainer.model.drafter import DFlashDrafter
    from trainer.serving.dflash2_eval import dflash2_generate
    from trainer.serving.evaluate import heldout_prompts, load_target
    from trainer.serving.export import export_drafter, read_checkpoint
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)   # its stats' clock synchronises CUDA
    torch.set_num_threads(1)
    target = load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)
    cfg, dense = train_drafter(target, tiny_small_dir / "data", epochs=3)
    cfg2 = as_dflash2(cfg, selector_rank=16)
    model = DFlashDrafter(cfg2)
    missing, unexpected = model.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "selector" in k for k in missing)
    perturb_dflash2(model, cfg.hidden_size)
    ckpt = CheckpointManager(tmp_path / "run").save(1, model.state_dict(), cfg2.to_dict(), {"step": 1})
    out = export_drafter(ckpt, tmp_path / "export")
    theirs = ref.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    rcfg, state, _ = read_checkpoint(out)                 # ours, from the same (bf16) weights
    ours = DFlashDrafter(rcfg)
    ours.load_state_dict({k: v.float() for k, v in state.items()})
    proposer = _proposer_recording(ours)
    lengths = []
    for prompt in heldout_prompts(load_dataset(tiny_small_dir / "heldout"), 4):
        ids = torch.as_tensor(prompt)[None]
        want = ref.dflash_generate(theirs, target, ids, 40, None, 0.0, return_stats=True)
        got = dflash2_generate(proposer, target, ids, 40, [], 0.0)
        assert torch.equal(got.output_ids, want.output_ids)
        assert got.accept_lengths[:-1] == want.acceptance_lengths[:-1]
        lengths += got.accept_lengths
    assert max(lengths) > 1 and proposer.moved > 0, (lengths, proposer.moved)   # not trivially ones or argmax


def test_dflash2_sampled_verification_keeps_the_targets_distribution():
    """One draft drawn from the selector's q over its candidates: the first emitted token is distributed as
    the target's p, whatever q is (a candidate set that misses p's mass included); q == p accepts all."""
    from trainer.serving.dflash2_eval import verify_candidates
    g = torch.Generator().manual_seed(0)
    p_logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    cand = torch.tensor([[2, 0, 3]])               # K = 3 of V = 4: token 1 is no candidate
    q = torch.tensor([[0.6, 0.1, 0.3]])
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        i = torch.multinomial(q[0], 1, generator=g)
        path = cand[0, i]
        acc, nxt = verify_candidates(path, cand, q, p_logits, 1.0, g)
        counts[int(path) if acc == 1 else nxt] += 1
    assert (counts / n - torch.tensor([0.5, 0.3, 0.1, 0.1])).abs().max() < 0.015, counts / n
    cand_all, q_p = torch.tensor([[1, 0, 2, 3]]), torch.tensor([[0.3, 0.5, 0.1, 0.1]])
    accs = [verify_candidates(cand_all[0, torch.multinomial(q_p[0], 1, generator=g)], cand_all, q_p, p_logits, 1.0,
                              g)[0] for _ in range(200)]
    assert accs == [1] * 200
