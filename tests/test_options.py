"""trainer/options.py is the option system alone (issue 42): it imports, builds the parser, parses and checks
flags with torch unavailable, and so does `python -m trainer.config`, the Ansible controller's flag check and
argument-spec generator (the controller has no torch). Measurement-only flags (group "measurement") are
hidden from the operator's --help and the role's spec, and still parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = ["--target-model", "/m", "--data-dir", "/d", "--output-dir", "/o"]
NO_TORCH = "import sys\nsys.modules['torch'] = None\n"   # `import torch` raises ImportError from here on


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_options_import_build_and_parse_with_torch_blocked():
    r = _run("import trainer.options as o\n"
             "p = o.build_parser()\n"
             "cfg = o.parse_args(['--target-model', '/m', '--data-dir', '/d', '--output-dir', '/o',\n"
             "                    '--target-gpus', '0,1', '--drafter-gpus', '2', '--block-size', '16'])\n"
             "o.validate_flags(cfg, gpu_count=-1)\n"
             "assert isinstance(cfg, o.TrainConfig) and cfg.block_size == 16 and cfg.target_gpus == [0, 1]\n"
             "o.flag_spec(); o.ansible_spec_yaml()\n"
             "try:\n"
             "    o.validate_flags(o.parse_args(['--target-model', '/m', '--data-dir', '/d', '--output-dir', '/o',\n"
             "                                   '--block-size', '1']), gpu_count=-1)\n"
             "except o.ConfigError as e:\n"
             "    print(e)\n"
             "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] == 'torch'))\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["--block-size: must be >= 2, got 1", "[]"]


def test_the_controller_entry_point_runs_with_torch_blocked():
    """`python -m trainer.config FLAGS` and `--ansible-spec`, as the role runs them, without torch."""
    r = _run("import runpy\nsys.argv = ['trainer.config', '--ansible-spec']\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n")
    assert r.returncode == 0, r.stderr
    from trainer.options import ansible_spec_yaml
    assert r.stdout == ansible_spec_yaml()
    r = _run("import runpy\nsys.argv = ['trainer.config', *%r, '--block-size', '1']\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n" % (PATHS,))
    assert r.returncode == 2 and r.stderr == "dflash-train: error: --block-size: must be >= 2, got 1\n"
    r = _run("import runpy\nsys.argv = ['trainer.config', *%r]\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n" % (PATHS,))
    assert r.returncode == 0 and r.stdout == "flags ok\n", r.stderr
