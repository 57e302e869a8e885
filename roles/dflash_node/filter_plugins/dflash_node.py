"""Filters for the dflash_node role: parse /proc/devices and `pct config`, render GPU passthrough.

Kept as plain functions so tests/pve/test_provision*.py can check them without Ansible.
"""

from __future__ import annotations

import re
import shlex

# The device nodes a CUDA process in the container needs, besides one /dev/nvidiaN per GPU.
NVIDIA_CONTROL_NODES = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def dflash_char_majors(proc_devices: str) -> dict:
    """/proc/devices text -> {driver name: major} for character devices."""
    majors, section = {}, None
    for line in proc_devices.splitlines():
        if line.strip().endswith("devices:"):
            section = line.strip().split()[0].lower()
            continue
        m = re.fullmatch(r"\s*(\d+)\s+(\S+)\s*", line)
        if m and section == "character":
            majors.setdefault(m.group(2), int(m.group(1)))
    return majors


def dflash_nvidia_majors(proc_devices: str) -> dict:
    """The nvidia and nvidia-uvm majors, read from /proc/devices (never assumed).

    The GPU/control major registers as "nvidia-frontend" (older drivers) or "nvidia".
    Raises when either is missing: the driver or the nvidia_uvm module is not loaded.
    """
    majors = dflash_char_majors(proc_devices)
    nvidia = majors.get("nvidia-frontend", majors.get("nvidia"))
    uvm = majors.get("nvidia-uvm")
    missing = [n for n, v in (("nvidia", nvidia), ("nvidia-uvm", uvm)) if v is None]
    if missing:
        raise ValueError("/proc/devices has no %s character device: is the driver (and nvidia_uvm) loaded? "
                         "`nvidia-modprobe -u -c=0` creates /dev/nvidia-uvm" % " or ".join(missing))
    return {"nvidia": nvidia, "nvidia-uvm": uvm}


def dflash_gpu_device_nodes(gpus) -> list:
    return ["/dev/nvidia%d" % int(g) for g in gpus] + NVIDIA_CONTROL_NODES


def dflash_nvidia_lxc_lines(proc_devices: str, gpus, cgroup_key: str = "lxc.cgroup2", hook: str = "") -> list:
    """Raw PVE config lines (`key: value`) passing the given GPUs through with cgroup + mount entries.

    The majors are frozen into the lines; with `hook` (the node's dflash-nvidia-prestart) a
    pre-start hook refuses every later start at which /proc/devices no longer agrees (a reboot
    can hand nvidia-uvm another major) or a device node is missing."""
    majors = dflash_nvidia_majors(proc_devices)
    lines = ["%s.devices.allow: c %d:* rwm" % (cgroup_key, majors["nvidia"]),
             "%s.devices.allow: c %d:* rwm" % (cgroup_key, majors["nvidia-uvm"])]
    for node in dflash_gpu_device_nodes(gpus):
        lines.append("lxc.mount.entry: %s %s none bind,optional,create=file" % (node, node.lstrip("/")))
    if hook:
        lines.append("lxc.hook.pre-start: %s %d %d %s" % (hook, majors["nvidia"], majors["nvidia-uvm"],
                                                          " ".join(dflash_gpu_device_nodes(gpus))))
    return lines


def dflash_nvidia_dev_entries(gpus, start: int = 0) -> dict:
    """`pct set -devN` entries for the given GPUs (PVE >= 8.1 resolves the majors itself)."""
    return dflash_dev_entries(dflash_gpu_device_nodes(gpus), start)


def dflash_dev_entries(nodes, start: int = 0) -> dict:
    """`pct set -devN` entries for device nodes, numbered from `start` (e.g. the RDMA devices after
    the GPUs' entries)."""
    return {"dev%d" % (start + i): node for i, node in enumerate(nodes)}


# The devN paths this role passes through: the GPUs' nodes and the HCAs' (/dev/infiniband/...).
OWNED_DEV = re.compile(r"^/dev/nvidia|/infiniband/")


