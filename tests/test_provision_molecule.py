"""The molecule `provision` scenario: playbooks/provision.yml through the Proxmox API stand-in
(tests/standin/pve_api.py, HTTPS on 127.0.0.1:8006, real LXC containers behind it): CT 201 created
and running, idempotent second run, a wrong token fails with a clear error. About 4 minutes."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.slow
@pytest.mark.standin
@pytest.mark.provision
def test_molecule_provision_scenario():
    if os.geteuid() != 0 or shutil.which("lxc-start") is None or shutil.which("debootstrap") is None:
        pytest.skip("needs root, lxc and debootstrap (tests/setup-host.sh)")
    molecule = BIN / "molecule"
    if not molecule.exists():
        pytest.skip("molecule not installed")
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    r = subprocess.run([str(molecule), "test", "-s", "provision"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
