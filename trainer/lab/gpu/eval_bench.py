"""dflash-eval's loop: today's one-prompt loop beside the batched, captured one.

    python trainer/lab/gpu/eval_bench.py --shape 8b --out results/h200-8b-eval-loop.json

Not part of the test suite: it needs a GPU. One process, a random-init bf16 target of the shape and a random
drafter (5 layers, block 16), as `python -m trainer.lab.bench --serving` builds them; prompts of --prompt-len random tokens, --new-tokens each, no stop tokens. Random weights accept
about one token per verify step, so verify steps/s is the loop's cost per step, not a serving speed-up.
Each variant is warmed on prompts of the same shapes first (the captures happen there), then timed:

    single            evaluate.generate_each(loop="single"): dflash_generate, one prompt at a time (today)
    batched-eager-B   eval_decoder.BatchedSpecDecoder at batch B, no graphs
    batched-B         the same with the step captured as CUDA graphs (dflash-eval's default on GPUs)

--profile-phases: the timed single loop's phases (trainer/serving/phases.py: prefill, draft, verify, rollback,
accept; CUDA events read once at the end) in its row, as dflash-eval --profile-phases gives them, and one line
each on stdout.

Parity: per prompt, the accept lengths and tokens of `single` and `batched-16` on the timed prompts (bf16:
batched GEMMs round differently, so near-ties of random logits may part; reported, not asserted; on the
CPU in fp32 tests/serving/test_evaluate.py asserts equality).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.engine.runlog import format_table  # noqa: E402
from trainer.lab.bench.profile import kernel_profile  # noqa: E402
from trainer.lab.bench.run import results_file  # noqa: E402
from trainer.lab.bench.shapes import SHAPES, make_target_factory  # noqa: E402
from trainer.model.drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from trainer.model.families import HybridTransformersTooOld, check_hybrid_transformers  # noqa: E402
from trainer.model.modeling_dflash import dflash_generate  # noqa: E402
from trainer.model.target import decoder  # noqa: E402
from trainer.serving.captured.eval_decoder import BatchedSpecDecoder  # noqa: E402
from trainer.serving.captured.linear_states import timed_recurrent_steps  # noqa: E402
from trainer.serving.evaluate import hf_drafter  # noqa: E402
from trainer.serving.phases import NO_PHASES, PhaseTimer, lines, report  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def single_loop(drafter, target, prompts, new: int, dev, timer: PhaseTimer | None = None) -> list:
    """Today's loop on each prompt: (accept lengths, generated tokens); `timer`: its phases, the recording of the
    hybrid's per-position states among them (linear_states.timed_recurrent_steps)."""
    with timed_recurrent_steps(decoder(target), timer or NO_PHASES):
        outs = [dflash_generate(drafter, target, torch.as_tensor(q, device=dev)[None], new, [], phases=timer)
                for q in prompts]
    return [(o.accept_lengths, o.output_ids[0, o.num_prompt_tokens:].tolist()) for o in outs]


