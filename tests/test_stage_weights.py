"""roles/dflash_weights/files/dflash-stage-weights (issue 13, item 8): one staging at a time, and
a model staged before (a changed dflash_weights_name) is pruned, never a directory we did not
stage. Runs the script itself on temporary directories (a small tmpfs for the space check)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "roles" / "dflash_weights" / "files" / "dflash-stage-weights"


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
        time.sleep(1.5)
        assert p.poll() is None and not (tmp_path / "shm" / "A").exists()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "waiting for" in err and json.loads(out)["copied"]


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


def test_a_copy_the_containers_memory_cgroup_cannot_hold_is_refused_before_copying(tmp_path):
    """Issue 27: free room on /dev/shm is not enough; its pages are charged to the container's memory
    cgroup, which also holds the running trainer. A directory tree stands for /sys/fs/cgroup: the
    container's limit is an ancestor of the staging service's cgroup."""
    src = model(tmp_path / "store" / "M", 2)
    ct = tmp_path / "cg" / "ct"
    svc = ct / "system.slice" / "dflash-stage-weights.service"
    svc.mkdir(parents=True)
    for d, limit, current in ((ct, 64 << 20, 63 << 20), (ct / "system.slice", "max", 0), (svc, "max", 0)):
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
    rc, out = stage(src, tmp_path / "shm" / "M", tmp_path, "--cgroup-dir", str(svc))
    assert rc == 2
    assert "not enough memory in the container's cgroup" in out["msg"] and f"memory.current leaves 0.00 GiB ({1 << 20} bytes)" in out["msg"]
    assert not (tmp_path / "shm" / "M").exists()
    (ct / "memory.current").write_text(f"{32 << 20}\n")
    rc, out = stage(src, tmp_path / "shm" / "M", tmp_path, "--cgroup-dir", str(svc))
    assert rc == 0, out
    assert out["cgroup_headroom_bytes"] == 32 << 20
