"""Speculative generation and regeneration on a hybrid target (issue 39 item 3).

The seeds' target, Qwen3.6-27B, is a Qwen3.5 hybrid: Gated DeltaNet linear-attention layers with a
conv and a recurrent state beside gated full attention. Specifications, on the tiny Qwen3.5 target of
`dflash-tiny --arch qwen3_5` (and the dense tiny Qwen3 beside it where the claim is about both):
- after a verify step the linear layers' states are those after the accepted tokens: both loops of
  dflash-eval, fed proposals that are accepted in part (1..B tokens a step), emit the target's plain greedy
  decode and the same accept lengths (a loop that kept the whole block's state would drift at once);
- dflash-eval on a hybrid checkpoint runs both loops with one tau; the in-training eval's entry point too;
- dflash-regenerate's captured decoder (its CPU path: the same loop without graphs) writes the bytes of
  transformers' generate on a hybrid, left padding and a short last batch included;
- a path that cannot run a hybrid says so in one line and falls back (no traceback);
- the captured decoder's compiled small ops leave a hybrid's gated norm alone and compute its
  zero-centred RMSNorm.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from trainer.data.dataset import load_dataset
from trainer.model.drafter import DFlashConfig, DFlashDrafter, init_drafter_weights
from trainer.serving.evaluate import heldout_prompts, hf_drafter, load_target

BLOCK = 4
NEW = 24


def _target(d):
    torch.set_num_threads(1)
    return load_target(str(d / "target"), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_dir):
    return _target(tiny_hybrid_dir)


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def case(request):
    """(tiny dir, target, four prompts of different lengths) for the hybrid and the dense tiny target."""
    d = request.getfixturevalue("tiny_hybrid_dir" if request.param == "hybrid" else "tiny_small_dir")
    target = request.getfixturevalue("hybrid") if request.param == "hybrid" else _target(d)
    prompts = heldout_prompts(load_dataset(d / "heldout"), 4)
    return d, target, [p[:n] for p, n in zip(prompts, (41, 13, 66, 5))]


def untrained(target):
    cfg = DFlashConfig.from_target(target.config, num_draft_layers=2, block_size=BLOCK, mask_token_id=3)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=0)
    return cfg, model


def greedy(target, prompt, n):
    ids = torch.as_tensor(prompt)[None]
    out = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].tolist()   # prompt + n tokens


class Proposals:
    """The target's greedy continuation with one slot made wrong at a place that depends on the block's
    start: a step accepts 0..B-1 drafts (B at most 1 in B steps), so the states are rolled back by
    different amounts from step to step."""

    def __init__(self, target, prompts):
        self.full = [torch.as_tensor(greedy(target, p, NEW + 2 * BLOCK)) for p in prompts]
        self.lens = [len(p) for p in prompts]
        self.vocab = target.get_output_embeddings().weight.shape[0]

    def drafts(self, row: int, start: int) -> torch.Tensor:
        d = self.full[row][start + 1:start + BLOCK].clone()
        wrong = ((start * 2654435761) >> 5) % BLOCK
        if wrong:
            d[wrong - 1] = (d[wrong - 1] + 1) % self.vocab
        return d

    def single(self, real, row):
        """A stand-in for the single loop's drafter (its draft_logits) proposing `drafts`."""
        outer = self

        class Drafter:
            block_size, target_layer_ids, extract_taps = real.block_size, real.target_layer_ids, real.extract_taps

            def draft_logits(self, target, new_taps, first_token, start, cache):
                return torch.nn.functional.one_hot(outer.drafts(row, start), outer.vocab).float() * 10
        return Drafter()

    def batched(self, dec):
        """The batched loop's drafter (its proposer's `_draft`) replaced: each row's block starts at its
        position_ids[:, -B]."""
        def draft(_dec, first, new_taps, position_ids, mask):
            starts = position_ids[:, -BLOCK].tolist()
            rows = [self.lens.index(starts[0])] if first.shape[0] == 1 else range(first.shape[0])  # prefill: one row
            return torch.stack([self.drafts(r, s) for r, s in zip(rows, starts)])
        dec.proposer._draft = draft


