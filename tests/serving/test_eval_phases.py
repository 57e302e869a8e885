"""Where a speculative loop's step goes: dflash-eval --profile-phases (trainer/serving/phases.py).

Specifications, on the tiny hybrid (dflash-tiny --arch qwen3_5) and the dense tiny target, on the CPU:
- both loops, recording to a PhaseTimer, time every phase of their step (prefill, draft, verify, accept),
  each with calls and milliseconds; the rollback of the linear-attention states only on the hybrid (the
  dense single loop crops its KV cache instead), and in the hybrid's single loop transformers' recording
  of a state per position ("record", inside verify and prefill); one timer step per verify step of the
  single loop and one per batched step of the batched loop;
- the timer changes nothing: the same accept lengths and tokens generated with it as without it;
- off, the loops hold one shared no-op whose phase() is one shared null context;
- on a GPU (a stand-in for CUDA's events) a phase is an event pair, read with one sync at the end;
- dflash-eval --profile-phases puts "phases" in the JSON result and one line per phase on stderr; without
  the flag the result has no "phases"; the GPU script that measured the single loop (eval_bench.py) puts
  them in its single row.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from trainer.data.dataset import load_dataset
from trainer.model.drafter import DFlashConfig, DFlashDrafter, init_drafter_weights
from trainer.serving import phases
from trainer.serving.evaluate import generate_each, heldout_prompts, hf_drafter, load_target, speculative_eval

NEW = 12
STEP_PHASES = ("prefill", "draft", "verify", "accept")


def _untrained(target):
    cfg = DFlashConfig.from_target(target.config, num_draft_layers=1, block_size=4, mask_token_id=3)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, seed=0)
    return cfg, model


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def case(request):
    """(kind, target, servable drafter, three prompts of different lengths)."""
    d = request.getfixturevalue("tiny_hybrid_dir" if request.param == "hybrid" else "tiny_small_dir")
    torch.set_num_threads(1)
    target = load_target(str(d / "target"), torch.device("cpu"), torch.float32)
    cfg, model = _untrained(target)
    hf = hf_drafter(cfg, model.state_dict(), "cpu", torch.float32)
    prompts = heldout_prompts(load_dataset(d / "heldout"), 3)
    return request.param, target, hf, [p[:n] for p, n in zip(prompts, (23, 9, 31))]


@pytest.mark.parametrize("loop", ["single", "batched"])
def test_each_loop_times_every_phase_and_changes_nothing(case, loop):
    kind, target, hf, prompts = case
    plain = generate_each(target, hf, prompts, NEW, stop_ids=[], loop=loop, batch_size=2)
    timer = phases.PhaseTimer("cpu")
    with phases.recording(timer):
        timed = generate_each(target, hf, prompts, NEW, stop_ids=[], loop=loop, batch_size=2)
    assert timed == plain    # accept lengths and tokens generated, prompt by prompt
    got = timer.summary()
    for name in STEP_PHASES:
        assert got[name]["calls"] > 0 and got[name]["ms_total"] > 0, (name, got)
    assert ("rollback" in got) == (kind == "hybrid"), got
    if kind == "hybrid":
        assert got["rollback"]["ms_total"] > 0 and got["rollback"]["calls"] == got["verify"]["calls"]
    # transformers' one-token kernel recording a state per position: the single loop on a hybrid only
    assert ("record" in got) == (kind == "hybrid" and loop == "single"), got
    if "record" in got:
        assert 0 < got["record"]["ms_total"] < got["verify"]["ms_total"] + got["prefill"]["ms_total"]
        assert got["record"]["calls"] >= got["verify"]["calls"]
    steps = sum(len(lengths) for lengths, _ in plain)
    if loop == "single":
        assert timer.steps == steps == got["verify"]["calls"]       # one verify step, one target forward
        assert got["prefill"]["calls"] == len(prompts)
        assert ("crop" in got) == (kind == "dense")
    else:   # a batched step verifies the rows of a batch together: fewer steps than verify steps
        assert 0 < timer.steps < steps and got["verify"]["calls"] == timer.steps
        assert got["prefill"]["calls"] == 2                          # two batches of at most 2 prompts
    assert got["verify"]["ms_per_verify_step"] == pytest.approx(got["verify"]["ms_total"] / timer.steps, abs=1e-3)


def test_off_the_loops_hold_one_shared_no_op(case):
    _, target, hf, prompts = case
    assert phases.active() is phases.NO_PHASES and not phases.NO_PHASES.enabled
    assert phases.NO_PHASES.phase("verify") is phases.NO_PHASES.phase("draft")
    res = speculative_eval(target, hf, prompts[:1], 4, stop_ids=[])
    assert "phases" not in res
    with phases.recording(phases.PhaseTimer("cpu")) as timer:
        assert phases.active() is timer
        with pytest.raises(KeyError, match="unknown phase 'verfy'"):
            with timer.phase("verfy"):
                pass
    assert phases.active() is phases.NO_PHASES


def test_dflash_eval_profile_phases_puts_them_in_the_json(tiny_hybrid_dir, tmp_path, capsys, caplog):
    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.serving.evaluate import main as eval_main

    target = load_target(str(tiny_hybrid_dir / "target"), torch.device("cpu"), torch.float32)
    cfg, model = _untrained(target)
    CheckpointManager(tmp_path / "run").save(1, model.state_dict(), cfg.to_dict(), {})
    argv = ["--target-model", str(tiny_hybrid_dir / "target"), "--checkpoint", str(tmp_path / "run"),
            "--data-dir", str(tiny_hybrid_dir / "heldout"), "--device", "cpu", "--max-prompts", "2",
            "--max-new-tokens", "8", "--no-block-accuracy", "--loop", "single", "--json", "--speed-batch", ""]
    res = {}
    for flag in ([], ["--profile-phases"]):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainer.evaluate"):
            assert eval_main(argv + flag) == 0
        res[bool(flag)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("  ")]
    assert "phases" not in res[False]
    on = res[True]
    assert on["accept_length_histogram"] == res[False]["accept_length_histogram"]
    assert set(on["phases"]) == {*STEP_PHASES, "rollback", "record"}
    assert on["phase_steps"] == on["verify_steps"] and on["phase_step_ms"] > 0
    for p in on["phases"].values():
        assert p["calls"] > 0 and p["ms_total"] > 0 and 0 < p["share"] < 1
    # the phases partition the step, "record" lying inside verify and prefill
    assert sum(p["share"] for name, p in on["phases"].items() if name not in phases.WITHIN) <= 1.0 + 1e-3
    names = [line.split()[0] for line in lines]
    assert names == [*on["phases"], "untimed"], lines   # one line per phase, then what none covers


def test_the_eval_bench_times_the_single_loops_phases(tmp_path, capsys, monkeypatch):
    """The GPU script that measured the single loop's 294 ms a verify step (trainer/lab/gpu/eval_bench.py) puts
    the same phases in its single row with --profile-phases; a CPU smoke at the tiny hybrid shape."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "trainer" / "lab" / "gpu"))
    import eval_bench

    out = tmp_path / "bench.json"
    assert eval_bench.main(["--shape", "qwen3.5-tiny", "--prompt-len", "24", "--new-tokens", "6", "--single-prompts",
                            "1", "--batches", "1", "--eager-batches", "", "--profile-phases", "--out", str(out)]) == 0
    single = json.loads(out.read_text())["rows"][0]
    assert single["variant"] == "single" and single["phase_steps"] == single["verify_steps"]
    assert set(single["phases"]) == {*STEP_PHASES, "rollback", "record"}
    assert "phases of the single loop" in capsys.readouterr().out


def test_on_a_gpu_each_phase_is_an_event_pair_read_once_at_the_end(monkeypatch):
    """A stand-in for CUDA's events (this suite runs on CPUs): a phase records one event before and one after on
    the current stream, no synchronisation happens while phases run, and summary() synchronises once and sums
    each phase's elapsed times."""
    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = len(log)
            log.append("record")

        def elapsed_time(self, end):
            return 2.0 * (end.t - self.t)   # ms: two per log entry between the events

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("sync"))
    timer = phases.PhaseTimer("cuda")
    for _ in range(3):
        with timer.phase("verify"):
            log.append("work")
        with timer.phase("accept"):
            pass
        timer.step()
    assert "sync" not in log and log.count("record") == 12
    got = timer.summary(step_ms=10.0)
    assert log.count("sync") == 1
    assert got["verify"] == {"ms_total": 12.0, "ms_per_verify_step": 4.0, "calls": 3, "share": 0.4}
    assert got["accept"]["ms_total"] == 6.0 and list(got) == ["verify", "accept"]
