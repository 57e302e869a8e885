"""The trainer role's venv tasks (issue 13, item 4) on this host: python3-venv is ensured, and a
venv that a failed `python3 -m venv` left half-made (bin/python, no pip) is rebuilt, not skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("dpkg-query") is None or not Path("/usr/bin/python3").exists(),
                    reason="needs a Debian host")
def test_a_half_made_venv_is_rebuilt(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    assert (venv / "bin" / "python").exists() and not (venv / "bin" / "pip").exists()
    (tmp_path / "play.yml").write_text(json.dumps([{
        "hosts": "localhost", "gather_facts": False, "connection": "local",
        "vars": {"dflash_trainer_venv": str(venv), "dflash_trainer_python": "/usr/bin/python3",
                 "ansible_python_interpreter": "/usr/bin/python3"},
        "roles": [{"role": "dflash_trainer"}]}]))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    r = subprocess.run(["ansible-playbook", "-i", "localhost,", str(tmp_path / "play.yml"),
                        "--tags", "dflash_trainer_venv"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert (venv / "bin" / "pip").exists()
    assert subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"]).returncode == 0
