"""Programs for streamcheck from a DispatchPlan: the trainer's own loop over hundreds of steps, at the
production layouts, with stages that do no heavy work.

A real recorded run (DFLASH_RECORD_OPS, oprecord.py) is the ground truth but costs seconds per step on
the CPU; a plan of 1,000 steps at 5 + 3 ranks needs something faster. Here each rank runs, in turn, in this
one process, on PyTorch's "fake" process group (collectives return at once): the real `Trainer.run` loop
(train_step, optimizer_step, the stop vote), the real `Feed` (dispatch plan, prefetch thread, receive
posting), the real `Sender`/`Receiver` and slot ring, and a real FSDP2 drafter (build_drafter's wrapping,
the real DrafterStage.begin_step/_final_backward protocol, the real optimizer and clipping) shrunk to
hidden size 16. What is not real: the target's forward (a compute marker lasting tokens / target rate)
and the drafter's work on a micro-batch (one block through the tiny drafter, lasting rows / drafter rate).
oprecord logs every op as it does for a real run, so streamcheck sees the op order the code issues.

`python -m trainer.lab.opreplay --layouts 5+3,4+4x2 --settings orig,b16 --steps 1000` replays plans and checks
each (streamcheck.simulate): whether it hangs, and at which step first; its efficiency where it does not.

Checkpoints and in-training evals are not replayed (save and eval intervals beyond the plan): they are
host-side phases that every rank enters at the same step (see docs/distributed.md); recorded real runs
cover them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import logging
import queue
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from trainer.distributed import oprecord
from trainer.distributed.streamcheck import Program, Result, simulate, timing

# Per-GPU rates of one H200 for the timed replay (the 27B target and the 27B-width drafter of
# docs/performance.md, "Per-GPU rates: training", whose result files results/INDEX.md lists), bytes per
# hidden-state token at 27B width (5 taps + the final row, bf16), and link bandwidths (NVLink within a
# node; TCP between nodes, what the two-container layout gets today).
TARGET_TOK_S = 11_380.0
DRAFTER_ROWS_S = {16: 34_100.0, 32: 35_000.0}
BYTES_PER_TOKEN = 6 * 5120 * 2
LINK_GBPS = {"node": 150.0, "net": 2.5}

LAYOUTS = {
    # name: per node (drafter GPUs, target GPUs); the production shapes and the small ones
    "1+1": [(1, 1)], "1+2": [(2, 1)], "2+2": [(2, 2)], "5+3": [(3, 5)], "2+6": [(6, 2)],
    "4+4x2": [(2, 2), (2, 2)], "5+3x2": [(2, 2), (1, 3)],
    # docs/distributed.md's two nodes: node 0 at 5 + 3, node 1 eight targets and no drafter
    "13+3x2": [(3, 5), (0, 8)],
}


def topology(layout: str):
    """Every rank's Topology for `layout` ("T+D" or a LAYOUTS name): per node, drafters first (as
    topology.local_roles orders them), nodes in node-rank order."""
    from trainer.distributed.topology import LocalRole, Topology
    nodes = LAYOUTS.get(layout)
    if nodes is None:
        t, d = (int(x) for x in layout.split("+"))
        nodes = [(d, t)]
    roles, hosts, local = [], [], []
    for n, (nd, nt) in enumerate(nodes):
        node_roles = [LocalRole(False, True, "cpu") for _ in range(nd)]
        node_roles += [LocalRole(True, False, "cpu") for _ in range(nt)]
        roles += node_roles
        hosts += [f"node{n}"] * len(node_roles)
        local += list(range(len(node_roles)))
    if len(roles) == 1:
        roles = [LocalRole(True, True, "cpu")]
    return [Topology(r, len(roles), local[r], roles[r], hosts[r], roles, hosts) for r in range(len(roles))]


def synthetic_lengths_dataset(n_tokens: int, max_len: int, seed: int):
    """bench.shapes.synthetic_dataset's length and mask distribution (log-normal, completion = last 60%)."""
    from trainer.lab.bench.shapes import synthetic_dataset
    return synthetic_dataset(n_tokens, max_len, vocab=64, supervised=0.6, seed=seed)


