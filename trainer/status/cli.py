"""`dflash-status`: a run's status.json summarised, with the one health verdict (trainer/status/health.py):
exit 0 healthy, 1 failed, dead, stale (or a --unit/--training/--after-step condition unmet), 2 missing or
unreadable. Standard library only, so it starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterable, Mapping

from trainer.procs import pid_alive
from trainer.status.health import DEFAULT_MAX_AGE, unit_state, verdict
from trainer.status.writer import StatusFileError, format_value, read_status, to_jsonable


def _eval_line(ev: Any) -> str:
    if not isinstance(ev, Mapping) or ev.get("tau") is None:
        return "-"
    return f"tau {format_value(ev.get('tau'), '.3f')} at step {ev.get('step')}"


def _human_summary(path: str, st: Mapping[str, Any], healthy: bool, age: float | None,
                   reason: str) -> str:
    def g(key: str, fmt: str | None = None) -> str:
        v = st.get(key)
        if v is None:
            return "-"
        return format_value(v, fmt) if fmt else str(v)

    total = st.get("tokens_seen")
    rows = [
        ("status file", path),
        ("health", ("healthy" if healthy else "UNHEALTHY") + f" ({reason})"),
        ("phase", g("phase")),
        ("run id", g("run_id")),
        ("step", g("step")),
        ("epoch", g("epoch")),
        ("tokens seen", format_value(total, ",") if total is not None else "-"),
        ("tokens/s", g("tokens_per_s", ",.1f")),
        ("loss", g("loss", ".4f")),
        ("nan skips", f"{g('nan_skips')} (streak {g('nan_streak')})"),
        ("last eval", _eval_line(st.get("eval"))),
        ("last checkpoint", g("last_checkpoint")),
        ("resumed from", g("resumed_from")),
        ("heartbeat age", f"{age:.1f} s" if age is not None else "-"),
        ("pid", g("pid")),
        ("log file", g("log_file")),
    ]
    if st.get("recompiles"):
        rows.append(("recompiles", f"{st['recompiles']} graph(s) compiled after the warmup (the log names each guard)"))
    if st.get("error"):
        rows.append(("error", str(st.get("error"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-status",
        description="Summarise a DFlash training run's status.json: one health verdict, for operators "
                    "and for Ansible's health handler. Exit 0 healthy, 1 not healthy (failed, dead, stale, "
                    "or a condition below unmet), 2 status.json missing or unreadable.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--status-file", metavar="F", help="path to status.json")
    src.add_argument("--output-dir", metavar="D",
                     help="the trainer's --output-dir (reads D/status.json)")
    p.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE, metavar="S",
                   help="heartbeat older than S seconds counts as stale (default %(default)g)")
    p.add_argument("--no-pid-check", dest="check_pid", action="store_false",
                   help="do not check that the pid in status.json is alive (use where that pid does not "
                        "live, e.g. on the Proxmox node reading a container's file)")
    p.add_argument("--unit", metavar="U",
                   help="also judge the systemd unit: active, and status.json written by its main pid; "
                        "`final` when systemd gave up on it")
    p.add_argument("--training", action="store_true",
                   help="healthy only once the phase is training (or done) with a finite loss")
    p.add_argument("--after-step", type=int, metavar="N",
                   help="healthy only once the step has advanced past N")
    p.add_argument("--json", action="store_true",
                   help="print the status as JSON plus heartbeat_age_s, pid_alive, healthy, problems, final "
                        "(and unit with --unit); printed even when status.json is unreadable")
    return p


def resolve_status_path(args: argparse.Namespace) -> str:
    if args.status_file:
        return args.status_file
    if args.output_dir:
        return os.path.join(args.output_dir, "status.json")
    return os.environ.get("DFLASH_STATUS_FILE") or "status.json"


def main(argv: Iterable[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    path = resolve_status_path(args)
    unit = unit_state(args.unit) if args.unit else None
    try:
        st: dict[str, Any] | None = read_status(path)
        error = None
    except StatusFileError as e:
        st, error = None, str(e)
    v = verdict(st, max_age=args.max_age, check_pid=args.check_pid, unit=unit, unit_name=args.unit or "",
                training=args.training, after_step=args.after_step, read_error=error)
    if args.json:
        out = dict(st or {})
        out.update(v, status_file=path)
        out["pid_alive"] = pid_alive(out.get("pid"), out.get("started_at")) if args.check_pid and st else None
        if unit is not None:
            out["unit"] = unit
        print(json.dumps(to_jsonable(out), indent=2, sort_keys=True, allow_nan=False))
    if st is None:
        print(f"dflash-status: error: {error}", file=sys.stderr)
        return 2
    if not args.json:
        print(_human_summary(path, st, v["healthy"], v["heartbeat_age_s"], "; ".join(v["problems"]) or v["reason"]))
    sys.stdout.flush()
    return 0 if v["healthy"] else 1


if __name__ == "__main__":
    sys.exit(main())