def timed_phases(timer: PhaseTimer | None, secs: float) -> tuple[float, dict]:
    """(secs, a row's phases: phases.report, their lines printed; {} without a timer)."""
    if timer is None:
        return secs, {}
    out = report(timer, secs)
    print("\n".join(lines(out["phases"], out["phase_step_ms"] or 0.0, "single")), flush=True)
    return secs, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--single-prompts", type=int, default=3, help="prompts timed with today's loop (a rate)")
    p.add_argument("--batches", default="1,16,64", help="batched loop batch sizes (graphs on)")
    p.add_argument("--eager-batches", default="16", help="batched loop batch sizes without graphs")
    p.add_argument("--profile-batch", type=int, default=16, help="kernel classes of one eager step (0: none)")
    p.add_argument("--profile-phases", action="store_true", help="time the single loop's phases (phases.py)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    try:   # a hybrid shape on a transformers older than our cache API: one line, before the target is built
        check_hybrid_transformers(SHAPES[a.shape].linear is not None, f"--shape {a.shape}")
    except HybridTransformersTooOld as e:
        print(f"eval_bench: error: {e}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    res, save = results_file(a.out, {"shape": a.shape, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                                     "block_size": 16, "draft_layers": 5}, rows=[], parity={})
    meta = res["meta"]
    t0 = time.perf_counter()
    target = make_target_factory(a.shape, dtype)(dev)
    dcfg = DFlashConfig.from_target(target.config, num_draft_layers=5, block_size=16,
                                    mask_token_id=target.config.vocab_size - 1)
    torch.manual_seed(0)
    state = {k: v.to(dev) for k, v in DFlashDrafter(dcfg).state_dict().items()}
    drafter = hf_drafter(dcfg, state, dev, dtype)
    del state
    meta["init_s"] = round(time.perf_counter() - t0, 1)
    vocab = min(target.config.vocab_size, 150000)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in a.batches.split(",") if b]
    eager = [int(b) for b in a.eager_batches.split(",") if b]
    pool = [rng.integers(0, vocab, a.prompt_len) for _ in range(2 * max(batches + eager) + 16 + a.single_prompts)]
    L, new = a.prompt_len, a.new_tokens
    def row(name, batch, prompts, each, secs, extra=None):
        steps = sum(len(x[0]) for x in each)
        r = {"variant": name, "batch_size": batch, "prompts": prompts, "verify_steps": steps,
             "new_tokens": int(sum(x[1] for x in each)), "seconds": round(secs, 3),
             "verify_steps_per_s": round(steps / secs, 1), "tau": round(steps and
                                                                        sum(sum(x[0]) for x in each) / steps, 4)}
        r.update(extra or {})
        res["rows"].append(r)
        print("row:", json.dumps(r), flush=True)
        save()

    # today's loop (what generate_each(loop="single") runs): warm on one prompt, then timed; tokens kept
    single_loop(drafter, target, pool[-1:], new, dev)
    sync()
    timer, t = PhaseTimer(dev) if a.profile_phases else None, time.perf_counter()
    single = single_loop(drafter, target, pool[:a.single_prompts], new, dev, timer)
    sync()
    row("single", 1, a.single_prompts, [(x, len(y)) for x, y in single], *timed_phases(timer, time.perf_counter() - t))

    for b, graphs in [(b, False) for b in eager] + [(b, True) for b in batches]:
        name = f"batched-{b}" if graphs else f"batched-eager-{b}"
        try:
            n = b if b >= 16 else min(16, 4 * b)      # batch 1: 4 prompts (a rate); else at least one full batch
            dec = BatchedSpecDecoder(target, drafter, dev, b, new, [], graphs=graphs)
            warm = pool[-b:]
            t = time.perf_counter()
            dec.generate(warm)
            sync()
            warm_s = time.perf_counter() - t
            steps0 = dec.steps
            t = time.perf_counter()
            got = []
            for i in range(0, n, b):
                got += dec.generate(pool[i:i + b])
            sync()
            secs = time.perf_counter() - t
            each = [(lengths, len(toks)) for lengths, toks in got]
            row(name, b, n, each, secs, {"warm_s": round(warm_s, 2), "graphs_captured": dec.captures,
                                         "batched_steps": dec.steps - steps0,
                                         "ms_per_batched_step": round(1000 * secs / max(1, dec.steps - steps0), 2)})
            if graphs and b == 16:   # parity with today's loop on the same prompts (the timed ones)
                k = len(single)
                res["parity"] = {"prompts": k,
                                 "accept_lengths_equal": sum(single[i][0] == got[i][0] for i in range(k)),
                                 "tokens_equal": sum(single[i][1] == got[i][1].tolist() for i in range(k)),
                                 "first_token_differing": [next((j for j, (x, y) in enumerate(
                                     zip(single[i][1], got[i][1].tolist())) if x != y), None) for i in range(k)]}
                print("parity:", res["parity"], flush=True)
                save()
            if not graphs and b == a.profile_batch and cuda:   # one eager step, kernels by class
                dec._alloc(L + new + 32)

                def one():
                    with dec._target_attn():
                        dec._step(-(-(L + 16) // dec.view_step) * dec.view_step)
                dec.generate(pool[:b])
                dec.done.zero_()
                dec.start.fill_(L)
                dec.step.zero_()     # the step counter indexes the per-step log: back to its first column
                one()
                prof = kernel_profile(one, dev, top=15)
                res["profile"] = prof | {"batch_size": b}
                print("profile:", {k: round(v, 2) for k, v in prof["by_class_ms"].items()},
                      round(prof["gpu_ms"], 2), flush=True)
                save()
        except Exception as e:  # noqa: BLE001  a variant that fails is a row, not the end of the run
            res["rows"].append({"variant": name, "batch_size": b, "error": repr(e)[:500]})
            print("error:", name, repr(e)[:500], flush=True)
            save()
        dec = None
        if cuda:
            torch.cuda.empty_cache()
    base = res["rows"][0]["verify_steps_per_s"]
    for r in res["rows"]:
        if "verify_steps_per_s" in r:
            r["over_single"] = round(r["verify_steps_per_s"] / base, 2)
    if cuda:
        meta["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    save()
    print(format_table(["variant", "batch", "prompts", "verify steps/s", "x single", "ms/batched step", "tau"],
                       [[r["variant"], r["batch_size"], r.get("prompts"), r.get("verify_steps_per_s"),
                         r.get("over_single"), r.get("ms_per_batched_step"), r.get("tau", r.get("error", "")[:40])]
                        for r in res["rows"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
