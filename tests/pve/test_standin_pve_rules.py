"""The PVE stand-in's rules where PVE 8 differs from a plain LXC container (issue 52): it must be
no more lenient than PVE, or the roles pass here and break on a node.

- mount points are mounted in key order (rootfs, mp0, mp1, ...), not by path;
- a passed-through device is a node made for the CT (0660, its root's uid/gid) and allowed rw, not rwm;
- `pct config` (and GET .../config) show the pending values; --current 1 the running ones;
- a token may not read the tasks of its user (the user may read its tokens').
"""

from __future__ import annotations

import os
import stat

import pytest

from tests.pve.test_provision import PVE_API, TEMPLATE, _pct, pve_api  # noqa: F401


def _node(tmp_path, acl=None):
    return pve_api.Node("pve", str(tmp_path / "etc"), pve_api.FakeLxc(str(tmp_path / "lxc"), None), [TEMPLATE],
                        ["local", "local-lvm"], acl or pve_api.AccessControl(None))


def test_mount_points_are_mounted_in_key_order_not_by_path(tmp_path):
    """mp0 at /workspace/models and mp1 at /workspace: PVE mounts mp0 first, and mp1 then hides it."""
    node = _node(tmp_path)
    node.write(220, {"hostname": "ct", "mp0": "/srv/models,mp=/workspace/models,ro=1", "mp1": "/srv/ws,mp=/workspace",
                     "mp10": "/srv/data,mp=/data", "mp2": "/srv/ckpt,mp=/ckpt"}, [])
    text = node.lxc_config(220)
    order = [text.index(f"/srv/{x} ") for x in ("models", "ws", "ckpt", "data")]
    assert order == sorted(order), text


def test_a_device_is_a_node_made_for_the_ct_0660_and_allowed_rw(tmp_path):
    (tmp_path / "etc" / "lxc").mkdir(parents=True)
    conf = tmp_path / "etc" / "lxc" / "221.conf"
    conf.write_text("arch: amd64\nhostname: ct221\nmemory: 512\nunprivileged: 1\n"
                    "rootfs: local-lvm:vm-221-disk-0,size=4G\n")
    assert _pct(tmp_path, "set", 221, "-dev0", "/dev/null", "-dev1", "/dev/zero,mode=0600,uid=5,gid=6").returncode == 0
    assert _pct(tmp_path, "start", 221).returncode == 0
    lxc = (tmp_path / "lxc" / "221" / "config").read_text()
    passthrough = tmp_path / "lxc" / "221" / "passthrough"
    assert f"lxc.mount.entry = {passthrough}/dev/null dev/null none bind,create=file 0 0" in lxc
    allows = [line for line in lxc.splitlines() if "devices.allow" in line]
    assert allows and all(line.endswith(" rw") for line in allows), allows
    assert any(line.endswith("c 1:3 rw") for line in allows)
    if os.geteuid() == 0:
        st = (passthrough / "dev" / "null").stat()
        assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_uid, st.st_gid) == (100000, 100000)          # the unprivileged CT's root
        st = (passthrough / "dev" / "zero").stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and (st.st_uid, st.st_gid) == (100005, 100006)


def test_pct_config_shows_the_pending_values_and_current_the_running_ones(tmp_path):
    (tmp_path / "etc" / "lxc").mkdir(parents=True)
    conf = tmp_path / "etc" / "lxc" / "222.conf"
    conf.write_text("arch: amd64\nhostname: ct222\nmemory: 512\ndev0: /dev/null\n"
                    "rootfs: local-lvm:vm-222-disk-0,size=4G\n")
    assert _pct(tmp_path, "start", 222).returncode == 0
    assert _pct(tmp_path, "set", 222, "-dev1", "/dev/zero", "--delete", "dev0").returncode == 0
    assert "[pve:pending]" in conf.read_text()
    shown = _pct(tmp_path, "config", 222).stdout
    assert "dev1: /dev/zero" in shown and "dev0" not in shown and "[pve:pending]" not in shown
    current = _pct(tmp_path, "config", 222, "--current", 1).stdout
    assert "dev0: /dev/null" in current and "dev1" not in current
    node = _node(tmp_path)
    assert node.config(222)[0].get("dev1") == "/dev/zero" and "dev1" not in node.config(222, current=True)[0]


