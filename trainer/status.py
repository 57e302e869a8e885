"""status.json heartbeat, systemd notification and the `dflash-status` command.

Standard library only (importable without torch), so `dflash-status` starts fast.

* :class:`StatusWriter` keeps the current status dict and writes ``status.json`` atomically
  (temp file in the same directory, flush + fsync, ``os.replace``, directory fsync). Non-finite
  floats become JSON ``null``; the file is always valid JSON.
* :func:`sd_notify` / :class:`Notifier` speak the systemd notify protocol over ``$NOTIFY_SOCKET``
  (AF_UNIX datagram; a leading ``@`` means the abstract namespace). They never raise.
* :func:`main` is ``dflash-status``: exit 0 healthy, 1 failed or stale, 2 missing/unreadable.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from .fsutil import atomic_write_text

log = logging.getLogger(__name__)

PHASES = ("starting", "loading", "warmup", "training", "checkpointing", "done", "failed")

# Every key of the contract, present from the first write on (null until known).
STATUS_FIELDS = (
    "phase", "step", "epoch", "tokens_seen", "tokens_per_s", "loss", "nan_skips", "nan_streak",
    "updated_at", "started_at", "pid", "run_id", "last_checkpoint", "error", "resumed_from",
    "log_file",
)

DEFAULT_MAX_AGE = 300.0


# --------------------------------------------------------------------------------------------
# JSON helpers


def to_jsonable(value: Any) -> Any:
    """Return ``value`` as plain JSON data: non-finite floats -> None, Paths -> str,
    tensor / numpy scalars -> Python numbers, tuples/sets -> lists."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    item = getattr(value, "item", None)  # torch / numpy scalars (0-d tensors)
    if callable(item):
        try:
            return to_jsonable(item())
        except Exception:  # noqa: BLE001 - not a scalar after all
            pass
    return str(value)


