"""tau during training (--eval-every with --eval-data-dir, trainer/engine/evaltrain.py): the real speculative-generation
eval of the current drafter weights at the steps the flag names, recorded once, by the leader, in
metrics.jsonl, status.json and eval.json (the end-of-run eval); on any layout of ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.engine.test_trainer import _status, losses, records, tiny_args, train_here
from trainer.__main__ import main as train_main
from trainer.engine.evaltrain import eval_due
from trainer.engine.metrics import MetricsFile

BLOCK = 8   # tiny_args' --block-size
# hard labels: the target trains on its first 6 of 8 layers, so an eval that forgot the others would differ
# from dflash-eval's on the checkpoint; these settings (CE, as they were tuned) move tau between steps 2 and 4
# (the eval sees its step)
LEARN = ("--no-use-soft-labels", "--loss", "ce", "--lr", "5e-3", "--grad-accum", "1", "--max-anchors", "16")
SMALL_EVAL = ("--eval-prompts", "4", "--eval-max-new-tokens", "32")


def _offline(tiny: Path, ckpt: Path) -> dict:
    """What dflash-eval measures on a checkpoint: its own target load, the weights from the files."""
    from trainer.serving.evaluate import evaluate_checkpoint
    return evaluate_checkpoint(str(ckpt), str(tiny / "target"), str(tiny / "heldout"), device="cpu", max_prompts=4,
                               max_new_tokens=32, with_block_accuracy=False)


def _same_eval(rec: dict, ref: dict):
    assert rec["accept_length_histogram"] == ref["accept_length_histogram"]
    assert rec["tau"] == pytest.approx(ref["tau"], rel=1e-12)
    assert rec["per_position_acceptance"] == pytest.approx(ref["per_position_acceptance"], rel=1e-12)


def test_eval_every_measures_the_current_weights_at_its_steps(tiny_small_dir, tmp_path):
    out = tmp_path / "eval"
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "5", "--save-interval", "2",
                                "--keep-checkpoints", "0", *LEARN, "--eval-data-dir", str(tiny_small_dir / "heldout"),
                                "--eval-every", "2", *SMALL_EVAL)) == 0
    evals = records(out, "eval")
    assert [(r["step"], r["final"]) for r in evals] == [(2, False), (4, False), (5, True)]
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 5], "one step record per step, evals beside them"
    for r in evals:
        assert 1.0 <= r["tau"] <= BLOCK and len(r["per_position_acceptance"]) == BLOCK - 1
        assert r["prompts"] == 4 and r["max_new_tokens"] == 32
        assert r["loop"] == "batched", "dflash-eval's default loop (the in-training eval ran the single loop before)"
    # the eval at a step is dflash-eval on the checkpoint written at that step: the current weights
    for r in evals:
        _same_eval(r, _offline(tiny_small_dir, out / f"step-{r['step']:08d}"))
    assert evals[0]["accept_length_histogram"] != evals[1]["accept_length_histogram"], \
        "steps 2 and 4 must measure different weights (else this test cannot tell them apart)"
    # status.json: the last eval; eval.json: the end-of-run eval, with the teacher-forced figure as before
    st = _status(out)
    assert st["eval"]["step"] == 5 and st["eval"]["tau"] == evals[-1]["tau"] and "block_accuracy" in st["eval"]
    final = json.loads((out / "eval.json").read_text())
    assert final["step"] == 5 and final["tau"] == evals[-1]["tau"] and 0 <= final["block_accuracy"] <= 1
    assert final["checkpoint"].endswith("step-00000005")


@pytest.mark.slow
def test_resume_cuts_later_evals_evaluates_at_the_same_steps_and_evals_leave_training_alone(tiny_small_dir,
                                                                                             tmp_path):
    """A run stopped after step 3 lost its step-3 checkpoint (killed between eval and save): the restart
    resumes from step 2, cuts metrics.jsonl back to it (eval records too) and evaluates at 4 and at its end.
    The losses are those of a run without evals: an eval changes no state the training reads."""
    out, plain = tmp_path / "resumed", tmp_path / "plain"
    # constant noise: the noise anneals over the run's --max-steps, so the 3-step first run would draw steps 2
    # and 3 at another amplitude than the 5-step runs (1e-7 of the loss under soft labels, 2e-6 under the
    # default hard labels), whatever the evals do
    flat = ["--noise-start", "0.02", "--noise-end", "0.02"]
    ev = [*flat, "--save-interval", "2", "--eval-data-dir", str(tiny_small_dir / "heldout"), "--eval-every", "2",
          "--eval-prompts", "2", "--eval-max-new-tokens", "16"]
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "3", *ev)) == 0
    assert [r["step"] for r in records(out, "eval")] == [2, 3]
    shutil.rmtree(out / "step-00000003")
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "5", *ev)) == 0
    assert _status(out)["resumed_from"].endswith("step-00000002")
    assert [(r["step"], r["final"]) for r in records(out, "eval")] == [(2, False), (4, False), (5, True)]
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 5]
    assert train_here(tiny_args(tiny_small_dir, plain, "--max-steps", "5", *flat, "--save-interval", "2")) == 0
    assert losses(plain) == pytest.approx(losses(out), rel=1e-6)
    assert not records(plain, "eval")


def test_metrics_file_cuts_eval_records_after_the_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = []
    for s in range(1, 7):
        lines.append({"step": s, "loss": 1.0})
        if s % 2 == 0:
            lines.append({"kind": "eval", "step": s, "tau": 1.5})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    mf = MetricsFile(path, resume_step=4)
    mf.close()
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r.get("kind", "step"), r["step"]) for r in kept] == [
        ("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4), ("eval", 4)]
    assert mf.last["eval"]["step"] == 4 and mf.last["step"]["step"] == 4   # what status.json's eval resumes with


def test_eval_steps_are_a_function_of_the_step():
    assert [s for s in range(1, 12) if eval_due(s, 4, last=s == 11)] == [4, 8, 11]
    assert [s for s in range(1, 12) if eval_due(s, 0, last=s == 11)] == [11]


@pytest.mark.parametrize("layout", [("--cpu-target-workers", "1", "--cpu-drafter-replicas", "2")])
def test_separate_target_and_drafter_ranks_evaluate_once_on_the_target_rank(tiny_small_dir, tmp_path, layout):
    """Ranks 0, 1 drafters (FSDP shards), rank 2 the target: the leader gathers the drafter, sends it to the
    eval owner (rank 2), which measures tau with its target; the leader records it once."""
    out = tmp_path / "three"   # (a larger lr: on 3 ranks tau then moves between steps 2 and 4)
    assert train_main(tiny_args(tiny_small_dir, out, "--max-steps", "4", "--save-interval", "2", *layout, *LEARN,
                                "--lr", "1e-2", "--eval-data-dir", str(tiny_small_dir / "heldout"),
                                "--eval-every", "2", *SMALL_EVAL)) == 0
    evals = records(out, "eval")
    assert [(r["step"], r["final"]) for r in evals] == [(2, False), (4, True)]
    for r in evals:
        _same_eval(r, _offline(tiny_small_dir, out / f"step-{r['step']:08d}"))
    assert evals[0]["accept_length_histogram"] != evals[1]["accept_length_histogram"]
    st = _status(out)
    assert st["world_size"] == 3 and st["eval"]["step"] == 4
    log = (out / "logs" / "latest.log").read_text()
    assert log.count("eval at step 2: tau") == 1
    owner_logs = [p for p in (out / "logs").glob("*-rank2.log")]
    assert owner_logs and "eval at step 2 on rank 2" in owner_logs[0].read_text()


def test_the_in_training_eval_runs_dflash_evals_loop_and_falls_back_as_it_does(tiny_small_dir, monkeypatch, caplog):
    """The loop evaltrain asks evaluate_state for: batched (eagerly: IN_TRAINING_GRAPHS) at its temperature 0; on a
    target the batched loop cannot run, the single loop with one warning line, and the same accept lengths."""
    import logging

    import torch

    from trainer.data.dataset import load_dataset
    from trainer.engine.evaltrain import IN_TRAINING_GRAPHS, eval_loop
    from trainer.model.drafter import DFlashConfig, DFlashDrafter, init_drafter_weights
    from trainer.serving.captured import linear_states
    from trainer.serving.evaluate import evaluate_state, load_target

    assert IN_TRAINING_GRAPHS is False
    target = load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)
    cfg = DFlashConfig.from_target(target.config, num_draft_layers=1, block_size=4, mask_token_id=3)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=0)
    assert eval_loop(cfg) == "auto"
    ds = load_dataset(tiny_small_dir / "heldout")
    run = lambda: evaluate_state(cfg, model.state_dict(), target, ds, torch.device("cpu"), torch.float32, 3, 10,  # noqa: E731
                                 with_block_accuracy=False, loop=eval_loop(cfg), graphs=IN_TRAINING_GRAPHS)
    batched = run()
    monkeypatch.setattr(linear_states, "hybrid_unsupported", lambda base, speculative=False: "no rollback kernel")
    with caplog.at_level(logging.WARNING, logger="trainer.evaluate"):
        single = run()
    assert (batched["loop"], single["loop"]) == ("batched", "single")
    assert single["accept_length_histogram"] == batched["accept_length_histogram"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "batched loop cannot run this target (no rollback kernel)" in lines[0]


def test_eval_every_without_eval_data_dir_is_a_config_error(tiny_small_dir, tmp_path, capsys):
    assert train_main(tiny_args(tiny_small_dir, tmp_path / "o", "--eval-every", "2")) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-train: error: --eval-every:") and "--eval-data-dir" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "o").exists()
