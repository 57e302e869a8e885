"""status.json heartbeat, systemd notification and the `dflash-status` command.

Standard library only (importable without torch), so `dflash-status` starts fast.

* :data:`STATUS_SCHEMA` declares every key status.json can hold, once: its meaning, the phases that write it,
  and whether it is there from the first write. docs/contracts.md's table is rendered from it
  (``trainer/tools/contracts_tables.py --write``).
* :class:`StatusWriter` keeps the current status dict and writes ``status.json`` atomically
  (temp file in the same directory, flush + fsync, ``os.replace``, directory fsync). Non-finite
  floats become JSON ``null``; the file is always valid JSON.
* :func:`sd_notify` / :class:`Notifier` speak the systemd notify protocol over ``$NOTIFY_SOCKET``
  (AF_UNIX datagram; a leading ``@`` means the abstract namespace). They never raise.
* :func:`verdict` is the one health verdict; :func:`main` is ``dflash-status``: exit 0 healthy,
  1 failed, dead, stale (or a --unit/--training/--after-step condition unmet), 2 missing/unreadable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

from trainer.fsutil import atomic_write_text

log = logging.getLogger(__name__)

PHASES = ("starting", "loading", "warmup", "training", "checkpointing", "eval", "done", "failed")


class StatusField(NamedTuple):
    """One key of status.json: its meaning, the phases whose writes set it, and whether it is in the file
    from the first write on (``always``, null until known) or only once first written."""
    name: str
    meaning: str
    phases: tuple[str, ...]
    always: bool = True


# What status.json reports, declared once. StatusWriter refuses (under pytest, or DFLASH_STATUS_STRICT=1) a key
# not declared here; docs/contracts.md's table is rendered from it (python trainer/tools/contracts_tables.py --write);
# tests/test_status.py checks every writer in trainer/ against it.
STATUS_SCHEMA: tuple[StatusField, ...] = (
    StatusField("phase", "where the job is: " + "|".join(PHASES) + " (`failed` also by the supervisor for a "
                "failed rank, and by a start refused as bad input)", PHASES),
    StatusField("step", "optimizer steps done (0 before the first; the checkpoint's step on resume)",
                ("starting", "training", "checkpointing", "eval", "done", "failed")),
    StatusField("epoch", "the epoch the data has reached (0-based)", ("training",)),
    StatusField("tokens_seen", "tokens trained on so far (carried over a resume)", ("training",)),
    StatusField("tokens_per_s", "training tokens/s over the last 50 steps (eval pauses left out)", ("training",)),
    StatusField("loss", "loss of the last step with a finite loss", ("training",)),
    StatusField("nan_skips", "optimizer steps skipped for a non-finite loss or gradient, in total",
                ("starting", "training", "failed")),
    StatusField("nan_streak", "of those, how many in a row up to the last step (--max-nan-skips fails the run)",
                ("starting", "training", "failed")),
    StatusField("updated_at", "unix seconds (float) of this write: the heartbeat dflash-status ages", PHASES),
    StatusField("started_at", "unix seconds the writer started (a pid that started later is a reused one)",
                ("starting",)),
    StatusField("pid", "the job's process: the supervisor `python -m trainer`, the unit's MainPID; its ranks "
                "die with it", PHASES),
    StatusField("run_id", "this run's id (also in its log file's name)", PHASES),
    StatusField("last_checkpoint", "path of the newest checkpoint, or null", ("training",)),
    StatusField("error", "why the run failed (a failed rank is named: `rank N failed (signal 9): ...`), else null",
                ("done", "failed")),
    StatusField("resumed_from", "the checkpoint this run resumed from, or null", ("training",)),
    StatusField("log_file", "this run's log file", ("starting",)),
    StatusField("eval", "the last tau eval, null until one ran (a resumed run starts with the last one "
                "metrics.jsonl kept): `step`, `tau`, `per_position_acceptance`, `prompts`, `verify_steps`, "
                "`seconds`, and `block_accuracy` for the end-of-run eval", ("loading", "eval")),
    StatusField("startup", "per rank, during the start-up (trainer/distributed/startup.py): its last progress note, "
                "`role`, `phase`, `detail` (e.g. `target shape 2 of 3 (1x4096, compile and autotune)`), `seq` "
                "(counts its notes) and `at` (unix seconds); the supervisor ends a start-up none of whose notes "
                "moves for the stall bound", ("starting", "loading", "warmup"), always=False),
    StatusField("world_size", "processes in the job (ranks)", ("starting",), always=False),
    StatusField("ranks", "per rank, from the first training step on (null until its first stop vote): `rank`, "
                "`role` (target, drafter or target+drafter), `items` (micro-batches), `busy_s` (stage seconds), "
                "`wait_s` (seconds waiting), `peak_gib` (peak GPU memory), `recompiles` (graphs it compiled after "
                "the warmup)", ("training",), always=False),
    StatusField("recompiles", "graphs compiled after the warmup, all ranks together, from the first stop vote on: "
                "each is a micro-batch shape the warmup's compiled graphs did not cover, a compile in the middle of "
                "a step; the rank that compiled it logs the step and the guard it failed "
                "(trainer/ops/compiling.py)", ("training",), always=False),
)

# Every key of the contract, present from the first write on (null until known).
STATUS_FIELDS = tuple(f.name for f in STATUS_SCHEMA if f.always)
# Keys written once known, absent before (world_size at start, ranks from the first training step).
STATUS_LATER_FIELDS = tuple(f.name for f in STATUS_SCHEMA if not f.always)
STATUS_KEYS = frozenset(f.name for f in STATUS_SCHEMA)


class UndeclaredStatusField(TypeError):
    """A writer gave StatusWriter a key STATUS_SCHEMA does not declare (raised only when strict), as a
    function refuses an unexpected keyword."""


def strict_default(env: Mapping[str, str] | None = None) -> bool:
    """Whether a StatusWriter refuses undeclared keys by default: DFLASH_STATUS_STRICT=1/0 when set, else
    under pytest (PYTEST_CURRENT_TEST, which a trainer the tests start inherits). Outside tests an undeclared
    key is written and logged once: the heartbeat must not kill training."""
    env = os.environ if env is None else env
    flag = env.get("DFLASH_STATUS_STRICT")
    if flag is not None:
        return flag.strip() not in ("", "0")
    return "PYTEST_CURRENT_TEST" in env


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
    A key :data:`STATUS_SCHEMA` does not declare raises :class:`UndeclaredStatusField` when ``strict``
    (default :func:`strict_default`: under pytest), else it is written and logged once.
    """

    def __init__(self, path: str | os.PathLike, run_id: str, *, min_interval: float = 0.0,
                 notifier: "Notifier | None" = None, started_at: float | None = None,
                 pid: int | None = None, strict: bool | None = None):
        self.path = Path(path)
        self.strict = strict_default() if strict is None else bool(strict)
        self._undeclared_logged: set[str] = set()
        self.run_id = str(run_id)
        self.pid = int(pid) if pid is not None else os.getpid()   # the job's process (the unit's MainPID)
        self.min_interval = float(min_interval)
        self.notifier = notifier
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {k: None for k in STATUS_FIELDS}
        self._state.update(
            run_id=self.run_id, pid=self.pid,
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
        undeclared = fields.keys() - STATUS_KEYS
        if undeclared:
            self._undeclared(sorted(undeclared))
        with self._lock:
            self._state.update(fields)
            now = time.time()
            phase = self._state.get("phase")
            if (not force and self.min_interval > 0 and self._last_write is not None
                    and now - self._last_write < self.min_interval
                    and phase == self._last_written_phase):
                return False
            self._state["updated_at"] = now
            self._state["pid"] = self.pid
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

    def _undeclared(self, keys: list[str]) -> None:
        msg = (f"status.json field(s) {', '.join(keys)} not declared in trainer/status.py STATUS_SCHEMA: declare "
               f"each there (meaning, phases), then render docs/contracts.md with "
               f"`.venv/bin/python trainer/tools/contracts_tables.py --write`")
        if self.strict:
            raise UndeclaredStatusField(msg)
        new = [k for k in keys if k not in self._undeclared_logged]
        if new:
            self._undeclared_logged.update(new)
            log.warning("%s", msg)

    def flush(self) -> bool:
        """Write the current state now (ignores throttling)."""
        return self.update(force=True)


@contextlib.contextmanager
def beating(writer, interval: float = 30.0, **fields: Any):
    """Inside the block `fields` hold (phase="eval") and status.json is written every `interval` s, so the
    supervisor, which pets systemd's watchdog whenever the file moves, keeps petting it through a long host
    phase whose rank 0 is blocked (waiting for the eval owner); the previous phase is written back after.
    A rank without a status file (not a StatusWriter) does nothing."""
    if not isinstance(writer, StatusWriter):
        yield
        return
    before = writer.get("phase")
    writer.update(force=True, **fields)
    stop = threading.Event()

    def beat():
        while not stop.wait(interval):
            writer.update(force=True)

    t = threading.Thread(target=beat, name="status-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        writer.update(force=True, phase=before)


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


def record_failure(path: str | os.PathLike, error: str, *, only_into_existing_dir: bool = False,
                   merge_rank_error: bool = False) -> bool:
    """status.json's writes outside a running job's :class:`StatusWriter`, in one place: a start refused
    before any rank runs (bad input, a bad shard) and the supervisor's record of a failed rank. Reads the
    file (a fresh record when it is missing or unreadable), sets ``phase`` failed, ``error``, ``updated_at``
    and this process's ``pid``, and writes it atomically. ``merge_rank_error``: a rank's own failure
    ("rank N: <why>") already in the file is kept after ``error`` unless ``error`` quotes it.
    ``only_into_existing_dir``: a mistyped output path creates nothing. Returns whether it wrote; an
    unwritable file is not an error (the caller's stderr line is the report)."""
    if only_into_existing_dir and not Path(path).parent.is_dir():
        return False
    try:
        st = read_status(path)
    except Exception:  # noqa: BLE001  missing or unreadable: a fresh record
        st = {}
    if merge_rank_error and st.get("phase") == "failed" and st.get("error"):
        rank_why = st["error"].split(": ", 1)[-1]     # the rank wrote "rank N: <why>"
        if rank_why not in error:                      # the supervisor's line may quote it already
            error = f"{error}; {st['error']}"
    st.update(phase="failed", error=error, updated_at=time.time(), pid=os.getpid())
    try:
        atomic_write_json(path, st)
    except OSError as e:
        log.debug("could not write %s: %s", path, e)
        return False
    return True


def pid_alive(pid: Any, started_at: Any = None) -> bool | None:
    """Whether ``pid`` (from status.json) is a live process *here*: None when status.json names no
    usable pid. A zombie counts as dead, and so does a process that started after the trainer wrote
    ``started_at`` (the pid was reused after the trainer died). Meaningful only in the trainer's own
    pid namespace (the container)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return None
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    if state == "Z":
        return False
    if start is not None and isinstance(started_at, (int, float)) and start > float(started_at) + 5.0:
        return False
    return True


def _proc_stat(pid: int) -> tuple[str, float | None] | None:
    """(state letter, start time in unix seconds) from /proc, or None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat", "r") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", "r") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        start = btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return fields[0], start
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def unit_state(unit: str) -> dict[str, Any]:
    """`systemctl show UNIT` (the properties the verdict needs); MainPID/NRestarts as ints."""
    import subprocess
    props = ("ActiveState", "SubState", "MainPID", "NRestarts", "Result", "ExecMainStatus")
    try:
        out = subprocess.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)],
                             capture_output=True, text=True, check=False, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"ActiveState": "unknown", "SubState": str(e)}
    state: dict[str, Any] = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for key in ("MainPID", "NRestarts"):
        try:
            state[key] = int(state.get(key, 0))
        except ValueError:
            state[key] = 0
    return state


