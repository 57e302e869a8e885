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
  hosts: all
  gather_facts: false
  roles:
    - role: dflash_trainer
  handlers:
    - name: The service role's topic, reported
      ansible.builtin.debug:
        msg: HANDLER restart dflash notified
      listen: restart dflash
"""
# One run, two hosts on this machine (local connection), each its own home: `first` has none (a first
# install), `changed` a venv whose installed.json names another wheel. The role builds the wheel once
# (run_once on the controller), as a deploy to several CTs does: a run per case built it twice.
HOSTS = ("first", "changed")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The check-mode run over both hosts: (its output, whitespace collapsed, host -> its home)."""
    tmp = tmp_path_factory.mktemp("check-mode")
    src = tmp / "src"          # a copy of the trainer sources (the wheel is built from it)
    shutil.copytree(REPO / "trainer", src / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(REPO / "pyproject.toml", src / "pyproject.toml")
    homes = {h: tmp / h / "opt-dflash" for h in HOSTS}
    home = homes["changed"]
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "pip").write_text("")     # the venv exists: only the wheel differs
    (home / "installed.json").write_text(json.dumps({
        "name": "dflash-trainer", "version": "0.0.1", "wheel": "dflash_trainer-0.0.1-py3-none-any.whl",
        "sha256": "ab" * 32, "extras": []}))
    (tmp / "play.yml").write_text(PLAYBOOK)
    (tmp / "hosts.yml").write_text(json.dumps({"all": {"hosts": {
        h: {"dflash_trainer_home": str(homes[h])} for h in HOSTS}}}))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(REPO / "roles"),
               ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    extra = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
             "dflash_trainer_src_dir": str(src)}
    r = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp / "hosts.yml"), "--check", "--diff",
                        "--extra-vars", json.dumps(extra), str(tmp / "play.yml")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = re.sub(r"\s+", " ", r.stdout + " " + r.stderr)
    assert r.returncode == 0, text[-3000:]
    return text, homes


def _notified(text, host):
    return re.search(rf"ok: \[{host}\] => msg: HANDLER restart dflash notified", text)


def test_check_mode_first_install_reports_what_it_would_install_and_exits_0(run):
    text, homes = run
    home = homes["first"]
    assert re.search(r"would install dflash-trainer \S+ \([0-9a-f]{12}, dflash_trainer-\S+\.whl\) into "
                     + re.escape(str(home)) + r"/venv, replacing nothing \(first install\)", text), text[-3000:]
    assert _notified(text, "first"), text[-3000:]
    assert not home.exists()        # check mode wrote nothing


def test_check_mode_after_a_trainer_change_names_both_versions_and_exits_0(run):
    text, homes = run
    home = homes["changed"]
    assert re.search(re.escape(f"into {home}/venv, replacing dflash-trainer 0.0.1 (abababababab)"), text), \
        text[-3000:]
    assert _notified(text, "changed"), text[-3000:]
    assert json.loads((home / "installed.json").read_text())["version"] == "0.0.1"
