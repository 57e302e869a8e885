"""dflash-eval measures tau by speculative generation, the loop serving runs.

Specifications: the loop's output equals plain greedy decoding of the target; a drafter that proposes
the target's own continuation is accepted in full (tau = B); one that is always wrong gives tau = 1;
tau equals a brute-force re-count done with the trainer's drafter on the final text; a trained
drafter beats an untrained one; temperature > 0 keeps the target's distribution.
"""

import json

import numpy as np
import pytest
import torch

from trainer.data.dataset import load_dataset
from trainer.model.checkpoint_format import CheckpointManager
from trainer.model.drafter import DFlashConfig, DFlashDrafter, PackedMeta, init_drafter_weights
from trainer.model.modeling_dflash import dflash_generate, verify_block
from trainer.ops.loss import dflash_loss
from trainer.serving.evaluate import evaluate, evaluate_checkpoint, heldout_prompts, hf_drafter, load_target
from trainer.serving.evaluate import main as eval_main

BLOCK = 4
MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tiny_small_dir):
    torch.set_num_threads(1)
    return load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def prompts(tiny_small_dir):
    return heldout_prompts(load_dataset(tiny_small_dir / "heldout"), 4)


def drafter_config(target, layers=2):
    return DFlashConfig.from_target(target.config, num_draft_layers=layers, block_size=BLOCK, mask_token_id=3)


def untrained(target, seed=0):
    cfg = drafter_config(target)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=seed)
    return cfg, model


def greedy(target, prompt, n):
    ids = torch.as_tensor(prompt)[None]
    out = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class Scripted:
    """A stand-in drafter proposing the tokens `script(start)` returns (one-hot logits)."""

    def __init__(self, real, script):
        self.block_size, self.target_layer_ids = real.block_size, real.target_layer_ids
        self.extract_taps, self.script, self.vocab = real.extract_taps, script, real.config.vocab_size

    def draft_logits(self, target, new_taps, first_token, start, cache):
        toks = torch.as_tensor(self.script(start))
        return torch.nn.functional.one_hot(toks, self.vocab).float() * 10


def test_generation_equals_plain_greedy_decoding(target, prompts):
    cfg, model = untrained(target)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    for p in prompts[:3]:
        res = dflash_generate(hf, target, torch.as_tensor(p)[None], MAX_NEW, [])
        assert res.output_ids[0, len(p):].tolist() == greedy(target, p, MAX_NEW)
        assert sum(res.accept_lengths) >= MAX_NEW - 1  # every token after the first came from a verify step


def test_a_drafter_proposing_the_targets_continuation_gives_tau_equal_block_size(target, prompts):
    cfg, model = untrained(target)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    p = prompts[0]
    full = list(p) + greedy(target, p, MAX_NEW + BLOCK)
    oracle = Scripted(hf, lambda start: full[start + 1:start + BLOCK])
    res = dflash_generate(oracle, target, torch.as_tensor(p)[None], MAX_NEW, [])
    assert res.accept_lengths == [BLOCK] * len(res.accept_lengths)
    assert res.output_ids[0].tolist() == full[:len(p) + MAX_NEW]
    # and one that is always wrong emits exactly one token per step (the target's own)
    wrong = Scripted(hf, lambda start: [(t + 1) % 300 for t in full[start + 1:start + BLOCK]])
    res = dflash_generate(wrong, target, torch.as_tensor(p)[None], MAX_NEW, [])
    assert res.accept_lengths == [1] * (MAX_NEW - 1)
    assert res.output_ids[0].tolist() == full[:len(p) + MAX_NEW]


def test_stop_tokens_end_generation_like_greedy(target, prompts):
    cfg, model = untrained(target)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    p = prompts[1]
    ref = greedy(target, p, MAX_NEW)
    stop = ref[10]
    res = dflash_generate(hf, target, torch.as_tensor(p)[None], MAX_NEW, [stop])
    assert res.output_ids[0, len(p):].tolist() == ref[:ref.index(stop) + 1]