def dflash_stale_dev_keys(current_keys: dict, want_keys: dict) -> list:
    """The devN keys of the config that pass through a device this role owns (a GPU's or an HCA's
    node) and that it no longer wants: after 8 GPUs then 4 (or an HCA removed) they would pass a
    device twice (PVE's pre-start hook: mknod "File exists") or one that is gone ("does not exist")."""
    out = []
    for key, value in (current_keys or {}).items():
        if not re.fullmatch(r"dev\d+", key) or key in (want_keys or {}):
            continue
        head = str(value).split(",")[0]
        path = head[len("path="):] if head.startswith("path=") else head
        if OWNED_DEV.search(path):
            out.append(key)
    return sorted(out, key=lambda k: int(k[3:]))


def dflash_place_dev_entries(want_keys: dict, current_keys: dict) -> dict:
    """`want_keys` with its devN entries renumbered around the devN keys of the config that pass
    through a device this role does not own (an operator's own dev7: /dev/fuse): the role's entries
    take the lowest free numbers in order, and never overwrite another's. Other keys are unchanged."""
    foreign = {int(k[3:]) for k, v in (current_keys or {}).items()
               if re.fullmatch(r"dev\d+", k) and not OWNED_DEV.search(_dev_path(v))}
    out = {k: v for k, v in (want_keys or {}).items() if not re.fullmatch(r"dev\d+", k)}
    n = 0
    for key in sorted((k for k in (want_keys or {}) if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:])):
        while n in foreign:
            n += 1
        out["dev%d" % n] = want_keys[key]
        n += 1
    return out


def _dev_path(value) -> str:
    head = str(value).split(",")[0]
    return head[len("path="):] if head.startswith("path=") else head


def dflash_stale_lines(current_raw, desired, majors=None, own_cpuset=False) -> list:
    """Raw lines this role manages (GPU mount entries, /dev/shm, cgroup allows for the nvidia
    majors; the cpuset line when the role sets one) that are in the config but no longer wanted."""
    patterns = [r"lxc\.mount\.entry:\s*/dev/nvidia", r"lxc\.mount\.entry:\s*\S+\s+dev/shm\s",
                r"lxc\.prlimit\.memlock:", r"lxc\.hook\.pre-start:\s*\S*dflash-nvidia-prestart\s"]
    if own_cpuset:
        patterns.append(r"lxc\.cgroup2?\.cpuset\.cpus:")
    for major in (majors or {}).values():
        patterns.append(r"lxc\.cgroup2?\.devices\.allow:\s*c\s+%d:" % int(major))
    return [line for line in current_raw
            if any(re.match(p, line) for p in patterns) and line not in desired]


def dflash_pct_config(text: str) -> dict:
    """`pct config VMID` output -> {'keys': {key: value}, 'raw': ['lxc.x: v', ...]} (main section only)."""
    keys, raw = {}, []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("["):
            break
        if not s or s.startswith("#"):
            continue
        k, _, v = s.partition(":")
        if k.startswith("lxc."):
            raw.append("%s: %s" % (k.strip(), v.strip()))
        else:
            keys[k.strip()] = v.strip()
    return {"keys": keys, "raw": raw}


def dflash_ct_root_ids(pct_config_text: str) -> list:
    """[uid, gid] that the CT's root is on the node: 0 for a privileged CT; for an unprivileged
    one the base of its `lxc.idmap` u/g 0 lines (PVE's default map: 100000). As pve-container
    (update_lxc_config), a CT with its own lxc.idmap lines is unprivileged too."""
    cfg = dflash_pct_config(pct_config_text or "")
    idmap = [line for line in cfg["raw"] if line.startswith("lxc.idmap:")]
    if str(cfg["keys"].get("unprivileged", "0")) != "1" and not idmap:
        return [0, 0]
    ids = {"u": 100000, "g": 100000}
    for line in cfg["raw"]:
        m = re.match(r"lxc\.idmap:\s*([ug])\s+0\s+(\d+)\s", line)
        if m:
            ids[m.group(1)] = int(m.group(2))
    return [ids["u"], ids["g"]]