def test_both_loops_roll_the_states_back_to_the_accepted_tokens_and_emit_the_greedy_decode(case):
    """Fails before the fix on the hybrid: the single loop's DynamicCache() had no layer for the recurrent
    state (IndexError), the batched loop's cache no get_recurrent_state (AttributeError)."""
    from trainer.model.modeling_dflash import dflash_generate
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder

    _, target, prompts = case
    cfg, model = untrained(target)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    prop = Proposals(target, prompts)
    single = [dflash_generate(prop.single(hf, i), target, torch.as_tensor(p)[None], NEW, [])
              for i, p in enumerate(prompts)]
    for i, (p, res) in enumerate(zip(prompts, single)):
        assert res.output_ids[0].tolist() == prop.full[i][:len(p) + NEW].tolist()
        assert len(set(res.accept_lengths)) >= 3          # partial acceptances: rollbacks of several lengths
    dec = BatchedSpecDecoder(target, hf, "cpu", len(prompts), NEW, [], graphs=False)
    prop.batched(dec)
    for i, (lengths, toks) in enumerate(dec.generate(prompts)):
        assert toks.tolist() == prop.full[i][len(prompts[i]):len(prompts[i]) + NEW].tolist()
        assert lengths == single[i].accept_lengths


def test_single_loop_frees_the_recorded_states_after_each_rollback(hybrid, tiny_hybrid_dir):
    """transformers records a hybrid's past for crop(); the loop crops after the prefill and every verify,
    so the recorded history and the conv inputs never outgrow one block."""
    from trainer.model.modeling_dflash import crop_cache, target_cache

    cache = target_cache(hybrid, BLOCK)
    linear = [layer for layer in cache.layers if getattr(layer, "record_past", False)]
    assert linear and len(linear) == sum(t == "linear_attention" for t in hybrid.config.layer_types)
    ids = torch.as_tensor(heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 1)[0])[None]
    hybrid(input_ids=ids, cache=cache, use_cache=True)
    crop_cache(cache, ids.shape[1])
    hybrid(input_ids=ids[:, :BLOCK], position_ids=torch.arange(BLOCK)[None] + ids.shape[1], cache=cache,
           use_cache=True)
    crop_cache(cache, ids.shape[1] + 2)
    assert int(cache.get_seq_length()) == ids.shape[1] + 2
    for layer in linear:
        assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0]
        assert layer.recurrent_states_history[0] == []


def test_dflash_eval_runs_both_loops_on_a_hybrid_checkpoint_with_one_tau(hybrid, tiny_hybrid_dir, tmp_path,
                                                                         capsys):
    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.serving.evaluate import evaluate_state
    from trainer.serving.evaluate import main as eval_main

    cfg, model = untrained(hybrid)
    CheckpointManager(tmp_path / "run").save(1, model.state_dict(), cfg.to_dict(), {})
    res = {}
    for loop in ("batched", "single"):   # before the fix: AttributeError ('_RowKV' ...), then IndexError
        assert eval_main(["--target-model", str(tiny_hybrid_dir / "target"), "--checkpoint", str(tmp_path / "run"),
                          "--data-dir", str(tiny_hybrid_dir / "heldout"), "--device", "cpu", "--max-prompts", "3",
                          "--max-new-tokens", "12", "--no-block-accuracy", "--loop", loop, "--batch-size", "2",
                          "--json", "--speed-batch", ""]) == 0
        res[loop] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["single"]["loop"] == "single" and res["batched"]["loop"] == "batched"
    assert res["single"]["accept_length_histogram"] == res["batched"]["accept_length_histogram"]
    # the in-training eval's entry point (trainer/engine/evaltrain.py), here in the single loop, on the current weights
    ds = load_dataset(tiny_hybrid_dir / "heldout")
    inner = evaluate_state(cfg, model.state_dict(), hybrid, ds, torch.device("cpu"), torch.float32, 3, 12,
                           with_block_accuracy=True)
    assert inner["accept_length_histogram"] == res["single"]["accept_length_histogram"]
    assert 0 <= inner["block_accuracy"] <= 1


