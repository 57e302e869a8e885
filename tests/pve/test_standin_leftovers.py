"""What a suite run killed mid-way leaves on the host, and the stand-in's next run (root only).

- tests/standin/lxc-stale-cgroups on this host's real cgroup hierarchies: what an LXC monitor killed
  with its run leaves under pve-container's fixed names (lxc.monitor/<vmid>, lxc/<vmid>/ns/...) is
  removed before the next start; a left cgroup that still holds a process is not touched and named; a
  bad vmid is refused in one line. The real lxc-start over such leftovers is the fault suite's setup
  (tests/faults/faultlib.py Standin.leave_stale_cgroups), which also removes a CT 201 the killed run
  left instead of booting it.
- A node's sshd pid file that outlived its sshd names a number another process may hold since: the
  stand-in neither signals nor counts that process as the node's sshd."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tests/standin/lxc-stale-cgroups"
VMID = "298"        # no stand-in uses it (tests/pve/test_standin_vmids.py lists theirs)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroup directories)")


def hierarchies() -> list[Path]:
    mounts = [ln.split() for ln in Path("/proc/self/mounts").read_text().splitlines()]
    return sorted({Path(m[1]) for m in mounts if m[2] in ("cgroup", "cgroup2")})


def tops(h: Path) -> list[Path]:
    return [h / "lxc.monitor" / VMID, h / "lxc" / VMID]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def leftovers():
    """The tree a killed run leaves: the monitor's group and the container's, with the groups systemd
    made inside (as found on this host after a killed suite run), in every hierarchy."""
    made = []
    for h in hierarchies():
        try:
            (h / "lxc.monitor" / VMID).mkdir(parents=True)
            (h / "lxc" / VMID / "ns" / "system.slice" / "dflash.service").mkdir(parents=True)
        except OSError:            # a hierarchy this host does not let root write (read-only mount)
            continue
        made.append(h)
    if not made:
        pytest.skip("no writable cgroup hierarchy")
    yield made
    for h in made:
        for top in tops(h):
            if top.is_dir():
                subprocess.run(["find", str(top), "-depth", "-type", "d", "-exec", "rmdir", "{}", "+"], check=False)


def test_a_killed_runs_cgroups_are_removed_before_the_start(leftovers):
    r = run_tool(VMID)
    assert r.returncode == 0, r.stderr
    removed = [str(top) for h in leftovers for top in tops(h)]
    for top in removed:
        assert not Path(top).exists(), f"{top} left"
    # one line for the CT, naming every group it removed
    lines = r.stderr.splitlines()
    head = f"lxc-stale-cgroups: CT {VMID}: removed {len(removed)} cgroups an earlier run's killed LXC monitor left: "
    assert len(lines) == 1 and lines[0].startswith(head), r.stderr
    assert sorted(lines[0][len(head):].split()) == sorted(removed)
    # nothing left: a second call has nothing to say
    again = run_tool(VMID)
    assert again.returncode == 0 and again.stderr == ""


def test_a_left_cgroup_with_a_process_in_it_is_kept_and_named(leftovers):
    # a process in the container's inner group of one hierarchy (not cpuset v1: it takes a task only
    # once cpuset.cpus and .mems are set)
    h = next(h for h in leftovers if not (h / "cpuset.cpus").exists())
    inner = h / "lxc" / VMID / "ns"
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        (inner / "cgroup.procs").write_text(str(sleeper.pid))
        r = run_tool(VMID)
        assert r.returncode == 1
        busy = [ln for ln in r.stderr.splitlines() if "still holds" in ln]
        assert busy == [f"lxc-stale-cgroups: CT {VMID}: {h / 'lxc' / VMID} still holds processes {sleeper.pid}; not removed"]
        assert inner.is_dir()
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
    for _ in range(50):        # the kernel empties the group once the process is reaped
        if not (inner / "cgroup.procs").read_text().strip():
            break
        time.sleep(0.1)
    assert run_tool(VMID).returncode == 0
    assert not (h / "lxc" / VMID).exists()


@pytest.mark.parametrize("bad", ["", "20x", "../201"])
def test_a_bad_vmid_is_refused_in_one_line(bad):
    r = run_tool(bad) if bad else run_tool()
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "VMID" in r.stderr


def test_a_stale_sshd_pid_file_is_not_a_running_node(tmp_path):
    node = Path("/var/lib/dflash-standin/node-leftover-test")
    shutil.rmtree(node, ignore_errors=True)
    node.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "120"])     # the number the pid file names now belongs to this
    try:
        (node / "sshd.pid").write_text(f"{other.pid}\n")
        env = {**os.environ, "DFLASH_STANDIN_NODE": str(node), "DFLASH_STANDIN_VMID": VMID,
               "DFLASH_STANDIN_LXCPATH": str(tmp_path)}
        st = subprocess.run([str(REPO / "tests/standin/standin.sh"), "status"], env=env, capture_output=True,
                            text=True, timeout=60)
        # (status reads the node's sshd as `up` (HUP or start) and `down` (kill) do: node_sshd; `down` itself
        # is not run here, as it may remove the pct shim that container lanes running beside share)
        assert st.stdout.splitlines() == [f"CT {VMID}: ABSENT", "node sshd: stopped"], st.stdout + st.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        shutil.rmtree(node, ignore_errors=True)