@dataclass
class ReplayItem:
    seq_no: int
    plan: object
    final_gather: None
    target_s: float
    drafter_s: float
    send_s: float


class ReplayTarget:
    """The target stage's slot ring and events with no model: what TargetStage does around its forward."""

    def __init__(self, device, num_slots: int):
        from trainer.distributed.transport import Slot, new_stream
        self.device = device
        self.stream = new_stream(device, "TargetStage")
        self.slots = [Slot(i, torch.empty(0)) for i in range(num_slots)]
        self._next = 0
        self.k, self.hidden = 1, 0

    def next_slot(self):
        from trainer.engine.target_stage import TargetStage
        return TargetStage.next_slot(self)

    def forward_pack(self, item: ReplayItem, slot) -> dict:
        from trainer.distributed.transport import device_ctx, new_event, stream_ctx
        with device_ctx(self.device), stream_ctx(self.stream):
            start = new_event(self.device, True)
            start.record()
            oprecord.compute(self.stream, f"target fwd+pack mb {item.seq_no}", item.target_s)
            slot.ready = new_event(self.device)
            slot.ready.record()
        slot.rows, slot.final_rows = 0, 0
        return {"start": start, "done": slot.ready}

    def numel(self, slot) -> int:
        return 0


class EmulatedFSDP:
    """The collectives FSDP2 issues for the drafter, without a model: the same calls our code makes on the
    real FSDP module (set_requires_gradient_sync, set_reshard_after_backward, unshard), and per forward and
    backward the ops FSDP2 issues, through oprecord as the real module's go. What it emits (per forward:
    the all-gather streams wait on the current stream; an all-gather per unit when not unsharded, on
    FSDP's all-gather stream, the current stream waiting for it; per syncing backward a reduce-scatter
    per unit from the current stream; resharding when told) is tested op for op against recordings of
    the real FSDP2 module (tests/distributed/test_streamcheck.py)."""

    def __init__(self, units: int):
        self.units = units
        self.sync = True
        self.reshard_after_backward = True
        self.unsharded = False
        self.pending: list = []          # async all-gathers (unshard(async_op=True)) not yet waited on

    def set_requires_gradient_sync(self, v: bool, **_):
        self.sync = v

    def set_reshard_after_backward(self, v: bool, **_):
        self.reshard_after_backward = v

    def modules(self):
        return [_Unit(self) for _ in range(self.units)]

    def unshard_unit(self, async_op: bool):
        """One unit's FSDPModule.unshard (drafter_stage.fsdp_units calls it per unit, in forward order)."""
        rec = oprecord.RECORDER
        if self.unsharded or len(self.pending) >= self.units:
            return
        op = rec.program.collective(rec.stream_name(), "drafters", "all_gather_single",
                                    "all_gather_single on drafters")
        if async_op:
            self.pending.append(op)
        else:
            rec.program.wait(rec.stream_name(), op)

    def forward(self):
        rec = oprecord.RECORDER
        stream = rec.stream_name()
        rec.program.wait_event(oprecord.FSDP_AG, rec.program.record(stream))   # root pre-forward
        if self.pending:
            for op in self.pending:
                rec.program.wait(stream, op)
            self.pending = []
        elif not self.unsharded:
            ops = [rec.program.collective(oprecord.FSDP_AG, "drafters", "all_gather_single",
                                          "all_gather_single on drafters") for _ in range(self.units)]
            for op in ops:
                rec.program.wait(stream, op)
        self.unsharded = True

    def backward(self):
        rec = oprecord.RECORDER
        stream = rec.stream_name()
        if self.sync:
            for _ in range(self.units):
                op = rec.program.collective(stream, "drafters", "reduce_scatter_single",
                                            "reduce_scatter_single on drafters")
                rec.program.wait(stream, op)
        if self.reshard_after_backward:
            self.unsharded = False

    def parameters(self):
        return iter(())


class _Unit:
    def __init__(self, fsdp: EmulatedFSDP):
        self.fsdp = fsdp

    def unshard(self, async_op: bool = False):
        self.fsdp.unshard_unit(async_op)


