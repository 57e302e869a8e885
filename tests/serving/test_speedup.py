"""dflash-eval's wall-clock section and its lossless check (trainer/serving/speedup.py), and the n-gram
baseline (trainer/serving/captured/proposers.py NgramProposer).

Specifications: the CLI prints a table of the target alone, the drafter and the n-gram baseline at each
--speed-batch and writes the same rows under "speed" in its JSON; every speculative output equals the
target's greedy output; a verify step that picks other tokens than the target's (an injected bug) fails the
eval with exit 1 and one line naming the first prompt and position that differ. The lookup proposes what
follows the longest matched suffix at its earliest occurrence (vLLM's rule), and its accept lengths equal a
brute-force re-count on the final text.
"""

import json

import numpy as np
import pytest
import torch

from trainer.data.dataset import load_dataset
from trainer.model.checkpoint_format import CheckpointManager
from trainer.model.drafter import DFlashConfig, DFlashDrafter, init_drafter_weights
from trainer.serving.captured.proposers import NO_DRAFT, NgramProposer
from trainer.serving.evaluate import heldout_prompts, load_target
from trainer.serving.evaluate import main as eval_main

BLOCK = 4


@pytest.fixture(scope="module")
def target(tiny_small_dir):
    torch.set_num_threads(1)
    return load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def checkpoint(target, tmp_path_factory):
    cfg = DFlashConfig.from_target(target.config, num_draft_layers=2, block_size=BLOCK, mask_token_id=3)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model)
    run = tmp_path_factory.mktemp("speed") / "run"
    CheckpointManager(run).save(1, model.state_dict(), cfg.to_dict(), {})
    return run


