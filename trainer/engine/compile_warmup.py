"""Compile/autotune surprises before step 1: target shapes on target ranks; on drafter ranks one
forward/backward per warmup shape on random taps (all drafter ranks together: it runs the FSDP
collectives), gradients thrown away."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from trainer.config.options import TrainConfig
from trainer.data.dataset import Batch
from trainer.distributed.startup import StartupBounds
from trainer.ops.compiling import begin_warmup, end_warmup, resolve_compile, wants
from trainer.engine.feed import Feed, make_item
from trainer.ops.plan import FLEX_BLOCK

log = logging.getLogger("trainer")


def warmup_batches(cfg: TrainConfig) -> list[list[int]]:
    """Sequence lengths of the drafter's warmup micro-batches. Uncompiled: one sequence (autotuning only).
    Compiled (--compile all|drafter): the compiled layers should cover the shapes a step can bring, because
    after the warmup a shape they do not cover stops the step for a compile (compiling.end_warmup; inductor's own
    size regimes make full coverage impossible to promise). Under the old freeze it ran eagerly, and eager
    FlexAttention materializes the whole [heads, rows, ctx] score matrix (tens of GiB at 27B width: the OOM
    in results/log-issue15-27b-b16-oom).
    Dynamo specializes sizes 0 and 1 even when compiled dynamic, so the warmup brings a chunk holding one
    sequence, full chunks holding several equal sequences, mixed lengths with a partial tail chunk, and a
    chunk of a single 128-row query tile. (Sizes equal in every warmup shape, e.g. block rows and context
    rows at --max-anchors 32 with 512-token sequences, no longer tie the graphs to that equality:
    compiling.compile_layers turns dynamo's duck shaping off.)"""
    seq = min(cfg.max_seq_len, cfg.token_budget)
    shapes = [[seq]]
    if not wants(cfg.compile, "drafter"):
        return shapes
    per = max(2, min(cfg.max_batch_size, cfg.token_budget // cfg.max_seq_len))
    full = max(cfg.block_size * 2, min(cfg.max_seq_len, cfg.token_budget // per))
    shapes.append([full] * per)
    # mixed: two medium sequences (a partial chunk) and short ones that share a chunk
    short = max(cfg.block_size * 2, cfg.drafter_chunk_rows // (4 * cfg.block_size))
    mixed = [n for n in (seq // 2 + 37, seq // 3 + 74) if n > short] + [min(short, seq)] * 3
    while sum(mixed) > cfg.token_budget and len(mixed) > 2:
        mixed.pop(0)
    shapes.append(mixed)
    # a chunk of one 128-row query tile: a micro-batch's tail chunk (the sequences left after a full chunk)
    # can be that small, and its tile lists then have one query tile, a size-1 dimension that dynamo
    # specializes (a sequence of L tokens has at most L - 2 anchors)
    shapes.append([min(seq, FLEX_BLOCK // cfg.block_size + 2)])
    return shapes


def target_warmup_shapes(cfg: TrainConfig) -> list[tuple[int, int]]:
    """[rows, tokens] of the target's warmup batches."""
    long_b = max(1, cfg.token_budget // cfg.max_seq_len)
    return [(long_b, cfg.max_seq_len), (min(cfg.max_batch_size, cfg.token_budget // 256 or 1), 256)]


# Worst cases for one piece of start-up work, the unit the start-up's stall bound counts in: one warmup
# shape that compiles and autotunes (a hybrid target's layers compile per mixer class), one eager shape,
# the load of a 27B target from /dev/shm.
COMPILED_SHAPE_S = 1800.0
EAGER_SHAPE_S = 600.0
LOAD_S = 1800.0


def startup_bounds(cfg, compile_opt: str | None = None) -> StartupBounds:
    """From the config: the stall bound is the slowest single piece of start-up work (the load, or one
    warmup shape of a role that compiles); the barrier's bound is the load plus every shape of the role
    with the most work, each at its worst case."""
    on_cpu = not cfg.target_gpus and not cfg.drafter_gpus
    resolved = resolve_compile(compile_opt or cfg.compile, on_cpu)
    resolved_cfg = dataclasses.replace(cfg, compile=resolved)
    per = {}
    for role, n in (("target", len(target_warmup_shapes(cfg))), ("drafter", len(warmup_batches(resolved_cfg)))):
        per[role] = (n, COMPILED_SHAPE_S if wants(resolved, role) else EAGER_SHAPE_S)
    stall = max([LOAD_S] + [s for _, s in per.values()])
    barrier = LOAD_S + max(n * s for n, s in per.values())
    why = (f"--compile {resolved}; load {LOAD_S:.0f}s, "
           + ", ".join(f"{n} {role} shape(s) at {s:.0f}s" for role, (n, s) in per.items()))
    return StartupBounds(stall, barrier, why)


def warmup(cfg: TrainConfig, dcfg, feed: Feed, target, drafter, opt, device: torch.device, dtype: torch.dtype,
           progress) -> None:
    """Every stage this rank holds, at the shapes training will bring. progress(phase, detail): the
    start-up's proof of progress (trainer/distributed/startup.py), once before each shape."""
    t0 = time.perf_counter()
    compiled = cfg.compile != "none"
    if compiled:
        begin_warmup()
    vocab = dcfg.vocab_size
    how = "compile and autotune" if compiled else "autotune"
    if target is not None:
        shapes = target_warmup_shapes(cfg)
        for i, shape in enumerate(shapes):
            progress("warmup", f"target shape {i + 1} of {len(shapes)} ({shape[0]}x{shape[1]}, "
                               f"{how if wants(cfg.compile, 'target') else 'eager'})")
            target.warmup([shape], vocab)
    if drafter is not None:
        k, hidden = len(dcfg.target_layer_ids), dcfg.hidden_size
        batches = warmup_batches(cfg)
        for j, lens in enumerate(batches):
            progress("warmup", f"drafter shape {j + 1} of {len(batches)} ({len(lens)} sequences, "
                               f"{how if wants(cfg.compile, 'drafter') else 'eager'})")
            t1 = time.perf_counter()
            rng = np.random.default_rng(sum(lens))
            n, s = len(lens), max(lens)
            ids = rng.integers(0, vocab, size=(n, s))
            lengths = np.array(lens)
            mask = np.arange(s)[None, :] < lengths[:, None]
            mask[:, 0] = False
            plan = feed.plan(ids, mask, lengths, list(range(n)), 0, seed=0,
                             max_anchors=min(cfg.max_anchors, cfg.drafter_chunk_rows // cfg.block_size))
            batch = Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(lengths),
                          list(range(n)), int(lengths.sum()), int(mask.sum()))
            item = make_item(-1, 0, 0, batch, plan, pin=device.type == "cuda", data_s=0.0)
            gen = torch.Generator(device=device).manual_seed(n)
            taps = torch.randn(plan.num_ctx_rows, k * hidden, generator=gen, device=device).to(dtype)
            nf = item.final_gather.shape[0] if item.final_gather is not None else 0
            final = (torch.randn(nf, hidden, generator=gen, device=device).to(dtype) if nf else None)
            drafter.begin_step()
            drafter.micro_step(item, taps, final, 0.0, 1.0, last=True)
            opt.zero_grad(set_to_none=True)
            drafter.reset_counters()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            log.info("warmup: drafter %s %d sequences, %d block rows in %d chunks in %.2fs", device, n,
                     sum(len(c.q_seq) for c in plan.chunks), len(plan.chunks), time.perf_counter() - t1)
    stance = end_warmup() if compiled else ""
    log.info("warmup done in %.1fs%s", time.perf_counter() - t0,
             {"": "", "default": f" (--compile {cfg.compile}: a shape its graphs do not cover compiles once, logged)",
              "eager_on_recompile": f" (--compile {cfg.compile}: graphs frozen, shapes they do not cover run eagerly)",
              "fail_on_recompile": f" (--compile {cfg.compile}: a shape its graphs do not cover is an error)"}[stance])