def test_the_captured_decoder_on_a_hybrid_writes_the_bytes_of_generate(tiny_hybrid_dir, tmp_path):
    """Fails before the fix: `'_KVCache' object has no attribute 'get_recurrent_state'`. Left padding of
    prompts of many lengths (a hybrid's linear layers must not fold the padding into their states) and a
    short last batch; the same loop is captured as CUDA graphs on GPUs."""
    from trainer.serving.regenerate import regenerate

    common = dict(max_new_tokens=16, shard_size=16, max_records=20, log=lambda msg: None)
    regenerate(tiny_hybrid_dir / "data", tiny_hybrid_dir / "target", tmp_path / "gen", batch_size=8,
               decoder="generate", **common)
    regenerate(tiny_hybrid_dir / "data", tiny_hybrid_dir / "target", tmp_path / "cap", batch_size=6,
               decoder="captured", **common)
    a = {p.name: p.read_bytes() for p in (tmp_path / "gen").glob("shard-*")}
    b = {p.name: p.read_bytes() for p in (tmp_path / "cap").glob("shard-*")}
    assert len(a) == 2 and a == b


def test_the_captured_decoder_holds_only_the_attention_layers_kv_and_each_linear_layers_state(hybrid):
    from trainer.serving.captured.regenerate_decoder import GraphDecoder

    dec = GraphDecoder(hybrid, "cpu", 2, 4, 0.0, [], 0)
    dec.generate([np.arange(5, 20), np.arange(7, 10)], range(2))
    types = hybrid.config.layer_types
    assert [k is None for k in dec.cache.k] == [t == "linear_attention" for t in types]
    lin = dec.cache.linear
    la = hybrid.model.layers[lin.ids[0]].linear_attn
    assert lin.conv[lin.ids[0]].shape == (2, la.conv_dim, la.conv_kernel_size)
    assert lin.rec[lin.ids[0]].shape == (2, la.num_v_heads, la.head_k_dim, la.head_v_dim)


def test_a_hybrid_the_fast_loops_cannot_run_falls_back_with_one_line(hybrid, tiny_hybrid_dir, monkeypatch, caplog,
                                                                     capsys):
    """A hybrid whose layer module has no chunked kernel to roll back with (another family): dflash-eval's
    batched loop says so in one line and runs the single loop; a hybrid the captured decoder cannot hold:
    dflash-regenerate says so in one line and runs generate."""
    import logging

    from trainer.serving.captured import linear_states
    from trainer.serving.evaluate import speculative_eval, speed_section
    from trainer.serving.regenerate import TargetGenerator

    monkeypatch.setattr(linear_states, "CHUNK_FN", "chunk_some_other_rule")
    cfg, model = untrained(hybrid)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    prompts = heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 2)
    with caplog.at_level(logging.WARNING, logger="trainer.evaluate"):
        res = speculative_eval(hybrid, hf, prompts, 6, loop="batched")
    assert res["loop"] == "single" and res["verify_steps"] > 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "batched loop cannot run this target" in lines[0] and "chunk_some_other_rule" in lines[0]
    caplog.clear()   # dflash-eval's speed table needs the captured loops: none, in one line
    with caplog.at_level(logging.WARNING, logger="trainer.evaluate"):
        assert speed_section(hybrid, hf, cfg, load_dataset(tiny_hybrid_dir / "heldout"), 2, 6, [1]) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no speed table" in lines[0] and "chunk_some_other_rule" in lines[0]
    assert TargetGenerator(hybrid, "cpu", 4, 0.0, 2, decoder="captured").decoder == "captured"   # needs no rollback
    monkeypatch.setattr(linear_states, "hybrid_unsupported", lambda base, speculative=False: "layer types mamba are not supported")
    gen = TargetGenerator(hybrid, "cpu", 4, 0.0, 2, decoder="captured")
    err = capsys.readouterr().err.strip().splitlines()
    assert gen.decoder == "generate" and len(err) == 1
    assert "captured decoder cannot run this target (layer types mamba" in err[0] and "using --decoder generate" in err[0]
    assert len(gen.complete(prompts, seed=0)[0]) == 4


