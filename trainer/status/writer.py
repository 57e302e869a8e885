"""status.json written and read: the trainer's :class:`StatusWriter` (atomic writes: a temp file in the same
directory, flush + fsync, ``os.replace``, directory fsync; non-finite floats become JSON ``null``, so the file
is always valid JSON), the heartbeat through a long host phase (:func:`beating`), the record of a failure
outside a running writer (:func:`record_failure`), and :func:`read_status`. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from trainer.fsutil import atomic_write_text
from trainer.status.notify import Notifier
from trainer.status.schema import STATUS_FIELDS, STATUS_KEYS, UndeclaredStatusField, strict_default

log = logging.getLogger("trainer.status")


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
        msg = (f"status.json field(s) {', '.join(keys)} not declared in trainer/status/schema.py STATUS_SCHEMA: declare "
               f"each there (meaning, phases), then render docs/contracts.md with "
               f"`.venv/bin/python trainer/lab/contracts_tables.py --write`")
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


def format_value(value: Any, fmt: str) -> str:
    """`value` formatted by `fmt`, "-" for None, str() where the format does not apply."""
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
    parts = [phase, f"step {format_value(st.get('step'), 'd')}"]
    if st.get("epoch") is not None:
        parts.append(f"epoch {st.get('epoch')}")
    if st.get("loss") is not None:
        parts.append(f"loss {format_value(st.get('loss'), '.4f')}")
    if st.get("tokens_per_s") is not None:
        parts.append(f"{format_value(st.get('tokens_per_s'), ',.0f')} tok/s")
    if st.get("nan_skips"):
        parts.append(f"nan skips {st.get('nan_skips')}")
    return ", ".join(parts)


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
