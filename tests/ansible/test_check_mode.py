"""`--check` tells the truth and exits 0 (issue 27, item 1).

The trainer role in check mode, on this machine (local connection, its home in a temporary
directory; check mode writes nothing there): a first install and a changed wheel must report
"would install ..." and notify the restart, not fail on the output of a command check mode never
ran (the torch/CUDA probe used to be skipped and then parsed: ansible-core 2.19 raised in from_json).
The deploy-level cases (no CT yet, a changed trainer on a running CT) run against the stand-ins:
tests/pve/test_provision_playbook.py (no CT yet) and molecule/default verify (a changed trainer).
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PLAYBOOK = """
- name: The trainer role alone, in check mode
  hosts: localhost
  gather_facts: false
  roles:
    - role: dflash_trainer
  handlers:
    - name: The service role's topic, reported
      ansible.builtin.debug:
        msg: HANDLER restart dflash notified
      listen: restart dflash
"""


def _play(tmp_path, src: Path, home: Path):
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(REPO / "roles"),
               ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    extra = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
             "dflash_trainer_src_dir": str(src), "dflash_trainer_home": str(home)}
    r = subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", "--check", "--diff",
                        "--extra-vars", json.dumps(extra), str(tmp_path / "play.yml")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    r.text = re.sub(r"\s+", " ", r.stdout + " " + r.stderr)
    return r


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A copy of the trainer sources (the wheel is built from it; a test may change it)."""
    d = tmp_path_factory.mktemp("trainer-src")
    shutil.copytree(REPO / "trainer", d / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(REPO / "pyproject.toml", d / "pyproject.toml")
    return d


def test_check_mode_first_install_reports_what_it_would_install_and_exits_0(tmp_path, src):
    home = tmp_path / "opt-dflash"
    r = _play(tmp_path, src, home)
    assert r.returncode == 0, r.text[-3000:]
    assert re.search(r"would install dflash-trainer \S+ \([0-9a-f]{12}, dflash_trainer-\S+\.whl\) into "
                     + re.escape(str(home)) + r"/venv, replacing nothing \(first install\)", r.text), r.text[-3000:]
    assert "HANDLER restart dflash notified" in r.text
    assert not home.exists()        # check mode wrote nothing


def test_check_mode_after_a_trainer_change_names_both_versions_and_exits_0(tmp_path, src):
    home = tmp_path / "opt-dflash"
    home.mkdir()
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "pip").write_text("")     # the venv exists: only the wheel differs
    (home / "installed.json").write_text(json.dumps({
        "name": "dflash-trainer", "version": "0.0.1", "wheel": "dflash_trainer-0.0.1-py3-none-any.whl",
        "sha256": "ab" * 32, "extras": []}))
    r = _play(tmp_path, src, home)
    assert r.returncode == 0, r.text[-3000:]
    assert "replacing dflash-trainer 0.0.1 (abababababab)" in r.text, r.text[-3000:]
    assert "HANDLER restart dflash notified" in r.text
    assert json.loads((home / "installed.json").read_text())["version"] == "0.0.1"
