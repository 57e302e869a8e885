#!/usr/bin/env python3
"""STAND-IN for the Proxmox VE API, for tests on a machine without Proxmox. This is NOT Proxmox.

It answers the handful of PVE API calls that community.proxmox.proxmox (create / update /
start / stop / remove an LXC container) and community.proxmox.proxmox_vm_info make, with real
LXC containers behind them, so the provisioning role can be run end to end here. Everything
outside those calls is absent. It also has a `pct` face (below) for the node-side role, which
on a real node talks to /etc/pve/lxc/<vmid>.conf and `pct` as root.

Served on https://127.0.0.1:8006/api2/json with a self-signed certificate it generates
(`cryptography` if importable, else the openssl CLI). Every request must carry
`Authorization: PVEAPIToken=USER@REALM!TOKENID=SECRET`; otherwise 401 with a PVE-like reason
("No ticket", "no such token 'X' for user 'Y'", "invalid token value!"). Responses are
`{"data": ...}`; errors carry the reason in the HTTP status line (as pveproxy does), plus
`{"errors": {param: why}}` for parameter errors.

Endpoints (paths below /api2/json; PVE API viewer: https://pve.proxmox.com/pve-docs/api-viewer/):
  GET    /version                                   {version, release, repoid}; the modules' token check
  GET    /nodes                                     the one node: [{node, status: online, ...}]
  GET    /cluster/resources[?type=vm]               [{id: lxc/<vmid>, vmid, name, node, type: lxc,
                                                    status, maxmem, maxcpu, maxdisk, template}];
                                                    how the modules find a container by vmid
  GET    /cluster/nextid                            lowest free vmid >= 100 (module path when no vmid)
  GET    /nodes/{node}/storage/{storage}/content    the template volume (vztmpl) on that storage;
                                                    the module checks `ostemplate` against it
  GET    /nodes/{node}/lxc                          [{vmid, name, status, maxmem, cpus, ...}]
  POST   /nodes/{node}/lxc                          create: task vzcreate (copy the cached rootfs into
                                                    the LXC container <vmid>, write its config)
  DELETE /nodes/{node}/lxc/{vmid}                   destroy: task vzdestroy (must be stopped unless force=1)
  GET    /nodes/{node}/lxc/{vmid}/config            the PVE config with its pending values applied
                                                    (current=1: without), raw lxc.* keys as
                                                    "lxc": [[k, v]...], plus digest
  PUT    /nodes/{node}/lxc/{vmid}/config            update keys (and `delete=k1,k2`), synchronous, null
  GET    /nodes/{node}/lxc/{vmid}/status/current    {status: running|stopped, vmid, name, maxmem, ...}
  POST   /nodes/{node}/lxc/{vmid}/status/start      task vzstart: regenerate the LXC config, lxc-start
  POST   /nodes/{node}/lxc/{vmid}/status/shutdown   task vzshutdown: clean stop (forceStop=1: kill after timeout)
  POST   /nodes/{node}/lxc/{vmid}/status/stop       task vzstop: immediate stop
  GET    /nodes/{node}/tasks/{upid}/status          {status: running|stopped, exitstatus: OK|<error>, ...}
  GET    /nodes/{node}/tasks/{upid}/log             [{n, t}] task log lines (the module reads it on timeout)

As in PVE, an API token may not set bind mounts (mpN with a host path), devN passthrough, or
feature flags other than nesting, nor any feature flag of a privileged CT (403 "Permission check
failed"), and raw lxc.* keys are not API parameters at all (400). That is why GPU passthrough, the
bind mounts and the /dev/shm mount live in the node-side role, which runs as root.

PVE 8's rules for what root may set (pve-container stable-bookworm): a devN path must exist and be
a block or character device ("Device X does not exist", "X is not a device"); on a running CT a devN
change, set or delete, stays in [pve:pending] until the next start; at a start a device passed twice
fails (the pre-start hook's mknod: "File exists"), and so does one that is gone; the device is
mknod'ed for the CT (mode 0660 unless `mode=`, owned by the CT's root unless `uid=`/`gid=`) into
<lxcpath>/<vmid>/passthrough and allowed `rw` (never `m`), never an optional bind mount. Mount
points are mounted in key order (rootfs, mp0, mp1, ...), so a later key hides an earlier one's
path below its own. `pct config` and GET .../config show the pending values (`--current 1`,
current=1: the running ones). A task is read by who started it, or by the user of the token that
did, else with Sys.Audit on /nodes/<node>: a token may not read its user's tasks. A raw lxc.* key outside is_valid_lxc_conf_key's
list (lxc.rootfs.path, unknown keys) is dropped with PVE's warning. A start is `systemctl start
pve-container@<vmid>` (vm_start), so that unit's drop-ins on the node apply, as systemd loaded them at its
last `daemon-reload` (the `systemctl` face): Requires=, Wants=, After=, RequiresMountsFor= (Requires= on
every fstab mount above the path) and ExecStartPre= (node_systemd.py beside this file; PVE_STANDIN_SYSTEMD_DIR,
PVE_STANDIN_FSTAB, PVE_STANDIN_FAILED_MOUNTS). A mount's stop propagates to the CTs whose unit Requires= it
(lxc-stop's 60 s, then a kill); `node-shutdown` models a node's shutdown (those first, then pve-guests with
each CT's `down=`). Not modelled: the boot order against pvestatd, which mounts PVE storages (README,
"NFS"); a CT's network (none, unless PVE_STANDIN_DHCP_AFTER gives a lease that many seconds after a
start). The generated LXC config has
PVE's cgroup layout: limits on lxc/<vmid>, the container in its inner `ns` group.

State: PVE-format configs in <pve-etc>/lxc/<vmid>.conf (default /etc/pve, as on a node: the
node-side role edits the same file); the LXC container is <lxcpath>/<vmid> (default
/var/lib/lxc) and its LXC config is regenerated from the PVE config at every start, as
pve-container does. A recorded `unprivileged: 1` (what the GUI makes by default and the
provision role sends) is real: the copied rootfs is shifted by 100000 (tests/standin/idshift.py,
as `pct create` does) and the LXC config maps ids 0-65535 onto 100000-165535 (`lxc.idmap =
u|g 0 100000 65536`), so root inside owns nothing on the node it was not given. Differences
from PVE, deliberately: there is no network (`net0` is recorded, the container gets
lxc.net.0.type = empty); storages are directories under the
container; cores/memory/swap become cgroup limits (cgroup2 keys on a pure cgroup2 host,
cgroup v1 keys otherwise).

Usage:
  pve_api.py serve --rootfs DIR --token 'root@pam!ansible=SECRET' [--port 8006] [--node pve]
                   [--state-dir DIR] [--pve-etc /etc/pve] [--lxcpath /var/lib/lxc] [--fake-lxc]
  pve_api.py pveum role add|user add|user token add|acl modify ...   (as README's first deploy runs them)
  pve_api.py systemctl daemon-reload|stop MOUNT|restart MOUNT;  pve_api.py node-shutdown
  pve_api.py pct config|set|start|stop|shutdown|reboot|status|exec VMID [...]
      The node-side subset of `pct` over the same state: `pct set VMID -mp0 ... -dev0 ...
      --delete k1,k2`, `pct config VMID` prints <pve-etc>/lxc/VMID.conf as pct does.
`--fake-lxc` keeps containers as records only (nothing runs): for the fast unit tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse

# The server's own modules (http.server, ssl, signal; the certificate's datetime and ipaddress; hashlib,
# uuid) are imported where they are used: the pct, systemctl and pveum faces run once per command the
# roles run on the node, hundreds of times a test run, and need none of them.

PVE_VERSION = {"version": "8.2.4", "release": "8.2", "repoid": "standin"}

# The LXC config keys PVE accepts (pve-container's schema, the subset that matters here).
CONFIG_KEYS = {
    "arch", "cmode", "console", "cores", "cpulimit", "cpuunits", "description", "features",
    "hookscript", "hostname", "lock", "memory", "nameserver", "onboot", "ostype", "protection",
    "rootfs", "searchdomain", "startup", "swap", "tags", "template", "timezone", "tty",
    "unprivileged",
}
INDEXED_KEYS = re.compile(r"^(mp|net|dev|unused)\d+$")
CREATE_ONLY = {"vmid", "ostemplate", "password", "ssh-public-keys", "storage", "force", "pool",
               "restore", "start", "unique", "ignore-unpack-errors", "node"}
UPDATE_ONLY = {"delete", "digest", "revert", "node", "vmid"}
# PVE's default id map for unprivileged containers (/etc/subuid root:100000:65536).
IDMAP_BASE = 100000
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # idshift.py, node_systemd.py beside this file
from node_systemd import daemon_reload, node_shutdown, start_unit, stop_mount  # noqa: E402


class ApiError(Exception):
    """An API error: HTTP status, the reason pveproxy puts in the status line, param errors."""

    def __init__(self, status: int, reason: str, errors: dict | None = None):
        super().__init__(reason)
        self.status, self.reason, self.errors = status, reason, errors


# --------------------------------------------------------------------------- access control
# PVE 8's privilege names (pve-access-control, PVE/AccessControl.pm $privgroups). A name outside
# this set is refused as PVE refuses it ("invalid privilege"): there is no VM.Config.* wildcard.
PRIVILEGES = frozenset("""
    VM.Allocate VM.Audit VM.Backup VM.Clone VM.Config.CDROM VM.Config.CPU VM.Config.Cloudinit
    VM.Config.Disk VM.Config.HWType VM.Config.Memory VM.Config.Network VM.Config.Options VM.Console
    VM.Migrate VM.Monitor VM.PowerMgmt VM.Snapshot VM.Snapshot.Rollback
    Sys.Audit Sys.Console Sys.Incoming Sys.Modify Sys.PowerMgmt Sys.Syslog Sys.AccessNetwork
    Datastore.Allocate Datastore.AllocateSpace Datastore.AllocateTemplate Datastore.Audit
    SDN.Allocate SDN.Audit SDN.Use Pool.Allocate Pool.Audit Permissions.Modify
    User.Modify Group.Allocate Realm.Allocate Realm.AllocateUser
    Mapping.Audit Mapping.Modify Mapping.Use