def emulated_guarded_step(model, opt, lr, clip, loss):
    """optim.guarded_step's collectives: the global norm of the sharded gradients (DTensor's functional
    all-reduce on the drafter group, waited on by the current stream)."""
    rec = oprecord.RECORDER
    stream = rec.stream_name()
    rec.program.wait(stream, rec.program.collective(stream, "drafters", "all_reduce", "all_reduce on drafters"))
    return torch.zeros(()), torch.zeros((), dtype=torch.bool)


def _replay_drafter_class():
    from trainer.distributed.transport import device_ctx, new_event, stream_ctx
    from trainer.engine.drafter_stage import DrafterStage

    class ReplayDrafter(DrafterStage):
        """The real DrafterStage's step protocol (begin_step, _final_backward, counters) on EmulatedFSDP,
        one forward and backward standing for a micro-batch's work."""

        def micro_step(self, item, taps, final, noise_amp, loss_scale, last, ready=None):
            with device_ctx(self.device), stream_ctx(self.stream):
                e0, e1 = new_event(self.device, True), new_event(self.device, True)
                if ready is not None and self.stream is not None:
                    self.stream.wait_event(ready)
                e0.record()
                self.model.forward()
                oprecord.compute(self.stream, f"drafter fwd+bwd mb {item.seq_no}", item.drafter_s)
                self._final_backward(last)
                self.model.backward()
                e1.record()
            return e0, e1

    return ReplayDrafter


def _tiny_dcfg(cfg):
    from trainer.model.drafter import DFlashConfig
    k = cfg.num_draft_layers
    return DFlashConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=cfg.num_draft_layers,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=1 << 16, block_size=cfg.block_size,
                        target_layer_ids=list(range(1, k + 1)), mask_token_id=63, target_num_hidden_layers=k + 4)


