"""dflash-regenerate's speed against its batch size, on a real target and real prompts, in one call.

    python trainer/lab/gpu/regenerate_sweep.py --target-model $R/smollm2-135m-instruct \
        --input $R/prompts/large.jsonl --batches 128,256,512,1024 --prompts 2048 --max-new-tokens 256 \
        --device cuda:0 --out results/h100-smollm2-regenerate-sweep.json

The target is loaded once; at each batch size a fresh TargetGenerator (dflash-regenerate's own class, its
switches decided as `dflash-regenerate` decides them for the device: `regenerate.resolve_switches`) is
warmed on one batch (the graph captures, timed apart as warmup_s) and then completes the same --prompts
prompts (a seeded sample of the input's lines, greedy), timed to the last token. Per batch size it reports
generated tokens, seconds, tok/s, and the slot use: generated tokens over rows x decode steps of each
batch, the share of decode work that went to rows still generating (a batch decodes until its longest
row stops, so a row that stopped early idles until then). A table on stderr, one JSON line on stdout,
and --out the whole result (trainer/lab/bench/run.py results_file). Runs on a CPU too (small sizes).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.config.preflight import check_model_dir  # noqa: E402
from trainer.engine.runlog import format_table  # noqa: E402
from trainer.model.target import load_target  # noqa: E402
from trainer.serving.regenerate import (  # noqa: E402
    RegenerateConfig,
    TargetGenerator,
    load_prompts,
    resolve_switches,
)


def slot_use(prompts: list, comps: list, batch_size: int) -> float:
    """Generated tokens over the decode slots TargetGenerator.complete's batches hold: the same order
    (longest prompt first), each batch rows x its longest completion."""
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    slots = sum(len(order[s:s + batch_size]) * max(len(comps[i]) for i in order[s:s + batch_size])
                for s in range(0, len(order), batch_size))
    return sum(len(c) for c in comps) / max(slots, 1)


def sweep(model, device: str, prompts: list, batches: list[int], max_new_tokens: int, switches: tuple,
          log=lambda m: print(m, file=sys.stderr, flush=True)) -> list[dict]:
    """One row per batch size (see the module docstring)."""
    static_cache, decoder, fuse, decode_attention, kv_fp8 = switches
    cuda = device.startswith("cuda")
    rows = []
    for b in batches:
        gen = TargetGenerator(model, device, max_new_tokens, 0.0, b, static_cache=static_cache, decoder=decoder,
                              fuse=fuse, decode_attention=decode_attention, kv_fp8=kv_fp8)
        t0 = time.perf_counter()
        gen.complete(prompts[:b], seed=0)
        if cuda:
            torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        comps = gen.complete(prompts, seed=0)
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        tokens = sum(len(c) for c in comps)
        digest = hashlib.sha256(b"".join(np.asarray(c, np.int64).tobytes() + b"|" for c in comps)).hexdigest()
        row = {"batch_size": b, "prompts": len(prompts), "tokens": tokens, "seconds": round(secs, 3),
               "tokens_per_s": round(tokens / secs, 1), "warmup_s": round(warm, 3),
               "slot_use": round(slot_use(prompts, comps, b), 4),
               "stopped_at_eos": sum(1 for c in comps if len(c) and int(c[-1]) in gen.stop_ids),
               "completions_sha256": digest}
        if cuda:
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows.append(row)
        log(f"batch {b}: {tokens} tokens in {secs:.2f}s, {tokens / secs:,.0f} tok/s")
        del gen
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return rows


def table(rows: list[dict]) -> str:
    return format_table(["batch", "prompts", "tokens", "s", "tok/s", "warmup s", "slot use", "at EOS"],
                        [[r["batch_size"], r["prompts"], r["tokens"], r["seconds"], r["tokens_per_s"],
                          r["warmup_s"], r["slot_use"], r["stopped_at_eos"]] for r in rows], floatfmt=",.2f")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-model", required=True)
    ap.add_argument("--input", action="append", required=True, help="JSONL as dflash-regenerate --input takes it")
    ap.add_argument("--batches", default="128,256,512,1024")
    ap.add_argument("--prompts", type=int, default=2048, help="prompts completed at every batch size")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decoder", default="auto", choices=("auto", "generate", "captured"))
    ap.add_argument("--seed", type=int, default=0, help="the prompt sample's seed")
    ap.add_argument("--out", default=None, help="write the results JSON here too")
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",") if x.strip()]
        assert batches and min(batches) >= 1 and a.prompts >= 1
    except (ValueError, AssertionError):
        print(f"regenerate_sweep: error: --batches {a.batches!r} / --prompts {a.prompts}: positive integers",
              file=sys.stderr)
        return 2
    target = Path(a.target_model)
    cfg = RegenerateConfig(target_model=str(target), output_dir="-", input=a.input, device=a.device,
                           decoder=a.decoder)
    switches = resolve_switches(cfg, [a.device], check_model_dir(str(target)), target)
    # the sample is drawn from the input's lines before they are tokenized: a 50K-line input costs its read only
    lines = [ln for p in a.input for ln in Path(p).read_text(encoding="utf-8").splitlines() if ln.strip()]
    pick = np.random.default_rng(a.seed).permutation(len(lines))[:a.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "sample.jsonl"
        sample.write_text("".join(lines[i] + "\n" for i in sorted(pick)), encoding="utf-8")
        prompts, _, _ = load_prompts(None, [sample], target, lambda m: None)
    source = {"inputs": [str(Path(p).absolute()) for p in a.input], "lines": len(lines), "sample_seed": a.seed}
    dev = torch.device(a.device)
    model = load_target(str(target), dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    rows = sweep(model, a.device, prompts, batches, a.max_new_tokens, switches)
    print(table(rows), file=sys.stderr)
    meta = {"target_model": str(target), "source": source, "max_new_tokens": a.max_new_tokens,
            "device_arg": a.device, "switches": dict(zip(("static_cache", "decoder", "fuse", "decode_attention",
                                                           "kv_fp8"), switches))}
    if a.out:
        from trainer.lab.bench.run import results_file
        res, save = results_file(a.out, meta, rows=rows)
        save()
    print(json.dumps({**meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
