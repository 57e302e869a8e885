"""README's "First deploy on a real node", read as the runbook it is (issue 52 items 10, 11, 13):
each step says what a fresh controller and a fresh PVE 8 node need, in commands that work as written."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _steps() -> dict:
    section = (REPO / "README.md").read_text().split("## First deploy on a real node", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"\n(\d+)\. ", "\n" + section)
    return {int(n): body for n, body in zip(parts[1::2], parts[2::2])}


def test_step_1_makes_the_venv_on_a_python_ansible_core_accepts_and_copies_the_key():
    step = _steps()[1]
    assert "python3 -m venv .venv && . .venv/bin/activate" in step
    assert "apt install python3-venv" in step                      # Debian's python3 has no venv module
    need = importlib.metadata.metadata("ansible-core")["Requires-Python"]        # the pinned ansible-core's floor
    floor = re.search(r">=\s*(\d+\.\d+)", need).group(1)
    assert f"Python {floor} or later" in step, (need, step[:300])
    assert "ssh-copy-id root@" in step


def test_step_2_installs_the_driver_with_dkms_and_looks_the_template_up():
    step = _steps()[2]
    assert "--dkms" in step and "proxmox-default-headers" in step
    assert "pveam available --section system | grep debian-12-standard" in step
    assert "dflash_provision_ostemplate" in step


def test_the_nfs_paragraph_names_the_store_mount_point_inside_the_workspace():
    """Issue 52 item 1: PVE would make /workspace/models as the node's root, which root_squash refuses."""
    readme = (REPO / "README.md").read_text()
    nfs = readme.split("**NFS (a shared workspace or output directory, several nodes).**", 1)[1].split("\n\n", 1)[0]
    assert "mkdir -p /export/dflash/models && chown 100000:100000 /export/dflash\n/export/dflash/models" in nfs
