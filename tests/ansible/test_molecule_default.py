"""The molecule `default` scenario: the real deploy.yml on the local LXC stand-in.

create (CT 200 booted with systemd, node sshd on 127.0.0.1:2222, pct shim, wheelhouse, tiny
target) -> converge -> idempotence -> verify (unit active, health, progress, staged weights
match the manifest, run.sh allocator, --check --diff changes nothing, a rejected flag leaves
the job alone, restart.yml resumes from the checkpoint) -> destroy. About 15 minutes alone, 30 in the
whole suite on 2 cores.
"""
import pytest

from tests.conftest import run_molecule


@pytest.mark.slow
@pytest.mark.standin
def test_molecule_default_scenario():
    run_molecule("default")
