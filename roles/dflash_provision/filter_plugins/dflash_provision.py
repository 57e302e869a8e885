"""Filters for the dflash_provision role: what the API token needs, what it lacks, and how the
container's current config differs from the wanted one.

Plain functions, so tests/test_provision*.py and the stand-in's user.cfg use the same facts.
"""

from __future__ import annotations

import re

# Privileges on /vms/<vmid>, by what needs them (pve-container's check_ct_modify_config_perm and
# the API's endpoint checks; PVE 8 names, no wildcards).
VM_PRIVILEGES = [
    "VM.Allocate",        # create the CT; set features=nesting
    "VM.Audit",           # find it in /cluster/resources, read its config and status
    "VM.Config.CPU",      # cores
    "VM.Config.Disk",     # rootfs
    "VM.Config.Memory",   # memory, swap
    "VM.Config.Network",  # hostname, netN
    "VM.Config.Options",  # onboot, startup and the other plain options
    "VM.PowerMgmt",       # start
]


def _split_opts(value) -> dict:
    out = {}
    for part in str(value or "").split(","):
        k, sep, v = part.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def dflash_netif_bridges(netif: dict) -> list:
    """The SDN paths a token needs SDN.Use on for these netN values (PVE >= 8.0): the bridge in
    the zone `localnetwork`, or bridge/<tag> for a tagged interface."""
    paths = []
    for key in sorted(netif or {}):
        opts = _split_opts(netif[key])
        if opts.get("bridge"):
            path = "/sdn/zones/localnetwork/" + opts["bridge"]
            if opts.get("tag"):
                path += "/" + opts["tag"]
            if path not in paths:
                paths.append(path)
    return paths


def dflash_token_acl(vmid, storage: str, ostemplate: str, netif: dict, unprivileged: bool = True) -> list:
    """[{path, privs}] the provisioning token needs: one ACL per path, least privilege. Creating a
    privileged CT also needs Sys.Modify on / (pve-container's create_vm), granted without
    propagation (dflash_pveum_lines)."""
    acl = [] if unprivileged else [{"path": "/", "privs": ["Sys.Modify"]}]
    acl += [{"path": "/vms/%d" % int(vmid), "privs": list(VM_PRIVILEGES)},
           {"path": "/storage/" + storage, "privs": ["Datastore.AllocateSpace"]}]
    tpl_storage = str(ostemplate).split(":", 1)[0]
    if tpl_storage == storage:
        acl[-1]["privs"].append("Datastore.Audit")
    else:
        acl.append({"path": "/storage/" + tpl_storage, "privs": ["Datastore.Audit"]})
    acl += [{"path": p, "privs": ["SDN.Use"]} for p in dflash_netif_bridges(netif)]
    return acl


def dflash_token_role_privs(acl: list) -> list:
    return sorted({p for entry in acl for p in entry["privs"]})


def dflash_pveum_lines(acl: list, tokenid: str, role: str) -> list:
    """The `pveum` commands (run as root on the node) that grant exactly `acl` to the token."""
    lines = ['pveum role add %s --privs "%s"' % (role, " ".join(dflash_token_role_privs(acl))),
             "pveum user token add %s %s --privsep 1   # prints the secret once" % tuple(tokenid.split("!", 1))]
    lines += ["pveum acl modify %s --tokens '%s' --roles %s%s" % (e["path"], tokenid, role,
                                                                " --propagate 0" if e["path"] == "/" else "")
              for e in acl]
    return lines


def dflash_missing_privs(results: list, acl: list) -> list:
    """uri results of GET /access/permissions?path=P (one per acl entry, same order) ->
    [{path, missing: [...]}] for the paths where the token lacks something."""
    out = []
    for entry, res in zip(acl, results or []):
        data = ((res or {}).get("json") or {}).get("data") or {}
        have = set((data.get(entry["path"]) or {}).keys())
        missing = [p for p in entry["privs"] if p not in have]
        if missing:
            out.append({"path": entry["path"], "missing": missing})
    return out


def dflash_pin_netif(netif: dict, current: dict) -> dict:
    """netN values with the MAC the container already has: re-sending netN without hwaddr makes
    PVE generate a new MAC and re-plug the veth of a running container."""
    out = {}
    for key, value in (netif or {}).items():
        mac = _split_opts((current or {}).get(key)).get("hwaddr")
        if mac and "hwaddr" not in _split_opts(value):
            value = "%s,hwaddr=%s" % (value, mac)
        out[key] = value
    return out


def _same(current, wanted) -> bool:
    """community.proxmox.proxmox's comparison: strings as sets of comma parts (every wanted
    part present), everything else as strings."""
    if current is None:
        return False
    if isinstance(wanted, str):
        return set(wanted.split(",")) <= set(str(current).split(","))
    return str(wanted) == str(current)


def dflash_ct_drift(current: dict, wanted: dict) -> list:
    """[{key, current, wanted}] for each wanted key the current config does not have."""
    return [{"key": k, "current": (current or {}).get(k), "wanted": v}
            for k, v in sorted((wanted or {}).items())
            if v is not None and not _same((current or {}).get(k), v)]


def dflash_rootfs_gib(rootfs) -> float:
    """'local-lvm:vm-200-disk-0,size=64G' -> 64.0 (GiB)."""
    m = re.search(r"(?:^|,)size=(\d+(?:\.\d+)?)([KMGT]?)", str(rootfs or ""))
    if not m:
        return 0.0
    return float(m.group(1)) * {"K": 2 ** -20, "M": 2 ** -10, "G": 1, "T": 1024, "": 2 ** -30}[m.group(2)]


class FilterModule:
    def filters(self):
        return {
            "dflash_netif_bridges": dflash_netif_bridges,
            "dflash_token_acl": dflash_token_acl,
            "dflash_token_role_privs": dflash_token_role_privs,
            "dflash_pveum_lines": dflash_pveum_lines,
            "dflash_missing_privs": dflash_missing_privs,
            "dflash_pin_netif": dflash_pin_netif,
            "dflash_ct_drift": dflash_ct_drift,
            "dflash_rootfs_gib": dflash_rootfs_gib,
        }