""".split())

# The built-in roles the stand-in knows (a subset of PVE's; custom roles come from user.cfg).
BUILTIN_ROLES = {
    "Administrator": PRIVILEGES,
    "NoAccess": frozenset(),
    "PVEAuditor": frozenset({"VM.Audit", "Sys.Audit", "Datastore.Audit", "SDN.Audit", "Pool.Audit", "Mapping.Audit"}),
    "PVEVMUser": frozenset({"VM.Audit", "VM.Console", "VM.PowerMgmt", "VM.Backup", "VM.Config.CDROM",
                            "VM.Config.Cloudinit", "Pool.Audit"}),
    "PVEVMAdmin": frozenset(p for p in PRIVILEGES if p.startswith("VM.")) | {"Datastore.AllocateSpace",
                                                                             "Datastore.Audit", "Pool.Audit",
                                                                             "Sys.Audit", "Sys.Console"},
    "PVEDatastoreUser": frozenset({"Datastore.AllocateSpace", "Datastore.Audit"}),
    "PVESDNUser": frozenset({"SDN.Use", "SDN.Audit"}),
}


# The ACL paths PVE 8 accepts (PVE::AccessControl::check_path): anything else is "invalid ACL path".
ACL_PATH = re.compile(r"^/(?:|access(?:/(?:groups|realm)(?:/[^/]+)?)?|nodes(?:/[^/]+)?|pool(?:/[^/]+)?"
                      r"|sdn(?:/zones(?:/[^/]+(?:/[^/]+(?:/\d+)?)?)?|/vnets(?:/[^/]+)?)?|storage(?:/[^/]+)?"
                      r"|vms(?:/\d+)?|mapping(?:/(?:pci|usb|dir)(?:/[^/]+)?)?)$")


def valid_acl_path(path: str) -> bool:
    return bool(ACL_PATH.match(path.rstrip("/") or "/"))


def perm_error(what: str = "") -> ApiError:
    """PVE's raise_perm_exc: HTTP 403 'Permission check failed (<what>)'."""
    return ApiError(403, "Permission check failed" + (f" ({what})" if what else ""))


class AccessControl:
    """Users, API tokens, roles and ACLs, read from a PVE-format user.cfg, with PVE's rules:

    - root@pam has every privilege; nobody else has any privilege without an ACL.
    - An ACL on a path applies to that path, and to the paths below it when propagate is 1; the
      most specific path with an entry for the principal wins (NoAccess there means nothing).
    - An API token with privsep=1 (the default of `pveum user token add`) gets only what ACLs
      grant to the token itself, intersected with its user's privileges (a root@pam token: only
      the token's ACLs). privsep=0 tokens have their user's privileges.

    user.cfg lines understood (the format pveum writes):
        user:<userid>:<enable>:<expire>:...      token:<user@realm!name>:<expire>:<privsep>:<comment>:
        role:<name>:<priv>,<priv>,...:           acl:<propagate>:<path>:<users,tokens,@groups>:<roles>:
        group:<name>:<user>,<user>:<comment>:
    """

    def __init__(self, path: str | None):
        self.path = path
        self.users: set = {"root@pam"}
        self.tokens: dict = {}        # tokenid -> privsep (bool)
        self.roles: dict = dict(BUILTIN_ROLES)
        self.groups: dict = {}        # name -> set of users
        self.acl: list = []           # (path, propagate, principal, role)
        self.pools: set = set()
        if path and os.path.exists(path):
            with open(path) as f:
                self.parse(f.read())

    def parse(self, text: str) -> None:
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            kind, _, rest = line.partition(":")
            f = rest.split(":")
            if kind == "user":
                self.users.add(f[0])
            elif kind == "token":
                self.tokens[f[0]] = (f[2] if len(f) > 2 and f[2] != "" else "1") != "0"
            elif kind == "pool":
                self.pools.add(f[0])
            elif kind == "group":
                self.groups[f[0]] = set(filter(None, (f[1] if len(f) > 1 else "").split(",")))
            elif kind == "role":
                privs = set(filter(None, (f[1] if len(f) > 1 else "").split(",")))
                bad = sorted(privs - PRIVILEGES)
                if bad:
                    raise SystemExit(f"{self.path}:{lineno}: invalid privilege '{bad[0]}'")
                self.roles[f[0]] = frozenset(privs)
            elif kind == "acl":
                propagate, acl_path, who, roles = f[0], f[1], f[2], f[3]
                if not valid_acl_path(acl_path):
                    raise SystemExit(f"{self.path}:{lineno}: invalid ACL path '{acl_path}'")
                for principal in filter(None, who.split(",")):
                    for role in filter(None, roles.split(",")):
                        if role not in self.roles:
                            raise SystemExit(f"{self.path}:{lineno}: role '{role}' does not exist")
                        self.acl.append((acl_path.rstrip("/") or "/", propagate != "0", principal, role))

    def add_token(self, tokenid: str, privsep: bool = True) -> None:
        """A token the server was given a secret for but user.cfg does not list: `pveum user token
        add` defaults, i.e. privilege separated and without any ACL."""
        self.users.add(tokenid.split("!")[0])
        self.tokens.setdefault(tokenid, privsep)

    def _acl_privs(self, principal: str, path: str) -> set:
        groups = {"@" + g for g, members in self.groups.items() if principal in members}
        parts = [p for p in path.split("/") if p]
        levels = ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        privs: set = set()
        for level in levels:
            exact = level == levels[-1]
            mine = [(r, who) for (p, prop, who, r) in self.acl
                    if p == level and (exact or prop) and (who == principal or who in groups)]
            if mine:   # the most specific level wins; a user's own entry beats its groups'
                own = [r for r, who in mine if who == principal]
                roles = own or [r for r, _ in mine]
                privs = set().union(*(self.roles[r] for r in roles))
        return privs

    def permissions(self, authid: str, path: str) -> set:
        if authid == "root@pam":
            return set(PRIVILEGES)
        if "!" in authid:
            user = authid.split("!")[0]
            if authid not in self.tokens:
                return set()
            user_privs = self.permissions(user, path)
            if not self.tokens[authid]:
                return user_privs
            token_privs = self._acl_privs(authid, path)
            return token_privs if user == "root@pam" else token_privs & user_privs
        return self._acl_privs(authid, path) if authid in self.users else set()

    def check(self, authid: str | None, path: str, privs: list, any_of: bool = False) -> None:
        """rpcenv->check / check_any: 403 'Permission check failed (<path>, <priv>)'."""
        if authid is None:     # the node-side `pct` face: root on the node
            return
        have = self.permissions(authid, path)
        if any_of:
            if not have & set(privs):
                raise perm_error(f"{path}, {'|'.join(privs)}")
            return
        for p in privs:
            if p not in have:
                raise perm_error(f"{path}, {p}")

    def has(self, authid: str | None, path: str, privs: list) -> bool:
        return authid is None or set(privs) <= self.permissions(authid, path)

    def effective(self, authid: str) -> dict:
        """GET /access/permissions without a path (RPCEnvironment's get_effective_permissions): the
        top-level paths, every ACL path (anyone's) and every pool, each with the privileges held
        there; paths without any are left out."""
        paths = {"/", "/access", "/access/groups", "/nodes", "/pool", "/sdn", "/storage", "/vms", "/mapping"}
        paths |= {p for p, *_ in self.acl}
        paths |= {f"/pool/{p}" for p in self.pools}
        out = {}
        for p in sorted(paths):
            privs = self.permissions(authid, p)
            if privs:
                out[p] = {x: 1 for x in sorted(privs)}
        return out


# --------------------------------------------------------------------------- PVE config files

# pve-container's $valid_lxc_conf_keys (PVE 8, LXC/Config.pm): the raw lxc.* keys a config may carry,
# for privileged and unprivileged CTs alike; a string is PVE's reason for refusing that key. Besides
# these: lxc.cgroup.*, lxc.cgroup2.*, lxc.prlimit.*, lxc.net.* (is_valid_lxc_conf_key).
VALID_LXC_KEYS = {k: 1 for k in """
    lxc.apparmor.profile lxc.apparmor.allow_incomplete lxc.apparmor.allow_nesting lxc.apparmor.raw
    lxc.selinux.context lxc.include lxc.arch lxc.uts.name lxc.signal.halt lxc.signal.reboot lxc.signal.stop
    lxc.init.cmd lxc.pty.max lxc.console.logfile lxc.console.path lxc.tty.max lxc.devtty.dir lxc.hook.autodev
    lxc.autodev lxc.kmsg lxc.mount.fstab lxc.mount.entry lxc.mount.auto lxc.rootfs.mount lxc.cap.drop
    lxc.cap.keep lxc.seccomp.profile lxc.seccomp.notify.proxy lxc.seccomp.notify.cookie lxc.idmap
    lxc.hook.pre-start lxc.hook.pre-mount lxc.hook.mount lxc.hook.start lxc.hook.stop lxc.hook.post-stop
    lxc.hook.clone lxc.hook.destroy lxc.hook.version lxc.log.level lxc.log.file lxc.start.auto lxc.start.delay
    lxc.start.order lxc.group lxc.environment lxc.sysctl.fs.mqueue lxc.sysctl.kernel.msgmax
    lxc.sysctl.kernel.msgmnb lxc.sysctl.kernel.msgmni lxc.sysctl.kernel.sem lxc.sysctl.kernel.shmall
    lxc.sysctl.kernel.shmmax lxc.sysctl.kernel.shmmni lxc.sysctl.kernel.shm_rmid_forced
""".split()}
VALID_LXC_KEYS["lxc.rootfs.path"] = "lxc.rootfs.path is auto generated from rootfs"
VALID_LXC_KEYS["lxc.rootfs.options"] = ("lxc.rootfs.options is not supported, please use mount point options in "
                                        "the \"rootfs\" key")


def lxc_key_validity(key: str):
    """1 for a raw key PVE accepts, else PVE's reason (a string) or 0 (unknown key)."""
    if re.match(r"lxc\.(cgroup2?|prlimit|net)\.", key):
        return 1
    return VALID_LXC_KEYS.get(key, 0)


def parse_conf(text: str, warnings: list | None = None) -> tuple[dict, list, str]:
    """PVE .conf text -> (keys, raw lxc pairs, the rest: snapshot sections kept verbatim). A raw
    lxc.* line PVE does not allow is left out with a warning, as pve-container's (non-strict)
    parse_pct_config does: it never reaches the LXC config, and the next write drops it."""
    keys: dict = {}
    raw: list = []
    desc: list = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("["):
            return _with_desc(keys, desc), raw, "".join(lines[i:])
        if not s:
            continue
        if s.startswith("#"):
            desc.append(urllib.parse.unquote(s[1:]))
            continue
        k, _, v = s.partition(":")
        k, v = k.strip(), v.strip()
        if k.startswith("lxc."):
            validity = lxc_key_validity(k)
            if validity == 1:
                raw.append([k, v])
            elif warnings is not None:
                warnings.append(f"{k}: {validity}" if validity else f"unable to parse config: {s}")
        else:
            keys[k] = int(v) if re.fullmatch(r"-?\d+", v) and not INDEXED_KEYS.match(k) else v
    return _with_desc(keys, desc), raw, ""


# As pve-container: a change to a running container that cannot be applied live is written to the
# config's [pve:pending] section and applied at the next start (GUI: shown in red). `features` is one,
# and so is every devN, set or deleted (PVE 8's vmconfig_hotplug_pending hotplugs no device).
PENDING_ON_RUNNING = {"features"}
PENDING_ON_RUNNING_RE = re.compile(r"^dev\d+$")


