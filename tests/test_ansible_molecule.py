"""The molecule `default` scenario: the real deploy.yml on the local LXC stand-in.

create (CT 200 booted with systemd, node sshd on 127.0.0.1:2222, pct shim, wheelhouse, tiny
target) -> converge -> idempotence -> verify (unit active, health, progress, staged weights
match the manifest, run.sh allocator, --check --diff changes nothing, a rejected flag leaves
the job alone, restart.yml resumes from the checkpoint) -> destroy. About 10 minutes.
"""
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
def test_molecule_default_scenario():
    if os.geteuid() != 0 or shutil.which("lxc-start") is None or shutil.which("debootstrap") is None:
        pytest.skip("needs root, lxc and debootstrap (tests/setup-host.sh)")
    molecule = BIN / "molecule"
    if not molecule.exists():
        pytest.skip("molecule not installed")
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    r = subprocess.run([str(molecule), "test", "-s", "default"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