def test_speculative_sampling_keeps_the_targets_distribution():
    """First emitted token of a block with one draft: distributed as the target's p, whatever q is."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]))
    q_logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]]))
    counts = np.zeros(3)
    n = 20000
    for _ in range(n):
        d = torch.multinomial(torch.softmax(q_logits[0], -1), 1, generator=g)
        acc, nxt = verify_block(d, q_logits, p_logits, 1.0, g)
        counts[int(d) if acc == 1 else nxt] += 1
    assert np.abs(counts / n - np.array([0.6, 0.3, 0.1])).max() < 0.015, counts / n
    # q == p: every draft accepted
    accs = [verify_block(torch.multinomial(torch.softmax(p_logits[0], -1), 1, generator=g),
                         p_logits[:1], p_logits, 1.0, g)[0] for _ in range(200)]
    assert accs == [1] * 200


# ------------------------------------------------------------------------------- trained drafter


def train_drafter(target, data_dir, epochs=10, lr=5e-3, seed=0, max_anchors=32, snapshots=()):
    """A few epochs of the DFlash objective on the tiny data (hard labels, position decay), with the
    trainer's packed model; independent of train.py. With `snapshots`, also the drafter as it stood after
    each of those epochs ({epochs: (cfg, model)}, returned second): the run's first k epochs are exactly
    a k-epoch run's (same seed, same anchors and order, same optimizer steps)."""
    cfg = drafter_config(target)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=seed)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    ds = load_dataset(data_dir)
    w_slot = torch.exp(-(torch.arange(BLOCK, dtype=torch.float32) - 1) / 4.0)   # the recipe's decay, slot 0 off
    w_slot[0] = 0.0
    rng = np.random.default_rng(seed)
    cache = []
    with torch.no_grad():
        for i in range(len(ds)):
            ids, mask = ds[i]
            ids = torch.as_tensor(ids.astype(np.int64))
            hs = target(input_ids=ids[None], output_hidden_states=True).hidden_states
            cache.append((ids, mask.astype(bool), torch.cat([hs[t + 1][0] for t in cfg.target_layer_ids], -1)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    taken = {}
    for epoch in range(epochs):
        if epoch in snapshots:
            taken[epoch] = _snapshot(cfg, model)
        for i in rng.permutation(len(cache)):
            ids, m, taps = cache[i]
            n = len(ids)
            cand = np.nonzero(m[:-1] & m[1:])[0]
            a = torch.as_tensor(np.sort(rng.choice(cand, min(max_anchors, len(cand)), replace=False)))
            pos = (a[:, None] + torch.arange(BLOCK)).reshape(-1)
            valid = pos < n
            tokens = torch.full((len(a), BLOCK), cfg.mask_token_id)
            tokens[:, 0] = ids[a]
            labels = torch.where(valid, ids[pos.clamp(max=n - 1)], -1)
            weight = w_slot.repeat(len(a)) * valid
            meta = PackedMeta(torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros_like(pos),
                              a.repeat_interleave(BLOCK), pos, BLOCK)
            hidden = model(taps, embed[tokens.reshape(-1)], meta)
            loss, _ = dflash_loss(hidden, head, labels, weight, weight.sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
    if snapshots:
        return (cfg, model.eval()), taken
    return cfg, model.eval()


def _snapshot(cfg, model):
    copy = DFlashDrafter(cfg)
    copy.load_state_dict(model.state_dict())
    return cfg, copy.eval()


QUICK_EPOCHS = 3


@pytest.fixture(scope="module")
def trained_runs(target, tiny_small_dir):
    """One 10-epoch training run, with the drafter it held after 3 epochs (quick_trained's): the two
    drafters that two runs gave, for one run's target forwards and 10 epochs instead of 13."""
    return train_drafter(target, tiny_small_dir / "data", snapshots=(QUICK_EPOCHS,))


@pytest.fixture(scope="module")
def trained(trained_runs):
    return trained_runs[0]


def brute_force_tau(target, cfg, model, prompt, max_new):
    """Re-count without the loop: the final text is the target's greedy continuation, so the target's
    taps on it are those the loop saw; draft a block at every position in one packed forward (trainer's
    model, no cache), then walk: accept the matching prefix, move past it and the bonus token."""
    cont = greedy(target, prompt, max_new + BLOCK)
    ids = torch.as_tensor(list(prompt) + cont)
    n = len(ids)
    with torch.no_grad():
        hs = target(input_ids=ids[None], output_hidden_states=True).hidden_states
        taps = torch.cat([hs[t + 1][0] for t in cfg.target_layer_ids], -1)
        a = torch.arange(len(prompt), n - BLOCK)
        tokens = torch.full((len(a), BLOCK), cfg.mask_token_id)
        tokens[:, 0] = ids[a]
        pos = (a[:, None] + torch.arange(BLOCK)).reshape(-1)
        meta = PackedMeta(torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros_like(pos),
                          a.repeat_interleave(BLOCK), pos, BLOCK)
        hidden = model(taps, target.get_input_embeddings().weight[tokens.reshape(-1)], meta)
        drafts = (hidden @ target.get_output_embeddings().weight.t()).argmax(-1).view(len(a), BLOCK)[:, 1:]
    steps, start = [], len(prompt)
    while start - len(prompt) + 1 < max_new:
        d = drafts[start - len(prompt)]
        ok = (d == ids[start + 1:start + BLOCK]).long()
        acc = int(torch.cumprod(ok, 0).sum())
        steps.append(acc + 1)
        start += acc + 1
    return steps


@pytest.mark.slow
def test_generation_tau_equals_a_brute_force_recount(target, trained, prompts):
    cfg, model = trained
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    total = []
    for p in prompts:
        res = dflash_generate(hf, target, torch.as_tensor(p)[None], MAX_NEW, [])
        assert res.accept_lengths == brute_force_tau(target, cfg, model, p, MAX_NEW)
        total += res.accept_lengths
    assert max(total) > 1  # the re-count was not trivially all ones


@pytest.mark.slow
def test_trained_drafter_beats_untrained_and_eval_reports_it(target, trained, tiny_small_dir, tmp_path):
    cfg, model = trained
    ds = load_dataset(tiny_small_dir / "heldout")
    base_cfg, base = untrained(target, seed=3)
    before = evaluate(target, base, base_cfg, ds, torch.device("cpu"), max_prompts=8, max_new_tokens=64)
    assert before["tau"] < 1.15, before
    # through the trainer's entry point: paths only (checkpoint dir -> evaluate_checkpoint)
    out = tmp_path / "run"
    CheckpointManager(out).save(3, model.state_dict(), cfg.to_dict(), {})
    after = evaluate_checkpoint(str(out), str(tiny_small_dir / "target"), str(tiny_small_dir / "heldout"),
                                device="cpu", max_prompts=8, max_new_tokens=64, target=target, out_dir=str(out))
    assert json.loads((out / "eval.json").read_text()) == after
    assert after["step"] == 3 and after["checkpoint"].endswith("step-00000003")
    # 10 epochs on 48 sequences: tau ~1.4 (the teacher-forced block length reads ~1.9 on the same drafter)
    assert after["tau"] > before["tau"] + 0.25, (before, after)
    assert after["per_position_acceptance"][0] > 0.12
    assert sum(after["accept_length_histogram"]) == after["verify_steps"]
    assert after["tau"] == pytest.approx(
        sum((i + 1) * c for i, c in enumerate(after["accept_length_histogram"])) / after["verify_steps"])
    assert 0 < after["block_accuracy"] <= 1 and 1 <= after["teacher_forced_block_len"] <= BLOCK


def test_cli_on_a_checkpoint_and_on_an_export(target, tiny_small_dir, tmp_path, capsys):
    from trainer.serving.export import export_drafter
    cfg, model = untrained(target)
    out = tmp_path / "run"
    CheckpointManager(out).save(1, model.state_dict(), cfg.to_dict(), {})
    export_drafter(out, tmp_path / "export")
    results = []
    for src in (out, tmp_path / "export"):
        assert eval_main(["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(src),
                          "--data-dir", str(tiny_small_dir / "heldout"), "--device", "cpu", "--max-prompts", "2",
                          "--max-new-tokens", "12", "--json", "--speed-batch", ""]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["verify_steps"] == results[1]["verify_steps"] > 0
    assert all(r["tau"] < 1.5 for r in results)
    # strict: a checkpoint whose weights do not match the config is refused, not half-loaded
    CheckpointManager(tmp_path / "bad").save(1, {k: v for k, v in model.state_dict().items() if k != "norm.weight"},
                                             cfg.to_dict(), {})
    with pytest.raises(RuntimeError, match="norm.weight"):
        evaluate_checkpoint(str(tmp_path / "bad"), str(tiny_small_dir / "target"), str(tiny_small_dir / "heldout"),
                            device="cpu", target=target)


# That importing trainer.serving.evaluate leaves the training engine (trainer.engine.train) out is checked in
# the fresh interpreter that runs dflash-eval --help (tests/repo/test_cli_quiet.py, NOT_IMPORTED): a process
# of its own here imported torch and transformers again only for that.


@pytest.mark.parametrize("extra, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--max-prompts", "0"], "--max-prompts: must be >= 1, got 0"),
    (["--temperature", "-1"], "--temperature: must be >= 0"),
    pytest.param(["--device", "cuda:0"], "--device cuda:0: CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    (["--device", "cuda:99"] if torch.cuda.is_available() else ["--device", "tpu"], "--device"),
])
def test_eval_bad_arguments_exit_2_with_one_line(target, tiny_small_dir, tmp_path, capsys, extra, needle):
    """Issue 30: these ended in tracebacks (or, --max-prompts 0, evaluated one prompt)."""
    from trainer.serving.evaluate import main as eval_main
    cfg = drafter_config(target)
    model = DFlashDrafter(cfg)
    CheckpointManager(tmp_path / "run").save(1, model.state_dict(), cfg.to_dict(), {})
    rc = eval_main(["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(tmp_path / "run"),
                    "--data-dir", str(tiny_small_dir / "heldout"), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("dflash-eval: error: ") and needle in err, err



# ------------------------------------------------------------------------------- the batched loop (issue 29)


@pytest.fixture(scope="module")
def quick_trained(trained_runs):
    """3 epochs: accept lengths of 1 and 2 (some 4) on the held-out prompts, enough to tell loops apart."""
    return trained_runs[1][QUICK_EPOCHS]


@pytest.fixture(scope="module")
def all_prompts(tiny_small_dir):
    return heldout_prompts(load_dataset(tiny_small_dir / "heldout"), 8)


BATCHED_MAX_NEW = 48


@pytest.fixture(scope="module")
def single_loop_runs(target, quick_trained, all_prompts):
    """The single loop on every prompt, without stop tokens and with two (tokens the greedy continuations
    emit part-way, so rows stop at different steps): (the drafter, [(stop_ids, its results)]), run once
    for both batch sizes below."""
    cfg, model = quick_trained
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    ref = [dflash_generate(hf, target, torch.as_tensor(p)[None], BATCHED_MAX_NEW, []) for p in all_prompts]
    stops = sorted({ref[0].output_ids[0, len(all_prompts[0]) + 20].item(),
                    ref[3].output_ids[0, len(all_prompts[3]) + 9].item()})
    return hf, [([], ref), (stops, [dflash_generate(hf, target, torch.as_tensor(p)[None], BATCHED_MAX_NEW, stops)
                                    for p in all_prompts])]


@pytest.mark.parametrize("batch_size", [3, 8])
def test_the_batched_loop_gives_each_prompts_accept_lengths_and_tokens_of_the_single_loop(
        target, single_loop_runs, all_prompts, batch_size):
    """Prompts of different lengths share a step, each row at its own position; with stop tokens some rows
    end early (frozen in the batch); a short last batch (8 = 3 + 3 + 2) repeats a finished row."""
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
    hf, runs = single_loop_runs
    max_new = BATCHED_MAX_NEW
    for stop_ids, single in runs:
        dec = BatchedSpecDecoder(target, hf, "cpu", batch_size, max_new, stop_ids)
        batched = [row for i in range(0, len(all_prompts), batch_size)
                   for row in dec.generate(all_prompts[i:i + batch_size])]
        for p, s, (lengths, toks) in zip(all_prompts, single, batched):
            assert lengths == s.accept_lengths
            assert toks.tolist() == s.output_ids[0, len(p):].tolist()
        assert max(n for s in single for n in s.accept_lengths) > 1      # not trivially all ones
    assert any(len(s.output_ids[0]) - len(p) < max_new for p, s in zip(all_prompts, single))   # some stopped


def test_tau_of_the_batched_loop_equals_the_single_loops(target, quick_trained, tiny_small_dir):
    """Through evaluate(): the same tau, histogram and per-position acceptance, loop recorded."""
    cfg, model = quick_trained
    ds = load_dataset(tiny_small_dir / "heldout")
    runs = {loop: evaluate(target, model, cfg, ds, torch.device("cpu"), max_prompts=8, max_new_tokens=40,
                           loop=loop, batch_size=5) for loop in ("single", "batched")}
    for key in ("tau", "verify_steps", "new_tokens", "per_position_acceptance", "accept_length_histogram"):
        assert runs["single"][key] == runs["batched"][key], key
    assert (runs["single"]["loop"], runs["batched"]["loop"]) == ("single", "batched")
    assert runs["batched"]["tau"] > 1.0


def test_loop_auto_batches_greedy_evals_and_keeps_the_single_loop_for_sampling():
    from trainer.serving.evaluate import resolve_loop
    assert resolve_loop("auto", 0.0) == "batched" and resolve_loop("auto", 0.7) == "single"
    assert resolve_loop("single", 0.0) == "single"
    with pytest.raises(ValueError, match="--loop batched: greedy only"):
        resolve_loop("batched", 0.7)


@pytest.mark.parametrize("extra, needle", [
    (["--loop", "batched", "--temperature", "0.5"], "--loop batched: greedy only (--temperature 0)"),
    (["--loop", "fast"], "--loop: expected one of auto, batched, single, got 'fast'"),
    (["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
])
def test_eval_bad_loop_arguments_exit_2_with_one_line(target, tiny_small_dir, tmp_path, capsys, extra, needle):
    cfg = drafter_config(target)
    CheckpointManager(tmp_path / "run").save(1, DFlashDrafter(cfg).state_dict(), cfg.to_dict(), {})
    rc = eval_main(["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(tmp_path / "run"),
                    "--data-dir", str(tiny_small_dir / "heldout"), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("dflash-eval: error: ") and needle in err, err


def test_cli_runs_both_loops_with_the_same_tau(target, tiny_small_dir, tmp_path, capsys):
    cfg, model = untrained(target)
    CheckpointManager(tmp_path / "run").save(1, model.state_dict(), cfg.to_dict(), {})
    res = {}
    for loop in ("single", "batched"):
        assert eval_main(["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(tmp_path / "run"),
                          "--data-dir", str(tiny_small_dir / "heldout"), "--device", "cpu", "--max-prompts", "3",
                          "--max-new-tokens", "12", "--no-block-accuracy", "--loop", loop, "--batch-size", "2",
                          "--json", "--speed-batch", ""]) == 0
        res[loop] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["single"]["loop"] == "single" and res["batched"]["loop"] == "batched"
    assert res["single"]["accept_length_histogram"] == res["batched"]["accept_length_histogram"]
