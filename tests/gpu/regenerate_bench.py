"""dflash-regenerate at serving speed (issue 29, goal 3): the captured decoder beside transformers' generate.

    python tests/gpu/regenerate_bench.py --shape 8b --out results/h200-8b-regenerate-captured.json
    python tests/gpu/regenerate_bench.py --shape 27b --skip-old --batches 128 --out ...

Not part of the test suite: it needs a GPU. One process, one random-init target of the shape (real
shapes, bf16; random weights never emit EOS, so every row generates --new-tokens), all timings on the
same GPU in the same call:

1. parity: the captured decoder's CUDA graphs against the same loop run eagerly (the same kernels: the
   tokens must be identical), and agreement with `generate` (bf16 on random weights: near-ties, so only
   reported, not asserted; on the CPU in fp32 tests/test_regenerate.py asserts byte equality);
2. ratio: `generate` with a static cache (today's path, --decoder generate) and the captured decoder at
   the same batch size on the same prompts (--ratio-prompt-len tokens each, --ratio-new-tokens), then
   the captured decoder at each of --batches on the same prompt distribution;
3. headline: TargetGenerator.complete (dflash-regenerate's own call: prompts sorted by length, batches,
   graphs captured as needed and counted in the time) on --mixed-prompts prompts of uniform random
   length in [--min-len, --max-len], --new-tokens each, at each of --batches.
Each variant is warmed on a batch of its own shapes first except the headline, which is timed cold (the
captures included, as a real run pays them once). Prefill / decode / capture seconds are synchronised
breakdowns of the captured decoder.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.bench import SHAPES, kernel_profile, make_target_factory, results_file  # noqa: E402
from trainer.regenerate import TargetGenerator  # noqa: E402
from trainer.runlog import format_table  # noqa: E402


def prompts_of(rng, n, lo, hi, vocab):
    return [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))) for _ in range(n)]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def make_gen(target, dev, bs, new, decoder, static_cache=True):
    gen = TargetGenerator(target, str(dev), new, 0.0, bs, static_cache=static_cache, decoder=decoder)
    gen.stop_ids = []   # random weights: no early stop, every row generates `new` tokens
    return gen


def fast_breakdown(gen) -> dict:
    f = gen._fast
    if f is None:
        return {}
    t = dict(f.times)
    t["graphs_captured"] = f.captures
    f.times = {k: 0 if isinstance(v, int) else 0.0 for k, v in f.times.items()}
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}


VARIANTS = {"sdpa-bool": ("sdpa", False, False), "sdpa": ("sdpa", True, False), "matmul": ("matmul", True, False),
            "fused": ("sdpa", True, True)}   # fused: norms, rotary, SiLU gate compiled (fastgen.fused_small_ops)


def set_variant(gen, name):
    f = gen._fast_decoder()
    f.decode_kernel, f.float_mask, f.fuse = VARIANTS[name]
    return f


def step_variants(a, res, save, target, dev, rng, vocab, batches, cuda) -> int:
    """ms per captured decode step for each variant and batch (same prompts per batch), a kernel-class
    profile of one eager decode step per variant at the first batch, then the mixed workload with the
    fastest variant at --headline-batch."""
    L, new = a.ratio_prompt_len, a.step_new_tokens
    res["steps"], res["profiles"] = [], {}
    names = a.step_variants.split(",")
    for bs in batches:
        warm, batch = prompts_of(rng, bs, L, L, vocab), prompts_of(rng, bs, L, L, vocab)
        for name in names:
            try:
                g = make_gen(target, dev, bs, new, "captured")
                f = set_variant(g, name)
                g.complete(warm, 0)
                fast_breakdown(g)
                f.timed = True
                done, secs = timed(lambda: g.complete(batch, 0))
                row = {"variant": name, "batch_size": bs, "prompt_len": L, "new_tokens": new,
                       "tokens_per_s": round(sum(len(c) for c in done) / secs, 1)} | fast_breakdown(g)
                row["decode_ms_per_step"] = round(1000 * row["decode_s"] / max(1, row["decode_steps"]), 2)
                if bs == batches[0]:     # one eager decode step, kernels by class (none listed on the CPU)
                    f.graphs = False
                    f.max_new = 64
                    f._alloc(-(-L // 64) * 64 + 64 + 2 * f.view_step)   # room for two more steps
                    f.out = torch.zeros((bs, 80), dtype=torch.long, device=dev)   # room for the profiled steps
                    f.generate(batch, range(bs))   # leaves the cache 64 tokens past the prompt
                    view = -(-(int(f.cache.slot) + 2) // f.view_step) * f.view_step

                    def one():
                        with f._attn():
                            f._decode_step(view)
                    one()
                    if cuda:
                        prof = kernel_profile(one, dev, top=15) | {"batch_size": bs, "view": view}
                        res["profiles"][name] = prof
                        row["profile_gpu_ms"] = round(prof["gpu_ms"], 2)
                        row["profile_by_class_ms"] = {k: round(v, 2) for k, v in prof["by_class_ms"].items()}
                    else:
                        one()
            except Exception as e:  # noqa: BLE001
                row = {"variant": name, "batch_size": bs, "error": repr(e)[:500]}
            res["steps"].append(row)
            print("step:", json.dumps(row), flush=True)
            g = f = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            save()
    ok = [r for r in res["steps"] if "decode_ms_per_step" in r and r["batch_size"] == batches[0]]
    best = min(ok, key=lambda r: r["decode_ms_per_step"])["variant"] if ok else "sdpa"
    res["best_variant"] = best
    if a.headline_batch:
        bs, n = a.headline_batch, a.mixed_prompts or 2 * a.headline_batch
        try:
            g = make_gen(target, dev, bs, a.new_tokens, "captured")
            f = set_variant(g, best)
            f.timed = True
            mixed = prompts_of(np.random.default_rng(1), n, a.min_len, a.max_len, vocab)
            done, secs = timed(lambda: g.complete(mixed, 0))
            toks = sum(len(c) for c in done)
            row = {"variant": best, "batch_size": bs, "prompts": n, "min_len": a.min_len, "max_len": a.max_len,
                   "prompt_tokens": int(sum(len(q) for q in mixed)), "new_tokens": a.new_tokens,
                   "generated": toks, "seconds": round(secs, 3), "tokens_per_s": round(toks / secs, 1)} | \
                fast_breakdown(g)
        except Exception as e:  # noqa: BLE001
            row = {"variant": best, "batch_size": bs, "error": repr(e)[:500]}
        res["headline"].append(row)
        print("headline:", json.dumps(row), flush=True)
        save()
    print(format_table(["variant", "batch", "decode ms/step", "tok/s (512+%d)" % new, "profile GPU ms (eager step)"],
                       [[r["variant"], r["batch_size"], r.get("decode_ms_per_step"), r.get("tokens_per_s"),
                         r.get("profile_gpu_ms")] for r in res["steps"]]))
    for name, p in res["profiles"].items():
        print(name, {k: round(v, 2) for k, v in p["by_class_ms"].items()})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--batches", default="64,256", help="captured decoder batch sizes")
    p.add_argument("--old-batch", type=int, default=64, help="generate's batch size in the ratio")
    p.add_argument("--skip-old", action="store_true", help="no generate rows (the 27B figure)")
    p.add_argument("--ratio-prompt-len", type=int, default=512)
    p.add_argument("--ratio-new-tokens", type=int, default=512)
    p.add_argument("--mixed-prompts", type=int, default=0, help="0: 2 x the largest batch")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--skip-ratio", action="store_true")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--step-variants", default="",
                   help="only the decode step: comma list of sdpa-bool (the first run's code), sdpa, matmul, fused; "
                        "each timed at each of --batches on --ratio-prompt-len prompts with --step-new-tokens, "
                        "plus a kernel-class profile of one eager step; then --headline-best runs the mixed "
                        "workload with the fastest")
    p.add_argument("--step-new-tokens", type=int, default=128)
    p.add_argument("--headline-batch", type=int, default=0, help="with --step-variants: the mixed workload at "
                                                                 "this batch with the fastest variant")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()   # the CPU: a smoke run of the script (--shape tiny)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    batches = [int(b) for b in a.batches.split(",")]
    res, save = results_file(a.out, {"shape": a.shape, "started": time.time(), "shape_dims": dict(zip(
        ["hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab"], SHAPES[a.shape]))},
        parity={}, ratio=[], headline=[])
    meta = res["meta"]

    t0 = time.perf_counter()
    target = make_target_factory(a.shape, torch.bfloat16 if cuda else torch.float32)(dev)
    meta["init_s"] = round(time.perf_counter() - t0, 1)
    vocab = min(target.config.vocab_size, 150000)
    rng = np.random.default_rng(0)

    if a.step_variants:
        return step_variants(a, res, save, target, dev, rng, vocab, batches, cuda)

    # 1. parity: graphs vs the same loop eagerly; agreement with generate
    ps = prompts_of(rng, 8, 100, 200, vocab)
    cap = make_gen(target, dev, 8, 64, "captured")
    eager = make_gen(target, dev, 8, 64, "captured")
    eager._fast_decoder().graphs = False
    gen = make_gen(target, dev, 8, 64, "generate", static_cache=False)   # no compile for 64 tokens
    a_cap, a_eag, a_gen = cap.complete(ps, 0), eager.complete(ps, 0), gen.complete(ps, 0)
    same = [bool(np.array_equal(x, y)) for x, y in zip(a_cap, a_eag)]
    first_diff = [int(np.argmax(x != y)) if not np.array_equal(x, y) else len(x) for x, y in zip(a_cap, a_gen)]
    res["parity"] = {"graphs_equal_eager_rows": sum(same), "rows": len(same),
                     "agree_with_generate_prefix_tokens": first_diff, "new_tokens": 64}
    print(f"parity: graphs == eager on {sum(same)}/{len(same)} rows; first token differing from generate: "
          f"{first_diff} (of 64)", flush=True)
    del cap, eager, gen
    save()

    # 2. ratio: same prompts, generate vs captured at the same batch, then the captured batch sizes
    if not a.skip_ratio:
        L, new = a.ratio_prompt_len, a.ratio_new_tokens
        variants = [("captured", b) for b in sorted(set([a.old_batch] + batches))] + \
                   ([] if a.skip_old else [("generate", a.old_batch)])   # generate last: its compile is slow
        for decoder, bs in variants:
            try:
                g = make_gen(target, dev, bs, new, decoder)
                warm = prompts_of(rng, bs, L, L, vocab)
                _, warm_s = timed(lambda: g.complete(warm, 0))
                fast_breakdown(g)
                batch = prompts_of(rng, bs, L, L, vocab)
                done, secs = (None, 0.0)
                if g._fast is not None:
                    g._fast.timed = True
                done, secs = timed(lambda: g.complete(batch, 0))
                toks = sum(len(c) for c in done)
                row = {"decoder": decoder, "batch_size": bs, "prompt_len": L, "new_tokens": new,
                       "prompts": len(done), "generated": toks, "warm_s": round(warm_s, 2),
                       "seconds": round(secs, 3), "tokens_per_s": round(toks / secs, 1),
                       "ms_per_step": round(1000 * secs / new, 2)} | fast_breakdown(g)
                if g._fast is not None and row.get("decode_steps"):
                    row["decode_ms_per_step"] = round(1000 * row["decode_s"] / row["decode_steps"], 2)
            except Exception as e:  # noqa: BLE001  a variant that fails is a row, not the end of the run
                row = {"decoder": decoder, "batch_size": bs, "error": repr(e)[:500]}
            res["ratio"].append(row)
            print("ratio:", json.dumps(row), flush=True)
            g = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            save()
        base = next((r["tokens_per_s"] for r in res["ratio"] if r.get("decoder") == "generate"
                     and "tokens_per_s" in r), None)
        if base:
            for r in res["ratio"]:
                if "tokens_per_s" in r:
                    r["over_generate"] = round(r["tokens_per_s"] / base, 2)

    # 3. headline: dflash-regenerate's call on mixed prompt lengths, cold (captures counted)
    for bs in batches:
        n = a.mixed_prompts or 2 * max(batches)
        try:
            g = make_gen(target, dev, bs, a.new_tokens, "captured")
            mixed = prompts_of(np.random.default_rng(1), n, a.min_len, a.max_len, vocab)
            g._fast_decoder().timed = True
            done, secs = timed(lambda: g.complete(mixed, 0))
            toks = sum(len(c) for c in done)
            row = {"decoder": "captured", "batch_size": bs, "prompts": n, "min_len": a.min_len,
                   "max_len": a.max_len, "prompt_tokens": int(sum(len(q) for q in mixed)),
                   "new_tokens": a.new_tokens, "generated": toks, "seconds": round(secs, 3),
                   "tokens_per_s": round(toks / secs, 1)} | fast_breakdown(g)
            if cuda:
                row["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
        except Exception as e:  # noqa: BLE001
            row = {"decoder": "captured", "batch_size": bs, "error": repr(e)[:500]}
        res["headline"].append(row)
        print("headline:", json.dumps(row), flush=True)
        g = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        save()

    rows = [[a.shape, "ratio", r.get("decoder"), r.get("batch_size"), r.get("prompt_len"), r.get("new_tokens"),
             r.get("tokens_per_s"), r.get("over_generate"), r.get("error", "")[:40]] for r in res["ratio"]]
    rows += [[a.shape, "mixed", r.get("decoder"), r.get("batch_size"), f"{a.min_len}-{a.max_len}",
              r.get("new_tokens"), r.get("tokens_per_s"), None, r.get("error", "")[:40]] for r in res["headline"]]
    print(format_table(["shape", "run", "decoder", "batch", "prompt", "new", "gen tok/s", "x generate", "error"],
                       rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