def atomic_write_json(path: str | os.PathLike, data: Any, *, mode: int = 0o644) -> None:
    """Write ``data`` as JSON to ``path`` atomically (never a partial file at ``path``)."""
    text = json.dumps(to_jsonable(data), indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write_text(path, text, mode=mode)


# --------------------------------------------------------------------------------------------
# status.json writer


class StatusWriter:
    """Keeps the trainer's status and writes it to ``path`` atomically on :meth:`update`.

    ``min_interval`` (seconds) throttles writes: an update within ``min_interval`` of the last
    write only merges its fields in memory, unless the phase changed or ``force=True``.
    ``notifier`` (a :class:`Notifier`), when given, gets a ``STATUS=`` line on every write.
    Write errors (e.g. a full disk) are logged, not raised: the heartbeat must not kill training.
    """

    def __init__(self, path: str | os.PathLike, run_id: str, *, min_interval: float = 0.0,
                 notifier: "Notifier | None" = None, started_at: float | None = None):
        self.path = Path(path)
        self.run_id = str(run_id)
        self.min_interval = float(min_interval)
        self.notifier = notifier
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {k: None for k in STATUS_FIELDS}
        self._state.update(
            run_id=self.run_id, pid=os.getpid(),
            started_at=float(started_at) if started_at is not None else time.time(),
            phase="starting", step=0, nan_skips=0, nan_streak=0,
        )
        self._last_write: float | None = None
        self._last_written_phase: str | None = None
        self._error_logged = False
        self.writes = 0

    def snapshot(self) -> dict[str, Any]:
        """A copy of the current status (including fields not yet written)."""
        with self._lock:
            return dict(self._state)

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            return self._state.get(key, default)

    def update(self, force: bool = False, **fields: Any) -> bool:
        """Merge ``fields`` and write status.json; returns True when the file was written."""
        with self._lock:
            self._state.update(fields)
            now = time.time()
            phase = self._state.get("phase")
            if (not force and self.min_interval > 0 and self._last_write is not None
                    and now - self._last_write < self.min_interval
                    and phase == self._last_written_phase):
                return False
            self._state["updated_at"] = now
            self._state["pid"] = os.getpid()
            self._state["run_id"] = self.run_id
            data = dict(self._state)
            try:
                atomic_write_json(self.path, data)
            except (OSError, ValueError, TypeError) as e:
                if not self._error_logged:
                    log.warning("could not write status file %s: %s", self.path, e)
                    self._error_logged = True
                return False
            if self._error_logged:
                log.info("status file %s written again", self.path)
                self._error_logged = False
            self._last_write = now
            self._last_written_phase = phase
            self.writes += 1
        if self.notifier is not None:
            self.notifier.status(format_status_line(data))
        return True

    def flush(self) -> bool:
        """Write the current state now (ignores throttling)."""
        return self.update(force=True)


def _fmt_num(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def format_status_line(st: Mapping[str, Any]) -> str:
    """One line for systemd's STATUS= (shown by `systemctl status`)."""
    phase = st.get("phase") or "?"
    if phase == "failed":
        return f"failed: {st.get('error') or 'unknown error'}"
    parts = [phase, f"step {_fmt_num(st.get('step'), 'd')}"]
    if st.get("epoch") is not None:
        parts.append(f"epoch {st.get('epoch')}")
    if st.get("loss") is not None:
        parts.append(f"loss {_fmt_num(st.get('loss'), '.4f')}")
    if st.get("tokens_per_s") is not None:
        parts.append(f"{_fmt_num(st.get('tokens_per_s'), ',.0f')} tok/s")
    if st.get("nan_skips"):
        parts.append(f"nan skips {st.get('nan_skips')}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# systemd notify protocol

_notify_error_logged = False


def sd_notify(*lines: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``lines`` (e.g. "READY=1") to ``$NOTIFY_SOCKET``.

    Returns False when NOTIFY_SOCKET is unset or sending failed; never raises (the first
    failure is logged as a warning)."""
    global _notify_error_logged
    env = os.environ if env is None else env
    addr = env.get("NOTIFY_SOCKET")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        if not _notify_error_logged:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying", addr)
            _notify_error_logged = True
        return False
    payload = "\n".join(str(x) for x in lines).encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(payload)
        return True
    except OSError as e:
        if not _notify_error_logged:
            log.warning("sd_notify to %s failed: %s (further failures not logged)",
                        env.get("NOTIFY_SOCKET"), e)
            _notify_error_logged = True
        return False


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """systemd's watchdog interval in seconds (WATCHDOG_USEC), or None when not set, invalid,
    or WATCHDOG_PID names another process."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Notifier:
    """Thin wrapper around :func:`sd_notify`; every method returns whether a message was sent.

    The trainer calls :meth:`watchdog` only when real progress happens (a finished step, a
    loading/checkpoint milestone), never from a timer, so a hung trainer is killed by
    WatchdogSec. :meth:`ready` sends READY=1 once.
    """

    def __init__(self, env: Mapping[str, str] | None = None):
        self._env = env
        self._ready_sent = False

    @property
    def env(self) -> Mapping[str, str]:
        return os.environ if self._env is None else self._env

    @property
    def enabled(self) -> bool:
        return bool(self.env.get("NOTIFY_SOCKET"))

    def notify(self, *lines: str) -> bool:
        return sd_notify(*lines, env=self.env)

    def ready(self, status: str | None = None) -> bool:
        if self._ready_sent:
            return False
        lines = ["READY=1"]
        if status:
            lines.append("STATUS=" + _one_line(status))
        sent = self.notify(*lines)
        self._ready_sent = sent or not self.enabled
        return sent

    def status(self, text: str) -> bool:
        text = _one_line(text)
        return self.notify("STATUS=" + text)

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        usec = max(1, int(float(seconds) * 1_000_000))
        return self.notify(f"EXTEND_TIMEOUT_USEC={usec}")

    def stopping(self, status: str | None = None) -> bool:
        lines = ["STOPPING=1"]
        if status:
            lines.append("STATUS=" + _one_line(status))
        return self.notify(*lines)

    def watchdog_interval(self) -> float | None:
        return watchdog_interval(self.env)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------------------------
# dflash-status


class StatusFileError(Exception):
    pass


def read_status(path: str | os.PathLike) -> dict[str, Any]:
    """Read and parse status.json; raises StatusFileError naming the file."""
    path = os.fspath(path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise StatusFileError(f"{path}: no such file (has the trainer started?)") from None
    except OSError as e:
        raise StatusFileError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise StatusFileError(f"{path}: not UTF-8 text: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise StatusFileError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise StatusFileError(f"{path}: invalid status: expected a JSON object, "
                              f"got {type(data).__name__}")
    return data


def evaluate_health(st: Mapping[str, Any], max_age: float = DEFAULT_MAX_AGE,
                    now: float | None = None) -> tuple[bool, float | None, str]:
    """(healthy, heartbeat_age_s, reason)."""
    now = time.time() if now is None else now
    updated = st.get("updated_at")
    age: float | None = None
    if isinstance(updated, (int, float)) and not isinstance(updated, bool) \
            and math.isfinite(updated):
        age = max(0.0, now - float(updated))
    phase = st.get("phase")
    if phase == "failed":
        return False, age, f"failed: {st.get('error') or 'no error recorded'}"
    if phase == "done":
        return True, age, "done"
    if age is None:
        return False, None, "stale: no valid updated_at"
    if age > max_age:
        return False, age, f"stale: no heartbeat for {age:.0f} s (max age {max_age:g} s)"
    return True, age, "ok"


def _human_summary(path: str, st: Mapping[str, Any], healthy: bool, age: float | None,
                   reason: str) -> str:
    def g(key: str, fmt: str | None = None) -> str:
        v = st.get(key)
        if v is None:
            return "-"
        return _fmt_num(v, fmt) if fmt else str(v)

    total = st.get("tokens_seen")
    rows = [
        ("status file", path),
        ("health", ("healthy" if healthy else "UNHEALTHY") + f" ({reason})"),
        ("phase", g("phase")),
        ("run id", g("run_id")),
        ("step", g("step")),
        ("epoch", g("epoch")),
        ("tokens seen", _fmt_num(total, ",") if total is not None else "-"),
        ("tokens/s", g("tokens_per_s", ",.1f")),
        ("loss", g("loss", ".4f")),
        ("nan skips", f"{g('nan_skips')} (streak {g('nan_streak')})"),
        ("last checkpoint", g("last_checkpoint")),
        ("resumed from", g("resumed_from")),
        ("heartbeat age", f"{age:.1f} s" if age is not None else "-"),
        ("pid", g("pid")),
        ("log file", g("log_file")),
    ]
    if st.get("error"):
        rows.append(("error", str(st.get("error"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-status",
        description="Summarise a DFlash training run's status.json. Exit 0 healthy, "
                    "1 failed or stale, 2 missing or unreadable.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--status-file", metavar="F", help="path to status.json")
    src.add_argument("--output-dir", metavar="D",
                     help="the trainer's --output-dir (reads D/status.json)")
    p.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE, metavar="S",
                   help="heartbeat older than S seconds counts as stale (default %(default)g)")
    p.add_argument("--json", action="store_true",
                   help="print the status as JSON plus heartbeat_age_s and healthy")
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
    try:
        st = read_status(path)
    except StatusFileError as e:
        print(f"dflash-status: error: {e}", file=sys.stderr)
        return 2
    healthy, age, reason = evaluate_health(st, args.max_age)
    if args.json:
        out = dict(st)
        out["heartbeat_age_s"] = round(age, 3) if age is not None else None
        out["healthy"] = healthy
        out["status_file"] = path
        print(json.dumps(to_jsonable(out), indent=2, sort_keys=True, allow_nan=False))
    else:
        print(_human_summary(path, st, healthy, age, reason))
    sys.stdout.flush()
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