def test_a_token_may_not_read_its_users_tasks(tmp_path):
    acl = pve_api.AccessControl(None)
    acl.parse("user:u@pve:1:0::::::\ntoken:u@pve!t:0:1::\ntoken:u@pve!audit:0:1::\n"
              "acl:1:/nodes/pve:u@pve,u@pve!audit:PVEAuditor:\n")
    node = _node(tmp_path, acl)
    node.tasks["UPID:user"] = {"user": "u@pve"}
    node.tasks["UPID:token"] = {"user": "u@pve!t"}
    with pytest.raises(pve_api.ApiError, match=r"Permission check failed \(/nodes/pve, Sys.Audit\)"):
        node.check_task_access("UPID:user", "u@pve!t")
    node.check_task_access("UPID:token", "u@pve!t")            # its own
    node.check_task_access("UPID:token", "u@pve")              # the user reads its token's
    node.check_task_access("UPID:user", "u@pve!audit")         # Sys.Audit on the node


@pytest.mark.skipif(os.geteuid() != 0, reason="the node's root makes the mount path")
def test_a_bind_mount_is_hot_plugged_as_the_nodes_root_and_root_squash_refuses_it(tmp_path, monkeypatch):
    """PVE hot-plugs `pct set -mpN` on a running CT: it makes the missing mount path as the NODE's
    root (walk_tree_nofollow, mkdirat) in the directory that holds it, here the workspace mount. On
    an NFS export with root_squash that mkdir is refused: the set fails and nothing is written; a
    stopped CT's start fails the same way. PVE_STANDIN_ROOT_SQUASH names such exports."""
    (tmp_path / "etc" / "lxc").mkdir(parents=True)
    store, ws = tmp_path / "store", tmp_path / "ws"
    store.mkdir()
    ws.mkdir()
    os.chown(ws, 100000, 100000)                                  # the CT root's own, as the role makes it
    conf = tmp_path / "etc" / "lxc" / "223.conf"
    conf.write_text(f"arch: amd64\nhostname: ct223\nmemory: 512\nunprivileged: 1\nmp0: {ws},mp=/workspace\n"
                    "rootfs: local-lvm:vm-223-disk-0,size=4G\n")
    assert _pct(tmp_path, "start", 223).returncode == 0
    assert _pct(tmp_path, "set", 223, "-mp1", f"{store},mp=/workspace/models,ro=1").returncode == 0
    made = (ws / "models").stat()
    assert (made.st_uid, made.st_gid) == (0, 0)                   # the node's root, not the CT's
    # the same on a root_squash export: refused, nothing written
    assert _pct(tmp_path, "set", 223, "--delete", "mp1").returncode == 0
    (ws / "models").rmdir()
    monkeypatch.setenv("PVE_STANDIN_ROOT_SQUASH", str(ws))
    before = conf.read_text()
    r = _pct(tmp_path, "set", 223, "-mp1", f"{store},mp=/workspace/models,ro=1")
    assert r.returncode == 2 and f"unable to hotplug mp1: mkdirat {ws}/models failed: Permission denied" in r.stderr
    assert conf.read_text() == before and not (ws / "models").exists()
    # stopped, with the mount in its config: every start fails until the directory is there
    assert _pct(tmp_path, "stop", 223).returncode == 0
    conf.write_text(before.replace("rootfs:", f"mp1: {store},mp=/workspace/models,ro=1\nrootfs:"))
    r = _pct(tmp_path, "start", 223)
    assert r.returncode == 2 and "Permission denied" in r.stderr
    (ws / "models").mkdir()
    os.chown(ws / "models", 100000, 100000)                       # as the NFS server's admin makes it
    assert _pct(tmp_path, "start", 223).returncode == 0