def test_compiled_small_ops_recognise_a_hybrids_norms(hybrid):
    """fuse: the zero-centred RMSNorm is computed as (1 + w) * x-hat; the gated norm of the linear layers
    (two inputs: it was once patched with a one-input forward, TypeError) as the normalised x times the
    weight times silu(gate); a two-input norm of another formula is left alone."""
    import copy

    from trainer.serving.captured.fused_ops import NORMS, norm_kind

    layer = hybrid.model.layers[0]
    norm = copy.deepcopy(layer.input_layernorm)
    gated = copy.deepcopy(layer.linear_attn.norm)
    with torch.no_grad():
        norm.weight.normal_()
        gated.weight.normal_()
    assert norm_kind(norm) == ("rms1p", "eps")
    assert norm_kind(gated) == ("rms_gated", "variance_epsilon")
    x, g = torch.randn(5, gated.weight.shape[0]), torch.randn(5, gated.weight.shape[0])
    torch.testing.assert_close(NORMS["rms_gated"][0](x, g, gated.weight, gated.variance_epsilon), gated(x, g))

    class SigmoidGated(torch.nn.Module):      # same inputs and attributes, another gate
        def __init__(self, w):
            super().__init__()
            self.weight, self.variance_epsilon = w, 1e-6

        def forward(self, hidden_states, gate):
            return gated(hidden_states, gate) * torch.sigmoid(gate) / torch.nn.functional.silu(gate)

    assert norm_kind(SigmoidGated(gated.weight)) is None
    assert norm_kind(layer.mlp) is None


@pytest.mark.slow
def test_the_compiled_conv_step_is_transformers_conv_update(hybrid):
    """fuse: a hybrid's one-position conv update (transformers' torch fallback of causal_conv1d_update on the
    CPU and wherever causal-conv1d is missing) runs compiled: the same new window in place and the same
    output (fp32: to rounding; bf16: equal), for the conv the model's layers have; other calls (several
    positions) reach the original; outside `fused_small_ops` the original is back."""
    import sys

    from trainer.serving.captured.fused_ops import fused_small_ops

    la = hybrid.model.layers[0].linear_attn
    mod = sys.modules[type(la).__module__]
    orig = mod.causal_conv1d_update
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        c, k = la.conv_dim, la.conv_kernel_size
        x = torch.randn(3, c, 1, generator=gen).to(dtype)
        state = torch.randn(3, c, k, generator=gen).to(dtype)
        w = la.conv1d.weight.detach().squeeze(1).to(dtype)
        want_state, got_state = state.clone(), state.clone()
        want = orig(x, want_state, w, None, activation="silu")
        with fused_small_ops(hybrid):
            assert mod.causal_conv1d_update is not orig
            got = mod.causal_conv1d_update(x, got_state, w, None, activation="silu")
            several = torch.randn(3, c, 2, generator=gen).to(dtype)
            s1, s2 = state.clone(), state.clone()
            torch.testing.assert_close(mod.causal_conv1d_update(several, s1, w, None, activation="silu"),
                                       orig(several, s2, w, None, activation="silu"), rtol=0, atol=0)
        assert mod.causal_conv1d_update is orig
        assert torch.equal(got_state, want_state) and got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_captured_decoder_with_compiled_small_ops_on_a_hybrid_gives_generates_tokens(hybrid, tiny_hybrid_dir):
    """fuse=True (the GPU default) on a hybrid; before the fix: TypeError from the gated norm (16 s of
    inductor compiles on the CPU)."""
    from trainer.serving.captured.regenerate_decoder import GraphDecoder
    from trainer.serving.regenerate import TargetGenerator

    prompts = heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 4)
    gen = TargetGenerator(hybrid, "cpu", 8, 0.0, 4)
    ref = gen._batch(prompts)
    got = GraphDecoder(hybrid, "cpu", 4, 8, 0.0, gen.stop_ids, gen.pad_id, fuse=True).generate(prompts, range(4))
    assert [list(a) for a in ref] == [list(b) for b in got]


