"""Compile/autotune surprises before step 1: target shapes on target ranks; on drafter ranks one
forward/backward per warmup shape on random taps (all drafter ranks together: it runs the FSDP
collectives), gradients thrown away."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np
import torch

from trainer.config.options import TrainConfig
from trainer.data.dataset import Batch
from trainer.distributed.startup import StartupBounds
from trainer.engine.feed import Feed, make_item
from trainer.ops.compiling import begin_warmup, end_warmup, resolve_compile, wants
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
    """[rows, tokens] of the target's warmup batches, in order. The planner makes batches of any row count
    from 1 to --max-batch-size, padded to any length. A compiled layer (compile_layers, dynamic=None) is
    first compiled for the sizes it sees, then again with the sizes that changed made symbolic (dynamo's
    automatic dynamic shapes); it specializes sizes 0 and 1 even then. So the warmup brings two row counts
    above 1 at two lengths (both dims symbolic), then one sequence alone (B = 1: a graph of its own, its
    length symbolic already). Without that last shape a one-sequence batch compiled the target's layers in
    the middle of a step, while the drafters' receives counted against the NCCL timeout.
    `batch_rows_unwarmed` checks a plan against these shapes."""
    seq = min(cfg.max_seq_len, cfg.token_budget)
    short = max(1, min(256, seq // 2))
    long_b = max(1, min(cfg.max_batch_size, cfg.token_budget // seq))
    short_b = max(1, min(cfg.max_batch_size, cfg.token_budget // short))
    shapes = []
    for b, s in ((long_b, seq), (short_b, short)):
        if b > 1 and (b, s) not in shapes:
            shapes.append((b, s))
    if len({b for b, _ in shapes}) == 1 and cfg.max_batch_size > 2:   # one row count above 1: B would stay static
        b = shapes[0][0] - 1 if shapes[0][0] > 2 else 3
        shapes.append((b, max(1, min(short, cfg.token_budget // b))))
    shapes.append((1, seq))
    return shapes


def batch_rows_unwarmed(rows, shapes: list[tuple[int, int]]) -> list[int]:
    """The batch row counts in `rows` that the compiled target's warmup `shapes` do not cover: a count
    warmed as such, or any count above 1 once two different ones above 1 were warmed (dynamo has then
    made the dim symbolic), is covered; 1 only as itself (dynamo specializes it)."""
    warmed = {b for b, _ in shapes}
    symbolic = len({b for b in warmed if b > 1}) >= 2
    return sorted({int(r) for r in rows if int(r) not in warmed and not (int(r) > 1 and symbolic)})


def planned_batch_rows(planner, epochs: int = 1) -> set[int]:
    """The row counts of the planner's batches over its first `epochs` epochs (host-side, no model)."""
    return {len(planner.batch(e, i)) for e in range(epochs) for i in range(planner.num_batches)}


def check_target_coverage(cfg: TrainConfig, planner) -> list[tuple[int, int]]:
    """Before the run: the target's warmup shapes, and a ValueError naming any planned batch row count a
    compiled target would compile in the middle of a step."""
    shapes = target_warmup_shapes(cfg)
    if wants(cfg.compile, "target"):
        missing = batch_rows_unwarmed(planned_batch_rows(planner), shapes)
        if missing:
            raise ValueError(f"--compile {cfg.compile}: the plan makes batches of {missing} sequences, which the "
                             f"target's warmup shapes {shapes} do not cover (a compile in the middle of a step)")
    return shapes


# Worst cases for one piece of start-up work, the unit the start-up's stall bound counts in: one warmup
# shape that compiles and autotunes (a hybrid target's layers compile per mixer class), one eager shape,
# the load of a 27B target from /dev/shm.
COMPILED_SHAPE_S = 1800.0
EAGER_SHAPE_S = 600.0
LOAD_S = 1800.0


def hybrid_target(cfg) -> bool:
    """Whether --target-model's config.json declares linear-attention layers (False when unreadable: the
    preflight names a missing or broken target)."""
    from trainer.model.families import is_hybrid
    if not cfg.target_model:
        return False
    try:
        with open(os.path.join(cfg.target_model, "config.json")) as f:
            return is_hybrid(json.load(f))
    except (OSError, ValueError):
        return False


def startup_bounds(cfg, compile_opt: str | None = None, hybrid: bool | None = None) -> StartupBounds:
    """From the config: the stall bound is the slowest single piece of start-up work (the load, or one
    warmup shape of a role that compiles); the barrier's bound is the load plus every shape of the role
    with the most work, each at its worst case."""
    on_cpu = not cfg.target_gpus and not cfg.drafter_gpus
    hybrid = hybrid_target(cfg) if hybrid is None else hybrid
    resolved = resolve_compile(compile_opt or cfg.compile, on_cpu, hybrid)
    resolved_cfg = dataclasses.replace(cfg, compile=resolved)
    per = {}
    for role, n in (("target", len(target_warmup_shapes(cfg))), ("drafter", len(warmup_batches(resolved_cfg)))):
        per[role] = (n, COMPILED_SHAPE_S if wants(resolved, role) else EAGER_SHAPE_S)
    stall = max([LOAD_S] + [s for _, s in per.values()])
    barrier = LOAD_S + max(n * s for n, s in per.values())
    why = (f"--compile {resolved}; load {LOAD_S:.0f}s, "
           + ", ".join(f"{n} {role} shape(s) at {s:.0f}s" for role, (n, s) in per.items()))
    return StartupBounds(stall, barrier, why, resolved)


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
