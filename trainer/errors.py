"""How a rank fails: the exceptions the trainer raises on purpose, what it reports of any other, and
its end with the supervisor.

TrainingFailed exits 1 (systemd restarts the job); BadInput exits 2 like the cheap checks in
preflight.validate, since a restart will not fix it (the unit's RestartPreventExitStatus=2).
"""

from __future__ import annotations

import os
import signal
import sys

from trainer.procs import pid_alive


class TrainingFailed(RuntimeError):
    pass


class BadInput(TrainingFailed):
    """Input found bad only when it is read (e.g. a malformed data shard): exit 2 like the cheap
    checks in preflight.validate, since restarting will not fix it (the unit's RestartPreventExitStatus=2)."""


def is_checkpoint_error(e: BaseException) -> bool:
    """Whether `e` is torch.distributed.checkpoint's CheckpointException, which derives from BaseException, so
    `except Exception` misses it. Asked without importing DCP (half a CPU-second of a rank's start, which loads
    it only to save or load a checkpoint): none can be raised before DCP is loaded."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(e, api.CheckpointException)


def root_cause(e: BaseException) -> str:
    """The OSError under a DCP failure (its CheckpointException wraps every rank's exception), else e."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return f"[Errno {x.errno}] {x.strerror}" + (f": {x.filename!r}" if x.filename else "")
        todo += [x.__cause__, x.__context__]
        for w in (getattr(x, "failures", None) or {}).values():
            todo.append(w[0] if isinstance(w, tuple) else w)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"   # DCP's text ends with the cause


def record(e: BaseException) -> None:
    """The launcher's error file: the supervisor names this rank's error in status.json and on stderr."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(e)
    except Exception:  # noqa: BLE001
        pass


def die_with_supervisor() -> None:
    """A rank started by our supervisor goes when the supervisor goes, whatever killed it (kill -9
    included): the kernel sends this rank SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG)."""
    sup = os.environ.get("DFLASH_SUPERVISOR_PID")
    if not sup:
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(sup) and pid_alive(int(sup)) is False:
        os._exit(1)   # the supervisor died before prctl took effect