def test_the_decode_step_can_write_each_recurrent_state_in_place(hybrid, tiny_hybrid_dir, monkeypatch):
    """state_inplace: the recurrent kernel writes the new state over the cache's buffer (no new tensor, no
    copy). FLA's kernel runs on GPUs only; here a stand-in module with FLA's launch convention
    (`kernel[grid](..., h0=, ht=)`, h0 read before ht is written) computes transformers' torch recurrence,
    and the tokens must stay those of generate, with every decode launch aliased."""
    import sys
    import types

    from trainer.serving.captured import linear_states, regenerate_decoder
    from trainer.serving.regenerate import TargetGenerator

    mod = sys.modules[type(hybrid.model.layers[0].linear_attn).__module__]
    torch_recurrent = mod.__dict__[linear_states.RECURRENT_FN]
    fake = types.ModuleType(linear_states.FLA_RECURRENT)
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            def run(h0, ht, args, out):
                q, k, v, g, beta, kw = args
                o, new = torch_recurrent(q, k, v, g=g, beta=beta, initial_state=h0.clone(), **kw)
                launches.append(ht is h0)
                ht.copy_(new)
                out["o"] = o
            return run

    fake.fused_recurrent_gated_delta_rule_fwd_kernel = Kernel()

    def recurrent(query, key, value, g, beta, initial_state=None, **kw):   # FLA's path: a new final state
        ht = torch.empty_like(initial_state)
        out = {}
        fake.fused_recurrent_gated_delta_rule_fwd_kernel[(1,)](h0=initial_state, ht=ht,
                                                               args=(query, key, value, g, beta, kw), out=out)
        return out["o"], ht

    monkeypatch.setitem(sys.modules, linear_states.FLA_RECURRENT, fake)
    monkeypatch.setattr(mod, linear_states.RECURRENT_FN, recurrent)
    prompts = heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 3)
    gen = TargetGenerator(hybrid, "cpu", 8, 0.0, 3)
    ref = gen._batch(prompts)            # generate through the stand-in: a new state each step
    assert launches and not any(launches)
    launches.clear()
    dec = regenerate_decoder.GraphDecoder(hybrid, "cpu", 3, 8, 0.0, gen.stop_ids, gen.pad_id, state_inplace=True)
    got = dec.generate(prompts, range(3))
    assert [list(a) for a in ref] == [list(b) for b in got]
    assert len(launches) == 7 * len(dec.linear_ids) and all(launches)   # every decode step's, aliased
    assert mod.__dict__[linear_states.RECURRENT_FN] is recurrent              # put back after each step
    assert isinstance(fake.fused_recurrent_gated_delta_rule_fwd_kernel, Kernel)
    # bf16 states (state_dtype): the kernel stores its fp32 result into the bf16 buffer it read
    launches.clear()
    dec16 = regenerate_decoder.GraphDecoder(hybrid, "cpu", 3, 8, 0.0, gen.stop_ids, gen.pad_id, state_inplace=True,
                                            state_dtype=torch.bfloat16)
    assert [len(c) for c in dec16.generate(prompts, range(3))] == [len(c) for c in ref]
    assert all(t.dtype == torch.bfloat16 for t in dec16.cache.linear.rec.values())
    assert len(launches) == 7 * len(dec.linear_ids) and all(launches)


