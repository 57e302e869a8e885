"""Every stand-in on this host owns its containers and its node port alone.

A run killed midway (a session cut off, a CI job cancelled) leaves its LXC container in
/var/lib/lxc and its files behind. Each stand-in's own set-up clears what it made, but a leftover of
one stand-in must never be in the way of another: the API stand-in refuses to create a CT over an
LXC container it did not make (as PVE refuses a vmid in use), so two stand-ins sharing a VMID would
fail each other's runs. These tests read the inventories the stand-ins are deployed with.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

# inventory -> the stand-in that builds its containers
STANDINS = {
    "inventory/local/hosts.yml": "molecule default and tests/demo.sh (tests/standin/standin.sh)",
    "tests/faults/inventory/hosts.yml": "the fault suite (tests/faults/faultlib.py)",
    "inventory/multinode/hosts.yml": "molecule multinode (molecule/multinode/standin-mn.sh)",
    "molecule/provision/inventory/hosts.yml": "molecule provision (tests/standin/pve_api.py)",
}


def _hosts(group: dict, inherited: dict):
    """(host name, its variables with the groups' vars below them) for every host of a YAML inventory group."""
    here = {**inherited, **(group.get("vars") or {})}
    for name, hv in (group.get("hosts") or {}).items():
        yield name, {**here, **(hv or {})}
    for child in (group.get("children") or {}).values():
        yield from _hosts(child or {}, here)


def _inventory(rel: str) -> list[tuple[str, dict]]:
    return list(_hosts(yaml.safe_load((REPO / rel).read_text())["all"], {}))


def _vmids(rel: str) -> list[int]:
    return [int(v["proxmox_vmid"]) for _, v in _inventory(rel) if "proxmox_vmid" in v]


def test_each_stand_in_has_its_own_vmids():
    owner: dict[int, str] = {}
    for rel, who in STANDINS.items():
        vmids = _vmids(rel)
        assert vmids, f"{rel}: no proxmox_vmid"
        for vmid in vmids:
            assert vmid not in owner, f"CT {vmid} is used by {owner.get(vmid)} and by {who}"
            owner[vmid] = who


def test_each_stand_in_node_listens_on_its_own_port():
    owner: dict[int, str] = {}
    for rel, who in STANDINS.items():
        ports = {int(v["ansible_port"]) for _, v in _inventory(rel)
                 if v.get("ansible_connection") != "local" and "ansible_port" in v}
        for port in ports:
            assert port not in owner, f"port {port} is used by {owner.get(port)} and by {who}"
            owner[port] = who


def test_the_scripts_build_the_vmids_their_inventories_name():
    """The scripts that build the containers carry the same VMIDs as the inventories that reach them."""
    local = set(_vmids("inventory/local/hosts.yml"))
    default = re.search(r'VMID="\$\{DFLASH_STANDIN_VMID:-(\d+)\}"', (REPO / "tests/standin/standin.sh").read_text())
    assert default and {int(default.group(1))} == local

    faults = set(_vmids("tests/faults/inventory/hosts.yml"))
    lib = re.search(r'^VMID = "(\d+)"', (REPO / "tests/faults/faultlib.py").read_text(), re.M)
    assert lib and {int(lib.group(1))} == faults

    multinode = set(_vmids("inventory/multinode/hosts.yml"))
    names = re.search(r"declare -A NAME=\(([^)]*)\)", (REPO / "molecule/multinode/standin-mn.sh").read_text())
    assert names and {int(x) for x in re.findall(r"\[(\d+)\]", names.group(1))} == multinode

    # and each of its nodes: the container's node and that node's sshd port, as the inventory says
    script = (REPO / "molecule/multinode/standin-mn.sh").read_text()
    node_of = dict(re.findall(r"\[(\d+)\]=(\S+?)[ )]", re.search(r"declare -A NODE=\(([^)]*\))", script).group(1)))
    port_of = dict(re.findall(r"\[(\d+)\]=(\d+)", re.search(r"declare -A PORT=\(([^)]*)\)", script).group(1)))
    inv = dict(_inventory("inventory/multinode/hosts.yml"))
    for host, v in inv.items():
        if "proxmox_vmid" in v:
            vmid = str(v["proxmox_vmid"])
            assert v["proxmox_node"] == node_of[vmid], f"{host}: CT {vmid} is on {node_of[vmid]} in standin-mn.sh"
            node = inv[v["proxmox_node"]]
            assert int(node["ansible_port"]) == int(port_of[vmid]), host
            # reached through its own node: the node's sshd and key
            assert (v["ansible_host"], int(v["ansible_port"]), v["ansible_ssh_private_key_file"]) == \
                (node["ansible_host"], int(node["ansible_port"]), node["ansible_ssh_private_key_file"]), host
