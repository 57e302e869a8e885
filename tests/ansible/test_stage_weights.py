"""roles/dflash_weights/files/dflash-stage-weights (issue 13, item 8): one staging at a time, and
a model staged before (a changed dflash_weights_name) is pruned, never a directory we did not
stage. Runs the script itself on temporary directories (a small tmpfs for the space check)."""

from __future__ import annotations

import fcntl
import importlib.machinery
import importlib.util
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "dflash_weights" / "files" / "dflash-stage-weights"
stage_mod = importlib.util.module_from_spec(
    importlib.util.spec_from_loader("dflash_stage_weights", importlib.machinery.SourceFileLoader("dflash_stage_weights", str(SCRIPT))))
stage_mod.__spec__.loader.exec_module(stage_mod)


def model(path: Path, mib: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(os.urandom(mib << 20))
    return path


def stage(src, dest, tmp, *extra, wait=True):
    cmd = [sys.executable, str(SCRIPT), "--source", str(src), "--dest", str(dest), "--margin-bytes", "0",
           "--manifest-dir", str(tmp / "manifests"), "--lock-file", str(tmp / "stage.lock"), *extra]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, json.loads(r.stdout)


def test_changing_the_model_prunes_the_one_staged_before_and_nothing_else(tmp_path):
    shm = tmp_path / "shm"
    a, b = model(tmp_path / "store" / "A", 1), model(tmp_path / "store" / "B", 1)
    assert stage(a, shm / "A", tmp_path)[0] == 0
    (shm / "not-ours").mkdir()
    (shm / "not-ours" / "data").write_text("someone else's")
    rc, res = stage(b, shm / "B", tmp_path, "--check")
    assert rc == 0 and res["would_change"] and res["pruned"] == [str(shm / "A")]
    assert (shm / "A" / "model.safetensors").exists()          # check mode removes nothing
    rc, res = stage(b, shm / "B", tmp_path)
    assert rc == 0 and res["pruned"] == [str(shm / "A")] and res["changed"]
    assert not (shm / "A").exists() and (shm / "B" / "model.safetensors").exists()
    assert (shm / "not-ours" / "data").read_text() == "someone else's"
    rc, res = stage(b, shm / "B", tmp_path)
    assert rc == 0 and not res["changed"] and not res["pruned"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_the_space_preflight_counts_the_model_that_will_be_pruned(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(shm)], check=True)
    try:
        a, b = model(tmp_path / "store" / "A", 4), model(tmp_path / "store" / "B", 4)
        assert stage(a, shm / "A", tmp_path)[0] == 0
        rc, res = stage(b, shm / "B", tmp_path, "--preflight-only", "--no-prune")
        assert rc == 2 and "not enough room" in res["msg"]
        rc, res = stage(b, shm / "B", tmp_path, "--preflight-only")
        assert rc == 0, res["msg"]
        rc, res = stage(b, shm / "B", tmp_path)
        assert rc == 0 and res["pruned"] == [str(shm / "A")], res["msg"]
    finally:
        subprocess.run(["umount", str(shm)], check=False)


def test_a_second_staging_waits_for_the_first(tmp_path):
    src = model(tmp_path / "store" / "A", 1)
    with open(tmp_path / "stage.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)          # the boot-time unit, copying
        p = stage(src, tmp_path / "shm" / "A", tmp_path, wait=False)
        # its first line says it waits (read while the lock is held: a fixed sleep was shorter than the
        # interpreter's start on a loaded host, and the script then found the lock free)
        ready, _, _ = select.select([p.stderr], [], [], 300)
        first = p.stderr.readline() if ready else ""
        assert "waiting for" in first, first
        assert p.poll() is None and not (tmp_path / "shm" / "A").exists()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and json.loads(out)["copied"], first + err


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(), reason="runs the script as nobody")
def test_a_source_file_the_containers_root_cannot_read_fails_the_preflight_naming_it():
    """An unprivileged CT's root is `nobody` to the node's files (issue 13): a weights file of mode 0600 on
    the node cannot be read inside. Played here by running the script as uid 65534 against root's files."""
    import shutil
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="dflash-stage-"))     # not under pytest's 0700 tmp dir
    try:
        top.chmod(0o777)
        src = model(top / "store" / "M", 1)
        for d in (top / "store", src):
            d.chmod(0o755)
        (src / "config.json").chmod(0o644)
        (src / "model.safetensors").chmod(0o600)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, str(SCRIPT),
                            "--source", str(src), "--dest", str(top / "shm" / "M"), "--margin-bytes", "0",
                            "--manifest-dir", str(top / "manifests"), "--lock-file", str(top / "stage.lock")],
                           capture_output=True, text=True)
        res = json.loads(r.stdout)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "cannot read 1 file(s)" in res["msg"] and "model.safetensors" in res["msg"], res["msg"]
        assert "chmod -R a+rX" in res["msg"]
        assert not (top / "shm").exists()                      # nothing copied
    finally:
        shutil.rmtree(top)