def dflash_workspace_owner(setting, ct_root_ids, fstype: str = "") -> list:
    """[uid, gid] the role makes the workspace owned by, or [] to leave the ownership alone.
    `auto` (the default): the CT's root, except on an NFS share, where the node's root may be
    squashed (root_squash refuses its chown): the export decides there (README, "NFS"). A
    number (or [uid, gid]): exactly that, wherever it is."""
    if str(setting) == "auto":
        return [] if str(fstype).strip().startswith("nfs") else [int(x) for x in ct_root_ids]
    if isinstance(setting, (list, tuple)):
        return [int(setting[0]), int(setting[1])]
    return [int(setting), int(setting)]


def dflash_pct_pending(text: str) -> list:
    """The keys of a PVE container config's [pve:pending] section: changes PVE made to a running
    container that it applies only at the next start (a `features` change, for one)."""
    keys, inside = [], False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("["):
            inside = s == "[pve:pending]"
            continue
        if inside and s and not s.startswith("#"):
            keys.append(s.partition(":")[0].strip())
    return keys


def dflash_conf_edit(text: str, add, remove) -> str:
    """A PVE container config with raw lines added to / removed from its MAIN section only.

    /etc/pve/lxc/<vmid>.conf holds the current config first, then one `[name]` section per
    snapshot (and `[pending]`); those describe other states of the container and are never
    touched. Lines to add that the main section has are left where they are; new ones go at
    the end of the main section.
    """
    lines = text.splitlines()
    cut = next((i for i, line in enumerate(lines) if line.strip().startswith("[")), len(lines))
    main, rest = lines[:cut], lines[cut:]
    while main and not main[-1].strip():
        main.pop()
    drop = {line.strip() for line in (remove or [])}
    main = [line for line in main if line.strip() not in drop]
    have = {line.strip() for line in main}
    main += [line for line in (add or []) if line.strip() not in have]
    out = "\n".join(main) + "\n"
    if rest:
        out += "\n" + "\n".join(rest) + "\n"
    return out


def dflash_proc_limit(limits_text: str, name: str = "Max locked memory") -> list:
    """/proc/<pid>/limits -> [soft, hard] of one limit (e.g. ['unlimited', 'unlimited'])."""
    for line in limits_text.splitlines():
        if line.startswith(name):
            return line[len(name):].split()[:2]
    return []


def dflash_same_opts(current, desired) -> bool:
    """Two PVE property strings are equal as sets of comma-separated parts (PVE reorders them)."""
    if current is None:
        return False
    return sorted(str(current).split(",")) == sorted(str(desired).split(","))


# Options of the role's bind mounts that an operator may set and the role keeps: shared=1 says the
# source is the same on every node (a cluster-wide share), which PVE needs to migrate the CT.
KEPT_MOUNT_OPTS = ("shared",)


def dflash_keep_mount_opts(want: dict, current: dict) -> dict:
    """The wanted mpN values with the KEPT_MOUNT_OPTS the current ones carry (else a rerun strips them)."""
    out = dict(want or {})
    for key, value in (want or {}).items():
        if not re.fullmatch(r"mp\d+", key):
            continue
        have = dict(p.split("=", 1) for p in str((current or {}).get(key) or "").split(",") if "=" in p)
        mine = dict(p.split("=", 1) for p in str(value).split(",") if "=" in p)
        extra = ["%s=%s" % (k, have[k]) for k in KEPT_MOUNT_OPTS if k in have and k not in mine]
        if extra:
            out[key] = ",".join([str(value)] + extra)
    return out


def dflash_mount_record(dropin_text: str, check: str = "") -> dict:
    """The start guard's drop-in (pve-container@<vmid>.service.d/dflash-mounts.conf) -> {source path:
    {target, fstype}}: the mount each bind-mount source was on when the role last wrote it, read back
    from its ExecStartPre= lines (`<check> VMID TARGET FSTYPE PATH`). The drop-in is the record."""
    out = {}
    for line in (dropin_text or "").splitlines():
        key, sep, value = line.strip().partition("=")
        if key.strip() != "ExecStartPre" or not sep:
            continue
        argv = shlex.split(value.replace("%%", "%"))
        if len(argv) == 5 and (not check or argv[0] == check):
            out[argv[4]] = {"target": argv[2], "fstype": argv[3]}
        elif len(argv) == 4 and (not check or argv[0] == check):
            # an older guard's `<check> VMID FSTYPE PATH`, written for sources on a network filesystem
            out[argv[3]] = {"target": None, "fstype": argv[2]}
    return out