def pending_on_running(key: str) -> bool:
    return key in PENDING_ON_RUNNING or bool(PENDING_ON_RUNNING_RE.match(key))
PENDING = "[pve:pending]"


def split_pending(rest: str) -> tuple[dict, str]:
    """The [pve:pending] section out of the text after the main section -> ({key: value}, the rest)."""
    out, pending, section = [], {}, None
    for line in rest.splitlines(keepends=True):
        if line.strip().startswith("["):
            section = line.strip()
        if section == PENDING:
            k, _, v = line.strip().partition(":")
            if v and not line.strip().startswith("["):
                pending[k.strip()] = v.strip()
            continue
        out.append(line)
    return pending, "".join(out).lstrip("\n")


def join_pending(pending: dict, rest: str) -> str:
    if not pending:
        return rest
    section = PENDING + "\n" + "".join(f"{k}: {v}\n" for k, v in sorted(pending.items()))
    return section + ("\n" + rest if rest else "")


def _with_desc(keys: dict, desc: list) -> dict:
    if desc:
        keys["description"] = "\n".join(desc)
    return keys


def render_conf(keys: dict, raw: list, rest: str = "") -> str:
    out = []
    if keys.get("description"):
        out += ["#" + urllib.parse.quote(line, safe=" /:=,.-_@") for line in str(keys["description"]).split("\n")]
    out += [f"{k}: {keys[k]}" for k in sorted(keys) if k != "description"]
    out += [f"{k}: {v}" for k, v in raw]
    text = "\n".join(out) + "\n"
    return text + ("\n" + rest if rest else "")


def split_opts(value: str) -> tuple[str | None, dict]:
    """'local-lvm:vm-1-disk-0,size=8G' -> ('local-lvm:vm-1-disk-0', {'size': '8G'})."""
    head, opts = None, {}
    for part in str(value).split(","):
        if "=" in part:
            k, _, v = part.partition("=")
            if k == "volume":
                head = v
            else:
                opts[k] = v
        elif part:
            head = part
    return head, opts


def check_device(path: str | None, key: str = "dev") -> os.stat_result:
    """pve-container's get_device_mode_and_rdev: a devN path must be a block or character device."""
    if not path:
        raise ApiError(500, f"Path is not defined for passthrough device {key}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ApiError(500, f"Device {path} does not exist")
    except OSError:
        raise ApiError(500, f"Error accessing device {path}")
    if (st.st_mode & 0o170000) not in (0o060000, 0o020000):
        raise ApiError(500, f"{path} is not a device")
    return st


def is_host_path(volume: str | None) -> bool:
    return bool(volume) and volume.startswith("/")


def root_squashed(host_dir: str) -> bool:
    """Stand-in for an NFS export with root_squash: the node's root is nobody under the directories
    listed in PVE_STANDIN_ROOT_SQUASH (colon-separated), so it may make nothing in a directory
    that is not writable by others."""
    for top in filter(None, os.environ.get("PVE_STANDIN_ROOT_SQUASH", "").split(":")):
        top = os.path.realpath(top)
        if os.path.realpath(host_dir) == top or os.path.realpath(host_dir).startswith(top + "/"):
            return not (os.stat(host_dir).st_mode & 0o002)
    return False


def make_mount_path(base: str, rel: str) -> None:
    """pve-container's walk_tree_nofollow: the missing directories of a mount path, made with
    mkdirat as the NODE's root (uid 0 on the node, never the CT's root), below `base` (the host
    directory of the mount that holds the path). A refused mkdir is PVE's error."""
    cur = base
    for part in [x for x in rel.split("/") if x]:
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt):
            raise RuntimeError(f"failed to mkdir mount path {nxt}: is a symlink")
        if not os.path.isdir(nxt):
            if root_squashed(cur):
                raise RuntimeError(f"mkdirat {nxt} failed: Permission denied")
            os.mkdir(nxt, 0o755)
            os.chown(nxt, 0, 0)
        cur = nxt


# --------------------------------------------------------------------------- LXC backends

class Lxc:
    """Real LXC containers named by vmid, under lxcpath."""

    def __init__(self, lxcpath: str, rootfs_src: str | None):
        self.lxcpath, self.rootfs_src = lxcpath, rootfs_src
        self.cgroup2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        self.memsw = os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")

    def dir(self, vmid: int) -> str:
        return os.path.join(self.lxcpath, str(vmid))

    def exists(self, vmid: int) -> bool:
        return os.path.exists(os.path.join(self.dir(vmid), "config"))

    def create(self, vmid: int, log, unprivileged: bool = True) -> None:
        if not self.rootfs_src or not os.path.isdir(self.rootfs_src):
            raise RuntimeError(f"stand-in has no rootfs to create from ({self.rootfs_src})")
        dest = os.path.join(self.dir(vmid), "rootfs")
        # traversable by others: an unprivileged CT's root (100000 here) must reach its rootfs
        os.makedirs(self.dir(vmid), mode=0o755, exist_ok=True)
        os.chmod(self.dir(vmid), 0o755)
        log(f"extracting archive (stand-in: copying {self.rootfs_src})")
        subprocess.run(["cp", "-a", "--reflink=auto", self.rootfs_src, dest], check=True,
                       capture_output=True)
        if unprivileged:
            # pct create of an unprivileged CT: the template's files belong to the mapped ids
            import idshift
            n = idshift.shift(dest, IDMAP_BASE)
            log(f"unprivileged: {n} files shifted to ids {IDMAP_BASE}+")

    def write_config(self, vmid: int, text: str) -> None:
        os.makedirs(self.dir(vmid), mode=0o755, exist_ok=True)
        path = os.path.join(self.dir(vmid), "config")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def state(self, vmid: int) -> str:
        if not self.exists(vmid):
            return "stopped"
        r = subprocess.run(["lxc-info", "-n", str(vmid), "-P", self.lxcpath, "-sH"],
                           capture_output=True, text=True)
        return "running" if r.stdout.strip() == "RUNNING" else "stopped"

    def pid(self, vmid: int) -> int | None:
        r = subprocess.run(["lxc-info", "-n", str(vmid), "-P", self.lxcpath, "-pH"],
                           capture_output=True, text=True)
        return int(r.stdout.strip()) if r.stdout.strip().isdigit() else None

    def start(self, vmid: int, log) -> None:
        # the cgroups a killed earlier run left under this vmid's fixed names (lxc-stale-cgroups says why)
        gc = subprocess.run([os.path.join(os.path.dirname(os.path.abspath(__file__)), "lxc-stale-cgroups"), str(vmid)],
                            capture_output=True, text=True)
        for line in gc.stderr.splitlines():
            log(line)
        if gc.returncode != 0:
            raise RuntimeError(f"startup for container '{vmid}' failed: {gc.stderr.strip()}")
        logfile = os.path.join(self.dir(vmid), "standin-start.log")
        r = subprocess.run(["lxc-start", "-n", str(vmid), "-P", self.lxcpath, "-d",
                            "-o", logfile, "-l", "WARN"], capture_output=True, text=True)
        if r.returncode != 0:
            tail = ""
            if os.path.exists(logfile):
                with open(logfile) as f:
                    tail = "".join(f.readlines()[-5:])
            raise RuntimeError(f"startup for container '{vmid}' failed: {r.stderr.strip()} {tail.strip()}")
        w = subprocess.run(["lxc-wait", "-n", str(vmid), "-P", self.lxcpath, "-s", "RUNNING",
                            "-t", "30"], capture_output=True, text=True)
        if w.returncode != 0:
            raise RuntimeError(f"container '{vmid}' did not reach RUNNING")
        log(f"lxc-start {vmid}: running")

    def stop(self, vmid: int, timeout: int | None, force: bool, log) -> None:
        if self.state(vmid) == "stopped":
            return
        if timeout is None:
            cmd = ["lxc-stop", "-n", str(vmid), "-P", self.lxcpath, "-k"]
        else:
            cmd = ["lxc-stop", "-n", str(vmid), "-P", self.lxcpath, "-t", str(timeout)]
            if not force:
                cmd.append("--nokill")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 and self.state(vmid) != "stopped":
            raise RuntimeError("container did not stop")
        log(f"lxc-stop {vmid}: stopped")

    def destroy(self, vmid: int) -> None:
        if os.path.isdir(self.dir(vmid)):
            subprocess.run(["rm", "-rf", "--one-file-system", self.dir(vmid)], check=True)

    def attach(self, vmid: int, argv: list) -> int:
        # PVE 8's `pct exec` keeps the caller's environment (--keep-env defaults to 1 until PVE 9),
        # minus SSL_CERT_FILE/SSL_CERT_DIR; so does the stand-in.
        env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
        return subprocess.call(["lxc-attach", "-n", str(vmid), "-P", self.lxcpath, "--keep-env",
                                "--", *argv], env=env)