def test_the_batched_loop_drafts_what_the_single_loop_drafts_with_sliding_draft_layers(hybrid, tiny_hybrid_dir):
    """A Qwen3.5 target's drafter gets sliding-window layers by default (--draft-layer-types auto): the batched
    loop's drafter cache (a buffer written at each position, the block rows after its view) must show each
    sliding layer the same keys as the single loop's DynamicCache. Every draft of every step is compared
    (an untrained drafter: its drafts depend on the whole context the window shows)."""
    from trainer.model.modeling_dflash import dflash_generate
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder

    cfg = DFlashConfig.from_target(hybrid.config, num_draft_layers=2, block_size=BLOCK, mask_token_id=3,
                                   layer_types="auto", sliding_window=8)
    assert "sliding_attention" in cfg.layer_types
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=0)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    prompts = heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 3)
    single = []
    real = hf.draft_logits

    def recorded(*args, **kwargs):
        logits = real(*args, **kwargs)
        single[-1].append(logits.argmax(-1).tolist())
        return logits
    hf.draft_logits = recorded
    for p in prompts:
        single.append([])
        dflash_generate(hf, hybrid, torch.as_tensor(p)[None], 16, [])
    del hf.draft_logits
    dec = BatchedSpecDecoder(hybrid, hf, "cpu", len(prompts), 16, [], graphs=False)
    batched, draft, prefill_rows = [[] for _ in prompts], dec.proposer._draft, list(range(len(prompts)))

    def recorded_rows(d, first, *args):
        out = draft(d, first, *args)
        rows = [prefill_rows.pop(0)] if first.shape[0] == 1 else range(len(prompts))   # prefill: row by row
        for r, d in zip(rows, out.tolist()):
            if r < len(prompts) and not (first.shape[0] > 1 and dec.done[r]):
                batched[r].append(d)
        return out
    dec.proposer._draft = recorded_rows
    dec.generate(prompts)
    for s, b in zip(single, batched):
        assert b[:len(s)] == s


