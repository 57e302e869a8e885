"""The molecule `provision` scenario: playbooks/provision.yml through the Proxmox API stand-in
(tests/standin/pve_api.py, HTTPS on 127.0.0.1:8006, real LXC containers behind it): CT 202 created
and running, idempotent second run, a wrong token fails with a clear error. About 4 minutes."""
import pytest

from tests.conftest import run_molecule


@pytest.mark.slow
@pytest.mark.standin
@pytest.mark.provision
def test_molecule_provision_scenario():
    run_molecule("provision")
