"""Filters for the dflash_provision role: what the API token needs, what it lacks, and how the
container's current config differs from the wanted one.

Plain functions, so tests/pve/test_provision*.py and the stand-in's user.cfg use the same facts.
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
]
# No VM.PowerMgmt: the role never starts, stops or reboots through the API (dflash_node does, as
# root on the node, once the config is right).


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


def dflash_pve_major(version) -> int:
    """GET /version's `version` ("8.2.4") -> 8; 0 where it cannot be read."""
    m = re.match(r"\s*(\d+)", str(version or ""))
    return int(m.group(1)) if m else 0


# Each kind of path gets its own role (suffix of dflash_provision_token_role), so a privilege is
# granted only where it is needed: no Datastore.AllocateSpace on the template storage, no VM.* on a
# storage path. "/" and the SDN paths are granted without propagation (no datacenter-wide
# Sys.Modify, no SDN.Use on every VLAN of the bridge).
ROLE_KINDS = {"sys": "Sys", "vm": "VM", "disk": "Disk", "template": "Template", "sdn": "SDN"}


def dflash_token_acl(vmid, storage: str, ostemplate: str, netif: dict, unprivileged: bool = True,
                     pve_version="8") -> list:
    """[{path, privs, kinds, propagate}] the provisioning token needs: one ACL per path, least
    privilege. Creating a privileged CT also needs Sys.Modify on / from PVE 9 on (pve-container
    master's create_vm; PVE 8 does not check it, and on / it would let the token change datacenter
    options), hence the node's version (GET /version)."""
    acl = []
    if not unprivileged and dflash_pve_major(pve_version) >= 9:
        acl.append({"path": "/", "privs": ["Sys.Modify"], "kinds": ["sys"], "propagate": False})
    acl += [{"path": "/vms/%d" % int(vmid), "privs": list(VM_PRIVILEGES), "kinds": ["vm"], "propagate": True},
            {"path": "/storage/" + storage, "privs": ["Datastore.AllocateSpace"], "kinds": ["disk"],
             "propagate": True}]
    tpl_storage = str(ostemplate).split(":", 1)[0]
    if tpl_storage == storage:
        acl[-1]["privs"].append("Datastore.Audit")
        acl[-1]["kinds"].append("template")
    else:
        acl.append({"path": "/storage/" + tpl_storage, "privs": ["Datastore.Audit"], "kinds": ["template"],
                    "propagate": True})
    acl += [{"path": p, "privs": ["SDN.Use"], "kinds": ["sdn"], "propagate": False}
            for p in dflash_netif_bridges(netif)]
    return acl


def dflash_token_role_privs(acl: list) -> list:
    return sorted({p for entry in acl for p in entry["privs"]})


def dflash_token_roles(acl: list, role: str) -> dict:
    """{role name: sorted privileges} for the kinds of path in `acl`, in the order they appear."""
    out: dict = {}
    for entry in acl:
        for kind, privs in _kind_privs(entry).items():
            out.setdefault(role + ROLE_KINDS[kind], set()).update(privs)
    return {name: sorted(privs) for name, privs in out.items()}


def _kind_privs(entry: dict) -> dict:
    """{kind: privileges} of one acl entry (a storage path may be both rootfs and template store)."""
    kinds = entry.get("kinds") or ["vm"]
    if kinds == ["disk", "template"]:
        return {"disk": ["Datastore.AllocateSpace"], "template": ["Datastore.Audit"]}
    return {kinds[0]: list(entry["privs"])}


def dflash_pveum_lines(acl: list, tokenid: str, role: str) -> list:
    """The `pveum` commands (run as root on the node) that grant exactly `acl` to the token: one
    role per kind of path. A privilege-separated token of any user other than root@pam has only what
    both it and its user are granted, so the user gets the same ACLs."""
    user, token = tokenid.split("!", 1)
    lines = ['pveum role add %s --privs "%s"' % (name, " ".join(privs))
             for name, privs in dflash_token_roles(acl, role).items()]
    if user != "root@pam":
        lines.append("pveum user add %s   # once" % user)
    lines.append("pveum user token add %s %s --privsep 1   # prints the secret once" % (user, token))
    who = "--tokens '%s'" % tokenid if user == "root@pam" else "--users %s --tokens '%s'" % (user, tokenid)
    for e in acl:
        roles = ",".join(role + ROLE_KINDS[k] for k in _kind_privs(e))
        lines.append("pveum acl modify %s %s --roles %s%s" % (e["path"], who, roles,
                                                            "" if e.get("propagate", True) else " --propagate 0"))
    return lines