def run_eval(tiny_small_dir, checkpoint, capsys, *extra):
    rc = eval_main(["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(checkpoint),
                    "--data-dir", str(tiny_small_dir / "heldout"), "--device", "cpu", "--max-prompts", "3",
                    "--max-new-tokens", "16", "--no-block-accuracy", "--speed-batch", "1,2", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_cli_prints_and_writes_the_speed_table_and_passes_the_lossless_check(tiny_small_dir, checkpoint,
                                                                                  capsys):
    rc, out, err = run_eval(tiny_small_dir, checkpoint, capsys, "--json")
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    speed = res["speed"]
    assert speed["batches"] == [1, 2] and speed["lossless"] == {"ok": True, "prompts": 3, "error": None}
    assert [(r["drafter"], r["batch"]) for r in speed["rows"]] == [
        ("target", 1), ("dflash", 1), ("ngram", 1), ("target", 2), ("dflash", 2), ("ngram", 2)]
    by = {(r["drafter"], r["batch"]): r for r in speed["rows"]}
    for b in (1, 2):
        alone = by[("target", b)]
        assert alone["tokens_per_s"] > 0 and "tau" not in alone and "speedup" not in alone
        for name in ("dflash", "ngram"):
            r = by[(name, b)]
            assert r["tokens"] == alone["tokens"]          # lossless: the same tokens, so the same count
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / alone["tokens_per_s"], rel=1e-2)
            assert r["tau"] >= 1.0 and r["verify_steps"] > 0
    # the speed rows' tau is the tau section's (the same batched loop, the same prompts)
    assert by[("dflash", 2)]["tau"] == pytest.approx(res["tau"], abs=1e-4)
    assert speed["ngram"] == {"max_n": 3, "min_n": 1, "k": BLOCK - 1}
    rc, out, _ = run_eval(tiny_small_dir, checkpoint, capsys)
    assert rc == 0 and "drafter    batch    tau   tokens/s  speedup" in out and "\nngram          2" in out


def test_a_corrupted_verify_step_fails_the_eval_naming_the_first_prompt_that_differs(
        tiny_small_dir, checkpoint, capsys, monkeypatch):
    """The injected bug: the verify step's LM head shifted by one token id (its argmax is the target's + 1), so
    every token a verify step emits differs from greedy decoding; the first is generated token 1 of prompt 0
    (token 0 comes from the prefill, which is right)."""
    from trainer.serving.captured import eval_decoder
    real = eval_decoder.BatchedSpecDecoder._step_inner

    class Shifted:
        def __init__(self, head):
            self.head, self.weight = head, head.weight

        def __call__(self, h):
            return torch.roll(self.head(h), 1, dims=-1)

    def corrupted(self, view):
        head = self.head
        self.head = Shifted(head)
        try:
            real(self, view)
        finally:
            self.head = head
    monkeypatch.setattr(eval_decoder.BatchedSpecDecoder, "_step_inner", corrupted)
    rc, out, err = run_eval(tiny_small_dir, checkpoint, capsys, "--json")
    said = [line for line in err.splitlines() if line.startswith("dflash-eval")]   # beside the load's progress bar
    assert rc == 1 and len(said) == 1 and err.endswith(said[0] + "\n"), err
    assert said[0].startswith("dflash-eval: not lossless: dflash at batch 1 differs from the target's greedy output "
                          "on prompt 0 at generated token 1 (target "), err
    res = json.loads(out.strip().splitlines()[-1])   # the table is still written
    assert res["speed"]["lossless"]["ok"] is False and res["speed"]["lossless"]["error"] in err


@pytest.mark.parametrize("extra, needle", [
    (["--speed-batch", "1,x"], "--speed-batch: expected batch sizes like 1,16"),
    (["--speed-batch", "0"], "--speed-batch: every batch size must be >= 1"),
    (["--ngram-min", "3", "--ngram-max", "2"], "--ngram-max/--ngram-min/--ngram-k: n-gram sizes: need 1 <= min"),
    (["--ngram-k", "9"], "--ngram-max/--ngram-min/--ngram-k: n-gram k: need 1 <= k (9) <= block size - 1 (3)"),
])
def test_bad_speed_arguments_exit_2_with_one_line(tiny_small_dir, checkpoint, capsys, extra, needle):
    rc, _, err = run_eval(tiny_small_dir, checkpoint, capsys, *extra)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


def lookup(tokens, max_n=3, min_n=1, k=BLOCK - 1, block=BLOCK):
    hist = torch.tensor([list(tokens) + [0] * 5])
    return NgramProposer(block, max_n, min_n, k).lookup(hist, torch.tensor([len(tokens) - 1]))[0].tolist()


def test_the_lookup_takes_the_longest_suffix_at_its_earliest_occurrence():
    # suffix [5, 6, 7] occurs at 0 (then 8, 9, 5) and at 5 (then 1, 2, 5): the earliest wins
    assert lookup([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]) == [8, 9, 5]
    # no 3-gram match: the 2-gram [2, 7] at 1, then the 1-gram would have matched earlier
    assert lookup([7, 2, 7, 4, 9, 9, 2, 7]) == [4, 9, 9]
    # fewer than k tokens after the match: the rest is no draft (vLLM proposes fewer)
    assert lookup([1, 2, 3, 1, 2]) == [3, 1, 2] and lookup([4, 1, 4]) == [1, 4, NO_DRAFT]
    # nothing matches, or the suffix is shorter than min_n
    assert lookup([1, 2, 3, 4]) == [NO_DRAFT] * 3
    assert lookup([3, 1, 2, 9, 2], min_n=2) == [NO_DRAFT] * 3 and lookup([3, 1, 2, 9, 2]) == [9, 2, NO_DRAFT]
    assert lookup([1, 2, 3, 1, 2, 3, 1], k=1) == [2, NO_DRAFT, NO_DRAFT]


def brute_force_ngram(full: list[int], n_prompt: int, max_new: int) -> list[int]:
    """Accept lengths of prompt lookup replayed on the final text: at each step the lookup on the tokens so
    far, accepted while it equals what follows."""
    lengths, start = [], n_prompt      # position of the newest token (the first generated one)
    while start - n_prompt + 1 < max_new:
        drafts = lookup(full[:start + 1])
        acc = 0
        while acc < len(drafts) and drafts[acc] == full[start + 1 + acc]:
            acc += 1
        lengths.append(acc + 1)
        start += acc + 1
    return lengths


def test_prompt_lookup_in_the_batched_loop_is_lossless_and_accepts_a_repeated_span(target, tiny_small_dir):
    """A prompt that ends with the target's own greedy continuation of its first part repeated: the lookup
    proposes that continuation, and whatever the target then writes, the loop emits exactly greedy decoding
    with the accept lengths a re-count on the final text gives."""
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
    from trainer.serving.speedup import target_alone
    base = heldout_prompts(load_dataset(tiny_small_dir / "heldout"), 3)
    max_new = 24

    def greedy(p, n):
        ids = torch.as_tensor(np.asarray(p))[None]
        out = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()
    # the target's continuation G of P, then P + G + P: greedy decoding there tends to write G again
    prompts = []
    for p in base:
        g = greedy(p, 12)
        prompts.append(np.asarray(list(p) + g + list(p), dtype=np.int64))
    dec = BatchedSpecDecoder(target, NgramProposer(BLOCK), "cpu", 2, max_new, [], graphs=False)
    got = [row for i in range(0, 3, 2) for row in dec.generate(prompts[i:i + 2])]
    ref = target_alone(target, prompts, max_new, [], 3)
    accepted = 0
    for p, (lengths, toks), want in zip(prompts, got, ref.outputs):
        longer = greedy(p, max_new + BLOCK)   # the last step may accept drafts past max_new
        assert toks.tolist() == want.tolist() == longer[:max_new]
        assert lengths == brute_force_ngram(list(p) + longer, len(p), max_new)
        accepted += sum(n - 1 for n in lengths)
    assert accepted >= max_new // 2, accepted         # the repeated span is found and accepted


def test_speed_section_is_the_library_entry_of_the_table(target, tiny_small_dir, checkpoint):
    from trainer.serving.evaluate import hf_drafter, speed_section
    from trainer.serving.export import read_checkpoint
    cfg, state, _ = read_checkpoint(str(checkpoint))
    speed = speed_section(target, hf_drafter(cfg, state, "cpu", torch.float32), cfg,
                          load_dataset(tiny_small_dir / "heldout"), 2, 8, [2], ngram=(2, 2, 1))
    assert speed["lossless"]["ok"] and [r["drafter"] for r in speed["rows"]] == ["target", "dflash", "ngram"]
    assert speed["ngram"] == {"max_n": 2, "min_n": 2, "k": 1}
