"""RDMA device passthrough (issue 27, "two-node runs go over TCP on the veth"): off by default;
`dflash_node_rdma_devices` passes the node's /dev/infiniband nodes into the container as `pct set
-devN` entries numbered after the GPUs', and the preflight refuses a device node the node lacks.

The filter is checked directly; the node role's play of playbooks/provision.yml runs against the PVE API
stand-in (fake LXC, the `node` fixture of test_provision_playbook.py), whose `pct set -devN` renders the
LXC config.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "roles" / "dflash_node" / "filter_plugins"))
import dflash_node as node_filters  # noqa: E402


def test_rdma_dev_entries_follow_the_gpus_entries():
    gpus = node_filters.dflash_nvidia_dev_entries([0, 1])
    assert list(gpus) == ["dev0", "dev1", "dev2", "dev3", "dev4"]      # 2 GPUs + 3 control nodes
    rdma = node_filters.dflash_dev_entries(["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0"], len(gpus))
    assert rdma == {"dev5": "/dev/infiniband/rdma_cm", "dev6": "/dev/infiniband/uverbs0"}
    assert node_filters.dflash_dev_entries([], 5) == {}


def test_rdma_passthrough_is_off_by_default():
    import yaml
    defaults = yaml.safe_load((REPO / "roles/dflash_node/defaults/main.yml").read_text())
    assert defaults["dflash_node_rdma_devices"] == []
    spec = yaml.safe_load((REPO / "roles/dflash_node/meta/argument_specs.yml").read_text())
    assert spec["argument_specs"]["main"]["options"]["dflash_node_rdma_devices"]["default"] == []


pytest.importorskip("requests")
from tests.pve.test_provision_playbook import VMID, create_ct, node, node_play, play  # noqa: E402,F401  (node: the API stand-in fixture)


@pytest.mark.provision
@pytest.mark.slow
def test_rdma_devices_are_passed_through_as_dev_entries_and_a_missing_one_is_refused(node, tmp_path):  # noqa: F811
    if os.geteuid() != 0:
        pytest.skip("makes character device nodes (mknod)")
    ib = node["tmp"] / "infiniband"              # the node's /dev/infiniband, made here
    ib.mkdir(exist_ok=True)
    devs = {"rdma_cm": (10, 58), "uverbs0": (231, 192)}
    for name, (major, minor) in devs.items():
        if not (ib / name).exists():
            os.mknod(ib / name, 0o600 | 0o020000, os.makedev(major, minor))
    want = [str(ib / "rdma_cm"), str(ib / "uverbs0")]

    # The devN entries are the node role's own: the provision role neither reads nor changes them, so every
    # run here is the node role's play, on CT 250 as the provision role makes it
    create_ct(node)
    r = play(node, playbook=node_play(node), dflash_node_rdma_devices=want)
    assert r.returncode == 0, r.text[-4000:]
    conf = node["conf"].read_text()
    # no GPUs on the stand-in node: the RDMA devices are dev0 and dev1
    assert f"dev0: {want[0]}\n" in conf and f"dev1: {want[1]}\n" in conf, conf
    lxc_conf = (node["tmp"] / "lxc" / str(VMID) / "config").read_text()
    passthrough = node["tmp"] / "lxc" / str(VMID) / "passthrough"
    for name, (major, minor) in devs.items():          # what PVE renders for lxc: a node made for the CT, allowed rw
        assert f"lxc.mount.entry = {passthrough}{ib / name} {str(ib / name).lstrip('/')} none bind,create=file" \
            in lxc_conf
        assert f"devices.allow = c {major}:{minor} rw\n" in lxc_conf

    # a device node the node lacks: the node role's preflight refuses it
    missing = str(ib / "uverbs7")
    r = play(node, playbook=node_play(node), dflash_node_rdma_devices=[*want, missing])
    assert r.returncode != 0
    assert f"dflash_node_rdma_devices names {missing}, not a character device on pve-fake" in r.text, r.text[-3000:]

    r = play(node, playbook=node_play(node), dflash_node_rdma_devices=want)   # a second run changes nothing
    assert r.returncode == 0 and "changed=0" in r.text, r.text[-3000:]       # (the refused one neither)

    # an HCA removed from the list: its devN is deleted, not left to fail the next start (issue 41 item 4)
    r = play(node, playbook=node_play(node), dflash_node_rdma_devices=want[:1])
    assert r.returncode == 0, r.text[-4000:]
    conf = node["conf"].read_text()
    assert sorted(k for k in re.findall(r"^(dev\d+):", conf, re.M)) == ["dev0"], conf
    assert "[pve:pending]" not in conf                      # the restart applied the pending delete
    r = play(node, playbook=node_play(node))                 # no RDMA at all: no devN left
    assert r.returncode == 0 and not re.findall(r"^dev\d+:", node["conf"].read_text(), re.M), r.text[-3000:]
