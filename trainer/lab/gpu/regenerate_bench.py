"""dflash-regenerate at serving speed: the captured decoder beside transformers' generate.

    python trainer/lab/gpu/regenerate_bench.py --shape 8b --out results/h200-8b-regenerate-captured.json
    python trainer/lab/gpu/regenerate_bench.py --shape 27b --skip-old --batches 128 --out ...

Not part of the test suite: it needs a GPU. One process, one random-init target of the shape (real
shapes, bf16; random weights never emit EOS, so every row generates --new-tokens), all timings on the
same GPU in the same call:

1. parity: the captured decoder's CUDA graphs against the same loop run eagerly (the same kernels: the
   tokens must be identical), and agreement with `generate` (bf16 on random weights: near-ties, so only
   reported, not asserted; on the CPU in fp32 tests/serving/test_regenerate.py asserts byte equality);
2. ratio: `generate` with a static cache (today's path, --decoder generate) and the captured decoder at
   the same batch size on the same prompts (--ratio-prompt-len tokens each, --ratio-new-tokens), then
   the captured decoder at each of --batches on the same prompt distribution;
3. headline: TargetGenerator.complete (dflash-regenerate's own call: prompts sorted by length, batches,
   graphs captured as needed and counted in the time) on --mixed-prompts prompts of uniform random
   length in [--min-len, --max-len], --new-tokens each, at each of --batches.
--attention-check: first the split-KV decode attention (trainer/ops/decode_attn.py) against
SDPA at the shape's attention (errors against fp32 math, a tile/split sweep, times in CUDA graphs; --attn-fp8
also an fp8 cache), then the triton decoder's tokens against its own eager loop and the sdpa decoder's.
--step-variants / --headline-variants name VARIANTS below (fused, fused-triton, fused-triton-trim, ...).
Each variant is warmed on a batch of its own shapes first except the headline, which is timed cold (the
captures included, as a real run pays them once). Prefill / decode / capture seconds are synchronised
breakdowns of the captured decoder.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.engine.runlog import format_table  # noqa: E402
from trainer.lab.bench.profile import kernel_profile  # noqa: E402
from trainer.lab.bench.run import results_file  # noqa: E402
from trainer.lab.bench.shapes import (  # noqa: E402
    SHAPES,
    make_target_factory,
)
from trainer.model.families import HybridTransformersTooOld, check_hybrid_transformers  # noqa: E402
from trainer.serving.regenerate import TargetGenerator  # noqa: E402


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
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}
    if f.prefill_chunks:   # [rows, width, seconds] of each prefill row chunk, in order
        out["prefill_chunks"], f.prefill_chunks = f.prefill_chunks, []
    return out


VARIANTS = {"sdpa-bool": ("sdpa", False, False), "sdpa": ("sdpa", True, False), "matmul": ("matmul", True, False),
            "fused": ("sdpa", True, True),   # fused: norms, rotary, SiLU gate compiled (fused_ops.fused_small_ops)
            "triton": ("triton", True, False),   # triton: the split-KV decode attention (trainer/ops/decode_attn.py)
            "fused-triton": ("triton", True, True),
            "fused-trim": ("sdpa", True, True, True),   # trim: each prefill row chunk at its own width
            "fused-triton-trim": ("triton", True, True, True),
            "fused-triton-trim-fp8": ("triton", True, True, True, True),   # fp8: the KV cache in fp8 e4m3
            # the fp8 cache read as fp16 operands (decode_attn.CONFIG["fp8_convert"]; the row above: "bf16")
            "fused-triton-trim-fp8-fp16": ("triton", True, True, True, True, "fp16"),
            "fused-triton-trim-fp8-shift": ("triton", True, True, True, True, "shift"),
            # the fp8 cache read by fp8 tensor-core products, q and the probabilities rounded to e4m3 ("dot")
            "fused-triton-trim-fp8-dot": ("triton", True, True, True, True, "dot"),
            # w8: the target's decoder-layer linears in fp8 (quantize_weights_fp8 below; the shared target is
            # quantized in place at the first such variant, so they run after the bf16 ones), each MLP compiled
            # whole (GraphDecoder fuse_mlp); -nomlp: the MLP as in `fused`
            "fused-triton-trim-w8": ("triton", True, True, True, False, "bf16", True, True),
            "fused-triton-trim-w8-nomlp": ("triton", True, True, True, False, "bf16", True, False),
            # inplace: a hybrid's recurrent states written in place by FLA's kernel (GraphDecoder state_inplace)
            "fused-triton-trim-inplace": ("triton", True, True, True, False, "bf16", False, False, True),
            "fused-trim-inplace": ("sdpa", True, True, True, False, "bf16", False, False, True),
            # bf16state: the recurrent states stored in bf16 (GraphDecoder state_dtype; other numerics)
            "fused-triton-trim-inplace-bf16state": ("triton", True, True, True, False, "bf16", False, False, True,
                                                    True),
            # nolinear: a hybrid's gated norm and one-position conv update left eager, as before 2026-12-04's
            # session 3 (GraphDecoder fuse_linear=False): the side-by-side baseline of compiling them
            "fused-triton-trim-inplace-nolinear": ("triton", True, True, True, False, "bf16", False, False, True,
                                                   False, False),
            "fused-triton-trim-inplace-bf16state-nolinear": ("triton", True, True, True, False, "bf16", False,
                                                             False, True, True, False),
            # bv32 / bv64: FLA's recurrent kernel with a K x 32 (x 64) state tile and 4 warps in place of its
            # K x 8 and one warp (GraphDecoder recurrent_tile; _AliasFinalState says why)
            "fused-triton-trim-inplace-bv32": ("triton", True, True, True, False, "bf16", False, False, True,
                                               False, True, (32, 4)),
            "fused-triton-trim-inplace-bf16state-bv32": ("triton", True, True, True, False, "bf16", False, False,
                                                         True, True, True, (32, 4)),
            "fused-triton-trim-inplace-bf16state-bv64": ("triton", True, True, True, False, "bf16", False, False,
                                                         True, True, True, (64, 4))}

def weights_fp8(name: str) -> bool:
    v = VARIANTS[name]
    return len(v) > 6 and v[6]


def graph_ms(fn, reps: int = 20, rounds: int = 3) -> float:
    """GPU ms per call of fn, `reps` calls captured in one CUDA graph (no launch overhead), best of rounds.
    Without CUDA (a smoke run: Triton's interpreter on the CPU): wall ms of one call."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / reps)
    del g
    return best


def attention_check(a, res, save, dev, dims) -> None:
    """The split-KV kernel against SDPA (the captured decoder's default) at the target's attention shape:
    errors of both against fp32 math, their tokens' inputs the same; a sweep of the kernel's tile and split
    at --attn-sweep-batch x --attn-sweep-len (full view read: bandwidth against the copy rate), then the best
    configuration at each of --attn-cases (batch x view), with and without the tiles skipped (left padding,
    the unwritten tail). Times: CUDA graphs of 20 calls, one layer's attention per call."""
    import torch.nn.functional as F

    from trainer.ops import decode_attn as da

    _, _, heads, kvh, d, _, _ = dims
    g = heads // kvh
    bf = torch.bfloat16
    out = res.setdefault("attention", {})
    x = torch.empty(2 << 30 if dev.type == "cuda" else 1 << 20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = graph_ms(lambda: y.copy_(x), reps=5)
    out["copy_tb_s"] = round(2 * x.numel() / ms / 1e9, 3)   # read + write
    print(f"attention: copy rate {out['copy_tb_s']} TB/s (read + write of {x.numel() >> 20} MiB)", flush=True)
    x = y = None   # frees them (a del would unbind the names the lambdas read)

    def inputs(b, L, seed=0):
        gen = torch.Generator(device=dev).manual_seed(seed)
        cap = L + 128
        q = torch.randn(b, heads, d, device=dev, dtype=bf, generator=gen)
        kb = torch.randn(b, kvh, cap, d, device=dev, dtype=bf, generator=gen)
        vb = torch.randn(b, kvh, cap, d, device=dev, dtype=bf, generator=gen)
        start = torch.randint(0, L // 2, (b,), device=dev, generator=gen)
        last = torch.tensor([L - 1 - L // 16], device=dev)   # the view's unwritten tail
        pos = torch.arange(L, device=dev)
        keep = (pos[None] >= start[:, None]) & (pos[None] <= last)
        mask = torch.zeros(b, 1, 1, L, dtype=bf, device=dev).masked_fill_(~keep[:, None, None], float("-inf"))
        return q, kb[:, :, :L], vb[:, :, :L], mask, start, last

    def sdpa(q, k, v, mask):
        b = q.shape[0]
        return F.scaled_dot_product_attention(q.reshape(b, kvh, g, d), k, v, attn_mask=mask).reshape(b, heads, d)

    if not a.attn_no_sweep:
        # sweep: full view read, no skipping
        b, L = a.attn_sweep_batch, a.attn_sweep_len
        q, k, v, mask, start, last = inputs(b, L)
        gb = da.kv_read_bytes(b, kvh, L, d, 2) / 1e9
        sweep = []
        base = {"sdpa": round(graph_ms(lambda: sdpa(q, k, v, mask)), 4)}
        tiles = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3)]
        for bn, nw, ns in tiles:
            try:
                t = graph_ms(lambda: da.split_kv_triton(q, k, v, mask, block_n=bn, num_warps=nw, num_stages=ns,
                                                        split_len=512))
                sweep.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "split_len": 512, "ms": round(t, 4)})
            except Exception as e:  # noqa: BLE001
                sweep.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "split_len": 512, "error": repr(e)[:200]})
            print("attention sweep:", json.dumps(sweep[-1]), flush=True)
        best = min((r for r in sweep if "ms" in r), key=lambda r: r["ms"])
        for sl in (128, 256, 1024, 1 << 20):
            bn, nw, ns = best["block_n"], best["num_warps"], best["num_stages"]
            try:
                t = graph_ms(lambda: da.split_kv_triton(q, k, v, mask, block_n=bn, num_warps=nw, num_stages=ns,
                                                        split_len=sl))
                sweep.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "split_len": sl, "ms": round(t, 4)})
            except Exception as e:  # noqa: BLE001
                sweep.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "split_len": sl, "error": repr(e)[:200]})
            print("attention sweep:", json.dumps(sweep[-1]), flush=True)
        best = min((r for r in sweep if "ms" in r), key=lambda r: r["ms"])
        for r in sweep:
            if "ms" in r:
                r["tb_s"] = round(gb / r["ms"], 3)
        da.CONFIG.update({k: best[k] for k in ("block_n", "split_len", "num_warps", "num_stages")})
        out["sweep"] = {"batch": b, "view": L, "kv_gb": round(gb, 4), "sdpa_ms": base["sdpa"],
                        "sdpa_tb_s": round(gb / base["sdpa"], 3), "rows": sweep, "best": dict(da.CONFIG)}
        print(f"attention sweep best {da.CONFIG}: {best['ms']} ms ({best['tb_s']} TB/s) vs sdpa {base['sdpa']} ms "
              f"({gb / base['sdpa']:.3f} TB/s); {gb:.3f} GB of K and V", flush=True)
        save()

    # parity and speed at each case, with the configuration chosen above
    out["cases"] = []
    for case in a.attn_cases.split(","):
        b, L = (int(t) for t in case.split("x"))
        q, k, v, mask, start, last = inputs(b, L, seed=1)
        sf = torch.einsum("bkgd,bkld->bkgl", q.reshape(b, kvh, g, d).float(), k.float()) * d ** -0.5
        ref = torch.einsum("bkgl,bkld->bkgd", torch.softmax(sf + mask.float(), -1), v.float()).reshape(b, heads, d)
        del sf
        o_s = sdpa(q, k, v, mask)
        o_t = da.split_kv_triton(q, k, v, mask, None, start, last)
        o_f = da.split_kv_triton(q, k, v, mask)
        gb = da.kv_read_bytes(b, kvh, L, d, 2) / 1e9
        row = {"batch": b, "view": L, "kv_gb": round(gb, 4),
               "sdpa_max_abs_err_vs_fp32": (o_s.float() - ref).abs().max().item(),
               "triton_max_abs_err_vs_fp32": (o_t.float() - ref).abs().max().item(),
               "triton_noskip_max_abs_err_vs_fp32": (o_f.float() - ref).abs().max().item(),
               "triton_vs_sdpa_max_abs": (o_t.float() - o_s.float()).abs().max().item(),
               "sdpa_mean_abs_err_vs_fp32": (o_s.float() - ref).abs().mean().item(),
               "triton_mean_abs_err_vs_fp32": (o_t.float() - ref).abs().mean().item(),
               "sdpa_ms": round(graph_ms(lambda: sdpa(q, k, v, mask)), 4),
               "triton_ms": round(graph_ms(lambda: da.split_kv_triton(q, k, v, mask, None, start, last)), 4),
               "triton_noskip_ms": round(graph_ms(lambda: da.split_kv_triton(q, k, v, mask)), 4)}
        row["sdpa_tb_s"] = round(gb / row["sdpa_ms"], 3)
        row["triton_noskip_tb_s"] = round(gb / row["triton_noskip_ms"], 3)
        row["speedup"] = round(row["sdpa_ms"] / row["triton_ms"], 3)
        if a.attn_fp8:   # the same keys and values stored in fp8 e4m3 (the --kv-fp8 cache)
            kq, vq = da.to_fp8(k), da.to_fp8(v)
            mode0 = da.CONFIG.get("fp8_convert", "bf16")
            for mode in a.attn_fp8_modes.split(","):   # "bf16" keeps the first call's keys (fp8_ms, ...)
                da.CONFIG["fp8_convert"] = mode
                key = "fp8" if mode == "bf16" else f"fp8_{mode}"
                try:
                    o_q = da.split_kv_triton(q, kq, vq, mask, None, start, last)
                    row[f"{key}_max_abs_err_vs_fp32"] = (o_q.float() - ref).abs().max().item()
                    row[f"{key}_mean_abs_err_vs_fp32"] = (o_q.float() - ref).abs().mean().item()
                    row[f"{key}_ms"] = round(graph_ms(lambda: da.split_kv_triton(q, kq, vq, mask, None, start, last)), 4)
                    row[f"{key}_noskip_ms"] = round(graph_ms(lambda: da.split_kv_triton(q, kq, vq, mask)), 4)
                    row[f"{key}_noskip_tb_s"] = round(gb / 2 / row[f"{key}_noskip_ms"], 3)
                    del o_q
                except Exception as e:  # noqa: BLE001  a mode that fails is a field, not the end of the run
                    row[f"{key}_error"] = repr(e)[:300]
                if mode == "dot" and not out["cases"] and f"{key}_ms" in row:
                    # the fp8 products' own tile (first case, whole view): the best goes into CONFIG's fp8_* keys
                    sweep = []
                    for bn, nw, ns in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
                                       (256, 8, 2)):
                        try:
                            t = graph_ms(lambda: da.split_kv_triton(q, kq, vq, mask, block_n=bn, num_warps=nw,
                                                                    num_stages=ns))
                            sweep.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "ms": round(t, 4),
                                          "tb_s": round(gb / 2 / t, 3)})
                        except Exception as e:  # noqa: BLE001
                            sweep.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "error": repr(e)[:200]})
                        print("fp8 dot sweep:", json.dumps(sweep[-1]), flush=True)
                    row["fp8_dot_sweep"] = sweep
                    best = min((r for r in sweep if "ms" in r), key=lambda r: r["ms"], default=None)
                    if best is not None:
                        da.CONFIG.update(fp8_block_n=best["block_n"], fp8_num_warps=best["num_warps"],
                                         fp8_num_stages=best["num_stages"])
                        row["fp8_dot_best"] = best
            da.CONFIG["fp8_convert"] = mode0
            del kq, vq
        out["cases"].append(row)
        print("attention case:", json.dumps(row), flush=True)
        q = k = v = mask = ref = o_s = o_t = o_f = None   # frees them, as above
        torch.cuda.empty_cache()
        save()