def evaluate_health(st: Mapping[str, Any], max_age: float = DEFAULT_MAX_AGE,
                    now: float | None = None, *, check_pid: bool = False) -> tuple[bool, float | None, str]:
    """(healthy, heartbeat_age_s, reason). ``check_pid``: a job whose phase says it runs but whose
    pid is not alive here is ``dead`` at once, not healthy until its heartbeat goes stale."""
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
    if check_pid and pid_alive(st.get("pid"), st.get("started_at")) is False:
        return False, age, (f"dead: pid {st.get('pid')} is not running (phase was {phase}"
                            + (f", last heartbeat {age:.0f} s ago)" if age is not None else ")"))
    if age is None:
        return False, None, "stale: no valid updated_at"
    if age > max_age:
        return False, age, f"stale: no heartbeat for {age:.0f} s (max age {max_age:g} s)"
    return True, age, "ok"


def verdict(st: Mapping[str, Any] | None, *, max_age: float = DEFAULT_MAX_AGE, check_pid: bool = True,
            unit: Mapping[str, Any] | None = None, unit_name: str = "", training: bool = False,
            after_step: int | None = None, read_error: str | None = None,
            now: float | None = None) -> dict[str, Any]:
    """The one health verdict (dflash-status and the Ansible health handler): healthy, every reason
    it is not (problems), and final (waiting cannot help: systemd gave up on the unit).

    ``unit`` (systemctl show of the training unit): it must be active and status.json written by
    its main pid. ``training``: the phase must be training (done counts: the run finished) with a
    finite loss. ``after_step``: the step must have advanced past it."""
    problems: list[str] = []
    final = False
    age: float | None = None
    reason = read_error or "no status"
    if unit is not None:
        active = unit.get("ActiveState")
        final = active == "failed"
        if active != "active":
            problems.append(f"{unit_name or 'the unit'} is {active}/{unit.get('SubState')} "
                            f"(result {unit.get('Result')}, restarts {unit.get('NRestarts')})"
                            + ("; systemd gave up on it and will not restart it by itself" if final else ""))
    if st is None:
        problems.append(f"no readable status: {read_error}")
    else:
        ok, age, reason = evaluate_health(st, max_age, now, check_pid=check_pid)
        phase = st.get("phase")
        done = phase == "done"
        if not ok:
            problems.append(reason)
        if unit is not None and not done and st.get("pid") != unit.get("MainPID"):
            problems.append(f"status.json is from pid {st.get('pid')}, the unit's main pid is "
                            f"{unit.get('MainPID')} (not yet written by this run)")
        if training and not done:
            if phase not in ("training", "eval", "failed"):
                problems.append(f"phase is {phase}, not yet training")
            loss = st.get("loss")
            if not (isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)):
                problems.append(f"loss is not finite ({loss})")
        step = st.get("step")
        if after_step is not None and not done and not (isinstance(step, int) and step > after_step):
            problems.append(f"step {step} has not advanced past {after_step}")
    return {"healthy": not problems, "final": final, "problems": problems,
            "reason": problems[0] if problems else reason, "heartbeat_age_s": round(age, 3) if age is not None else None}


def _eval_line(ev: Any) -> str:
    if not isinstance(ev, Mapping) or ev.get("tau") is None:
        return "-"
    return f"tau {_fmt_num(ev.get('tau'), '.3f')} at step {ev.get('step')}"


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