def rank_program(cfg, topo, dataset, steps: int, net_hosts: bool, plans: dict | None = None) -> Program:
    """Run rank `topo.rank`'s real loop for `steps` steps on the fake process group; return its program.
    `plans`: step -> the dispatch plan's assignments, shared by the ranks of one layout replayed in turn. Every
    rank computes the same plan from the batch plan alone (DispatchPlan; tests/distributed/test_multi_rank.py
    checks two planners agree), so the first rank to reach a step computes it for all: the rest of the replay
    is per rank, and a thousand steps at 2 + 6 spent a quarter of their time planning the same steps 8 times."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.distributed.groups import Groups, connect
    from trainer.distributed.transport import Receiver, Sender
    from trainer.engine import train as train_mod
    from trainer.engine.train import Trainer

    dist.init_process_group("fake", store=FakeStore(), rank=topo.rank, world_size=topo.world)
    rec = None
    try:
        groups = Groups(topo, datetime.timedelta(seconds=60), cfg.transport, host_backend=None)
        members = {"WORLD": list(range(topo.world)), "control": list(range(topo.world)),
                   "drafters": list(topo.drafter_ranks), "dctl": list(topo.drafter_ranks)}
        rec = oprecord.install(topo.rank, _role(topo), groups.named(), members, None)
        rec.program.groups.update({name: list(g) for name, g in groups.pair_members().items()})
        connect(topo, groups, torch.device("cpu"))
        dev = torch.device("cpu")
        trainer = Trainer(cfg, topo, groups, dataset=dataset)
        trainer.feed.load()
        if plans is not None:
            own = trainer.feed.dispatch.step

            def shared_step(step: int):
                got = plans.get(step)
                if got is None:
                    got = plans[step] = own(step)
                return got
            trainer.feed.dispatch.step = shared_step
        trainer.feed.mask_token = 63
        trainer.dcfg = _tiny_dcfg(cfg)
        trainer._build_schedule()
        trainer.total_steps = min(trainer.total_steps, steps)
        per_step = trainer.feed.dispatch.per_step
        drafter_rate = DRAFTER_ROWS_S.get(cfg.block_size, 35_000.0)

        def make_item(seq: int) -> ReplayItem:
            a = trainer.feed.dispatch.step(seq // per_step)[seq % per_step]
            cross = net_hosts and topo.hosts[topo.target_ranks[a.target]] != topo.hosts[topo.drafter_ranks[a.drafter]]
            bw = LINK_GBPS["net" if cross else "node"] * 1e9
            return ReplayItem(seq, SimpleNamespace(num_ctx_rows=0), None, a.tokens / TARGET_TOK_S,
                              a.rows / drafter_rate, a.tokens * BYTES_PER_TOKEN / bw)
        trainer.feed.make_item = make_item
        trainer.feed.q = queue.Queue()     # unbounded: the prefetch thread runs ahead instead of handing over
                                           # the GIL per item (the op order does not depend on it: feed.py)
        if topo.is_target:
            trainer.target = ReplayTarget(dev, cfg.slots_per_worker)
            trainer.sender = Sender(dev, groups.link)
        if topo.is_drafter:
            embed = torch.zeros(64, 16)
            module = EmulatedFSDP(cfg.num_draft_layers + 1)     # a unit per layer and the root (build_drafter)
            trainer.drafter = _replay_drafter_class()(module, dev, embed, embed, cfg, trainer.dcfg, "sdpa")
            trainer.drafter.stream = oprecord.stream("DrafterStage")   # the real stage's stream name
            trainer.opt = None
            if not topo.is_target:
                trainer.receiver = Receiver(dev, 0, torch.float32, cfg.queue_depth, 1, 0, groups.link)
        trainer.warmup = lambda: None
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        trainer.report.open(None)
        real_step, train_mod.guarded_step = train_mod.guarded_step, emulated_guarded_step
        try:
            rc = trainer.run()
        finally:
            train_mod.guarded_step = real_step
        if rc != 0:
            raise RuntimeError(f"replay of rank {topo.rank} ended with {rc}")
        trainer.shutdown()
        return rec.program
    finally:
        if rec is not None:
            rec.uninstall()
            oprecord.RECORDER = None
        dist.destroy_process_group()


def _role(topo) -> str:
    if topo.is_target and topo.is_drafter:
        return "target+drafter"
    return f"target {topo.target_index}" if topo.is_target else f"drafter {topo.drafter_index}"


def replay_config(setting: str, **over):
    """The trainer config of a bench setting ("orig": the seed recipe, "b16"), CPU ranks, no checkpoints; its
    output_dir is a scratch directory of its own, which the caller removes."""
    from trainer.config.options import TrainConfig
    from trainer.lab.bench.run import SETTINGS
    out = tempfile.mkdtemp(prefix="dflash-replay-")
    base = dict(SETTINGS[setting])
    base.update(target_model="replay", data_dir="replay", output_dir=out, status_file=f"{out}/status.json",
                log_dir=f"{out}/logs", target_gpus=[], drafter_gpus=[],
                save_interval=10 ** 9, save_final=False, epochs=1000, profile_interval=10 ** 9, compile="none")
    base.update(over)
    return TrainConfig(**{k: v for k, v in base.items() if k in TrainConfig.__dataclass_fields__})


def plan_programs(layout: str, setting: str = "orig", steps: int = 1000, seed: int = 0,
                  dataset_tokens: int | None = None, **over) -> list[Program]:
    """Every rank's program for `steps` optimizer steps of `layout` at `setting`. The trainer's loggers say
    nothing under WARNING meanwhile (thousands of replayed steps), and get their level back after."""
    log = logging.getLogger("trainer")
    level = log.level
    log.setLevel(logging.WARNING)
    cfg = replay_config(setting, seed=seed, max_steps=steps, **over)
    topos = topology(layout)
    # a corpus of about 2M tokens (the plan goes through it epoch after epoch, reshuffled each time)
    ds = synthetic_lengths_dataset(dataset_tokens or 2_000_000, cfg.max_seq_len, seed)
    net = len({t for t in topos[0].hosts}) > 1
    try:
        plans: dict = {}
        return [rank_program(cfg, t, ds, steps, net, plans) for t in topos]
    finally:
        log.setLevel(level)
        shutil.rmtree(cfg.output_dir, ignore_errors=True)    # replay_config's scratch directory


@contextlib.contextmanager
def _no_cyclic_gc():
    """The cyclic garbage collector off meanwhile: a plan of 1,000 steps holds some 300,000 ops (each with its
    lists) alive until it is checked, and the collector walked them again and again as they piled up, a third
    of the replay's and the check's CPU time (measured at 2 + 6). What only it frees (each rank's Trainer, a
    tiny drafter's worth) waits for the collection after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_plan(layout: str, setting: str, steps: int, **over) -> dict:
    """Replay `steps` steps of `layout` at `setting` and check them; the result as a record."""
    with _no_cyclic_gc():
        t0 = time.perf_counter()
        progs = plan_programs(layout, setting, steps=steps, **over)
        t1 = time.perf_counter()
        res = simulate(progs)
        rec = {"layout": layout, "setting": setting, "steps": steps, **over, "ranks": len(progs),
               "ops": sum(len(p.ops) for p in progs), "hang": not res.ok, "cycle": res.cycle[:16],
               "replay_s": round(t1 - t0, 1), "check_s": round(time.perf_counter() - t1, 1)}
        if res.ok:
            rec.update(timing(res, progs))
        else:
            rec["first_hang_step"] = _first_stuck_step(progs, res)
    return rec


def _first_stuck_step(programs: list[Program], res: Result) -> int | None:
    """The earliest step (from the loop's marks) with an op that never completed."""
    best = None
    for p in programs:
        marks = sorted((n, text) for text, n in p.marks().items() if text.startswith("step "))
        done = {i for (r, i) in res.times if r == p.rank}
        stuck = next((o.id for o in p.ops if o.id not in done), None)
        if stuck is None:
            continue
        step = max((int(t.split()[1]) for n, t in marks if n <= stuck), default=0)
        best = step if best is None else min(best, step)
    return best


def plan_main(args) -> int:
    results = []
    combos = list(itertools.product(args.layouts.split(","), args.settings.split(","), args.transport.split(","),
                                    args.fsdp_prefetch.split(",")))
    rng = random.Random(0)
    for i in range(args.random):
        t, d = rng.randint(1, 6), rng.randint(1, 6)
        combos.append((f"{t}+{d}", rng.choice(["orig", "b16"]), rng.choice(args.transport.split(",")),
                       rng.choice(args.fsdp_prefetch.split(",")),
                       dict(seed=rng.randint(0, 10 ** 6), grad_accum=rng.randint(1, 6),
                            queue_depth=rng.randint(1, 3), slots_per_worker=rng.randint(1, 4))))
    for c in combos:
        layout, setting, transport, prefetch = c[:4]
        extra = c[4] if len(c) > 4 else {}
        steps = args.steps if not extra else max(50, args.steps // 5)
        rec = run_plan(layout, setting, steps, transport=transport, fsdp_prefetch=prefetch, **extra)
        results.append(rec)
        eff = (f"efficiency {rec['efficiency']:.3f} (of the step-barrier bound {rec['pipeline_efficiency']:.3f})"
               if rec.get("efficiency") and rec.get("pipeline_efficiency") else "")
        what = f"HANG (first at step {rec['first_hang_step']})" if rec["hang"] else "no hang"
        print(f"{layout:>6} {setting:>4} {transport:>5} {prefetch:>7} {steps:5d} steps"
              f"{' ' + str(extra) if extra else ''}: {what} {eff} ({rec['replay_s']}s + {rec['check_s']}s)",
              flush=True)
    if args.out:   # meta.commit: which code was checked (results/INDEX.md)
        from trainer.lab.bench.run import git_commit
        meta = {"argv": sys.argv[1:], **git_commit()}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 1 if any(r["hang"] for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.lab.opreplay",
                                 description="Replay the trainer's loop over DispatchPlans and check each under NCCL's rules.")
    ap.add_argument("--layouts", default="1+1,1+2,2+2,5+3,2+6,4+4x2",
                    help="comma-separated: T+D on one node, or a name from LAYOUTS (4+4x2: two nodes)")
    ap.add_argument("--settings", default="orig,b16", help="bench settings (orig: the seed recipe)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--transport", default="pair", help="comma-separated --transport values to compare")
    ap.add_argument("--fsdp-prefetch", default="step", help="comma-separated --fsdp-prefetch values to compare")
    ap.add_argument("--random", type=int, default=0, help="also this many randomized plans (layout, recipe, seed)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    return plan_main(ap.parse_args(argv))


if __name__ == "__main__":
    from trainer.optional import defer
    defer()   # a program: torchao only when asked for (trainer/optional.py)
    raise SystemExit(main())