def token_parity(res, save, target, dev, rng, vocab) -> None:
    """8 rows of 100-200 prompt tokens, 64 new: the triton decoder's graphs against its own eager loop (the
    same kernels: identical), and against the sdpa decoder (bf16 on random weights: reported, the first
    token where each row parts)."""
    ps = prompts_of(rng, 8, 100, 200, vocab)
    outs = {}
    for name, kernel, graphs in (("sdpa", "sdpa", True), ("triton", "triton", True), ("triton-eager", "triton", False)):
        g = make_gen(target, dev, 8, 64, "captured")
        f = g._fast_decoder()
        f.decode_kernel = kernel
        f.graphs = f.graphs and graphs
        outs[name] = g.complete(ps, 0)
    same = [bool(np.array_equal(x, y)) for x, y in zip(outs["triton"], outs["triton-eager"])]
    eq_sdpa = [bool(np.array_equal(x, y)) for x, y in zip(outs["triton"], outs["sdpa"])]
    first = [int(np.argmax(x != y)) if not np.array_equal(x, y) else len(x) for x, y in zip(outs["triton"], outs["sdpa"])]
    # prefill_trim: rows prefilled one by one (prefill_tokens 256), each at its own width or at the batch's
    trim = {}
    for on in (False, True):
        g = make_gen(target, dev, 8, 64, "captured")
        f = g._fast_decoder()
        f.decode_kernel, f.prefill_tokens, f.prefill_trim = "triton", 256, on
        trim[on] = g.complete(ps, 0)
    first_trim = [int(np.argmax(x != y)) if not np.array_equal(x, y) else len(x) for x, y in zip(trim[True], trim[False])]
    extra = {}
    if getattr(f, "linear_ids", None):   # a hybrid: FLA's kernel writing the states in place, the same tokens
        g = make_gen(target, dev, 8, 64, "captured")
        g._fast_decoder().decode_kernel, g._fast_decoder().state_inplace = "triton", True
        inplace = g.complete(ps, 0)
        extra["inplace_equal_triton_rows"] = sum(bool(np.array_equal(x, y)) for x, y in zip(inplace, outs["triton"]))
        g = make_gen(target, dev, 8, 64, "captured")   # bf16 states: where each row parts from fp32 states
        f16 = g._fast_decoder()
        f16.decode_kernel, f16.state_inplace, f16.state_dtype = "triton", True, torch.bfloat16
        extra["bf16_state_first_token_differing"] = [
            int(np.argmax(x != y)) if not np.array_equal(x, y) else len(x) for x, y in zip(g.complete(ps, 0), inplace)]
    res["token_parity"] = {**extra, "rows": 8, "new_tokens": 64, "triton_graphs_equal_eager_rows": sum(same),
                           "triton_equal_sdpa_rows": sum(eq_sdpa), "first_token_differing_from_sdpa": first,
                           "trim_equal_untrimmed_rows": sum(x == 64 for x in first_trim),
                           "trim_first_token_differing": first_trim}
    print("token parity:", json.dumps(res["token_parity"]), flush=True)
    save()