def dflash_found_mounts(lines: list, given: list) -> list:
    """`realpath` + `findmnt -n -o TARGET,FSTYPE -T` lines ("PATH<tab>TARGET<tab>FSTYPE", one per
    source, in the order of `given`) -> [{path, given, target, fstype}]."""
    out = []
    for line, g in zip(lines, given):
        path, target, fstype = (line.split("\t") + ["", ""])[:3]
        out.append({"path": path, "given": g, "target": target or "/", "fstype": fstype})
    return out


def dflash_pve_storages(mounts: list) -> list:
    """The PVE storages (/mnt/pve/<id>, mounted by pvestatd) that hold any of the sources: their ids."""
    out = []
    for m in mounts or []:
        for p in (m.get("target") or "", m.get("path") or ""):
            hit = re.match(r"^/mnt/pve/([^/]+)(/|$)", p)
            if hit and hit.group(1) not in out:
                out.append(hit.group(1))
    return out


def _below(path: str, mount: str) -> bool:
    return mount == "/" or path == mount or path.startswith(mount.rstrip("/") + "/")


def dflash_mount_expect(found: list, recorded: dict, declared: dict) -> list:
    """What each bind-mount source must be on: [{path, target, fstype, now, now_fstype, missing}].

    `found`: [{path (resolved), target, fstype}] as `findmnt -T` reads it now; `recorded`: the last
    drop-in's (dflash_mount_record); `declared`: {path: mount point} from the inventory. A declared
    mount point wins; else the recorded one holds unless the path now sits on a mount below it (a new
    share mounted there is an upgrade); it is never downgraded to the filesystem under an unmounted
    share. `missing`: the expected mount is not where the path is now."""
    out = []
    for f in found:
        want_target = (declared or {}).get(f.get("given")) or (declared or {}).get(f["path"])
        want_fstype = f["fstype"] if want_target in (None, f["target"]) else "?"
        rec = (recorded or {}).get(f["path"])
        if want_target is None and rec and rec["target"] is None:
            if rec["fstype"] != f["fstype"]:
                want_target, want_fstype = "its %s share" % rec["fstype"], rec["fstype"]
            rec = None
        if want_target is None and rec and not (_below(f["target"], rec["target"]) and f["target"] != rec["target"]):
            want_target, want_fstype = rec["target"], rec["fstype"]
        if want_target is None:
            want_target = f["target"]
        out.append({"path": f["path"], "target": want_target, "fstype": want_fstype, "now": f["target"],
                    "now_fstype": f["fstype"], "missing": want_target != f["target"]})
    return out


class FilterModule:
    def filters(self):
        return {
            "dflash_mount_record": dflash_mount_record,
            "dflash_mount_expect": dflash_mount_expect,
            "dflash_found_mounts": dflash_found_mounts,
            "dflash_pve_storages": dflash_pve_storages,
            "dflash_keep_mount_opts": dflash_keep_mount_opts,
            "dflash_char_majors": dflash_char_majors,
            "dflash_nvidia_majors": dflash_nvidia_majors,
            "dflash_gpu_device_nodes": dflash_gpu_device_nodes,
            "dflash_nvidia_lxc_lines": dflash_nvidia_lxc_lines,
            "dflash_nvidia_dev_entries": dflash_nvidia_dev_entries,
            "dflash_dev_entries": dflash_dev_entries,
            "dflash_pct_config": dflash_pct_config,
            "dflash_pct_pending": dflash_pct_pending,
            "dflash_ct_root_ids": dflash_ct_root_ids,
            "dflash_workspace_owner": dflash_workspace_owner,
            "dflash_stale_lines": dflash_stale_lines,
            "dflash_stale_dev_keys": dflash_stale_dev_keys,
            "dflash_place_dev_entries": dflash_place_dev_entries,
            "dflash_same_opts": dflash_same_opts,
            "dflash_conf_edit": dflash_conf_edit,
            "dflash_proc_limit": dflash_proc_limit,
        }
