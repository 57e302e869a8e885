"""DFlash2 in dflash-eval's batched loop (captured/eval_decoder.BatchedSpecDecoder with
dflash2_eval.DFlash2CachedModel): prompt by prompt, the same drafts at every step, the same accept lengths
and the same tokens as the single loop (dflash2_eval.dflash2_generate, the trainer's packed class run on the
whole context), on the tiny target; through evaluate(), the same tau in both loops. The single loop times
its phases for dflash-eval --profile-phases, as DFlash's does, and changes nothing by it.

The drafter: untrained, its convolutions moved off the identity (so the cached layers' convolution is
exercised) and its selector's codebooks drawn so that its path leaves the unary argmax.
"""

import pytest
import torch

from tests.conftest import perturb_dflash2
from trainer.data.dataset import load_dataset
from trainer.model.dflash2 import as_dflash2
from trainer.model.drafter import DFlashConfig, DFlashDrafter, init_drafter_weights
from trainer.serving.dflash2_eval import DFlash2Proposer, dflash2_generate
from trainer.serving.evaluate import evaluate, heldout_prompts, load_target

BLOCK = 4
NEW = 20


@pytest.fixture(scope="module")
def target(tiny_small_dir):
    torch.set_num_threads(1)
    return load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def drafter(target):
    cfg = as_dflash2(DFlashConfig.from_target(target.config, num_draft_layers=2, block_size=BLOCK, mask_token_id=3),
                     selector_rank=16, selector_top_k=4)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=0)
    perturb_dflash2(model, cfg.hidden_size)
    return cfg, model


class Recording(DFlash2Proposer):
    """The single loop's proposer, each step's path recorded."""

    def __init__(self, model):
        super().__init__(model)
        self.paths: list[list[int]] = []
        self.moved = 0

    def propose(self, *a, **k):
        path, cand, q = super().propose(*a, **k)
        self.paths.append(path.tolist())
        self.moved += int((path != cand[:, 0]).sum())   # top-K is sorted: column 0 is the unary argmax
        return path, cand, q


def test_the_batched_loop_drafts_and_accepts_what_the_single_loop_does_prompt_by_prompt(
        target, drafter, tiny_small_dir):
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
    cfg, model = drafter
    prompts = heldout_prompts(load_dataset(tiny_small_dir / "heldout"), 3)
    single, paths, moved = [], [], 0
    for p in prompts:
        rec = Recording(model)
        single.append(dflash2_generate(rec, target, torch.as_tensor(p)[None], NEW, [], 0.0))
        paths.append(rec.paths)
        moved += rec.moved
    assert moved > 0                      # the selector's path is not the drafter's argmax
    proposer = DFlash2Proposer(model)
    dec = BatchedSpecDecoder(target, proposer, "cpu", len(prompts), NEW, [], graphs=False)
    batched, draft, prefill_rows = [[] for _ in prompts], dec.proposer._draft, list(range(len(prompts)))

    def recorded(d, first, *args):
        out = draft(d, first, *args)
        rows = [prefill_rows.pop(0)] if first.shape[0] == 1 else range(len(prompts))   # prefill: row by row
        for r, path in zip(rows, out.tolist()):
            if not (first.shape[0] > 1 and dec.done[r]):
                batched[r].append(path)
        return out
    dec.proposer._draft = recorded
    for p, s, (lengths, toks), want, got in zip(prompts, single, dec.generate(prompts), paths, batched):
        assert toks.tolist() == s.output_ids[0, len(p):].tolist()
        assert lengths == s.accept_lengths
        assert got[:len(want)] == want


def test_evaluate_runs_dflash2_in_the_batched_loop_with_the_single_loops_tau(target, drafter, tiny_small_dir):
    cfg, model = drafter
    ds = load_dataset(tiny_small_dir / "heldout")
    runs = {loop: evaluate(target, DFlash2Proposer(model), cfg, ds, torch.device("cpu"), max_prompts=4,
                           max_new_tokens=NEW, loop=loop, batch_size=3) for loop in ("single", "batched")}
    for key in ("tau", "verify_steps", "new_tokens", "accept_length_histogram"):
        assert runs["single"][key] == runs["batched"][key], key
    assert (runs["single"]["loop"], runs["batched"]["loop"]) == ("single", "batched")


def test_the_dflash2_single_loop_times_its_phases_and_changes_nothing(target, drafter, tiny_small_dir):
    """DFlash2's own single loop (dflash2_generate) records to dflash-eval --profile-phases' timer as
    DFlash's does: every step phase, one timer step per verify step, the same accept lengths."""
    from trainer.serving import phases
    cfg, model = drafter
    prompts = [torch.as_tensor(p)[None] for p in heldout_prompts(load_dataset(tiny_small_dir / "heldout"), 3)]
    plain = [dflash2_generate(DFlash2Proposer(model), target, p, NEW, [], 0.0).accept_lengths for p in prompts]
    timer = phases.PhaseTimer("cpu")
    with phases.recording(timer):
        timed = [dflash2_generate(DFlash2Proposer(model), target, p, NEW, [], 0.0).accept_lengths for p in prompts]
    assert timed == plain
    got = timer.summary()
    assert timer.steps == sum(map(len, plain)) == got["verify"]["calls"] == got["draft"]["calls"]
    assert got["prefill"]["calls"] == len(prompts) and "crop" in got and "rollback" not in got
    assert all(got[k]["ms_total"] > 0 for k in ("prefill", "draft", "verify", "accept")), got


def test_the_loops_an_architecture_runs_in_come_from_its_entry(target, drafter, tiny_small_dir, tmp_path, capsys,
                                                               monkeypatch):
    """dflash-eval asks the architecture table (trainer/model/architectures.py) which loops a drafter runs in: an
    entry without the batched loop gets --loop batched (and the speed table, which times it) refused in one
    line, and evaluate() refuses it too."""
    import dataclasses

    from trainer.model import architectures
    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.serving.evaluate import main as eval_main
    cfg, model = drafter
    CheckpointManager(tmp_path / "run").save(1, model.state_dict(), cfg.to_dict(), {})
    monkeypatch.setitem(architectures.ARCHITECTURES, "dflash2",
                        dataclasses.replace(architectures.ARCHITECTURES["dflash2"], eval_loops=("single",)))
    args = ["--target-model", str(tiny_small_dir / "target"), "--checkpoint", str(tmp_path / "run"), "--data-dir",
            str(tiny_small_dir / "heldout"), "--device", "cpu"]
    for extra, needle in ((["--loop", "batched"], "--loop batched: a dflash2 drafter runs in the single loop"),
                          ([], "--speed-batch: a dflash2 drafter has no batched loop to time")):
        assert eval_main(args + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    with pytest.raises(ValueError, match="a dflash2 drafter runs in the single loop"):
        evaluate(target, DFlash2Proposer(model), cfg, load_dataset(tiny_small_dir / "heldout"), torch.device("cpu"),
                 max_prompts=1, max_new_tokens=4, loop="batched")
