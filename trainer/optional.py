"""Optional accelerators load only when asked for (--fp8): a program defers them, an import does not.

transformers imports torchao at import time whenever it is installed (its quantizer registry,
transformers/quantizers/quantizer_torchao.py), and torchao's import loads its compiled kernels (on a CPU
torch: two "Failed to load ... .so" lines) and registers pytree constants (two deprecation warnings): on
every CLI call, --help included, and in the unit's journal. A None in sys.modules makes the package look
absent to importlib (find_spec returns None, import raises ModuleNotFoundError) until allow() lifts it.

Who calls defer(): the programs, before they import transformers (the console scripts through
trainer/cli.py, `python -m trainer` and its ranks, `python -m trainer.lab.bench`). `import trainer` and the
modules under it leave sys.modules alone, so a library user's own torchao is theirs.
"""

from __future__ import annotations

import sys

DEFERRED = ("torchao",)


def defer() -> None:
    """Make the DEFERRED packages look absent from now on (a package already imported stays)."""
    for name in DEFERRED:
        sys.modules.setdefault(name, None)


def allow(name: str) -> None:
    """Let the deferred package NAME be found and imported from now on (the caller asked for it)."""
    if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]
