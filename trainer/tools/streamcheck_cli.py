"""The checker's command line: `python -m trainer.tools.streamcheck_cli check <dir>` decides whether a recorded
run's op order (a DFLASH_RECORD_OPS directory, trainer/distributed/oprecord.py) can hang under NCCL's rules. The
rules themselves are trainer/distributed/streamcheck.py, which imports nothing of the trainer. Replaying the
trainer's loop over DispatchPlans and checking them is the team's instrument, trainer/lab/opreplay.py's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.distributed.streamcheck import load_programs, simulate, with_p2p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.tools.streamcheck_cli",
                                 description="Decide whether the trainer's op order can hang under NCCL's rules.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check a recorded run (a DFLASH_RECORD_OPS directory)")
    c.add_argument("dir")
    c.add_argument("--p2p", choices=("shared", "pair"), default=None,
                   help="replay point-to-point on the group's communicator (eager init) or one per pair")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    from trainer.optional import defer
    defer()   # a program: torchao only when asked for (trainer/optional.py)
    raise SystemExit(main())
