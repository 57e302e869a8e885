"""Pipeline benchmark: each stage alone, then the whole pipeline sync and async, in one process.

    python -m trainer.lab.bench --shape 8b --settings orig,b16 --out results/h200x2-8b.json
    python -m trainer.lab.bench --shape tiny            # CPU smoke test (the test suite runs this)

Targets are random-init Qwen3-shaped models built in memory (no weights on disk); the hybrid shapes
(qwen3.6-27b, tiny-hybrid) are Qwen3.5's language model, Qwen3_5ForCausalLM (3 Gated DeltaNet : 1 gated
attention layers), as the trainer loads it from the VL checkpoint. Data is synthetic
with a length mix up to --max-seq-len. Throughput is target context tokens per second. MFU is model
FLOPs (counted as in docs/performance-archive.md, "The benchmark") over wall time and the datasheet dense bf16 peak.
Prints a table last and writes everything to JSON.

Here: the settings and variants, the stage and pipeline timings, the serving figures, the results file and
the command line. Beside it: bench/shapes.py (the random-init targets by shape, the synthetic data),
bench/flops.py (the model FLOPs and the peak), bench/profile.py (memory, kernel classes, compiles) and
bench/checks.py (the shape-cache probe, FlexAttention's parity on the GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config.options import TrainConfig
from trainer.data.dataset import Dataset
from trainer.engine.runlog import format_table, setup_console
from trainer.lab.bench.checks import check_flex_on_gpu, probe_shape_cache
from trainer.lab.bench.flops import model_flops_drafter, model_flops_drafter_before, model_flops_target, peak_flops
from trainer.lab.bench.profile import (
    KERNEL_CLASSES,
    compiles_since,
    gpu_name,
    kernel_profile,
    mem_snapshot,
    memory_flatness,
    reset_peaks,
    sync_all,
)
from trainer.lab.bench.shapes import SHAPES, make_target_factory, synthetic_dataset
from trainer.model import architectures
from trainer.model.target import decoder
from trainer.ops.compiling import compile_counters

log = logging.getLogger("trainer.bench")

SETTINGS = {
    # block, anchors, token budget, max seq, grad accum, soft labels and their loss, spelled out: "orig" is the
    # seed recipe (the trainer's default until 2026-12-06, block 32), and both settings' figures in
    # docs/performance.md were measured with soft-label CE (the defaults are hard labels and CE + D-PACE now;
    # variant "dpace" measures those)
    "orig": dict(block_size=32, max_anchors=1024, token_budget=49152, max_seq_len=8192, grad_accum=4,
                 use_soft_labels=True, loss="ce"),
    "b16": dict(block_size=16, max_anchors=512, token_budget=49152, max_seq_len=8192, grad_accum=4,
                use_soft_labels=True, loss="ce"),
}
TINY_SETTINGS = dict(token_budget=1024, max_seq_len=256, max_anchors=16)
# --variants: each runs the chosen parts again with these trainer options (combine with '+')
VARIANTS = {
    "base": {},
    "compile": {"compile": "all"},
    "ctarget": {"compile": "target"},
    "cdrafter": {"compile": "drafter"},
    "cudnn": {"sdpa_backend": "cudnn"},
    "any": {"sdpa_backend": "any"},      # PyTorch's choice (cuDNN on H200): the default before auto left cuDNN out
    "flash": {"sdpa_backend": "flash"},
    "world": {"transport": "world"},
    "pad1": {"pad_multiple": 1},   # each batch padded to its exact longest length (the old behaviour)
    # each drafter speed-up off alone, and all of them ("old": the drafter stage before them), to credit each
    "nodedup": {"loss_dedup": False},        # LM head on every row, soft-label targets per block row
    "nofull": {"flex_full_blocks": False},   # no FlexAttention full-block lists (mask_mod on every tile)
    "bf16logits": {"fp32_logits": False},    # LM-head logits rounded to bf16 before the softmax
    "ctxcopy": {"flex_ctx_group": 16},       # context copies per 16 query tiles (the default at 19ee62b)
    # FlexAttention on the context keys only, the in-block part as a dense batched attention, merged
    # by log-sum-exp (our key of --flex-kernel-options; combine with fk* variants by hand)
    "split": {"flex_kernel_options": "SPLIT_BLOCKS=true"},
    # the same, block part + merge with their own backward; refused with the drafter's layers compiled (wrong
    # gradients there on the GPU: config.split_blocks), so it times only with --set compile=target
    "split2": {"flex_kernel_options": "SPLIT_BLOCKS=2"},
    "old": {"loss_dedup": False, "flex_full_blocks": False, "fp32_logits": False, "flex_ctx_group": 0},
    # FP8 training of the drafter's linear layers (torchao float8 recipes)
    "fp8": {"fp8": "tensorwise"},
    "fp8row": {"fp8": "rowwise"},
    # each drafter architecture but the default (trainer/model/architectures.py: DFlash2's block-local
    # convolutions and candidate selector), and the D-PACE loss (hard labels: it is defined on them)
    **{name: {"arch": name} for name in architectures.names() if name != architectures.DEFAULT},
    "dpace": {"loss": "ce+dpace", "use_soft_labels": False},
    # FlexAttention kernel options for the drafter's 128-row tiles (PyTorch's H100 defaults for bf16, head
    # dim 128: forward 128x64, 8 warps, 3 stages; backward 64/128/128/64, 8 warps, 3 stages)
    "fk64": {"flex_kernel_options": "fwd_BLOCK_M=64,fwd_BLOCK_N=64,fwd_num_warps=4"},
    "fkbwd64": {"flex_kernel_options": "bwd_BLOCK_M1=64,bwd_BLOCK_N1=64,bwd_BLOCK_M2=64,bwd_BLOCK_N2=64,"
                                       "bwd_num_warps=4"},
}


def parse_sets(items: list[str]) -> dict:
    """--set FIELD=VALUE -> {field: value typed like the TrainConfig default}; unknown fields are errors."""
    import dataclasses
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD one of TrainConfig's fields")
        default = fields[key].default
        if isinstance(default, bool):
            out[key] = val.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, int):
            out[key] = int(val)
        elif isinstance(default, float):
            out[key] = float(val)
        else:
            out[key] = val
    return out


def variant_options(name: str) -> dict:
    out = {}
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {part!r} (known: {', '.join(VARIANTS)}; combine with '+')")
        out.update(VARIANTS[part])
    return out




def git_commit() -> dict:
    """Which code a result measured (results/INDEX.md reads it): {"commit": this checkout's `git rev-parse
    HEAD`, "commit_dirty": whether tracked files differ from it}. $DFLASH_GIT_COMMIT stands in where the
    tree travelled without its .git; None where neither says (an installed wheel)."""
    import os
    import subprocess
    if os.environ.get("DFLASH_GIT_COMMIT"):
        return {"commit": os.environ["DFLASH_GIT_COMMIT"], "commit_dirty": None}
    import trainer
    root = Path(trainer.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return {"commit": None, "commit_dirty": None}
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=30)
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "commit_dirty": None}
        return {"commit": head.stdout.strip(),
                "commit_dirty": git("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "commit_dirty": None}


def results_file(out: str | None, meta: dict, **sections):
    """A GPU measurement script's results: {"meta": the device, torch and transformers versions and the
    argv, then `meta`; then `sections`}, and a save() that writes them whole to `out` (when given), so a run
    cut short still leaves what it measured. Returns (results, save)."""
    import transformers
    res = {"meta": {"device": gpu_name(), "torch": torch.__version__, "transformers": transformers.__version__,
                    "argv": sys.argv[1:], **git_commit(), **meta}, **sections}
    path = Path(out) if out else None

    def save() -> None:
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res, indent=2))
    return res, save


@dataclass
class Ctx:
    args: argparse.Namespace
    shape: str
    setting: str
    dtype: torch.dtype
    dataset: Dataset
    factory: object
    cfg_base: dict
    over: dict


def make_cfg(ctx: Ctx, **over) -> TrainConfig:
    a = ctx.args
    d = dict(target_model="(random init)", data_dir="(synthetic)", output_dir=str(Path(a.work) / "run"),
             target_gpus=a.target_gpus, drafter_gpus=a.drafter_gpus, epochs=1000, num_draft_layers=5,
             gamma=10.0 if ctx.cfg_base["block_size"] == 32 else 7.0, noise_start=0.05, noise_end=0.01,
             save_interval=10**9, keep_checkpoints=1, resume=False, profile_interval=3600.0,
             status_file=str(Path(a.work) / "run" / "status.json"), log_dir=str(Path(a.work) / "run" / "logs"),
             mask_token_id=None, lr=6e-4, warmup_ratio=0.04, weight_decay=0.01, grad_clip=1.0,
             max_batch_size=64, save_final=False)
    d.update(ctx.cfg_base)
    d.update(getattr(a, "extra", {}))
    d.update(ctx.over)
    d.update(over)
    return TrainConfig(**d)


def _new_trainer(ctx: Ctx, **over):
    """A world-size-1 trainer in this process (target and drafter roles on one device)."""
    import shutil

    from trainer.distributed.groups import init_single
    from trainer.engine.train import Trainer
    shutil.rmtree(Path(ctx.args.work) / "run", ignore_errors=True)
    cfg = make_cfg(ctx, **over)
    topo, groups = init_single(cfg)
    t = Trainer(cfg, topo, groups, target_factory=ctx.factory, dataset=ctx.dataset)
    t.setup()
    return t


def timed_window(t) -> list[int]:
    """The batches the pipeline runs time (every step but the first), so stage-alone rates are
    measured on exactly the same data; plus batch 0 in front as an untimed warm-up."""
    bps = t.batches_per_step
    return [0] + list(range(bps, bps * t.cfg.max_steps))


def timed_after_warm(run, warm: list, timed: list, devices) -> tuple[float, dict]:
    """run(warm) untimed, then run(timed) between device syncs: (its wall seconds, the compile counters
    before it)."""
    run(warm)
    sync_all(devices)
    c0 = compile_counters()
    t0 = time.perf_counter()
    run(timed)
    sync_all(devices)
    return time.perf_counter() - t0, c0


def bench_target(ctx: Ctx, t) -> dict:
    """Forward + capture + pack on the target stage, slots recycled; no drafter, nothing sent. The timed
    batches run twice; tok_s is the second pass (figures before 2026-12-04 are one pass after the warmup)."""
    from trainer.model.target import layer_kernels
    items = [t.feed.make_item(s) for s in timed_window(t)]
    n = len(items) - 1
    st = t.target
    devices = [st.device]
    reset_peaks(devices)

    def run(its):
        for it in its:
            slot = st.next_slot()
            st.forward_pack(it, slot)

    # the timed window twice: the first pass meets each batch shape for the first time (on a hybrid target
    # fla's Triton kernels specialise and autotune per shape: results/INDEX.md, h200-qwen3.6-27b-target-eager.json),
    # the second is the steady state a long run sees; tok_s is the second, the first is kept beside it
    first, _ = timed_after_warm(run, items[:1], items[1:], devices)
    wall, c0 = timed_after_warm(run, [], items[1:], devices)
    prof = None
    if ctx.args.profile and st.device.type == "cuda":
        prof = kernel_profile(lambda: run(items[1:3]), st.device)
        prof["tokens"] = sum(it.plan.num_tokens for it in items[1:3])
    tokens = sum(it.plan.num_tokens for it in items[1:])
    lengths = np.concatenate([it.lengths for it in items[1:]])
    layers_run = len(decoder(st.model).layers)
    flops = model_flops_target(lengths, ctx.shape, layers_run)
    peak = peak_flops(1)
    return {"tok_s": tokens / wall, "tok_s_per_gpu": tokens / wall, "batches": n,
            "wall_s": wall, "tok_s_first_pass": tokens / first, "first_pass_wall_s": first, "tflops": flops / wall / 1e12, "mfu": flops / wall / peak if peak else None,
            "memory": mem_snapshot(devices), "kernels": prof, "compiles_in_timed_window": compiles_since(c0),
            "layer_kernels": layer_kernels(st.model, st.device.type)}


def bench_drafter(ctx: Ctx, t) -> dict:
    """The drafter stage fed from hidden states already on its device: micro-steps + optimizer steps."""
    items = [t.feed.make_item(s) for s in timed_window(t)]
    n = len(items) - 1
    d = t.drafter
    devices = [d.device]
    k = len(t.dcfg.target_layer_ids) * t.dcfg.hidden_size
    bufs = []
    for it in items:
        rows = it.plan.num_ctx_rows
        taps = torch.randn(rows, k, device=d.device, dtype=t.dtype)
        nf = len(it.plan.final_gather) if it.plan.final_gather is not None else 0
        final = torch.randn(nf, t.dcfg.hidden_size, device=d.device, dtype=t.dtype) if nf else None
        bufs.append((it, taps, final))
    reset_peaks(devices)
    per_step = t.batches_per_step

    def steps(bs):
        for i in range(0, len(bs), per_step):
            chunk = bs[i:i + per_step]
            d.begin_step()
            for j, (it, taps, final) in enumerate(chunk):
                d.micro_step(it, taps, final, 0.03, 1.0 / per_step, last=j == len(chunk) - 1)
            t.optimizer_step()
        t.report.pending.clear()

    wall, c0 = timed_after_warm(steps, bufs[:1], bufs[1:], devices)
    prof = None
    if ctx.args.profile and d.device.type == "cuda":
        it, taps, final = bufs[0]
        prof = kernel_profile(lambda: (d.begin_step(), d.micro_step(it, taps, final, 0.03, 1.0, last=True)), d.device,
                              top=60)   # every kernel of note: the micro-batch's GPU time accounted for
        prof["block_rows"] = sum(len(c.q_seq) for c in it.plan.chunks)
        t.opt.zero_grad(set_to_none=True)
    tokens = sum(b[0].plan.num_tokens for b in bufs[1:])
    rows = sum(sum(len(c.q_seq) for c in b[0].plan.chunks) for b in bufs[1:])
    flops = sum(model_flops_drafter(b[0].plan, t.dcfg, t.cfg.use_soft_labels) for b in bufs[1:])
    executed = sum(model_flops_drafter(b[0].plan, t.dcfg, t.cfg.use_soft_labels, executed=True) for b in bufs[1:])
    peak = peak_flops(1)
    # MFU counts useful work only (model_flops_drafter); executed work is reported beside it
    return {"tok_s": tokens / wall, "block_rows_per_s": rows / wall, "block_rows_per_token": rows / tokens,
            "batches": n, "wall_s": wall, "tflops": flops / wall / 1e12,
            "mfu": flops / wall / peak if peak else None,
            "executed_tflops": executed / wall / 1e12, "executed_over_useful": executed / flops,
            "mfu_executed": executed / wall / peak if peak else None,
            "mfu_as_counted_before": (sum(model_flops_drafter_before(b[0].plan, t.dcfg, t.cfg.use_soft_labels)
                                          for b in bufs[1:]) / wall / peak) if peak else None,
            "memory": mem_snapshot(devices), "kernels": prof,
            "compiles_in_timed_window": compiles_since(c0),
            "layer_types": t.dcfg.layer_types, "sliding_window": t.dcfg.sliding_window}


def _shared_gpu(ctx: Ctx) -> bool:
    """One rank holds both roles (one GPU, or the CPU with one worker and one replica): in-process."""
    from trainer.distributed.topology import local_roles
    return len(local_roles(make_cfg(ctx))) == 1


def _rank_entry(spec_path: str) -> None:
    """One rank of a multi-rank benchmark run (spawned by elastic_launch): the trainer itself, with the
    benchmark's random-init target and synthetic data; each rank writes its figures next to the spec."""
    from trainer.engine.rank import train_rank
    spec = torch.load(spec_path, weights_only=False)
    cfg = TrainConfig(**spec["cfg"])
    factory = make_target_factory(spec["shape"], getattr(torch, spec["dtype"]))

    def on_done(t):
        out = {"rank": t.topo.rank, "role": t.topo.role.device + (" target" if t.topo.is_target else "")
               + (" drafter" if t.topo.is_drafter else ""), "memory": mem_snapshot([t.device])}
        if t.topo.leader:
            out["pipeline"] = _pipeline_figures(t)
            out["split"] = t.report.split_table(1.0)
        Path(spec_path).with_name(f"rank-{t.topo.rank}.json").write_text(json.dumps(out, default=str))
    rc = train_rank(cfg, factory, spec["dataset"], on_done=on_done)
    if rc:
        raise SystemExit(rc)


def _timed_window(t) -> dict:
    """The pipeline's timed window: every step but the first (it fills the pipeline); tokens from the
    step log, time from CUDA events at both ends on GPUs (the host loop runs ahead of the GPU, so host
    timestamps would flatter the rate), else the host clock."""
    logs = t.report.step_log.entries()
    first = 1 if len(logs) > 2 else 0
    (ta, sa, ka), (tb, sb, kb) = logs[first], logs[-1]
    wall, timed = tb - ta, "host clock"
    evs = dict(t.report.step_events.entries())
    if t.device.type == "cuda" and sa in evs and sb in evs:
        wall, timed = evs[sa].elapsed_time(evs[sb]) / 1000.0, "cuda events"
    return {"t0": ta, "t1": tb, "tok_s": (kb - ka) / wall, "steps_timed": sb - sa, "wall_s": wall,
            "timed_with": timed}


def _pipeline_figures(t) -> dict:
    w = _timed_window(t)
    wall = w["wall_s"]
    prof = t.profiler.snapshot()
    return {"tok_s": w["tok_s"], "steps_timed": w["steps_timed"], "wall_s": wall, "timed_with": w["timed_with"],
            "stage_busy_fraction": {k: v["total_s"] / max(wall, 1e-9) for k, v in prof.items()},
            "ranks": t.report.rank_rates(wall), "world_size": t.topo.world}


def bench_pipeline_ranks(ctx: Ctx, async_: bool) -> dict:
    """The pipeline as the trainer runs it on several GPUs: one process per GPU through elastic_launch,
    target ranks sending to drafter ranks over NCCL."""
    import shutil
    import tempfile

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.distributed.launch import free_port
    from trainer.distributed.topology import local_roles
    work = Path(ctx.args.work)
    shutil.rmtree(work / "run", ignore_errors=True)
    cfg = make_cfg(ctx, async_pipeline=async_, max_steps=ctx.args.pipeline_steps)
    work.mkdir(parents=True, exist_ok=True)
    spec_dir = Path(tempfile.mkdtemp(prefix="ranks-", dir=work))
    spec = spec_dir / "spec.pt"
    torch.save({"cfg": cfg.to_dict(), "shape": ctx.shape, "dtype": str(ctx.dtype).split(".")[-1],
                "dataset": ctx.dataset}, spec)
    n = len(local_roles(cfg))
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=spec_dir.name, rdzv_backend="c10d",
                      rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.5,
                      start_method="spawn", log_line_prefix_template="[rank${rank}]:")
    elastic_launch(lc, _rank_entry)(str(spec))
    ranks = [json.loads((spec_dir / f"rank-{r}.json").read_text()) for r in range(n)]
    res = dict(ranks[0]["pipeline"])
    res["memory"] = {k: v for r in ranks for k, v in r["memory"].items() if k != "host_rss_bytes"}
    res["rank_roles"] = [r["role"] for r in ranks]
    res["split_table"] = ranks[0].get("split")
    log.info("ranks:\n%s", ranks[0].get("split"))
    return res


def bench_pipeline(ctx: Ctx, async_: bool) -> dict:
    if not _shared_gpu(ctx):
        return bench_pipeline_ranks(ctx, async_)
    t = _new_trainer(ctx, async_pipeline=async_, max_steps=ctx.args.pipeline_steps)
    devices = [t.device]
    try:
        reset_peaks(devices)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        caught = []
        orig_show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                caught.append((time.perf_counter(), threading.current_thread().name, str(message)[:120]))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            c0 = compile_counters()
            try:
                rc = t.run()
            finally:
                warnings.showwarning = orig_show
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        if rc != 0:
            raise RuntimeError(f"pipeline run exited {rc}")
        w = _timed_window(t)
        ta, tb, wall = w["t0"], w["t1"], w["wall_s"]
        in_window = [c for c in caught if ta <= c[0] <= tb]
        by_thread = {}
        for _, name, _ in in_window:
            key = name.split("_")[0]
            by_thread[key] = by_thread.get(key, 0) + 1
        prof = t.profiler.snapshot()
        waits = {k: v["total_s"] / max(wall, 1e-9) for k, v in prof.items() if "wait" in k}
        busy = {k: v["total_s"] / max(wall, 1e-9) for k, v in prof.items() if "wait" not in k}
        return {"tok_s": w["tok_s"], "steps_timed": w["steps_timed"], "wall_s": wall, "timed_with": w["timed_with"],
                "wait_fraction": waits, "stage_busy_fraction": busy,
                "transport": "same rank (world size 1)" if t.topo.world == 1 else "NCCL point-to-point",
                "sync_ops_whole_run": len(caught), "compiles_whole_run_incl_warmup": compiles_since(c0), "sync_ops_timed_window_by_thread": by_thread,
                "memory": mem_snapshot(devices),
                "memory_flatness": memory_flatness(t.report.mem_log.entries()),
                "memory_per_step": t.report.mem_log.entries()}  # the first and the last 100 steps
    finally:
        _dispose(t)


def _dispose(t):
    """Stop a trainer's threads and hand its GPU memory back before the next part builds one."""
    from trainer.distributed.groups import finish_single
    t.shutdown()
    finish_single()
    t.__dict__.clear()  # the caller still holds `t`: drop what it owns so the memory can go
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_setting(args, shape: str, setting: str, dtype, factory, save=lambda r: None, variant: str = "base") -> dict:
    base = dict(SETTINGS[setting])
    if shape.startswith("tiny"):
        base.update(TINY_SETTINGS)
    if args.token_budget:
        base["token_budget"] = args.token_budget
    if args.max_seq_len:
        base["max_seq_len"] = args.max_seq_len
    vocab = SHAPES[shape].vocab
    # enough sequences that length buckets fill their batches, as with a real corpus; sized by the steps of
    # the parts that run, so a stage-alone run times the same batches whatever --pipeline-steps says
    parts = args.parts.split(",")
    steps = max([args.steps] + [args.pipeline_steps for p in ("sync", "async") if p in parts])
    need = max(base["token_budget"] * 4 * steps * base["grad_accum"], args.dataset_tokens)
    ds = synthetic_dataset(need, base["max_seq_len"], vocab, args.supervised,
                           mean_len=min(args.mean_len, base["max_seq_len"]),
                           min_len=min(args.min_len, base["max_seq_len"]))
    over = variant_options(variant)
    ctx = Ctx(args, shape, setting, dtype, ds, factory, base, over)
    res = {"setting": setting, "variant": variant, "options": over, **base, "dataset_tokens": ds.num_tokens,
           "dataset_sequences": len(ds)}
    for p, fn, gpus in (("target", bench_target, args.target_gpus), ("drafter", bench_drafter, args.drafter_gpus)):
        if p not in parts:
            continue
        # each stage alone on its own GPU: a world-size-1 trainer there (both roles, one of them timed)
        t = _new_trainer(ctx, max_steps=args.steps, target_gpus=gpus[:1], drafter_gpus=gpus[:1],
                         cpu_target_workers=1, cpu_drafter_replicas=1)
        try:
            # each stage alone needs nothing of the other: give its memory back first (and its warmup: at the
            # 27B shapes the drafter's warmup beside the target ran the GPU out of memory)
            if p == "drafter":
                t.target = None
            else:
                t.drafter = t.opt = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            t.warmup()
            log.info("bench %s/%s: %s stage alone", shape, setting, p)
            try:
                res[p] = fn(ctx, t)
                save(res)
            except Exception as e:  # keep the other parts
                log.exception("%s stage failed", p)
                res[p] = {"error": repr(e)}
        finally:
            _dispose(t)
    for p, flag in (("sync", False), ("async", True)):
        if p in parts:
            log.info("bench %s/%s: whole pipeline %s", shape, setting, p)
            try:
                res[p] = bench_pipeline(ctx, flag)
                save(res)
            except Exception as e:
                log.exception("%s pipeline failed", p)
                res[p] = {"error": repr(e)}
    rate = lambda k: res.get(k, {}).get("tok_s")
    if rate("target") and rate("drafter"):
        res["min_stage_tok_s"] = min(rate("target"), rate("drafter"))
        if rate("async"):
            res["async_over_min_stage"] = rate("async") / res["min_stage_tok_s"]
    if rate("async") and rate("sync"):
        res["async_over_sync"] = rate("async") / rate("sync")
    return res


def bench_serving(shape: str, device: torch.device, factory, prompts: int, prompt_len: int, max_new_tokens: int,
                  batch_sizes: list[int]) -> dict:
    """The serving-side GPU figures on a random-init target of `shape`: the generation-loop eval (dflash-eval's
    loop, one prompt at a time as serving verifies it) in verify steps/s, and regeneration
    (dflash-regenerate's batched greedy `generate`) in generated tokens/s per batch size. Random weights:
    acceptance is about 1 token per verify step, so verify steps/s is the loop's cost per step."""
    from trainer.model.drafter import DFlashConfig, DFlashDrafter
    from trainer.serving.evaluate import hf_drafter, speculative_eval
    from trainer.serving.regenerate import TargetGenerator
    target = factory(device)
    dcfg = DFlashConfig.from_target(target.config, num_draft_layers=5, block_size=16,
                                    mask_token_id=target.config.vocab_size - 1)
    torch.manual_seed(0)
    state = {k: v.to(device) for k, v in DFlashDrafter(dcfg).state_dict().items()}
    drafter = hf_drafter(dcfg, state, device, next(target.parameters()).dtype)
    del state
    rng = np.random.default_rng(0)
    vocab = min(target.config.vocab_size, 150000)
    ps = [rng.integers(0, vocab, prompt_len) for _ in range(max(prompts, 3 * max(batch_sizes)))]
    speculative_eval(target, drafter, ps[:1], max_new_tokens=16, stop_ids=[])   # warm kernels
    ev = speculative_eval(target, drafter, ps[:prompts], max_new_tokens=max_new_tokens, stop_ids=[])
    out = {"eval": {k: ev[k] for k in ("tau", "verify_steps", "prompts", "new_tokens", "seconds",
                                       "verify_steps_per_s")} | {"tokens_per_s": round(ev["new_tokens"] / ev["seconds"], 1)},
           "regenerate": []}
    del drafter
    for bs in batch_sizes:
        for static in (False, True):   # dflash-regenerate --static-cache off / on, side by side
            gen = TargetGenerator(target, str(device), max_new_tokens, 0.0, bs, static_cache=static)
            gen.stop_ids = []   # random weights: no early stop, every row generates max_new_tokens
            gen.complete(ps[:bs], seed=0)   # warm: the full batch's shapes (compiled with a static cache)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            done = gen.complete(ps[bs:3 * bs], seed=0)   # two full batches
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            secs = time.perf_counter() - t0
            toks = sum(len(c) for c in done)
            out["regenerate"].append({"batch_size": bs, "static_cache": static, "prompts": len(done),
                                      "new_tokens": toks, "seconds": round(secs, 3),
                                      "tokens_per_s": round(toks / secs, 1)})
    if device.type == "cuda":
        out["peak_gpu_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        label = f"{r['shape']}/{r['setting']}" + (f" {r['variant']}" if r.get("variant", "base") != "base" else "")
        for part in ("target", "drafter", "sync", "async"):
            p = r.get(part)
            if not p:
                continue
            mem = p.get("memory", {})
            peaks = ", ".join(f"{k[5:]}={v / 2**30:.1f}G" for k, v in mem.items() if k.startswith("peak_"))
            rows.append([label, part, p.get("tok_s"),
                         None if p.get("mfu") is None else f"{100 * p['mfu']:.1f}%",
                         peaks or "-", p.get("error", "")[:40]])
        rows.append([label, "async/min(stage)", r.get("async_over_min_stage"), "", "", ""])
        rows.append([label, "async/sync", r.get("async_over_sync"), "", "", ""])
    return format_table(["shape/setting", "part", "tok/s", "MFU", "peak GPU mem", "error"], rows)


def kernel_table(results: list[dict]) -> str:
    """GPU milliseconds per kernel class for the profiled stages (--profile)."""
    classes = KERNEL_CLASSES
    rows = []
    for r in results:
        label = f"{r['shape']}/{r['setting']}" + (f" {r['variant']}" if r.get("variant", "base") != "base" else "")
        for part in ("target", "drafter"):
            k = (r.get(part) or {}).get("kernels")
            if k:
                rows.append([label, part, k["gpu_ms"]] + [k["by_class_ms"].get(c, 0.0) for c in classes])
    if not rows:
        return ""
    return format_table(["shape/setting", "stage", "GPU ms"] + [f"{c} ms" for c in classes], rows)


def main(argv=None) -> int:
    from trainer.optional import defer
    defer()   # a program: torchao only when a variant asks for it (trainer/optional.py)
    p = argparse.ArgumentParser(prog="python -m trainer.lab.bench", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--settings", default="orig,b16")
    p.add_argument("--parts", default="target,drafter,sync,async")
    p.add_argument("--target-gpus", default=None, help="default: 0 (cpu for the tiny shapes)")
    p.add_argument("--drafter-gpus", default=None, help="default: 1 if present, else 0")
    p.add_argument("--dataset-tokens", type=int, default=20_000_000, help="synthetic corpus size")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per stage-alone run (first untimed)")
    p.add_argument("--pipeline-steps", type=int, default=0,
                   help="optimizer steps per sync/async pipeline run, the first untimed (0: 11 on GPUs, so that "
                        "10 steps are timed between CUDA events; --steps on the CPU)")
    p.add_argument("--supervised", type=float, default=0.5, help="completion share of each sequence")
    p.add_argument("--mean-len", type=int, default=2048)
    p.add_argument("--min-len", type=int, default=64, help="shortest synthetic sequence")
    p.add_argument("--variants", default="base",
                   help=f"comma list, each runs the parts again with trainer options: {', '.join(VARIANTS)} "
                        "(combine with '+', e.g. compile+cudnn)")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel class for each stage (torch.profiler)")
    p.add_argument("--token-budget", type=int, default=0, help="override the setting's token budget")
    p.add_argument("--max-seq-len", type=int, default=0, help="override the setting's max sequence length")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other trainer option for every variant, e.g. --set drafter_chunk_rows=16384")
    p.add_argument("--no-flex-check", action="store_true")
    p.add_argument("--shape-cache-probe", type=int, default=0, metavar="N",
                   help="only measure host RSS per new attention shape (N new shapes, then the same again) "
                        "for each SDPA backend in --probe-backends, then exit")
    p.add_argument("--probe-backends", default="any,auto,flash",
                   help="SDPA backends for --shape-cache-probe (auto on the CPU)")
    p.add_argument("--serving", default="", metavar="PROMPTS,PROMPT_LEN,NEW_TOKENS,BATCHES",
                   help="only measure dflash-eval's generation loop (verify steps/s) and dflash-regenerate "
                        "(tok/s) on the random target of --shape, e.g. 16,512,128,16+64, then exit")
    p.add_argument("--work", default="/tmp/dflash-bench")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    setup_console()  # the console setup_logging also uses: each line printed once
    cuda = torch.cuda.is_available() and not a.shape.startswith("tiny")
    if a.pipeline_steps <= 0:
        a.pipeline_steps = 11 if cuda else a.steps
    if a.target_gpus is None:
        a.target_gpus = "0" if cuda else "cpu"
    if a.drafter_gpus is None:
        a.drafter_gpus = ("1" if torch.cuda.device_count() > 1 else "0") if cuda else "cpu"
    parse = lambda s: [] if s == "cpu" else [int(x) for x in s.split(",")]
    a.target_gpus, a.drafter_gpus = parse(a.target_gpus), parse(a.drafter_gpus)
    dtype = torch.bfloat16 if cuda else torch.float32
    factory = make_target_factory(a.shape, dtype)
    results = []
    meta = {"device": gpu_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "target_gpus": a.target_gpus, "drafter_gpus": a.drafter_gpus, "shape": a.shape,
            "shape_dims": dict(zip(["hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab"],
                                   SHAPES[a.shape].dims)), "hybrid_dims": SHAPES[a.shape].linear,
            "argv": sys.argv[1:], "started": time.time(),
            **git_commit()}
    out = Path(a.out) if a.out else None
    if a.shape_cache_probe:
        backends = a.probe_backends.split(",") if cuda else ["auto"]
        dev = torch.device("cuda", a.target_gpus[0]) if cuda else torch.device("cpu")
        rows = probe_shape_cache(a.shape, dev, dtype, backends, a.shape_cache_probe)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "shape_cache_probe": rows}, indent=2))
        print(format_table(["backend", "pass", "shapes", "s", "RSS growth MB", "after trim MB", "KB/shape"],
                           [[r["backend"], r["pass"], r["shapes"], r["seconds"], r["rss_growth_bytes"] / 1e6,
                             r["rss_growth_after_trim_bytes"] / 1e6, r["per_shape_bytes"] / 1e3] for r in rows]))
        return 0
    if a.serving:
        try:
            n, plen, new, batches = a.serving.split(",")
            spec = (int(n), int(plen), int(new), [int(b) for b in batches.split("+")])
        except ValueError:
            print(f"bench: error: --serving {a.serving!r}: expected PROMPTS,PROMPT_LEN,NEW_TOKENS,B1+B2",
                  file=sys.stderr)
            return 2
        dev = torch.device("cuda", a.target_gpus[0]) if cuda else torch.device("cpu")
        res = bench_serving(a.shape, dev, factory, *spec)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "serving": res}, indent=2))
        ev = res["eval"]
        print(format_table(["shape", "loop", "batch", "verify steps/s", "tok/s", "tau"],
                           [[a.shape, "dflash-eval", 1, ev["verify_steps_per_s"], ev["tokens_per_s"], ev["tau"]]]
                           + [[a.shape, "dflash-regenerate" + (" --static-cache" if r["static_cache"] else ""),
                               r["batch_size"], "-", r["tokens_per_s"], "-"] for r in res["regenerate"]]))
        return 0
    if cuda and not a.no_flex_check:
        meta["flex_check"] = check_flex_on_gpu(torch.device("cuda", a.drafter_gpus[0]))
        log.info("flex vs dense-mask reference: %s", meta["flex_check"])
    def save(partial):
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "results": results + [partial]}, indent=2, default=str))

    a.extra = parse_sets(a.set)
    variants = a.variants.split(",")
    for v in variants:
        variant_options(v)  # fail fast on a typo, before any GPU work
    for s in a.settings.split(","):
        for v in variants:
            r = run_setting(a, a.shape, s, dtype, factory, save, variant=v)
            r["shape"] = a.shape
            results.append(r)
            save({"shape": a.shape, "setting": "(complete)"})
            print(table(results[-1:]), flush=True)
    kt = kernel_table(results)
    if kt:
        print(kt)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