class _FlaTiles:
    """A stand-in of FLA 0.6's fused recurrent kernel at one position (T = 1), with its launch convention and
    its programs' index math (`NV = cdiv(V, BV)`, `i_v, i_nh = pid % NV, pid // NV`, a K x BV tile each): it
    runs each program of the grid on its tile in torch, and fails on a program outside the state or a tile
    written twice. `launches` records (programs, BV, num_warps)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(q, k, v, g, beta, o, h0, ht, V, BV, HV, num_warps=1, **_):
            n_v = -(-V // BV)
            rows = h0.shape[0] * HV
            done = torch.zeros(rows, n_v, dtype=torch.int32)
            for pid in range(grid[0]):
                i_v, i_nh = pid % n_v, pid // n_v
                assert i_nh < rows, f"program {pid} is outside the state ({rows} heads)"
                n, hv = divmod(i_nh, HV)
                cols = slice(i_v * BV, min(V, i_v * BV + BV))
                h = h0[n, hv, :, cols].float() * torch.exp(g[n, 0, hv].float())
                kk = k[n, 0, hv // (HV // k.shape[2])].float()
                qq = q[n, 0, hv // (HV // q.shape[2])].float()
                vv = beta[n, 0, hv].float() * (v[n, 0, hv, cols].float() - (h * kk[:, None]).sum(0))
                h = h + kk[:, None] * vv[None, :]
                o[n, 0, hv, cols] = (h * qq[:, None]).sum(0).to(o.dtype)
                ht[n, hv, :, cols] = h.to(ht.dtype)
                done[i_nh, i_v] += 1
            assert bool((done == 1).all()), "a state tile written twice or not at all"
            self.launches.append((grid[0], BV, num_warps))
        return run


def _fla_launch(kernel, q, k, v, g, beta, h0, BV=8):
    """FLA 0.6's wrapper: BV = 8, one warp, grid (NV * N * HV,), ht a new tensor."""
    N, _, HV, V = v.shape
    o, ht = torch.empty_like(v), torch.empty_like(h0)
    kernel[(-(-V // BV) * N * HV,)](q=q, k=k, v=v, g=g, beta=beta, o=o, h0=h0, ht=ht, V=V, BV=BV, HV=HV,
                                    num_warps=1)
    return o, ht


@pytest.mark.parametrize("V, tile", [(128, (32, 4)), (128, (64, 4)), (96, (32, 2))])
def test_the_recurrent_kernel_can_run_with_a_wider_state_tile(V, tile):
    """GraphDecoder(recurrent_tile=): FLA's recurrent kernel launched with (BV, num_warps) = tile in place of
    FLA's (8, 1), its grid rescaled so that every K x BV tile of every head's state is one program's: the
    output and the new state (written over h0) equal FLA's own launch."""
    from trainer.serving.captured.linear_states import _AliasFinalState

    torch.manual_seed(0)
    N, H, HV, K = 3, 2, 4, 16
    q, k = torch.randn(N, 1, H, K), torch.randn(N, 1, H, K)
    v, g, beta = torch.randn(N, 1, HV, V), -torch.rand(N, 1, HV), torch.rand(N, 1, HV)
    h0 = torch.randn(N, HV, K, V)

    ref_kernel = _FlaTiles()
    o_ref, ht_ref = _fla_launch(ref_kernel, q, k, v, g, beta, h0.clone())
    assert ref_kernel.launches == [(-(-V // 8) * N * HV, 8, 1)]

    kernel = _FlaTiles()
    state = h0.clone()
    alias = _AliasFinalState(kernel, tile)
    o, _ = _fla_launch(alias, q, k, v, g, beta, state)
    assert kernel.launches == [(-(-V // tile[0]) * N * HV, *tile)]
    assert alias.hits == [state.data_ptr()]            # written over h0, the cache's buffer
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(state, ht_ref)

    # no tile: FLA's own launch, aliased as before
    kernel = _FlaTiles()
    state = h0.clone()
    _fla_launch(_AliasFinalState(kernel), q, k, v, g, beta, state)
    assert kernel.launches == [(-(-V // 8) * N * HV, 8, 1)]
    torch.testing.assert_close(state, ht_ref)


def test_a_launch_not_of_flas_form_is_not_retiled():
    """A grid that is not FLA 0.6's one-dimensional (NV * N * HV,) (another FLA): launched as it came."""
    from trainer.serving.captured.linear_states import _AliasFinalState

    alias = _AliasFinalState(None, (32, 4))
    kw = {"V": 128, "BV": 8, "num_warps": 1}
    assert alias._retile((16, 2), kw) == ((16, 2), kw)           # two-dimensional
    assert alias._retile((17,), kw) == ((17,), kw)               # not a multiple of NV = 16
    assert alias._retile((32,), {"V": 128}) == ((32,), {"V": 128})   # no BV: not FLA 0.6's kernel
    assert alias._retile((32,), kw) == ((8,), {"V": 128, "BV": 32, "num_warps": 4})


def _spy_on_the_in_place_step(monkeypatch) -> list:
    """Replace the decoder's in-place context with a spy; the list it returns gets each step's tile."""
    from trainer.serving.captured import regenerate_decoder

    seen = []

    def spy(base, states, fla_module=None, tile=None):
        seen.append(tile)
        return contextlib.nullcontext()

    monkeypatch.setattr(regenerate_decoder, "inplace_recurrent_state", spy)
    return seen


def test_the_decoder_hands_its_recurrent_tile_to_the_in_place_step(hybrid, tiny_hybrid_dir, monkeypatch):
    """recurrent_tile reaches the kernel's alias on each in-place decode step (and only with state_inplace)."""
    from trainer.serving.captured import regenerate_decoder
    from trainer.serving.regenerate import TargetGenerator

    seen = _spy_on_the_in_place_step(monkeypatch)
    prompts = heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 2)
    gen = TargetGenerator(hybrid, "cpu", 4, 0.0, 2)
    ref = gen._batch(prompts)
    dec = regenerate_decoder.GraphDecoder(hybrid, "cpu", 2, 4, 0.0, gen.stop_ids, gen.pad_id, state_inplace=True,
                                          recurrent_tile=(32, 4))
    assert [list(a) for a in dec.generate(prompts, range(2))] == [list(b) for b in ref]
    assert seen and set(seen) == {(32, 4)}
    seen.clear()
    regenerate_decoder.GraphDecoder(hybrid, "cpu", 2, 4, 0.0, gen.stop_ids, gen.pad_id,
                                    recurrent_tile=(32, 4)).generate(prompts, range(2))
    assert seen == []


def test_dflash_regenerate_writes_a_hybrids_recurrent_states_in_place(hybrid, tiny_hybrid_dir, monkeypatch):
    """dflash-regenerate's captured decoder runs each decode step with the recurrent states written in place
    (measured faster on the GPU, the same tokens as the copy), with FLA's own state tile."""
    from trainer.serving.regenerate import TargetGenerator

    seen = _spy_on_the_in_place_step(monkeypatch)
    prompts = heldout_prompts(load_dataset(tiny_hybrid_dir / "heldout"), 2)
    gen = TargetGenerator(hybrid, "cpu", 4, 0.0, 2)
    dec = gen._fast_decoder()
    assert dec.state_inplace and dec.state_dtype == torch.float32
    assert [list(a) for a in dec.generate(prompts, range(2))] == [list(b) for b in gen._batch(prompts)]
    assert seen and set(seen) == {None}


def test_a_timed_prefill_records_each_row_chunks_shape_and_seconds(hybrid):
    """timed=True (the benchmark's breakdown): one [rows, width, seconds] per prefill row chunk, at the chunk's
    own trimmed width, the seconds summing to the prefill's less its tail; untimed (dflash-regenerate), no
    record and no synchronisation. The record is what separates a first call of a shape in FLA's shape-keyed
    kernels from the prefill's own rate on the GPU (docs/serving.md, "Hybrid targets")."""
    from trainer.serving.captured.kv_cache import PAD_TO
    from trainer.serving.captured.regenerate_decoder import GraphDecoder

    lens = [150, 140, 20, 10, 70]            # two chunks of 2 rows and one of 1 (prefill_tokens // 192 = 2)
    prompts = [np.arange(3, 3 + n) % 500 for n in lens]
    dec = GraphDecoder(hybrid, "cpu", 5, 2, 0.0, [], 0, prefill_tokens=2 * 192)
    dec.generate(prompts, range(5))
    assert dec.prefill_chunks == []
    dec.timed = True
    dec.generate(prompts, range(5))
    rows = [c[0] for c in dec.prefill_chunks]
    widths = [c[1] for c in dec.prefill_chunks]
    assert rows == [2, 2, 1]
    assert widths == [-(-max(lens[i:i + 2]) // PAD_TO) * PAD_TO for i in (0, 2, 4)] == [192, 64, 128]
    spent = sum(c[2] for c in dec.prefill_chunks)
    assert 0 < spent <= dec.times["prefill_s"] + 1e-3


def test_the_regeneration_bench_reports_each_headline_pass(hybrid, monkeypatch, capsys):
    """--headline-passes 2: the same mixed prompts twice in one process, a new generator each time; the row
    is the last pass's, with each pass's figures and the first pass's rate beside it. A count that is not a
    whole number of passes is refused before anything is built (exit 2)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "trainer" / "lab" / "gpu"))
    import regenerate_bench as rb

    with pytest.raises(SystemExit) as e:
        rb.main(["--shape", "qwen3.5-tiny", "--headline-passes", "0"])
    assert e.value.code == 2 and "'0' is not a whole number of passes" in capsys.readouterr().err

    a = rb.argparse.Namespace(headline_batch=3, mixed_prompts=5, min_len=8, max_len=100, new_tokens=3,
                              headline_passes=2)
    rows = []
    rb.headlines(a, {}, lambda section, row: rows.append((section, row)), torch.device("cpu"), 500, False, hybrid,
                 ["sdpa"])
    (section, row), = rows
    assert section == "headline" and "error" not in row, row
    assert row["pass"] == 2 and [p["pass"] for p in row["passes"]] == [1, 2]
    assert row["tokens_per_s"] == row["passes"][1]["tokens_per_s"]
    assert row["tokens_per_s_first_pass"] == row["passes"][0]["tokens_per_s"]
    assert row["generated"] == 5 * 3 and row["batches"] == 2
    assert sum(c[0] for c in row["prefill_chunks"]) == 3 + 3     # a short last batch runs at the full batch
