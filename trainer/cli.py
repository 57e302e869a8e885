"""The console scripts (pyproject.toml's [project.scripts]): each defers the optional accelerators
(trainer/optional.py) before its module, and with it transformers, is imported, then runs its main(). Called
as the script (no argv), it marks its process a program, whose module import is frozen for the collector."""

from __future__ import annotations

import importlib


def _run(module: str, argv=None) -> int:
    from trainer.optional import defer, loading, program
    if argv is None:   # the console script: a process of its own (a caller that passes argv runs it in its own)
        program()
    else:
        defer()
    with loading():   # the module's imports (torch, transformers) frozen for the collector (trainer/optional.py)
        mod = importlib.import_module(module)
    return mod.main(argv)


def train(argv=None) -> int:
    return _run("trainer.__main__", argv)


def status(argv=None) -> int:
    return _run("trainer.status.cli", argv)


def prepare(argv=None) -> int:
    return _run("trainer.data.prepare", argv)


def regenerate(argv=None) -> int:
    return _run("trainer.serving.regenerate", argv)


def tiny(argv=None) -> int:
    return _run("trainer.tools.tiny", argv)


def evaluate(argv=None) -> int:
    return _run("trainer.serving.evaluate", argv)


def export(argv=None) -> int:
    return _run("trainer.serving.export", argv)


def real(argv=None) -> int:
    return _run("trainer.tools.realmodel", argv)