def dflash_user_cfg_lines(acl: list, tokenid: str, role: str) -> list:
    """The user.cfg lines those `pveum` commands leave (the PVE stand-in reads them)."""
    user = tokenid.split("!", 1)[0]
    lines = ["user:%s:1:0::::::" % user] if user != "root@pam" else []
    lines.append("token:%s:0:1::" % tokenid)
    lines += ["role:%s:%s:" % (name, ",".join(privs)) for name, privs in dflash_token_roles(acl, role).items()]
    who = tokenid if user == "root@pam" else "%s,%s" % (user, tokenid)
    lines += ["acl:%d:%s:%s:%s:" % (int(e.get("propagate", True)), e["path"], who,
                                   ",".join(role + ROLE_KINDS[k] for k in _kind_privs(e))) for e in acl]
    return lines


def _have(res, path) -> set:
    data = ((res or {}).get("json") or {}).get("data") or {}
    return set((data.get(path) or {}).keys())


def dflash_missing_privs(results: list, acl: list) -> list:
    """uri results of GET /access/permissions?path=P (one per acl entry, same order) ->
    [{path, missing: [...]}] for the paths where the token lacks something."""
    out = []
    for entry, res in zip(acl, results or []):
        missing = [p for p in entry["privs"] if p not in _have(res, entry["path"])]
        if missing:
            out.append({"path": entry["path"], "missing": missing})
    return out


def _allowed(path: str, acl: list) -> set:
    """What `acl` grants on `path`: its entry there, and what an entry above it propagates."""
    out: set = set()
    for e in acl:
        if e["path"] == path or (e.get("propagate", True) and path.startswith(e["path"].rstrip("/") + "/")):
            out.update(e["privs"])
    return out


def dflash_excess_privs(perms: dict, acl: list) -> list:
    """GET /access/permissions without a path: the token's effective privileges on every path PVE
    lists there (/, the top-level paths, every ACL path of anyone, every pool) -> [{path, excess}]
    where it holds more than `acl` grants. A grant on /nodes, /access, a pool, /mapping, another VM,
    a storage or an SDN zone shows up here, not only one on the paths the token needs."""
    out = []
    for path in sorted(perms or {}):
        excess = sorted(set(perms[path] or {}) - _allowed(path, acl))
        if excess:
            out.append({"path": path, "excess": excess})
    return out


# An Authorization header as http.client and requests quote it when they refuse it.
_TOKEN_HEADER = re.compile(r"(PVEAPIToken=[^=\s'\"]+=)[^'\"\s]*")


def dflash_redact(text, secret) -> str:
    """`text` (an error an HTTP client or the API gave) without the token secret: the header it
    may quote, and the secret itself as given, trimmed, and escaped as a bytes or str repr shows
    it (a newline in a refused header reads `\\n` there)."""
    out = _TOKEN_HEADER.sub(r"\1<secret hidden>", str(text or ""))
    secret = str(secret or "")
    forms = {secret, secret.strip(), secret.encode("unicode_escape").decode(),
             secret.strip().encode("unicode_escape").decode()}
    for form in sorted((f for f in forms if f), key=len, reverse=True):
        out = out.replace(form, "<secret hidden>")
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
            "dflash_token_roles": dflash_token_roles,
            "dflash_pve_major": dflash_pve_major,
            "dflash_pveum_lines": dflash_pveum_lines,
            "dflash_user_cfg_lines": dflash_user_cfg_lines,
            "dflash_missing_privs": dflash_missing_privs,
            "dflash_excess_privs": dflash_excess_privs,
            "dflash_pin_netif": dflash_pin_netif,
            "dflash_redact": dflash_redact,
            "dflash_ct_drift": dflash_ct_drift,
            "dflash_rootfs_gib": dflash_rootfs_gib,
        }
