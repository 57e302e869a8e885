"""Every playbook parses (ansible-playbook --syntax-check) against both inventories."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PLAYBOOKS = ["deploy.yml", "restart.yml"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "playbooks").glob("*.yml")
) + sorted(str(p.relative_to(REPO)) for p in (REPO / "molecule" / "default").glob("*.yml")
           if p.name != "molecule.yml")


@pytest.mark.parametrize("inventory", ["inventory/production", "inventory/local"])
@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_syntax(playbook, inventory):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    r = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, playbook],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
