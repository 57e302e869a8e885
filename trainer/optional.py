"""What a program does that an import must not: optional accelerators load only when asked for (--fp8), the
cyclic garbage collector keeps off the heap the program's imports built, and the exit skips the teardown.

transformers imports torchao at import time whenever it is installed (its quantizer registry,
transformers/quantizers/quantizer_torchao.py), and torchao's import loads its compiled kernels (on a CPU
torch: two "Failed to load ... .so" lines) and registers pytree constants (two deprecation warnings): on
every CLI call, --help included, and in the unit's journal. A None in sys.modules makes the package look
absent to importlib (find_spec returns None, import raises ModuleNotFoundError) until allow() lifts it.

Who calls defer(): the programs, before they import transformers (the console scripts through
trainer/cli.py, `python -m trainer` and its ranks, `python -m trainer.lab.bench`). `import trainer` and the
modules under it leave sys.modules alone, so a library user's own torchao is theirs.

The collector: torch and transformers (with torch._dynamo, DTensor and sympy under it) leave a rank some
560,000 objects (the supervisor, torch alone, 240,000) that live as long as the process. Each full collection
walks all of them: during the imports (the heap grows past the thresholds again and again), during the run,
and in the collections of the interpreter's exit. Measured on a tiny CPU job (cpuacct): a rank 6.0 -> 4.0
CPU-seconds, its supervisor 3.4 -> 1.6, for every process that starts.
loading() wraps a program's heavy imports: no collection while they run, then gc.freeze() moves what they
built out of the collector's sight for good (the pattern the gc module documents for a pre-forking server),
and collection goes on as before for everything made after. The cyclic garbage the imports left (a rank:
11,000 objects, about 7 MB) stays with the frozen heap instead of being collected. Only a process marked by
program() (the console scripts run as such, `python -m trainer`: each a process of its own) does that; for an
importer (a test calling main() in its own process, a library user) loading() does nothing, so the importer's
heap and collector are its own.

The exit: a program's process ends through end(), which does what the interpreter's own exit does first
(threading's shutdown: its exit hooks, then every non-daemon thread joined; the atexit handlers, logging's
flush and close among them; the standard streams and C stdio flushed) and then leaves with os._exit, as
multiprocessing's children do. What it skips is the teardown after that: every module's dict cleared and the
heap's hundreds of thousands of objects freed one by one, and the last collections; in a tiny job's rank that
was 0.3-0.5 CPU-seconds, in its supervisor 0.3, for nothing (the kernel frees the memory and closes the files
and sockets anyway). As with any os._exit, a file object still open with unwritten data would lose it: the
trainer's own (metrics.jsonl, flushed each write; the log files, closed by logging's atexit) are written by
then. An importer's process (pytest, a library user) gets a plain SystemExit.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

DEFERRED = ("torchao",)

_program = False   # program() was called: this process is one of ours, its collector ours to tune
_loading = 0       # loading() blocks open (nested: the outermost one freezes)


def defer() -> None:
    """Make the DEFERRED packages look absent from now on (a package already imported stays)."""
    for name in DEFERRED:
        sys.modules.setdefault(name, None)


def allow(name: str) -> None:
    """Let the deferred package NAME be found and imported from now on (the caller asked for it)."""
    if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]


def program() -> None:
    """First thing in a program's own process: defer(), and let loading() tune the collector."""
    global _program
    defer()
    _program = True


@contextlib.contextmanager
def loading():
    """Around a program's heavy imports: in a process marked by program(), no cyclic collection inside, and
    what exists at the end frozen (never collected: modules and what they hold live to the exit anyway). An
    importer's process: nothing."""
    global _loading
    if not _program:
        yield
        return
    was_enabled = gc.isenabled()
    if _loading == 0:
        gc.disable()
    _loading += 1
    try:
        yield
    finally:
        _loading -= 1
        if _loading == 0:
            gc.freeze()
            if was_enabled:
                gc.enable()


def end(rc: int):
    """The last step of a program (in place of sys.exit(rc)): in a process marked by program(), the
    interpreter's exit up to its teardown (threads, atexit, flushes), then os._exit(rc); else SystemExit(rc)."""
    if not _program:
        raise SystemExit(rc)
    import atexit
    import threading
    threading._shutdown()   # what Py_FinalizeEx calls first (multiprocessing's children call it too)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    try:   # what a C library left in its stdio buffers (exit() flushes them, _exit does not)
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(rc)
