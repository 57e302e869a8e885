"""Importing the package changes no global state (issue 42): `import trainer` used to put
sys.modules["torchao"] = None for every importer, so a library user's own torchao vanished. Now the
programs defer it (trainer/optional.py): the console scripts through trainer/cli.py, `python -m trainer`
and `python -m trainer.lab.bench`. Each check runs in a fresh interpreter, as an importer would."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _py(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_importing_trainer_leaves_torchao_in_sys_modules_untouched():
    out = _py("import sys\nimport trainer, trainer.config, trainer.status, trainer.ops.plan, trainer.optional\n"
              "print(repr(sys.modules.get('torchao', 'absent')))")
    assert out == "'absent'"


def test_importing_trainer_keeps_an_installed_torchao_findable():
    find = "import importlib.util\nprint(importlib.util.find_spec('torchao') is not None)"
    assert _py("import trainer\n" + find) == _py(find)


def test_a_console_script_defers_torchao_before_its_module_loads():
    out = _py("import sys\nfrom trainer import cli\ntry:\n    cli.status(['--help'])\nexcept SystemExit:\n    pass\n"
              "print(repr(sys.modules.get('torchao', 'absent')))")
    assert out.splitlines()[-1] == "None"


def test_allow_lifts_the_deferral():
    out = _py("import importlib.util, sys\nfrom trainer.optional import allow, defer\ndefer()\n"
              "a = importlib.util.find_spec('torchao')\nallow('torchao')\n"
              "print(a is None, 'torchao' in sys.modules)")
    assert out == "True False"


def test_every_console_script_goes_through_trainer_cli():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    from trainer import cli
    for name, target in scripts.items():
        module, func = target.split(":")
        assert module == "trainer.cli" and callable(getattr(cli, func)), name


def test_a_program_freezes_its_imports_for_the_collector_and_an_importer_keeps_its_own():
    """trainer/optional.py: loading() around a program's heavy imports leaves the collector on and what they built
    frozen (a rank's collections no longer walk torch and transformers); in a process program() did not mark (a test
    calling main() in its own process, a library user) it does nothing."""
    out = _py("import gc\nimport trainer.optional as o\nwith o.loading():\n    import json\n"
              "importer = (gc.get_freeze_count(), gc.isenabled())\no.program()\nwith o.loading():\n"
              "    import email.message\nprint(importer == (0, True), gc.get_freeze_count() > 0, gc.isenabled(),"
              " repr(__import__('sys').modules.get('torchao', 'absent')))")
    assert out == "True True True None"


def test_a_program_ends_as_the_interpreter_would_up_to_its_teardown_and_an_importer_gets_system_exit():
    """trainer/optional.py end(): in a program's process, threading's shutdown (a non-daemon thread still running
    finishes), the atexit handlers, Python's and C's stdio buffers flushed, then the exit status; no module teardown.
    In an importer's process a plain SystemExit."""
    code = ("import atexit, ctypes, sys, threading, time\nimport trainer.optional as o\n"
            "try:\n    o.end(4)\nexcept SystemExit as e:\n    print('importer', e.code)\n"
            "o.program()\natexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
            "ctypes.CDLL(None).printf(b'c-stdio\\n')\no.end(3)\nprint('not reached')\n")
    env = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}   # both stdout buffers in use
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 3, r.stderr
    assert r.stdout.splitlines() == ["importer 4", "thread", "atexit", "c-stdio"]