def _node_headroom(node_root: Path, vmid: int) -> str:
    """The role's own node-side read (tasks/main.yml), run on a directory tree standing for the
    node's /sys/fs/cgroup."""
    import yaml
    tasks = yaml.safe_load((SCRIPT.parents[1] / "tasks" / "main.yml").read_text())
    argv = next(t for t in tasks if "headroom, from its cgroup on the node" in t["name"])["ansible.builtin.command"]["argv"]
    return subprocess.run([*argv[:4], str(node_root), f"lxc/{vmid}"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_copy_the_containers_memory_cgroup_cannot_hold_is_refused_before_copying(tmp_path):
    """Issues 27 and 41: free room on /dev/shm is not enough; its pages are charged to the
    container's memory cgroup, which also holds the running trainer. PVE's layout: the limit is on
    the node's lxc/<vmid> (lxc.cgroup.dir.container, .inner = ns); inside the container
    /sys/fs/cgroup is the inner `ns` group, whose memory.max is `max`, and the limit is above the
    cgroup namespace's root, out of sight. The role reads the headroom on the node and passes it in."""
    src = model(tmp_path / "store" / "M", 2)
    node_ct = tmp_path / "node" / "sys/fs/cgroup" / "lxc" / "250"       # the node's view
    ct_root = tmp_path / "ct" / "sys/fs/cgroup"                         # the container's view: lxc/250/ns
    svc = ct_root / "system.slice" / "dflash-stage-weights.service"
    svc.mkdir(parents=True)
    node_ct.mkdir(parents=True)
    for d, limit, current in ((node_ct, 64 << 20, 63 << 20), (ct_root, "max", 63 << 20),
                              (ct_root / "system.slice", "max", 0), (svc, "max", 0)):
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
    headroom = _node_headroom(tmp_path / "node" / "sys/fs/cgroup", 250)
    assert headroom == str(1 << 20)
    rc, out = stage(src, tmp_path / "shm" / "M", tmp_path, "--cgroup-dir", str(svc), "--node-headroom-bytes", headroom)
    assert rc == 2, out
    assert "not enough memory in the container's cgroup" in out["msg"] and f"inactive_file) leaves 0.00 GiB ({1 << 20} bytes)" in out["msg"]
    assert not (tmp_path / "shm" / "M").exists()
    (node_ct / "memory.current").write_text(f"{32 << 20}\n")
    rc, out = stage(src, tmp_path / "shm" / "M", tmp_path, "--cgroup-dir", str(svc),
                    "--node-headroom-bytes", _node_headroom(tmp_path / "node" / "sys/fs/cgroup", 250))
    assert rc == 0, out
    assert out["cgroup_headroom_bytes"] == 32 << 20


def test_the_headroom_counts_reclaimable_page_cache_as_room_and_stops_at_memory_high(tmp_path):
    """Issue 52 item 4: memory.current holds the page cache of the weights just read from the
    store, which the kernel reclaims before it refuses a tmpfs page (inactive_file in memory.stat);
    PVE sets memory.high 128 MiB below memory.max and throttles there. Both views, the node's read
    and the script's own walk, count the same way."""
    node_ct = tmp_path / "node" / "lxc" / "250"
    node_ct.mkdir(parents=True)
    (node_ct / "memory.max").write_text(f"{1024 << 20}\n")
    (node_ct / "memory.high").write_text(f"{896 << 20}\n")
    (node_ct / "memory.current").write_text(f"{1000 << 20}\n")
    (node_ct / "memory.stat").write_text(f"anon {100 << 20}\nfile {900 << 20}\nactive_file {100 << 20}\n"
                                         f"inactive_file {800 << 20}\nshmem 0\n")
    want = (896 << 20) - ((1000 << 20) - (800 << 20))
    assert _node_headroom(tmp_path / "node", 250) == str(want)
    assert stage_mod.cgroup_headroom(str(node_ct)) == want
    (node_ct / "memory.high").write_text("max\n")                 # no high: memory.max is the limit
    assert _node_headroom(tmp_path / "node", 250) == str((1024 << 20) - (200 << 20))
    v1 = tmp_path / "v1" / "memory" / "lxc" / "250"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{64 << 20}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{60 << 20}\n")
    (v1 / "memory.stat").write_text(f"cache {50 << 20}\ntotal_inactive_file {40 << 20}\n")
    assert _node_headroom(tmp_path / "v1", 250) == str(44 << 20)


def test_the_node_side_read_takes_cgroup_v1_and_says_when_there_is_no_limit(tmp_path):
    root = tmp_path / "cg"
    assert _node_headroom(root, 250) == f"none: no {root}/lxc/250 on this node"
    v1 = root / "memory" / "lxc" / "250"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{64 << 20}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{60 << 20}\n")
    assert _node_headroom(root, 250) == str(4 << 20)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")        # v1's "no limit"
    assert _node_headroom(root, 250) == f"none: no memory limit on {root}/lxc/250"
