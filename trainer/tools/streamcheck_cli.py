"""The checker's command line: `python -m trainer.tools.streamcheck_cli check <dir>` decides whether a recorded
run's op order can hang under NCCL's rules; `... plan` replays the trainer's loop over DispatchPlans
(trainer/tools/opreplay.py) and checks it. The rules themselves are trainer/distributed/streamcheck.py, which imports
nothing of the trainer; this module is the one that reaches up to the loop."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

from trainer.distributed.streamcheck import Program, Result, load_programs, simulate, timing, with_p2p
from trainer.tools.opreplay import plan_programs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.tools.streamcheck_cli",
                                 description="Decide whether the trainer's op order can hang under NCCL's rules.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check a recorded run (a DFLASH_RECORD_OPS directory)")
    c.add_argument("dir")
    c.add_argument("--p2p", choices=("shared", "pair"), default=None,
                   help="replay point-to-point on the group's communicator (eager init) or one per pair")
    pl = sub.add_parser("plan", help="replay the trainer's loop over a DispatchPlan (trainer/tools/opreplay.py) and check it")
    pl.add_argument("--layouts", default="1+1,1+2,2+2,5+3,2+6,4+4x2",
                    help="comma-separated: T+D on one node, or a name from opreplay.LAYOUTS (4+4x2: two nodes)")
    pl.add_argument("--settings", default="orig,b16", help="bench settings (orig: the seed recipe)")
    pl.add_argument("--steps", type=int, default=1000)
    pl.add_argument("--transport", default="pair", help="comma-separated --transport values to compare")
    pl.add_argument("--fsdp-prefetch", default="step", help="comma-separated --fsdp-prefetch values to compare")
    pl.add_argument("--random", type=int, default=0, help="also this many randomized plans (layout, recipe, seed)")
    pl.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        return plan_main(args)
    if args.cmd == "check":
        files = sorted(Path(args.dir).glob("ops-rank*.json"))
        if not files:
            print(f"streamcheck: error: {args.dir}: no ops-rank*.json files", file=sys.stderr)
            return 2
        progs = load_programs(files)
        if args.p2p:
            progs = [with_p2p(p, args.p2p) for p in progs]
        res = simulate(progs)
        print(f"{len(progs)} ranks, {sum(len(p.ops) for p in progs)} ops: {res.explain()}")
        return 0 if res.ok else 1
    return 2


def run_plan(layout: str, setting: str, steps: int, **over) -> dict:
    """Replay `steps` steps of `layout` at `setting` (opreplay) and check them; the result as a record."""
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
        from trainer.tools.bench import git_commit
        meta = {"argv": sys.argv[1:], **git_commit()}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 1 if any(r["hang"] for r in results) else 0



if __name__ == "__main__":
    from trainer.optional import defer
    defer()   # a program: torchao only when asked for (trainer/optional.py)
    raise SystemExit(main())
