"""Run logging: stdout + one log file per run, a progress display, fixed-width tables.

* :func:`setup_logging` configures the root logger: the console (records below ERROR on stdout,
  errors on stderr, each one line: an exception shows as ``Type: message``, its traceback goes to
  the file only) and ``<log_dir>/train-<UTC time>-<run_id>.log`` (everything, with tracebacks), with
  ``<log_dir>/latest.log`` a relative symlink to it, replaced atomically. Each line is printed once:
  console handlers installed before (``logging.basicConfig``, :func:`setup_console`) are replaced.
  Off a terminal, Hugging Face progress bars ("Loading weights") are turned off.
* :func:`setup_console`: the same console without a file (the benchmark, tools).
* :class:`Progress`: an in-place bar on a TTY, a plain log line every ``interval`` seconds
  otherwise (systemd/journald, redirected output).
* :func:`format_table`: fixed-width text tables (profiling, benchmark).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

log = logging.getLogger("trainer.runlog")   # the name it has always logged under

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_HANDLER_MARK = "_dflash_runlog"


class UTCFormatter(logging.Formatter):
    """ISO-8601 UTC timestamps with milliseconds, e.g. 2025-01-31T12:00:00.123Z."""

    converter = time.gmtime

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        t = time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created))
        return f"{t}.{int(record.msecs):03d}Z"


def utc_stamp(t: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if t is None else t))


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._") or "run"


def _update_symlink(link: Path, target_name: str) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


class ConsoleFormatter(UTCFormatter):
    """One line per record on the console. An exception becomes ``: Type: message`` (plus where the
    traceback is); errors are folded onto one line. Multi-line info (the stage table) stays as is."""

    def __init__(self, fmt: str = LOG_FORMAT, log_file: str | os.PathLike | None = None):
        super().__init__(fmt)
        self.log_file = os.fspath(log_file) if log_file else None

    def format(self, record: logging.LogRecord) -> str:
        exc, exc_text, stack = record.exc_info, record.exc_text, record.stack_info
        summary = ""
        if exc and exc[1] is not None:
            summary = f": {type(exc[1]).__name__}: {exc[1]}"
            if self.log_file:
                summary += f" (traceback in {self.log_file})"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            text = super().format(record) + summary
        finally:
            record.exc_info, record.exc_text, record.stack_info = exc, exc_text, stack
        if record.levelno >= logging.ERROR:
            text = " | ".join(line.strip() for line in text.splitlines() if line.strip())
        return text


class _Below:
    """Handler filter: records below ``level`` only."""

    def __init__(self, level: int):
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def _on_console(record: logging.LogRecord) -> bool:
    """``log.error(..., extra={"console": False})``: the file only (the caller prints its own line,
    e.g. ``dflash-train: error: ...``, so the console does not get the same error twice)."""
    return getattr(record, "console", True)


def _is_console(h: logging.Handler) -> bool:
    """A plain StreamHandler (not a FileHandler) on stdout/stderr: what logging.basicConfig installs."""
    return type(h) is logging.StreamHandler and getattr(h, "stream", None) in (
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


class _StdHandler(logging.StreamHandler):
    """A console handler on whatever sys.stdout or sys.stderr is when a record is emitted, not when the
    handler was installed: a process that swaps them (pytest's capture between tests) would otherwise
    keep writing to a closed stream, and logging's error report about it lands in the next caller's
    stderr."""

    def __init__(self, which: str):
        self._which = which          # "stdout" or "stderr" (logging.Handler owns self._name)
        super().__init__()

    @property
    def stream(self):
        return getattr(sys, self._which)

    @stream.setter
    def stream(self, value):
        pass


def _console_handlers(out: TextIO | None, err: TextIO | None, log_file=None) -> list[logging.Handler]:
    fmt = ConsoleFormatter(LOG_FORMAT, log_file)
    so = logging.StreamHandler(out) if out is not None else _StdHandler("stdout")
    so.addFilter(_Below(logging.ERROR))
    se = (logging.StreamHandler(err) if err is not None else
          logging.StreamHandler(out) if out is not None else _StdHandler("stderr"))
    se.setLevel(logging.ERROR)
    for h in (so, se):
        h.addFilter(_on_console)
        h.setFormatter(fmt)
        setattr(h, _HANDLER_MARK, True)
    return [so, se]


def _install(handlers: list[logging.Handler], level: int | str) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_MARK, False) or _is_console(h):
            root.removeHandler(h)
            h.close()  # a StreamHandler leaves its stream open
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(True)


def quiet_progress_bars(stream: TextIO | None = None) -> None:
    """Off a terminal, Hugging Face's tqdm bars (transformers' "Loading weights", hub downloads) would
    write hundreds of carriage-return updates into the journal and the log: turn them off."""
    stream = stream if stream is not None else sys.stderr
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # read when huggingface_hub is imported
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in ("transformers.utils.logging", "huggingface_hub.utils"):
        mod = sys.modules.get(name)
        fn = getattr(mod, "disable_progress_bar" if name.startswith("transformers") else "disable_progress_bars",
                     None) if mod else None
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001
                pass


def setup_console(level: int | str = logging.INFO, *, stream: TextIO | None = None,
                  err_stream: TextIO | None = None) -> None:
    """The console of :func:`setup_logging` without a log file (the benchmark and other tools).
    Call instead of logging.basicConfig, so a later setup_logging does not print every line twice."""
    _install(_console_handlers(stream, err_stream), level)
    quiet_progress_bars(err_stream)


def setup_logging(log_dir: str | os.PathLike, run_id: str, level: int | str = logging.INFO,
                  *, stream: TextIO | None = None, err_stream: TextIO | None = None,
                  link_latest: bool = True) -> Path:
    """Configure the root logger for a training run and return the run's log file path.

    ``stream``/``err_stream``: the console (default stdout / stderr; only ``stream`` given: both go
    there). Calling it again replaces the handlers it installed before, and any plain console
    handler (basicConfig's), but not others' (pytest's, a FileHandler)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"train-{utc_stamp()}-{_safe_name(run_id)}.log"
    fh = logging.FileHandler(path, mode="a", encoding="utf-8")
    fh.setFormatter(UTCFormatter(LOG_FORMAT))
    setattr(fh, _HANDLER_MARK, True)
    _install(_console_handlers(stream, err_stream, path) + [fh], level)
    quiet_progress_bars(err_stream if err_stream is not None else stream)

    try:
        if link_latest:   # rank 0's file; other ranks' files sit beside it
            _update_symlink(log_dir / "latest.log", path.name)
    except OSError as e:
        log.warning("could not update %s: %s", log_dir / "latest.log", e)
    log.info("logging to %s (run %s)", path, run_id)
    return path


# ------------------------------------------------------------------------------- progress


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h >= 24:
        d, h = divmod(h, 24)
        return f"{d}d{h:02d}:{m:02d}:{s:02d}"
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _fmt_metric(value: Any) -> str:
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except Exception:  # noqa: BLE001
            pass
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        a = abs(value)
        if a != 0 and (a < 1e-3 or a >= 1e6):
            return f"{value:.3e}"
        return f"{value:.4f}" if a < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    return str(value)


class Progress:
    """Progress of a run of ``total`` steps (None or 0: unknown).

    On a TTY (``stream.isatty()``) it redraws one line in place with ``\\r`` at most every
    ``refresh`` seconds; otherwise it logs one plain line through ``logger`` every ``interval``
    seconds. ``update(step, **metrics)`` takes the absolute step (a resumed run may start at
    any step) and any metrics to show (loss=..., tok_s=...).
    """

    def __init__(self, total: int | None, desc: str = "train", *, interval: float = 30.0,
                 stream: TextIO | None = None, logger: logging.Logger | None = None,
                 tty: bool | None = None, refresh: float = 0.2, width: int = 24,
                 clock=time.monotonic):
        self.total = int(total) if total else None
        self.desc = desc
        self.interval = float(interval)
        self.stream = stream if stream is not None else sys.stderr
        self.logger = logger or logging.getLogger("trainer.progress")
        if tty is None:
            try:
                tty = bool(self.stream.isatty())
            except (AttributeError, ValueError):
                tty = False
        self.tty = tty
        self.refresh = float(refresh)
        self.width = int(width)
        self._clock = clock
        self._t0 = clock()
        self._start_step: int | None = None
        self.step = 0
        self.metrics: dict[str, Any] = {}
        self._last_emit: float | None = None
        self._last_len = 0
        self._closed = False
        self.lines_emitted = 0

    # rate over the steps seen since this Progress started (resume-safe)
    def rate(self) -> float | None:
        if self._start_step is None:
            return None
        dt = self._clock() - self._t0
        done = self.step - self._start_step
        return done / dt if dt > 0 and done > 0 else None

    def eta(self) -> float | None:
        r = self.rate()
        if not self.total or not r:
            return None
        return max(0, self.total - self.step) / r

    def format(self, bar: bool = False) -> str:
        parts = [self.desc] if self.desc else []
        if self.total:
            pct = 100.0 * min(self.step, self.total) / self.total
            if bar:
                filled = int(self.width * min(self.step, self.total) / self.total)
                parts.append("|" + "#" * filled + "-" * (self.width - filled) + "|")
            parts.append(f"{self.step}/{self.total} ({pct:.1f}%)")
        else:
            parts.append(f"step {self.step}")
        r = self.rate()
        if r is not None:
            parts.append(f"{r:.2f} it/s" if r >= 1 or r == 0 else f"{1 / r:.2f} s/it")
        if self.total:
            parts.append(f"eta {format_duration(self.eta())}")
        parts.append(f"elapsed {format_duration(self._clock() - self._t0)}")
        parts.extend(f"{k}={_fmt_metric(v)}" for k, v in self.metrics.items())
        return " ".join(parts)

    def update(self, step: int, **metrics: Any) -> None:
        if self._closed:
            return
        if self._start_step is None:
            # the first update anchors the rate: steps before it happened before we started
            self._start_step = int(step)
            self._t0 = self._clock()
        self.step = int(step)
        self.metrics.update(metrics)
        now = self._clock()
        if self.tty:
            if self._last_emit is None or now - self._last_emit >= self.refresh or \
                    (self.total and self.step >= self.total):
                self._draw()
                self._last_emit = now
        else:
            if self._last_emit is None or now - self._last_emit >= self.interval:
                self._log()
                self._last_emit = now

    def _draw(self) -> None:
        line = self.format(bar=True)
        pad = max(0, self._last_len - len(line))
        try:
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
        except (OSError, ValueError):
            return
        self._last_len = len(line)
        self.lines_emitted += 1

    def _log(self) -> None:
        self.logger.info("%s", self.format(bar=False))
        self.lines_emitted += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._start_step is None:
            return
        if self.tty:
            self._draw()
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        else:
            self._log()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------- tables


def _cell(value: Any, floatfmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return format(value, floatfmt) if math.isfinite(value) else str(value)
    return str(value)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(headers: Sequence[Any], rows: Iterable[Sequence[Any]], *,
                 floatfmt: str = ",.3f", align: Sequence[str] | None = None) -> str:
    """A fixed-width text table: header, a dashed rule, rows. Numbers are right-aligned,
    text left-aligned (override per column with ``align`` of '<' / '>'). Floats use
    ``floatfmt``; None shows as '-'. Short rows are padded with empty cells."""
    headers = [str(h) for h in headers]
    rows = [list(r) for r in rows]
    ncol = max([len(headers)] + [len(r) for r in rows])
    headers += [""] * (ncol - len(headers))
    rows = [r + [""] * (ncol - len(r)) for r in rows]
    text = [[_cell(v, floatfmt) for v in r] for r in rows]
    if align is None:
        align = []
        for c in range(ncol):
            vals = [r[c] for r in rows if r[c] not in ("", None)]
            align.append(">" if vals and all(_is_num(v) for v in vals) else "<")
    align = list(align) + ["<"] * (ncol - len(align))
    widths = [max([len(headers[c])] + [len(t[c]) for t in text]) for c in range(ncol)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{s:{a}{w}}" for s, a, w in zip(cells, align, widths)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(t) for t in text]
    return "\n".join(out)