def is_fp8_weight(w) -> bool:
    """A quantized (tensor subclass) weight, as quantize_weights_fp8 leaves it, not a plain tensor."""
    return type(w) not in (torch.Tensor, torch.nn.Parameter)


def quantize_weights_fp8(model) -> int:
    """The `w8` variants: every nn.Linear in the decoder's layers to torchao's float8 inference form, in place
    (weights e4m3 with one scale per output row, inputs quantized per row at each call, torch._scaled_mm);
    embeddings, norms and the LM head stay bf16, as serving engines' FP8 checkpoints keep them. Returns the
    number of layers converted. Needs torchao and compute capability 8.9+ (torchao refuses a CPU)."""
    from trainer import allow_optional
    from trainer.model.target import decoder

    allow_optional("torchao")   # the programs defer it (trainer/optional.py)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    layers = decoder(model).layers
    n = sum(isinstance(m, torch.nn.Linear) for m in layers.modules())
    quantize_(layers, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return n


def set_variant(gen, name):
    from trainer.ops import decode_attn as da

    v = VARIANTS[name]
    quantized = is_fp8_weight(gen._fast_decoder().base.layers[0].mlp.gate_proj.weight)
    if weights_fp8(name) and not quantized:   # once, in place: every later variant sees fp8 weights
        t0 = time.perf_counter()
        n = quantize_weights_fp8(gen.model)
        print(f"weights: {n} linear layers quantized to fp8 in {time.perf_counter() - t0:.1f}s", flush=True)
        gen._fast = None
    elif quantized and not weights_fp8(name):
        raise RuntimeError(f"{name}: a bf16-weight variant after the target was quantized (list w8 variants last)")
    f = gen._fast_decoder()
    f.decode_kernel, f.float_mask, f.fuse = v[:3]
    f.prefill_trim = v[3] if len(v) > 3 else False
    f.kv_fp8 = v[4] if len(v) > 4 else False
    da.CONFIG["fp8_convert"] = v[5] if len(v) > 5 else "bf16"   # read when the step's graphs are captured
    f.fuse_mlp = v[7] if len(v) > 7 else False
    f.state_inplace = v[8] if len(v) > 8 else False
    f.state_dtype = torch.bfloat16 if len(v) > 9 and v[9] else torch.float32
    f.fuse_linear = v[10] if len(v) > 10 else True
    f.recurrent_tile = v[11] if len(v) > 11 else None
    return f


def weights_parity(res, save, target, dev, rng, vocab) -> None:
    """--weights-parity: what fp8 weights (the `w8` variants) do to the target's logits, teacher-forced on 8
    random prompts of 256 tokens: bf16 and fp8 each against fp32 (the same weights: bf16 -> fp32 -> bf16 is
    exact), relative L2 error of the logits and top-1 agreement. Quantizes the shared target: call it after
    every bf16 variant. Random weights make near-flat logits, so top-1 agreement is a lower bound."""
    ids = torch.as_tensor(np.stack(prompts_of(rng, 8, 256, 256, vocab)), device=dev)

    @torch.no_grad()
    def logits():
        return torch.cat([target(input_ids=ids[i:i + 2]).logits.float() for i in range(0, len(ids), 2)])

    bf16 = logits()
    buffers = [(m, n, b) for m in target.modules() for n, b in m._buffers.items() if b is not None]
    target.float()
    fp32 = logits()
    target.to(torch.bfloat16)
    for m, n, b in buffers:   # the rotary tables etc. as they were (.to converts buffers too)
        m._buffers[n] = b
    quantize_weights_fp8(target)
    w8 = logits()

    def cmp(x):
        return {"rel_l2": float((x - fp32).norm() / fp32.norm()),
                "top1_agree": float((x.argmax(-1) == fp32.argmax(-1)).float().mean())}
    res["weights_parity"] = {"prompts": 8, "tokens": 256, "bf16_vs_fp32": cmp(bf16), "fp8_vs_fp32": cmp(w8),
                             "fp8_vs_bf16_top1": float((w8.argmax(-1) == bf16.argmax(-1)).float().mean()),
                             "fp32_logit_std": float(fp32.std())}
    print("weights parity:", json.dumps(res["weights_parity"]), flush=True)
    save()


def step_variants(a, res, save, target, dev, rng, vocab, batches, cuda) -> int:
    """ms per captured decode step for each variant and batch (same prompts per batch), a kernel-class
    profile of one eager decode step per variant at the first batch, then the mixed workload with the
    fastest variant at --headline-batch."""
    new = a.step_new_tokens
    res["steps"], res["profiles"] = [], {}
    names = a.step_variants.split(",")

    def record(section: str, row: dict) -> None:
        """A row into the results (printed, saved now: a cut-short call keeps it), the GPU memory freed."""
        res[section].append(row)
        print(f"{section}:", json.dumps(row), flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        save()

    heads = (a.headline_variants.split(",") if a.headline_variants else []) if a.headline_batch else []
    # bf16-weight variants first (steps, then their headlines), then the fp8-weight ones: quantizing the shared
    # target is one-way
    for phase in (False, True):
        phase_names = [n for n in names if weights_fp8(n) == phase]
        phase_heads = [n for n in heads if weights_fp8(n) == phase]
        if phase and a.weights_parity and phase_names:
            try:   # a failure is recorded; the w8 rows below then fail alone
                weights_parity(res, save, target, dev, rng, vocab)
            except Exception as e:  # noqa: BLE001
                res["weights_parity"] = {"error": repr(e)[:500]}
                save()
        step_rows(a, res, record, target, dev, rng, vocab, batches, cuda, phase_names)
        headlines(a, res, record, dev, vocab, cuda, target, phase_heads)
    if a.headline_batch and not a.headline_variants:   # the fastest variant's headline
        ok = [r for r in res["steps"] if "decode_ms_per_step" in r and r["batch_size"] == batches[0]]
        best = min(ok, key=lambda r: r["decode_ms_per_step"])["variant"] if ok else "sdpa"
        res["best_variant"] = best
        headlines(a, res, record, dev, vocab, cuda, target, [best])
    prefill_compare(a, res, record, dev, vocab, target)
    print(format_table(["variant", "batch", "decode ms/step", "tok/s (512+%d)" % new, "profile GPU ms (eager step)"],
                       [[r["variant"], r["batch_size"], r.get("decode_ms_per_step"), r.get("tokens_per_s"),
                         r.get("profile_gpu_ms")] for r in res["steps"]]))
    for name, p in res["profiles"].items():
        print(name, {k: round(v, 2) for k, v in p["by_class_ms"].items()})
    for r in res["headline"]:
        print("headline:", r.get("variant"), r.get("tokens_per_s"), r.get("error", ""))
    return 0


def step_rows(a, res, record, target, dev, rng, vocab, batches, cuda, names) -> None:
    """ms per captured decode step of each variant in `names` at each batch, a kernel-class profile of one
    eager decode step at the first batch."""
    L, new = a.ratio_prompt_len, a.step_new_tokens
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
            g = f = None
            record("steps", row)


def headlines(a, res, record, dev, vocab, cuda, target, names) -> None:
    """The mixed workload (dflash-regenerate's own call), cold, at --headline-batch for each of `names`;
    with --headline-passes N, N times over the same prompts, each pass with a new generator (graphs captured
    again, counted), the process's kernels kept: pass 1 pays every first call of a shape (on a hybrid, FLA's
    shape-keyed compiles and autotunes), the last pass is a long regeneration's steady rate. One row per
    variant: the last pass's figures, with `passes` (each pass's seconds, tok/s and prefill seconds)."""
    for name in names:
        bs, n = a.headline_batch, a.mixed_prompts or 2 * a.headline_batch
        passes = []
        try:
            mixed = prompts_of(np.random.default_rng(1), n, a.min_len, a.max_len, vocab)
            for i in range(a.headline_passes):
                g = make_gen(target, dev, bs, a.new_tokens, "captured")
                f = set_variant(g, name)
                f.timed = True
                done, secs = timed(lambda: g.complete(mixed, 0))
                toks = sum(len(c) for c in done)
                row = {"variant": name, "batch_size": bs, "prompts": n, "min_len": a.min_len, "max_len": a.max_len,
                       "prompt_tokens": int(sum(len(q) for q in mixed)), "new_tokens": a.new_tokens,
                       "generated": toks, "seconds": round(secs, 3), "tokens_per_s": round(toks / secs, 1)} | \
                    fast_breakdown(g)
                passes.append({"pass": i + 1, "seconds": row["seconds"], "tokens_per_s": row["tokens_per_s"],
                               "prefill_s": row.get("prefill_s")})
                print(f"headline {name} pass {i + 1}/{a.headline_passes}: {json.dumps(row)}", flush=True)
                g = f = None
            if a.headline_passes > 1:
                row["pass"], row["passes"] = a.headline_passes, passes
                row["tokens_per_s_first_pass"] = passes[0]["tokens_per_s"]
            if cuda:
                row["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
        except Exception as e:  # noqa: BLE001
            row = {"variant": name, "batch_size": bs, "error": repr(e)[:500], "passes": passes}
        g = f = None
        record("headline", row)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)


def prefill_compare(a, res, record, dev, vocab, target) -> None:
    if a.prefill_compare and a.headline_batch:   # the prefill alone (1 new token), trim off and on, same prompts
        bs, n = a.headline_batch, a.mixed_prompts or 2 * a.headline_batch
        mixed = prompts_of(np.random.default_rng(1), n, a.min_len, a.max_len, vocab)
        res["prefill"] = []
        for name in ("fused", "fused-trim", "fused", "fused-trim"):
            try:
                g = make_gen(target, dev, bs, 1, "captured")
                f = set_variant(g, name)
                g.complete(mixed[:bs // 4], 0)   # warm: the kernels' first calls
                fast_breakdown(g)
                f.timed = True
                _, secs = timed(lambda: g.complete(mixed, 0))
                row = {"variant": name, "batch_size": bs, "prompts": n, "seconds": round(secs, 3)} | fast_breakdown(g)
            except Exception as e:  # noqa: BLE001
                row = {"variant": name, "batch_size": bs, "error": repr(e)[:500]}
            g = f = None
            record("prefill", row)


def _passes(v: str) -> int:
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"{v!r} is not a whole number of passes (1 or more)")
    return int(v)


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
    p.add_argument("--headline-passes", type=_passes, default=1,
                   help="with --headline-batch: the mixed workload this many times in one process (each with a "
                        "new generator); the row reports the last pass and `tokens_per_s_first_pass`")
    p.add_argument("--headline-variants", default="",
                   help="with --step-variants: the mixed workload for each of these variants (default: the fastest)")
    p.add_argument("--prefill-compare", action="store_true",
                   help="with --step-variants and --headline-batch: the mixed workload's prefill alone (1 new "
                        "token), fused and fused-trim, twice each")
    p.add_argument("--variant", default="", choices=["", *VARIANTS],
                   help="the headline rows of the default mode with this variant (e.g. fused-triton)")
    p.add_argument("--weights-parity", action="store_true",
                   help="with --step-variants: before the first w8 variant, the logits of fp8 weights and of bf16 "
                        "against fp32 (teacher-forced)")
    p.add_argument("--attention-check", action="store_true",
                   help="first: the split-KV kernel against SDPA (errors, a tile/split sweep, times) and the "
                        "triton decoder's tokens against sdpa's and its own eager loop (needs a GPU)")
    p.add_argument("--attn-sweep-batch", type=int, default=256)
    p.add_argument("--attn-sweep-len", type=int, default=640)
    p.add_argument("--attn-fp8", action="store_true", help="the cases also with K and V in fp8 e4m3")
    p.add_argument("--attn-fp8-modes", default="bf16",
                   help="with --attn-fp8: decode_attn.CONFIG['fp8_convert'] modes to time (bf16, fp16, shift)")
    p.add_argument("--attn-no-sweep", action="store_true", help="no tile/split sweep: decode_attn.CONFIG as it is")
    p.add_argument("--attn-cases", default="256x640,256x1536,384x1536", help="batch x view, comma list")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()   # the CPU: a smoke run of the script (--shape tiny)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    batches = [int(b) for b in a.batches.split(",")]
    shape = SHAPES[a.shape]
    hybrid = shape.linear is not None
    try:   # a hybrid shape on a transformers older than our cache API: one line, before the target is built
        check_hybrid_transformers(hybrid, f"--shape {a.shape}")
    except HybridTransformersTooOld as e:
        print(f"regenerate_bench: error: {e}", file=sys.stderr)
        return 2
    dims = shape.attention_dims
    res, save = results_file(a.out, {"shape": a.shape, "started": time.time(), "shape_dims": dict(zip(
        ["hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab"], dims)),
        **({"hybrid": shape.linear} if hybrid else {})},
        parity={}, ratio=[], headline=[])
    meta = res["meta"]

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    target = make_target_factory(a.shape, dtype)(dev)
    if hybrid:   # which Gated DeltaNet kernels transformers resolved (FLA's, or its torch fallback)
        import importlib.util
        meta["fla"] = (importlib.import_module("fla").__version__ if importlib.util.find_spec("fla") else None)
    meta["init_s"] = round(time.perf_counter() - t0, 1)
    vocab = min(target.config.vocab_size, 150000)
    rng = np.random.default_rng(0)

    if a.attention_check and (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        try:   # a failure is recorded; the decoder rows below still run (theirs fail alone)
            attention_check(a, res, save, dev, dims)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            res.setdefault("attention", {})["error"] = repr(e)[:1000]
            save()
    if a.attention_check:
        try:
            token_parity(res, save, target, dev, rng, vocab)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            res["token_parity"] = {"error": repr(e)[:1000]}
            save()
    if a.step_variants:
        return step_variants(a, res, save, target, dev, rng, vocab, batches, cuda)

    # 1. parity: graphs vs the same loop eagerly; agreement with generate
    if not a.skip_parity:
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
            if a.variant:
                set_variant(g, a.variant)
            g._fast_decoder().timed = True
            done, secs = timed(lambda: g.complete(mixed, 0))
            toks = sum(len(c) for c in done)
            row = {"decoder": "captured", "variant": a.variant or "default", "batch_size": bs, "prompts": n,
                   "min_len": a.min_len,
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