class FakeLxc(Lxc):
    """Containers as records only (nothing runs): for the fast unit tests. The running state is a
    marker file, so the `pct` face (a new process per call) and the server agree. `exec` answers
    only what the node role asks a booted container (`systemctl is-active`, `systemctl stop`,
    `cat` of /proc/self/mounts and /proc/1/limits from the config's mount entries and
    lxc.prlimit.memlock, the network check's `ip -4`); anything else fails."""

    def _marker(self, vmid):
        return os.path.join(self.dir(vmid), "fake-running")

    def create(self, vmid, log, unprivileged=True):
        os.makedirs(self.dir(vmid), exist_ok=True)
        log("fake-lxc: no rootfs copied")

    def state(self, vmid):
        return "running" if os.path.exists(self._marker(vmid)) else "stopped"

    def pid(self, vmid):
        return None

    def start(self, vmid, log):
        os.makedirs(self.dir(vmid), exist_ok=True)
        with open(self._marker(vmid), "w") as f:
            f.write(f"{time.time()}\n")

    def stop(self, vmid, timeout, force, log):
        if os.path.exists(self._marker(vmid)):
            os.unlink(self._marker(vmid))

    def _mounts(self, vmid):
        """/proc/self/mounts: what the generated LXC config would mount (records only: nothing is mounted)."""
        try:
            with open(os.path.join(self.dir(vmid), "config")) as f:
                entries = [line.split("=", 1)[1].split() for line in f if line.startswith("lxc.mount.entry")]
        except OSError:
            entries = []
        print("/dev/fake / ext4 rw,relatime 0 0")
        for src, dest, fstype, opts, *_ in entries:
            flags = opts.split(",")
            if fstype == "tmpfs":
                size = next((o[5:] for o in flags if o.startswith("size=")), "0M")
                kib = int(size[:-1]) * {"k": 1, "K": 1, "M": 1024, "G": 1048576}[size[-1]]
                print(f"tmpfs /{dest} tmpfs rw,nosuid,nodev,size={kib}k 0 0")
            else:
                print(f"{src} /{dest} ext4 {'ro' if 'ro' in flags else 'rw'},relatime 0 0")

    def _limits(self, vmid):
        """/proc/1/limits: the memlock row from the config's lxc.prlimit.memlock."""
        memlock = "65536"
        try:
            with open(os.path.join(self.dir(vmid), "config")) as f:
                for line in f:
                    if line.startswith("lxc.prlimit.memlock"):
                        memlock = line.split("=", 1)[1].strip().split(":")[0]
        except OSError:
            pass
        memlock = "unlimited" if memlock in ("unlimited", "-1") else memlock
        print("Limit                     Soft Limit           Hard Limit           Units")
        print(f"Max locked memory         {memlock:<20} {memlock:<20} bytes")

    def attach(self, vmid, argv):
        if argv[:2] == ["systemctl", "is-active"]:
            print("active")
            return 0
        if argv[:2] == ["systemctl", "stop"]:
            return 0
        files = {"/proc/self/mounts": self._mounts, "/proc/1/limits": self._limits}
        if argv[0] == "cat" and len(argv) > 1 and all(x in files for x in argv[1:]):
            for x in argv[1:]:          # `cat A B`: each file's text in turn, as cat prints them
                files[x](vmid)
            return 0
        if argv[:2] == ["sh", "-c"] and "ip -4" in argv[2]:
            # the CT's IPv4 address and default route: none (the stand-in has no network), unless
            # PVE_STANDIN_DHCP_AFTER=S: a DHCP lease S seconds after the start, as ifupdown's dhclient
            # gets one after basic.target on a real CT (conflict detection, a DISCOVER retry)
            after = os.environ.get("PVE_STANDIN_DHCP_AFTER")
            try:
                with open(self._marker(vmid)) as f:
                    started = float(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                started = time.time()
            if after is not None and time.time() - started >= float(after):
                print("2: eth0    inet 10.1.2.50/24 brd 10.1.2.255 scope global dynamic eth0")
                print("---")
                print("default via 10.1.2.1 dev eth0")
            else:
                print("---")
            return 0
        print(f"fake-lxc: cannot run {argv!r} (nothing runs here)", file=sys.stderr)
        return 127


# --------------------------------------------------------------------------- the node's state

class Node:
    """One stand-in node: PVE configs, tasks, and the LXC backend."""

    def __init__(self, name: str, pve_etc: str, lxc: Lxc, templates: list, storages: list,
                 acl: AccessControl | None = None, version: str | None = None):
        self.name, self.pve_etc, self.lxc = name, pve_etc, lxc
        # GET /version; the rules that changed between majors follow it
        self.version = {**PVE_VERSION, **({"version": version, "release": version.rsplit(".", 1)[0]}
                                          if version else {})}
        self.acl = acl or AccessControl(os.path.join(pve_etc, "user.cfg"))
        self._acl_stamp = self._user_cfg_stamp()
        self.templates, self.storages = templates, storages
        self.tasks: dict = {}
        self.lock = threading.RLock()
        os.makedirs(self.conf_dir, exist_ok=True)

    def _user_cfg_stamp(self):
        try:
            st = os.stat(self.acl.path)
            return st.st_mtime_ns, st.st_size
        except (OSError, TypeError):
            return None

    def refresh_acl(self, tokens) -> None:
        """user.cfg changed on the node (`pveum`, as root there): read it again, as pmxcfs serves
        every change at once; the tokens the server was started with stay known."""
        stamp = self._user_cfg_stamp()
        if stamp != self._acl_stamp:
            acl = AccessControl(self.acl.path)
            for ident in tokens:
                acl.add_token(ident)
            self.acl, self._acl_stamp = acl, stamp

    def token_secret(self, tokenid: str) -> str | None:
        """<pve-etc>/priv/token.cfg, where `pveum user token add` keeps a token's secret."""
        try:
            with open(os.path.join(self.pve_etc, "priv", "token.cfg")) as f:
                for line in f:
                    ident, _, secret = line.strip().partition(" ")
                    if ident == tokenid:
                        return secret.strip()
        except OSError:
            pass
        return None

    # ---- configs
    @property
    def conf_dir(self) -> str:
        return os.path.join(self.pve_etc, "lxc")

    def conf_path(self, vmid: int) -> str:
        return os.path.join(self.conf_dir, f"{vmid}.conf")

    def vmids(self) -> list:
        out = []
        for f in os.listdir(self.conf_dir):
            m = re.fullmatch(r"(\d+)\.conf", f)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def read(self, vmid: int) -> tuple[dict, list, str]:
        try:
            with open(self.conf_path(vmid)) as f:
                return parse_conf(f.read())
        except FileNotFoundError:
            raise ApiError(500, f"Configuration file 'nodes/{self.name}/lxc/{vmid}.conf' does not exist")

    def write(self, vmid: int, keys: dict, raw: list, rest: str = "") -> None:
        path = self.conf_path(vmid)
        with open(path + ".tmp", "w") as f:
            f.write(render_conf(keys, raw, rest))
        os.chmod(path + ".tmp", 0o640)         # pmxcfs shows every file in /etc/pve as 0640
        os.replace(path + ".tmp", path)

    def config(self, vmid: int, current: bool = False) -> tuple[dict, list]:
        """load_current_config: the main section, with the [pve:pending] values applied over it
        (and its deletes done) unless `current` is asked for, as GET .../config and `pct config` do."""
        keys, raw, rest = self.read(vmid)
        if not current:
            pending, _ = split_pending(rest)
            for k in filter(None, pending.pop("delete", "").split(",")):
                keys.pop(k.strip(), None)
            keys.update(pending)
        return keys, raw

    def digest(self, vmid: int) -> str:
        import hashlib
        with open(self.conf_path(vmid), "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()

    def host_dir_of(self, vmid: int, keys: dict, ct_path: str, before: str | None = None) -> tuple[str, str]:
        """The node directory that holds `ct_path` in the CT, from the mounts in key order (rootfs,
        mp0, mp1, ...; only those before key `before`): (host dir of the mount, the path below it)."""
        best = ("", os.path.join(self.lxc.dir(vmid), "rootfs"))
        for k in sorted((k for k in keys if re.fullmatch(r"mp\d+", k)), key=lambda k: int(k[2:])):
            if before is not None and int(k[2:]) >= int(before[2:]):
                break
            vol, opts = split_opts(keys[k])
            mp = "/" + opts.get("mp", "").strip("/")
            if is_host_path(vol) and (ct_path == mp or ct_path.startswith(mp.rstrip("/") + "/")) \
                    and len(mp) >= len(best[0]):
                best = (mp, vol)
        mp, src = best
        return src, ct_path[len(mp):] if mp else ct_path

    def make_mount_paths(self, vmid: int, keys: dict, only: str | None = None) -> None:
        """Every host-path mount point's path, made as the node's root where it is missing (at a
        start, and for a hot-plug of `only`), as PVE does before it mounts."""
        for k in sorted((k for k in keys if re.fullmatch(r"mp\d+", k)), key=lambda k: int(k[2:])):
            if only is not None and k != only:
                continue
            vol, opts = split_opts(keys[k])
            if not (is_host_path(vol) and opts.get("mp")):
                continue
            base, rel = self.host_dir_of(vmid, keys, "/" + opts["mp"].strip("/"), before=k)
            if os.path.isdir(base):
                make_mount_path(base, rel)

    # ---- LXC config generation (what pve-container does at every start)
    def lxc_config(self, vmid: int, start: bool = False, log=None) -> str:
        warnings: list = []
        try:
            with open(self.conf_path(vmid)) as f:
                keys, raw, _ = parse_conf(f.read(), warnings)
        except FileNotFoundError:
            raise ApiError(500, f"Configuration file 'nodes/{self.name}/lxc/{vmid}.conf' does not exist")
        for w in warnings if log else []:
            log(f"vm {vmid} - {w}")
        d = self.lxc.dir(vmid)
        lines = [
            f"# GENERATED by the PVE stand-in (tests/standin/pve_api.py) from {self.conf_path(vmid)}",
            "# at each start; edit the PVE config, not this file.",
            "lxc.include = /usr/share/lxc/config/common.conf",
        ]
        unprivileged = str(keys.get("unprivileged", "0")) != "0"
        if unprivileged:
            # as pve-container writes it for an unprivileged CT: the userns config and the id map
            lines += ["lxc.include = /usr/share/lxc/config/userns.conf",
                      f"lxc.idmap = u 0 {IDMAP_BASE} 65536", f"lxc.idmap = g 0 {IDMAP_BASE} 65536"]
        lines += [
            f"lxc.arch = {'amd64' if keys.get('arch', 'amd64') == 'amd64' else keys['arch']}",
            f"lxc.uts.name = {keys.get('hostname', f'CT{vmid}')}",
            f"lxc.rootfs.path = dir:{d}/rootfs",
            "lxc.net.0.type = empty",
            "lxc.mount.auto = cgroup:mixed proc:mixed sys:mixed",
            "lxc.autodev = 1",
            "lxc.tty.max = 2",
            # pve-container's cgroup layout (LXC >= 4): the limits below are on lxc/<vmid>, and the
            # container runs in its inner `ns` group, whose memory.max is `max`: inside, the limit is
            # out of sight (dflash_weights reads it on the node).
            "lxc.cgroup.relative = 0",
            f"lxc.cgroup.dir.monitor = lxc.monitor/{vmid}",
            f"lxc.cgroup.dir.container = lxc/{vmid}",
            "lxc.cgroup.dir.container.inner = ns",
        ]
        mem = int(keys.get("memory", 512))
        swap = int(keys.get("swap", 512))
        ncpu = os.cpu_count() or 1
        cores = min(int(keys.get("cores", ncpu)), ncpu)
        cpus = "0" if cores <= 1 else f"0-{cores - 1}"
        if self.lxc.cgroup2:
            lines += [f"lxc.cgroup2.memory.max = {mem * 1024 * 1024}",
                      f"lxc.cgroup2.memory.swap.max = {swap * 1024 * 1024}",
                      f"lxc.cgroup2.cpuset.cpus = {cpus}"]
        else:
            lines += [f"lxc.cgroup.memory.limit_in_bytes = {mem * 1024 * 1024}",
                      f"lxc.cgroup.cpuset.cpus = {cpus}"]
            if self.lxc.memsw:
                lines.append(f"lxc.cgroup.memory.memsw.limit_in_bytes = {(mem + swap) * 1024 * 1024}")
        # Mount points in key order (rootfs, mp0, mp1, ...), as pve-container mounts them: a later
        # key's mount over an earlier one's path hides it (mp0 at /workspace/models, mp1 at
        # /workspace: the models are out of sight).
        mps = []
        for k, v in keys.items():
            if re.fullmatch(r"mp\d+", k):
                vol, opts = split_opts(v)
                mps.append((int(k[2:]), opts.get("mp", ""), vol, opts))
        for _, mp, vol, opts in sorted(mps, key=lambda m: m[0]):
            rel = mp.lstrip("/")
            if is_host_path(vol):
                flags = "bind,create=dir" + (",ro" if opts.get("ro") == "1" else "")
                lines.append(f"lxc.mount.entry = {vol} {rel} none {flags} 0 0")
            else:   # storage-backed: a directory beside the rootfs
                src = os.path.join(d, "volumes", (vol or "vol").replace(":", "_").replace("/", "_"))
                if not os.path.isdir(src):
                    os.makedirs(src)
                    if unprivileged:     # a new volume's root belongs to the CT's root, as in PVE
                        os.chown(src, IDMAP_BASE, IDMAP_BASE)
                lines.append(f"lxc.mount.entry = {src} {rel} none bind,create=dir 0 0")
        # devN as pve-container passes them through: update_lxc_config stats each (a missing one fails
        # the start: "Device ... does not exist"), the pre-start hook mknods each into
        # /var/lib/lxc/<vmid>/passthrough (a second entry for the same path: "File exists") and the
        # container gets that node, not an optional bind mount. With start=False (a config write
        # between starts) the checks wait for the start, as PVE's do.
        # The node is made with the entry's mode (0660 unless mode= says) and uid/gid (0, the CT's
        # root, shifted for an unprivileged CT), and the cgroup allows it rw, never m (mknod).
        seen = set()
        passthrough = os.path.join(d, "passthrough")
        if start:
            shutil.rmtree(passthrough, ignore_errors=True)
        for k in sorted((k for k in keys if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:])):
            path, dopts = split_opts(keys[k])
            path = path or dopts.get("path")
            try:
                st = check_device(path, k)
            except ApiError as e:
                if start:
                    raise RuntimeError(e.reason)
                continue
            if path in seen and start:
                raise RuntimeError(f"failed to mknod /var/lib/lxc/{vmid}/passthrough{path}: File exists")
            seen.add(path)
            kind = "b" if (st.st_mode & 0o170000) == 0o060000 else "c"
            node_path = passthrough + path
            if start and os.geteuid() == 0:
                os.makedirs(os.path.dirname(node_path), exist_ok=True)
                mode = int(dopts.get("mode", "0660"), 8)
                os.mknod(node_path, mode | (st.st_mode & 0o170000), st.st_rdev)
                os.chmod(node_path, mode)
                base = IDMAP_BASE if unprivileged else 0
                os.chown(node_path, base + int(dopts.get("uid", 0)), base + int(dopts.get("gid", 0)))
            lines.append(f"lxc.mount.entry = {node_path} {path.lstrip('/')} none bind,create=file 0 0")
            ver = "cgroup2" if self.lxc.cgroup2 else "cgroup"
            lines.append(f"lxc.{ver}.devices.allow = {kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rw")
        lines += [f"{k} = {v}" for k, v in raw]    # raw lxc.* keys, verbatim, last (as PVE)
        return "\n".join(lines) + "\n"

    # ---- tasks
    def task(self, kind: str, vmid: int, user: str, fn) -> str:
        start = int(time.time())
        upid = "UPID:{}:{:08X}:{:08X}:{:08X}:{}:{}:{}:".format(
            self.name, os.getpid(), random.randint(0, 0xFFFFFFF), start, kind, vmid, user)
        t = {"upid": upid, "node": self.name, "pid": os.getpid(), "pstart": 0, "starttime": start,
             "type": kind, "id": str(vmid), "user": user, "status": "running", "log": []}
        self.tasks[upid] = t

        def log(line):
            t["log"].append(line)

        def run():
            try:
                with self.lock:
                    fn(log)
                t["exitstatus"] = "OK"
                log("TASK OK")
            except Exception as e:  # the task's error is its exitstatus, as in PVE
                t["exitstatus"] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log(f"TASK ERROR: {e}")
                sys.stderr.write(f"task {upid} failed\n" + traceback.format_exc())
            t["endtime"] = int(time.time())
            t["status"] = "stopped"

        threading.Thread(target=run, daemon=True).start()
        return upid

    def check_task_access(self, upid: str, user: str) -> None:
        """pve-manager's Tasks.pm: a task is read by whoever started it, by the user of the token
        that started it, or with Sys.Audit on /nodes/<node>; a token may NOT read its user's tasks."""
        owner = (self.tasks.get(upid) or {}).get("user")
        if owner != user and (owner or "").split("!")[0] != user:
            self.acl.check(user, f"/nodes/{self.name}", ["Sys.Audit"])

    def task_status(self, upid: str) -> dict:
        t = self.tasks.get(upid)
        if not t:
            raise ApiError(500, f"no such task '{upid}'")
        return {k: v for k, v in t.items() if k != "log"}

    def task_log(self, upid: str) -> list:
        t = self.tasks.get(upid)
        if not t:
            raise ApiError(500, f"no such task '{upid}'")
        return [{"n": i + 1, "t": line} for i, line in enumerate(t["log"])]

    # ---- container operations
    def status(self, vmid: int) -> dict:
        keys, _, _ = self.read(vmid)
        state = self.lxc.state(vmid)
        out = {"vmid": vmid, "name": keys.get("hostname", f"CT{vmid}"), "type": "lxc",
               "status": state, "maxmem": int(keys.get("memory", 512)) * 1048576,
               "maxswap": int(keys.get("swap", 512)) * 1048576, "cpus": int(keys.get("cores", 1)),
               "maxdisk": self._disk_bytes(keys), "uptime": 0, "ha": {"managed": 0},
               "template": int(keys.get("template", 0))}
        if keys.get("lock"):
            out["lock"] = keys["lock"]
        pid = self.lxc.pid(vmid) if state == "running" else None
        if pid:
            out["pid"] = pid
            try:
                out["uptime"] = int(time.time() - os.stat(f"/proc/{pid}").st_mtime)
            except OSError:
                pass
        return out

    @staticmethod
    def _disk_bytes(keys: dict) -> int:
        _, opts = split_opts(keys.get("rootfs", ""))
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", opts.get("size", "0"))
        if not m:
            return 0
        mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
        return int(float(m.group(1)) * mult)

    def resources(self) -> list:
        out = []
        for vmid in self.vmids():
            try:
                s = self.status(vmid)
            except ApiError:
                continue
            out.append({"id": f"lxc/{vmid}", "type": "lxc", "vmid": vmid, "name": s["name"],
                        "node": self.name, "status": s["status"], "maxmem": s["maxmem"],
                        "maxcpu": s["cpus"], "maxdisk": s["maxdisk"], "template": s["template"]})
        return out

    def check_params(self, params: dict, extra: set) -> None:
        errors = {}
        for k in params:
            if k in CONFIG_KEYS or k in extra or INDEXED_KEYS.match(k):
                continue
            errors[k] = "property is not defined in schema and the schema does not allow additional properties"
        if errors:
            raise ApiError(400, "Parameter verification failed.", errors)

    def check_modify_perm(self, authid: str | None, vmid: int, old: dict, new: dict, delete: list,
                          unprivileged: bool) -> None:
        """pve-container's check_ct_modify_config_perm: the privilege each key needs, and the keys
        only root@pam may set (an API token never is root@pam, whatever user owns it)."""
        if authid is None or authid == "root@pam":
            return
        acl, vm = self.acl, f"/vms/{vmid}"

        def bridge(raw):
            _, opts = split_opts(raw)
            if not opts.get("bridge"):
                return
            base = f"/sdn/zones/localnetwork/{opts['bridge']}"
            if opts.get("tag"):
                acl.check(authid, f"{base}/{opts['tag']}", ["SDN.Use"])
            for tag in filter(None, opts.get("trunks", "").split(";")):
                acl.check(authid, f"{base}/{tag}", ["SDN.Use"])
            if not (opts.get("tag") or opts.get("trunks")):
                acl.check(authid, base, ["SDN.Use"])

        def features(value):
            return {f.partition("=")[0]: f.partition("=")[2] for f in str(value or "").split(",") if f}

        def one(opt, deleting):
            if opt in ("cores", "cpuunits", "cpulimit"):
                acl.check(authid, vm, ["VM.Config.CPU"])
            elif opt == "rootfs" or re.fullmatch(r"mp\d+", opt):
                acl.check(authid, vm, ["VM.Config.Disk"])
                if deleting:
                    return
                vol, _ = split_opts(new[opt])
                if is_host_path(vol):
                    kind = "device" if vol.startswith("/dev/") else "bind"
                    raise perm_error(f"mount point type {kind} is only allowed for root@pam")
                m = re.fullmatch(r"([^:\s]+):(\d+(\.\d+)?)", vol or "")
                if m:
                    acl.check(authid, f"/storage/{m.group(1)}", ["Datastore.AllocateSpace"])
            elif opt in ("memory", "swap"):
                acl.check(authid, vm, ["VM.Config.Memory"])
            elif re.fullmatch(r"net\d+", opt):
                acl.check(authid, vm, ["VM.Config.Network"])
                if old.get(opt):
                    bridge(old[opt])
                if not deleting and new.get(opt):
                    bridge(new[opt])
            elif re.fullmatch(r"dev\d+", opt):
                raise perm_error("configuring device passthrough is only allowed for root@pam")
            elif opt in ("nameserver", "searchdomain", "hostname"):
                acl.check(authid, vm, ["VM.Config.Network"])
            elif opt == "features":
                if not unprivileged:
                    raise perm_error("changing feature flags for privileged container is only allowed for root@pam")
                before, after = features(old.get(opt)), ({} if deleting else features(new.get(opt)))
                changed = {k for k in set(before) | set(after) if before.get(k, "") != after.get(k, "")}
                if changed - {"nesting"}:
                    raise perm_error("changing feature flags (except nesting) is only allowed for root@pam")
                if changed:
                    acl.check(authid, vm, ["VM.Allocate"])
            elif opt == "hookscript":
                raise perm_error("changing the hookscript is only allowed for root@pam")
            else:
                acl.check(authid, vm, ["VM.Config.Options"])

        for opt in sorted(new):
            one(opt, False)
        for opt in delete:
            one(opt, True)

    def normalise(self, vmid: int, params: dict, storage: str) -> dict:
        """Request values -> what PVE stores: allocated volumes, a MAC address, detected ostype."""
        keys = {}
        for k, v in params.items():
            if k in CREATE_ONLY or k in UPDATE_ONLY:
                continue
            if k == "rootfs" or re.fullmatch(r"mp\d+", k):
                vol, opts = split_opts(v)
                m = re.fullmatch(r"([\w\-.]+):(\d+(?:\.\d+)?)", vol or "")
                if m:   # "storage:SIZE_GiB" allocates a new volume
                    if m.group(1) not in self.storages:
                        raise ApiError(500, f"storage '{m.group(1)}' does not exist")
                    disk = 0 if k == "rootfs" else int(k[2:]) + 1
                    opts = {"size": f"{m.group(2)}G", **{o: x for o, x in opts.items() if o != "size"}}
                    vol = f"{m.group(1)}:vm-{vmid}-disk-{disk}"
                v = ",".join([vol] + [f"{o}={x}" for o, x in opts.items()]) if vol else v
            if re.fullmatch(r"net\d+", k):
                _, opts = split_opts(v)
                opts.setdefault("hwaddr", "BC:24:11:%02X:%02X:%02X" % (vmid % 256, random.randint(0, 255), random.randint(0, 255)))
                opts.setdefault("type", "veth")
                v = ",".join(f"{o}={x}" for o, x in opts.items())
            keys[k] = int(v) if isinstance(v, str) and re.fullmatch(r"-?\d+", v) and k in {
                "cores", "memory", "swap", "onboot", "unprivileged", "cpuunits", "tty", "protection", "template"} else v
        return keys

    def create(self, vmid: int, params: dict, user: str) -> str:
        with self.lock:
            if os.path.exists(self.conf_path(vmid)):
                raise ApiError(500, f"CT {vmid} already exists on node '{self.name}'")
            if self.lxc.exists(vmid):
                raise ApiError(500, f"CT {vmid}: an LXC container '{vmid}' exists outside the stand-in's records")
            self.check_params(params, CREATE_ONLY)
            # The order of pve-container's create_vm: privileged needs Sys.Modify on / (PVE 9 on:
            # master 4cc73b7; stable-bookworm, PVE 8, does not check it), VM.Allocate on the vmid,
            # each key's privilege, the template, the storage. The API's default is privileged
            # (unprivileged: 0; the GUI's default of 1 is the GUI's), as the backend below records it
            unprivileged = str(params.get("unprivileged", "0")) != "0"
            if not unprivileged and int(self.version["version"].split(".")[0]) >= 9:
                self.acl.check(user, "/", ["Sys.Modify"])
            if not self.acl.has(user, f"/vms/{vmid}", ["VM.Allocate"]):
                raise perm_error()
            self.check_modify_perm(user, vmid, {}, {k: v for k, v in params.items()
                                                    if k not in CREATE_ONLY and k != "unprivileged"},
                                   [], unprivileged)
            tpl = params.get("ostemplate", "")
            self.acl.check(user, f"/storage/{tpl.split(':')[0]}", ["Datastore.AllocateSpace", "Datastore.Audit"],
                           any_of=True)
            if tpl not in self.templates:
                raise ApiError(500, f"volume '{tpl}' does not exist")
            storage = params.get("storage", "local")
            self.acl.check(user, f"/storage/{storage}", ["Datastore.AllocateSpace"])
            p = dict(params)
            p.setdefault("rootfs", f"{storage}:4")
            keys = {"arch": "amd64", "ostype": "debian", "memory": 512, "swap": 512, "cores": 1,
                    **self.normalise(vmid, p, storage)}
            keys.setdefault("hostname", f"CT{vmid}")
            # the config exists (locked) while the task runs, as in PVE
            self.write(vmid, {**keys, "lock": "create"}, [])

        def work(log):
            try:
                self.lxc.create(vmid, log, str(keys.get("unprivileged", 0)) != "0")
            except Exception:
                os.unlink(self.conf_path(vmid))
                self.lxc.destroy(vmid)
                raise
            self.write(vmid, keys, [])
            self.lxc.write_config(vmid, self.lxc_config(vmid))
        return self.task("vzcreate", vmid, user, work)

    def update(self, vmid: int, params: dict, user: str | None) -> None:
        with self.lock:
            keys, raw, rest = self.read(vmid)
            self.check_params(params, UPDATE_ONLY)
            self.acl.check(user, f"/vms/{vmid}", ["VM.Config.Disk", "VM.Config.CPU", "VM.Config.Memory",
                                                  "VM.Config.Network", "VM.Config.Options"], any_of=True)
            self.check_modify_perm(user, vmid, keys, {k: v for k, v in params.items() if k not in UPDATE_ONLY},
                                   [k.strip() for k in str(params.get("delete", "")).split(",") if k.strip()],
                                   str(keys.get("unprivileged", "0")) != "0")
            if params.get("digest") and params["digest"] != self.digest(vmid):
                raise ApiError(500, "detected modified configuration - file changed by other user? Try again.")
            if keys.get("lock"):
                raise ApiError(500, f"CT is locked ({keys['lock']})")
            deletes = [k.strip() for k in str(params.get("delete", "")).split(",") if k.strip()]
            running = self.lxc.state(vmid) == "running"
            for k in deletes:
                if not (running and pending_on_running(k)):
                    keys.pop(k, None)
            values = self.normalise(vmid, params, "local")
            for k, v in values.items():
                if re.fullmatch(r"dev\d+", k):
                    check_device(split_opts(v)[0], k)
            if running:
                later = {k: v for k, v in values.items() if pending_on_running(k) and str(keys.get(k)) != str(v)}
                later_delete = [k for k in deletes if pending_on_running(k) and k in keys]
                if later or later_delete:
                    pending, rest = split_pending(rest)
                    for k in later:     # a set cancels a pending delete of that key
                        pending["delete"] = ",".join(d for d in pending.get("delete", "").split(",") if d and d != k)
                    pending.update(later)
                    if later_delete:
                        pending["delete"] = ",".join(sorted(set(filter(None, pending.get("delete", "").split(",")))
                                                            | set(later_delete)))
                    pending = {k: v for k, v in pending.items() if v != ""}
                    rest = join_pending(pending, rest)
                    values = {k: v for k, v in values.items() if k not in later}    # deleted keys stay till then
            if running:     # bind mounts are hot-plugged: the mount path first, as the node's root
                for k, v in values.items():
                    if re.fullmatch(r"mp\d+", k) and is_host_path(split_opts(v)[0]) and str(keys.get(k)) != str(v):
                        try:
                            self.make_mount_paths(vmid, {**keys, **values}, only=k)
                        except RuntimeError as e:      # nothing is written
                            raise ApiError(500, f"unable to hotplug {k}: {e}")
            keys.update(values)
            self.write(vmid, keys, raw, rest)
            self.lxc.write_config(vmid, self.lxc_config(vmid))   # applies at the next start

    def destroy(self, vmid: int, force: bool, user: str) -> str:
        self.read(vmid)
        if self.lxc.state(vmid) == "running" and not force:
            raise ApiError(500, f"CT {vmid} is running - destroy failed")

        def work(log):
            self.lxc.stop(vmid, None, True, log)
            self.lxc.destroy(vmid)
            os.unlink(self.conf_path(vmid))
        return self.task("vzdestroy", vmid, user, work)

    def apply_pending(self, vmid: int) -> None:
        """What a start does first: the [pve:pending] values become the config."""
        with self.lock:
            keys, raw, rest = self.read(vmid)
            pending, rest = split_pending(rest)
            if pending:
                for k in filter(None, pending.pop("delete", "").split(",")):
                    keys.pop(k.strip(), None)
                keys.update(pending)
                self.write(vmid, keys, raw, rest)

    def start(self, vmid: int, user: str) -> str:
        keys, _, _ = self.read(vmid)
        if keys.get("lock"):
            raise ApiError(500, f"CT is locked ({keys['lock']})")

        def work(log):
            if self.lxc.state(vmid) == "running":
                raise RuntimeError(f"CT {vmid} already running")
            self.apply_pending(vmid)
            self.make_mount_paths(vmid, self.read(vmid)[0])
            self.lxc.write_config(vmid, self.lxc_config(vmid, start=True, log=log))
            start_unit(vmid, log)
            self.lxc.start(vmid, log)
        return self.task("vzstart", vmid, user, work)

    def shutdown(self, vmid: int, timeout: int, force: bool, user: str) -> str:
        self.read(vmid)
        return self.task("vzshutdown", vmid, user,
                         lambda log: self.lxc.stop(vmid, timeout, force, log))

    def stop(self, vmid: int, user: str) -> str:
        self.read(vmid)
        return self.task("vzstop", vmid, user, lambda log: self.lxc.stop(vmid, None, True, log))

    def reboot(self, vmid: int, timeout: int | None, user: str) -> str:
        """vm_reboot: a clean shutdown that KILLS after the timeout (lxc-stop's default, 60 s,
        when none is given), then a start. A unit inside with a longer TimeoutStopSec is cut short."""
        keys, _, _ = self.read(vmid)
        if keys.get("lock"):
            raise ApiError(500, f"CT is locked ({keys['lock']})")

        def work(log):
            if self.lxc.state(vmid) != "running":
                return
            log(f"shutting down CT {vmid} (killed after {60 if timeout is None else timeout} s)")
            self.lxc.stop(vmid, 60 if timeout is None else timeout, True, log)
            self.apply_pending(vmid)
            self.make_mount_paths(vmid, self.read(vmid)[0])
            self.lxc.write_config(vmid, self.lxc_config(vmid, start=True, log=log))
            start_unit(vmid, log)
            self.lxc.start(vmid, log)
        return self.task("vzreboot", vmid, user, work)

    def wait(self, upid: str, timeout: float = 600) -> dict:
        end = time.time() + timeout
        while self.tasks[upid]["status"] == "running" and time.time() < end:
            time.sleep(0.1)
        return self.tasks[upid]


# --------------------------------------------------------------------------- HTTP

class Handler:
    """The API's request handler: serve() puts it before http.server.BaseHTTPRequestHandler."""
    server_version = "pve-api-daemon/3.0 (stand-in)"
    protocol_version = "HTTP/1.1"

    node: Node = None          # set by serve()
    tokens: dict = {}          # "user@realm!tokenid" -> secret

    def log_message(self, fmt, *args):   # one line per request on stderr, like an access log
        sys.stderr.write("%s %s\n" % (self.log_date_time_string(), fmt % args))

    def _reply(self, status: int, data=None, reason: str | None = None, errors=None):
        body = {"data": data}
        if errors:
            body["errors"] = errors
        raw = json.dumps(body).encode()
        self.send_response(status, reason)
        self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _auth(self) -> str:
        h = self.headers.get("Authorization", "")
        m = re.fullmatch(r"PVEAPIToken=([^!\s]+)!([^=\s]+)=(\S+)", h.strip())
        if not m:
            raise ApiError(401, "No ticket")
        user, tokenid, secret = m.groups()
        known = self.tokens.get(f"{user}!{tokenid}") or self.node.token_secret(f"{user}!{tokenid}")
        if known is None:
            raise ApiError(401, f"no such token '{tokenid}' for user '{user}'")
        if secret != known:
            raise ApiError(401, "invalid token value!")
        return f"{user}!{tokenid}"

    def _params(self) -> dict:
        url = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            body = self.rfile.read(n).decode()
            if "json" in (self.headers.get("Content-Type") or ""):
                params.update({k: str(v) for k, v in json.loads(body or "{}").items()})
            else:
                params.update(dict(urllib.parse.parse_qsl(body, keep_blank_values=True)))
        return params

    def _dispatch(self, method: str):
        try:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            params = self._params()
            if not path.startswith("/api2/json/"):
                raise ApiError(501, f"Method '{method} {path}' not implemented")
            self.node.refresh_acl(self.tokens)
            user = self._auth()
            self._reply(200, self._route(method, path[len("/api2/json"):].rstrip("/"), params, user))
        except ApiError as e:
            if e.status >= 500:   # the reason in the log too: a client may show only the status line
                sys.stderr.write(f"{self.log_date_time_string()} {method} {self.path}: {e.status} {e.reason}\n")
            self._reply(e.status, None, e.reason, e.errors)
        except Exception as e:   # an unexpected error is a 500 with the message, as in PVE
            sys.stderr.write(f"{self.log_date_time_string()} {method} {self.path}: unexpected error\n"
                             + traceback.format_exc())
            self._reply(500, None, str(e).splitlines()[0] if str(e) else type(e).__name__)

    def _route(self, method, path, p, user):
        node = self.node
        r = method + " " + path
        acl = node.acl
        if r == "GET /version":
            return self.node.version
        if r == "GET /access/permissions":
            # Each user/token may dump its own permissions (or those of its tokens); others
            # need Sys.Audit on /access.
            who = p.get("userid") or user
            if who != user and who.split("!")[0] != user:
                acl.check(user, "/access", ["Sys.Audit"])
            if p.get("path"):
                privs = acl.permissions(who, p["path"])
                return {p["path"]: {x: 1 for x in sorted(privs)}}
            return acl.effective(who)
        if r == "GET /nodes":
            return [{"node": node.name, "status": "online", "type": "node", "id": f"node/{node.name}",
                     "maxcpu": os.cpu_count(), "level": ""}]
        if r == "GET /cluster/resources":
            res = [x for x in node.resources() if acl.has(user, f"/vms/{x['vmid']}", ["VM.Audit"])]
            if p.get("type") in (None, "", "node"):
                res.append({"id": f"node/{node.name}", "type": "node", "node": node.name, "status": "online"})
            return [x for x in res if p.get("type") in (None, "") or
                    (p["type"] == "vm" and x["type"] in ("lxc", "qemu")) or x["type"] == p["type"]]
        if r == "GET /cluster/nextid":
            used = set(node.vmids())
            return str(next(i for i in range(100, 1000000000) if i not in used))
        m = re.fullmatch(r"/nodes/([^/]+)(/.*)?", path)
        if not m:
            raise ApiError(501, f"Method '{method} {path}' not implemented (stand-in)")
        if m.group(1) != node.name:
            raise ApiError(595, f"no such cluster node '{m.group(1)}'")
        sub = m.group(2) or ""
        r = method + " " + sub
        t = re.fullmatch(r"GET /tasks/([^/]+)/(status|log)", r)
        if t:
            node.check_task_access(t.group(1), user)
            return node.task_status(t.group(1)) if t.group(2) == "status" else node.task_log(t.group(1))
        if re.fullmatch(r"GET /storage/[^/]+/content", r):
            storage = sub.split("/")[2]
            if storage not in node.storages:
                raise ApiError(500, f"storage '{storage}' does not exist")
            acl.check(user, f"/storage/{storage}", ["Datastore.Audit", "Datastore.AllocateSpace"], any_of=True)
            return [{"volid": t, "content": "vztmpl", "format": "tzst", "size": 123456789}
                    for t in node.templates if t.split(":")[0] == storage]
        if r == "GET /lxc":
            return [{k: s[k] for k in ("vmid", "name", "status", "maxmem", "maxswap", "cpus",
                                        "maxdisk", "uptime", "template") if k in s} | {"type": "lxc"}
                    for s in (node.status(v) for v in node.vmids() if acl.has(user, f"/vms/{v}", ["VM.Audit"]))]
        if r == "POST /lxc":
            vmid = int(p.get("vmid") or 0)
            if vmid < 100:
                raise ApiError(400, "Parameter verification failed.", {"vmid": "value must have a minimum value of 100"})
            return node.create(vmid, p, user)
        m = re.fullmatch(r"(GET|PUT|POST|DELETE) /lxc/(\d+)(/.*)?", r)
        if not m:
            raise ApiError(501, f"Method '{method} /nodes/{node.name}{sub}' not implemented (stand-in)")
        vmid, rest = int(m.group(2)), (m.group(3) or "")
        op = method + " " + rest
        vm = f"/vms/{vmid}"
        need = {"DELETE ": "VM.Allocate", "GET /config": "VM.Audit", "GET /status/current": "VM.Audit",
                "POST /status/start": "VM.PowerMgmt", "POST /status/shutdown": "VM.PowerMgmt",
                "POST /status/stop": "VM.PowerMgmt", "POST /status/reboot": "VM.PowerMgmt"}.get(op)
        if need:
            acl.check(user, vm, [need])
        if op == "DELETE ":
            return node.destroy(vmid, p.get("force") == "1", user)
        if op == "GET /config":
            keys, raw = node.config(vmid, current=str(p.get("current", "0")) not in ("0", "", "false"))
            out = dict(keys)
            if raw:
                out["lxc"] = raw
            out["digest"] = node.digest(vmid)
            return out
        if op == "PUT /config":
            node.update(vmid, p, user)
            return None
        if op == "GET /status/current":
            return node.status(vmid)
        if op == "POST /status/start":
            return node.start(vmid, user)
        if op == "POST /status/shutdown":
            return node.shutdown(vmid, int(p.get("timeout") or 60), p.get("forceStop") == "1", user)
        if op == "POST /status/stop":
            return node.stop(vmid, user)
        if op == "POST /status/reboot":
            return node.reboot(vmid, int(p["timeout"]) if p.get("timeout") else None, user)
        raise ApiError(501, f"Method '{method} /nodes/{node.name}{sub}' not implemented (stand-in)")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")


# --------------------------------------------------------------------------- certificate

def make_cert(cert: str, key: str) -> None:
    """A self-signed certificate for 127.0.0.1 / localhost, usable as its own CA bundle."""
    if os.path.exists(cert) and os.path.exists(key):
        return
    os.makedirs(os.path.dirname(cert) or ".", exist_ok=True)
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "30",
                        "-subj", "/CN=pve-standin/O=PVE stand-in (tests only)",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                        "-addext", "basicConstraints=critical,CA:TRUE"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        return
    import datetime
    import ipaddress
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pve-standin"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "PVE stand-in (tests only)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=30))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                     x509.DNSName("localhost")]), critical=False)
         .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                      content_commitment=False, key_encipherment=False, data_encipherment=False,
                                      key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()), critical=False)
         .sign(k, hashes.SHA256()))
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()))
    with open(cert, "wb") as f:
        f.write(c.public_bytes(serialization.Encoding.PEM))


