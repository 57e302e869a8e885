"""STAND-IN for the Proxmox node's systemd, as far as CT starts and stops see it (tests/standin/pve_api.py
uses it; this is NOT systemd).

PVE 8 starts a CT with `systemctl start pve-container@<vmid>` (pve-container's vm_start), so the drop-ins the
node has for that unit act on every start: here as systemd loaded them at its last `daemon-reload`
(PVE_STANDIN_SYSTEMD_DIR, PVE_STANDIN_FSTAB, PVE_STANDIN_FAILED_MOUNTS). pve-container@.service has
DefaultDependencies=no: only a Requires= (RequiresMountsFor=) on a mount pulls a CT's stop into that
mount's stop, with the unit's ExecStop (lxc-stop, 60 s, then a kill) instead of pve-guests' `down=`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess


def mount_unit(path: str) -> str:
    """systemd-escape --path --suffix=mount PATH."""
    r = subprocess.run(["systemd-escape", "--path", "--suffix=mount", "--", path], capture_output=True, text=True)
    return r.stdout.strip()


def fstab_mounts() -> list:
    """The node's mounts that have a unit file at boot (its /etc/fstab): PVE_STANDIN_FSTAB, colon-separated
    mount points. A share mounted by hand or by a PVE storage has none."""
    return [m.rstrip("/") or "/" for m in os.environ.get("PVE_STANDIN_FSTAB", "").split(":") if m]


def unit_deps(vmid: int) -> dict:
    """What pve-container@<vmid>.service's drop-ins (PVE_STANDIN_SYSTEMD_DIR; unset: none) say, as systemd
    loads them at its last daemon-reload (PVE_STANDIN_SYSTEMD_DIR/.loaded, written by `pve_api.py
    systemctl daemon-reload`; a drop-in written after it is not seen yet): {requires, wants, after: [unit],
    exec_start_pre: [line]}. RequiresMountsFor=P is Requires= and After= on the mount unit of P and of
    every mount above it that has a unit file (systemd.unit(5))."""
    out = {"requires": [], "wants": [], "after": [], "exec_start_pre": []}
    base = os.environ.get("PVE_STANDIN_SYSTEMD_DIR")
    if not base:
        return out
    try:
        with open(os.path.join(base, ".loaded")) as f:
            loaded = json.load(f)
    except (OSError, ValueError):
        loaded = {}
    unit = f"pve-container@{vmid}.service"
    lines = []
    for d in ("pve-container@.service.d", f"{unit}.d"):
        for name, text in sorted((loaded.get(d) or {}).items()):
            lines += [x.strip() for x in text.splitlines() if "=" in x and not x.lstrip().startswith(("#", ";"))]
    fstab = fstab_mounts()
    for line in lines:
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip().replace("%%", "%")
        if key == "RequiresMountsFor":
            for path in shlex.split(value):
                for m in fstab:
                    if m == "/" or path == m or path.startswith(m + "/"):
                        out["requires"].append(mount_unit(m))
                        out["after"].append(mount_unit(m))
        elif key in ("Requires", "Wants", "After"):
            out[key.lower()] += value.split()
        elif key == "ExecStartPre":
            out["exec_start_pre"].append(value)
    return out


def daemon_reload(base: str) -> None:
    """`systemctl daemon-reload`: systemd reads the unit files and drop-ins anew; until then a changed
    drop-in has no effect (the stand-in keeps what it loaded in <systemd dir>/.loaded)."""
    loaded = {}
    for d in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if d.endswith(".service.d") and os.path.isdir(os.path.join(base, d)):
            loaded[d] = {}
            for name in sorted(os.listdir(os.path.join(base, d))):
                if name.endswith(".conf"):
                    with open(os.path.join(base, d, name)) as f:
                        loaded[d][name] = f.read()
    with open(os.path.join(base, ".loaded"), "w") as f:
        json.dump(loaded, f)


def start_unit(vmid: int, log) -> None:
    """pve-container's vm_start runs `systemctl start pve-container@<vmid>`: the drop-ins systemd loaded for
    that unit act as systemd makes them act, before LXC starts. A Requires= or Wants= mount unit is started
    first; one listed in PVE_STANDIN_FAILED_MOUNTS (colon-separated mount points that fail to mount, e.g. an
    fstab NFS share whose server is down) fails: under Requires= the start fails with systemd's message,
    under Wants= the start goes on. Requires= on a mount with no unit file (not in PVE_STANDIN_FSTAB and not
    mounted) fails as "not found". ExecStartPre=: run here, on the node; a failure fails the start (its
    stderr, which PVE sends to /run/pve/ct-<vmid>.stderr and the journal, is logged to the task and quoted)."""
    deps = unit_deps(vmid)
    unit = f"pve-container@{vmid}.service"
    failed = {mount_unit(os.path.realpath(m)) for m in os.environ.get("PVE_STANDIN_FAILED_MOUNTS", "").split(":") if m}
    known = {mount_unit(m) for m in fstab_mounts()}
    with open("/proc/self/mounts") as f:
        known |= {mount_unit(line.split()[1].encode().decode("unicode_escape")) for line in f}
    for dep in deps["requires"]:
        if dep.endswith(".mount") and dep not in known:
            raise RuntimeError(f"Failed to start {unit}: Unit {dep} not found.")
        if dep in failed:
            raise RuntimeError(f"A dependency job for {unit} failed. See 'journalctl -xe' for details.")
    for dep in deps["wants"]:
        if dep in failed:
            log(f"{dep}: mount failed (Wants= of {unit}: the start goes on)")
    for value in deps["exec_start_pre"]:
        ignore = value.startswith("-")
        try:
            r = subprocess.run(shlex.split(value.lstrip("-")), capture_output=True, text=True)
        except OSError as e:            # systemd: status=203/EXEC
            r = subprocess.CompletedProcess(value, 203, "", f"{unit}: Failed to execute {value.lstrip('-')}: {e}")
        if r.returncode != 0 and not ignore:
            for x in r.stderr.splitlines():
                log(f"{unit}: {x}")
            raise RuntimeError(f"Job for {unit} failed because the control process exited with error code."
                               f" (journal: {r.stderr.strip()})")


def stop_mount(node, mount: str, log) -> list:
    """A stop job for the mount unit of `mount` (`systemctl stop|restart`, or a node's shutdown, when
    umount.target stops every mount): systemd propagates it to every unit that Requires= it, so each running
    CT whose pve-container@ unit does is stopped by that unit's ExecStop (pve-container-stop-wrapper:
    lxc-stop with its default 60 s, then a kill). Wants= and After= propagate nothing (After= only orders
    the mount's own stop after the CT's). -> [vmid] stopped this way."""
    unit, hit = mount_unit(mount), []
    for vmid in node.vmids():
        if node.lxc.state(vmid) == "running" and unit in unit_deps(vmid)["requires"]:
            log(f"pve-container@{vmid}.service: stopped with {unit} (Requires=): lxc-stop, killed after 60 s")
            node.lxc.stop(vmid, 60, True, log)
            hit.append(vmid)
    return hit


def node_shutdown(node, log) -> dict:
    """The node shuts down: umount.target stops every fstab mount, and pve-guests' stop (stopall) shuts each
    running CT down with its `startup: down=` budget (180 s unset), then kills it. pve-container@.service has
    DefaultDependencies=no, so only a Requires= on a mount pulls its stop into the shutdown early, at once,
    with lxc-stop's 60 s instead. -> {vmid: (who stopped it, seconds it was given)}."""
    out = {}
    for m in fstab_mounts():
        for vmid in stop_mount(node, m, log):
            out.setdefault(vmid, (f"stop propagated from {mount_unit(m)}", 60))
    for vmid in node.vmids():
        if node.lxc.state(vmid) == "running":
            down = _split_startup(node.read(vmid)[0].get("startup")).get("down", 180)
            log(f"pve-guests: shutting down CT {vmid} (timeout {down} s)")
            node.lxc.stop(vmid, down, True, log)
            out[vmid] = ("pve-guests", down)
    return out


def _split_startup(value) -> dict:
    return {k: int(v) for k, v in (x.split("=", 1) for x in str(value or "").split(",") if "=" in x)
            if k in ("order", "up", "down")}
