"""Every playbook parses (ansible-playbook --syntax-check) against both inventories.

One ansible-playbook run per inventory checks them all (it loads every playbook it is given, and a
parse error anywhere fails the run naming the file): a run per playbook cost an interpreter start and
Ansible's imports each, about 0.6 CPU-s, 22 times."""
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
def test_syntax(inventory):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    r = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, *PLAYBOOKS],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # each playbook was loaded and checked: ansible-playbook names every one it parsed
    assert [ln.removeprefix("playbook: ") for ln in r.stdout.splitlines() if ln.startswith("playbook: ")] \
        == PLAYBOOKS, r.stdout