# --------------------------------------------------------------------------- entry points

def build_node(a) -> Node:
    backend = (FakeLxc if a.fake_lxc else Lxc)(a.lxcpath, a.rootfs)
    acl = AccessControl(a.user_cfg or os.path.join(a.pve_etc, "user.cfg"))
    return Node(a.node, a.pve_etc, backend, a.template, a.storage, acl, a.pve_version)


def serve(a) -> None:
    tokens = {}
    for t in a.token + [x for x in os.environ.get("PVE_STANDIN_TOKENS", "").split() if x]:
        ident, _, secret = t.partition("=")
        if "!" not in ident or not secret:
            sys.exit(f"pve_api.py: --token must look like USER@REALM!TOKENID=SECRET, got {ident!r}")
        tokens[ident] = secret
    if not tokens:
        sys.exit("pve_api.py: no API token configured (--token or PVE_STANDIN_TOKENS)")
    os.makedirs(a.state_dir, exist_ok=True)
    cert, key = os.path.join(a.state_dir, "pve-ssl.pem"), os.path.join(a.state_dir, "pve-ssl.key")
    make_cert(cert, key)
    node = build_node(a)
    for ident in tokens:
        node.acl.add_token(ident)
    import http.server
    import signal
    import ssl
    handler = type("Handler", (Handler, http.server.BaseHTTPRequestHandler), {"node": node, "tokens": tokens})
    httpd = http.server.ThreadingHTTPServer((a.listen, a.port), handler)
    httpd.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown).start())
    if a.pidfile:
        with open(a.pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
    print(f"pve_api.py: PVE API STAND-IN (not Proxmox) on https://{a.listen}:{httpd.server_address[1]}/api2/json "
          f"node={node.name} cert={cert}", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    finally:
        if a.pidfile and os.path.exists(a.pidfile):
            os.unlink(a.pidfile)


def pct(a, argv: list) -> int:
    """The node-side subset of `pct`, on the same state as the API (run as root on the node)."""
    node = build_node(a)
    if len(argv) < 2 or not argv[1].isdigit():
        print("usage: pve_api.py pct config|set|start|stop|shutdown|reboot|status|exec VMID ...", file=sys.stderr)
        return 2
    cmd, vmid, rest = argv[0], int(argv[1]), argv[2:]
    if os.environ.get("PVE_STANDIN_PCT_LOG"):       # for tests: what the node role ran, in order
        with open(os.environ["PVE_STANDIN_PCT_LOG"], "a") as f:
            f.write(json.dumps(argv) + "\n")
    try:
        if cmd == "config":
            # pct config shows the pending values (what the next start applies); --current the
            # running config
            opts = dict(zip(rest[::2], rest[1::2]))
            if set(opts) - {"--current", "--snapshot"} or len(rest) % 2:
                raise ApiError(400, f"400 unable to parse option: {' '.join(rest)}")
            keys, raw = node.config(vmid, current=opts.get("--current", "0") not in ("0", "false"))
            sys.stdout.write(render_conf(keys, raw))
        elif cmd == "set":
            params, i = {}, 0
            while i < len(rest):
                opt = rest[i].lstrip("-")
                if i + 1 >= len(rest):
                    raise ApiError(400, f"option '{rest[i]}' needs a value")
                params[opt] = rest[i + 1]
                i += 2
            node.update(vmid, params, None)     # root: no token privilege rules
        elif cmd == "status":
            node.read(vmid)
            print(f"status: {node.lxc.state(vmid)}")
        elif cmd in ("start", "stop", "shutdown", "reboot"):
            node.read(vmid)
            # pct shutdown: --timeout (default 60) then fail, or kill with --forceStop 1;
            # pct reboot: --timeout (default: lxc-stop's 60 s), then always kill.
            opts = dict(zip(rest[::2], rest[1::2]))
            unknown = set(opts) - ({"--timeout", "--forceStop"} if cmd == "shutdown" else
                                   {"--timeout"} if cmd == "reboot" else set())
            if unknown or len(rest) % 2:
                raise ApiError(400, f"400 unable to parse option: {' '.join(rest)}")
            timeout = int(opts["--timeout"]) if "--timeout" in opts else None
            upid = {"start": lambda: node.start(vmid, "root@pam"),
                    "stop": lambda: node.stop(vmid, "root@pam"),
                    "shutdown": lambda: node.shutdown(vmid, 60 if timeout is None else timeout,
                                                      opts.get("--forceStop") == "1", "root@pam"),
                    "reboot": lambda: node.reboot(vmid, timeout, "root@pam")}[cmd]()
            t = node.wait(upid, timeout=3600)
            if t["exitstatus"] != "OK":
                raise ApiError(500, t["exitstatus"])
        elif cmd == "exec":
            if rest and rest[0] == "--":
                rest = rest[1:]
            if not rest:
                raise ApiError(400, "missing command")
            if node.lxc.state(vmid) != "running":
                raise ApiError(500, f"container '{vmid}' not running!")
            return node.lxc.attach(vmid, rest)
        else:
            print(f"pct (stand-in): unknown command '{cmd}'", file=sys.stderr)
            return 2
    except ApiError as e:
        print(e.reason + ("" if not e.errors else " " + json.dumps(e.errors)), file=sys.stderr)
        return 2
    return 0


def systemctl(a, argv: list) -> int:
    """The node's systemd as far as CT starts and stops see it (run as root on the node):
    `systemctl daemon-reload` (what it loaded is what a start applies), `systemctl stop|restart MOUNT`
    (a path or its mount unit: the stop propagates to CTs whose unit Requires= it), and
    `node-shutdown` (pve_api.py node-shutdown: which CTs pve-guests stops with their down= budget and
    which a propagated stop cuts at 60 s, one line each). Calls are appended to PVE_STANDIN_SYSTEMCTL_LOG."""
    if os.environ.get("PVE_STANDIN_SYSTEMCTL_LOG"):
        with open(os.environ["PVE_STANDIN_SYSTEMCTL_LOG"], "a") as f:
            f.write(" ".join(argv) + "\n")
    base = os.environ.get("PVE_STANDIN_SYSTEMD_DIR")
    if argv == ["daemon-reload"]:
        if base:
            daemon_reload(base)
        return 0
    node = build_node(a)

    def log(line):
        print(line)
    if argv == ["node-shutdown"]:
        for vmid, (who, budget) in sorted(node_shutdown(node, log).items()):
            print(f"CT {vmid}: stopped by {who}, given {budget} s")
        return 0
    if len(argv) == 2 and argv[0] in ("stop", "restart"):
        mount = argv[1]
        if mount.endswith(".mount"):
            mount = subprocess.run(["systemd-escape", "--unescape", "--path", mount[:-len(".mount")]],
                                   capture_output=True, text=True).stdout.strip()
        hit = stop_mount(node, mount, log)
        if argv[0] == "restart":
            for vmid in hit:
                node.wait(node.start(vmid, "root@pam"))
        return 0
    print(f"systemctl (stand-in): unknown command '{' '.join(argv)}'", file=sys.stderr)
    return 2


def box_table(rows: list) -> str:
    """PVE's CLI formatter (--output-format text, the default on a terminal and off one): a key/value
    table in box-drawing characters, as `pveum user token add` prints the secret."""
    rows = [("key", "value")] + [(str(k), str(v)) for k, v in rows]
    wk, wv = (max(len(r[i]) for r in rows) for i in (0, 1))

    def rule(left, mid, right, fill):
        return left + fill * (wk + 2) + mid + fill * (wv + 2) + right

    out = [rule("┌", "┬", "┐", "─"), f"│ {rows[0][0]:<{wk}} │ {rows[0][1]:<{wv}} │", rule("╞", "╪", "╡", "═")]
    for i, (k, v) in enumerate(rows[1:]):
        if i:
            out.append(rule("├", "┼", "┤", "─"))
        out.append(f"│ {k:<{wk}} │ {v:<{wv}} │")
    out.append(rule("└", "┴", "┘", "─"))
    return "\n".join(out)


def pveum(a, argv: list) -> int:
    """The `pveum` subset README's first deploy runs as root on the node, on the same user.cfg the
    API reads: `role add NAME --privs "P ..."`, `user add USERID`, `user token add USERID NAME
    [--privsep 0|1]` (prints the secret once; kept in <pve-etc>/priv/token.cfg as PVE keeps it),
    `acl modify PATH --roles R [--users U] [--tokens T] [--propagate 0|1]`. Errors as pveum's."""
    path = a.user_cfg or os.path.join(a.pve_etc, "user.cfg")
    acl = AccessControl(path)

    def opts(rest, allowed):
        out = dict(zip(rest[::2], rest[1::2]))
        bad = sorted(set(out) - allowed) or (["?"] if len(rest) % 2 else [])
        if bad:
            raise ApiError(400, f"400 unable to parse option: {' '.join(rest)}")
        return out

    def append(line):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")
    try:
        words = argv[:3] if argv[:2] == ["user", "token"] else argv[:2]
        rest = argv[len(words):]
        if words == ["role", "add"] and rest:
            name, o = rest[0], opts(rest[1:], {"--privs"})
            if name in acl.roles:
                raise ApiError(400, f"role '{name}' already exists")
            privs = o.get("--privs", "").replace(",", " ").split()
            bad = sorted(set(privs) - PRIVILEGES)
            if bad:
                raise ApiError(400, f"invalid privilege '{bad[0]}'")
            append(f"role:{name}:{','.join(privs)}:")
        elif words == ["user", "add"] and rest:
            opts(rest[1:], set())
            if rest[0] in acl.users:
                raise ApiError(400, f"user '{rest[0]}' already exists")
            append(f"user:{rest[0]}:1:0::::::")
        elif words == ["user", "token", "add"] and len(rest) >= 2:
            user, name, o = rest[0], rest[1], opts(rest[2:], {"--privsep", "--comment", "--expire"})
            if user not in acl.users:
                raise ApiError(400, f"no such user ('{user}')")
            if f"{user}!{name}" in acl.tokens:
                raise ApiError(400, "Token already exists.")
            privsep = "0" if o.get("--privsep", "1") in ("0", "false") else "1"
            import uuid
            secret = str(uuid.uuid4())
            append(f"token:{user}!{name}:{o.get('--expire', '0')}:{privsep}:{o.get('--comment', '')}:")
            os.makedirs(os.path.join(a.pve_etc, "priv"), exist_ok=True)
            with open(os.path.join(a.pve_etc, "priv", "token.cfg"), "a") as f:
                f.write(f"{user}!{name} {secret}\n")
            print(box_table([("full-tokenid", f"{user}!{name}"), ("info", f'{{"privsep":"{privsep}"}}'),
                             ("value", secret)]))
        elif words == ["acl", "modify"] and rest:
            acl_path, o = rest[0], opts(rest[1:], {"--roles", "--users", "--tokens", "--groups", "--propagate"})
            if not valid_acl_path(acl_path):
                raise ApiError(400, f"invalid ACL path '{acl_path}'")
            who = [x for k in ("--users", "--tokens") for x in o.get(k, "").split(",") if x]
            who += ["@" + g for g in o.get("--groups", "").split(",") if g]
            roles = [r for r in o.get("--roles", "").split(",") if r]
            if not who or not roles:
                raise ApiError(400, "missing roles and users, tokens or groups")
            for r in roles:
                if r not in acl.roles:
                    raise ApiError(400, f"role '{r}' does not exist")
            for t in (x for x in who if "!" in x):
                if t not in acl.tokens:
                    raise ApiError(400, f"no such token '{t.split('!')[1]}' for user '{t.split('!')[0]}'")
            propagate = "0" if o.get("--propagate", "1") in ("0", "false") else "1"
            append(f"acl:{propagate}:{acl_path}:{','.join(who)}:{','.join(roles)}:")
        else:
            print(f"pveum (stand-in): unknown command '{' '.join(argv[:3])}'", file=sys.stderr)
            return 2
    except ApiError as e:
        print(e.reason, file=sys.stderr)
        return 255
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="pve_api.py", description="Proxmox VE API STAND-IN for tests (not Proxmox).")
    p.add_argument("mode", choices=["serve", "pct", "pveum", "systemctl", "node-shutdown"])
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8006)
    p.add_argument("--node", default=os.environ.get("PVE_STANDIN_NODE", "pve"))
    p.add_argument("--token", action="append", default=[], help="USER@REALM!TOKENID=SECRET (repeatable)")
    p.add_argument("--state-dir", default=os.environ.get("PVE_STANDIN_STATE", "/var/lib/pve-standin"))
    p.add_argument("--pve-etc", default=os.environ.get("PVE_STANDIN_ETC", "/etc/pve"))
    p.add_argument("--lxcpath", default=os.environ.get("PVE_STANDIN_LXCPATH", "/var/lib/lxc"))
    p.add_argument("--rootfs", default=os.environ.get("PVE_STANDIN_ROOTFS"),
                   help="the rootfs a create copies (tests/standin/build-rootfs.sh prints one)")
    p.add_argument("--template", action="append", default=None,
                   help="template volids the stand-in 'has' (default local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst)")
    p.add_argument("--storage", action="append", default=None, help="storage ids (default local, local-lvm)")
    p.add_argument("--user-cfg", default=os.environ.get("PVE_STANDIN_USER_CFG"),
                   help="PVE-format user.cfg with users, tokens, roles and ACLs (default <pve-etc>/user.cfg)")
    p.add_argument("--pve-version", default=os.environ.get("PVE_STANDIN_VERSION"),
                   help=f"the version GET /version reports, whose major picks the rules (default {PVE_VERSION['version']})")
    p.add_argument("--pidfile")
    p.add_argument("--fake-lxc", action="store_true", default=os.environ.get("PVE_STANDIN_FAKE_LXC") == "1",
                   help="records only, nothing runs (unit tests; env PVE_STANDIN_FAKE_LXC=1)")
    if argv and argv[0] == "pveum":
        return pveum(p.parse_args(["pveum"]), argv[1:])
    if argv and argv[0] in ("systemctl", "node-shutdown"):
        a = p.parse_args(["pct"])
        a.template = a.template or ["local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"]
        a.storage = a.storage or ["local", "local-lvm"]
        return systemctl(a, argv[1:] if argv[0] == "systemctl" else ["node-shutdown"])
    if argv and argv[0] == "pct":
        # pct's own arguments follow; the stand-in options come from the environment.
        a = p.parse_args(["pct"])
        a.template = a.template or ["local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"]
        a.storage = a.storage or ["local", "local-lvm"]
        return pct(a, argv[1:])
    a = p.parse_args(argv)
    a.template = a.template or ["local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"]
    a.storage = a.storage or ["local", "local-lvm"]
    serve(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
