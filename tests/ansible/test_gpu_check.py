"""The GPU check dflash.service runs before the trainer and the health check runs first (issue 27
items 2 and 3): the container's NVIDIA userspace must be the node's driver version, and the device
files must open read-write as CUDA opens them (nvidia-smi never opens /dev/nvidia-uvm, so a stale
device-cgroup rule or a missing node passed every earlier check). A directory stands for / here.
"""
import subprocess
import sys
from pathlib import Path

from tests.ansible.test_render import unit_settings  # the production unit: conftest.py's rendered

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "roles" / "dflash_service" / "files" / "dflash-gpu-check"
PROC_VERSION = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Tue Jan 14 10:00:00 UTC 2025\n"
                "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def fake_root(tmp_path, kernel="570.124.06", user="570.124.06", gpus=8, skip=()):
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text(PROC_VERSION.format(v=kernel))
    lib = tmp_path / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    if user:
        (lib / f"libnvidia-ml.so.{user}").write_text("")
    (tmp_path / "dev").mkdir()
    for name in ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(gpus)]:
        if name not in skip:
            (tmp_path / "dev" / name).write_text("")     # a file that opens read-write, as a device would
    return tmp_path


def check(root, gpus="0,1,2,3,4,5,6,7"):
    return subprocess.run([sys.executable, str(CHECK), "--root", str(root), "--gpus", gpus],
                          capture_output=True, text=True)


def test_matching_driver_and_openable_devices_pass(tmp_path):
    r = check(fake_root(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "driver 570.124.06 (kernel module and userspace), 8 GPUs open read-write" in r.stdout


def test_a_node_driver_upgrade_is_refused_naming_both_versions_and_the_fix(tmp_path):
    r = check(fake_root(tmp_path, kernel="570.133.20", user="570.124.06"))
    assert r.returncode == 1
    assert ("NVIDIA driver mismatch: the node's kernel module is 570.133.20, this container's userspace is "
            "570.124.06: install NVIDIA-Linux-x86_64-570.133.20.run --no-kernel-module --silent") in r.stderr


def test_no_userspace_in_the_container_says_what_to_install(tmp_path):
    r = check(fake_root(tmp_path, user=None))
    assert r.returncode == 1
    assert "no NVIDIA userspace in this container" in r.stderr and "570.124.06.run --no-kernel-module" in r.stderr


def test_a_missing_nvidia_uvm_fails_where_nvidia_smi_would_pass(tmp_path):
    r = check(fake_root(tmp_path, skip=("nvidia-uvm",)))
    assert r.returncode == 1
    assert "cannot open /dev/nvidia-uvm read-write as CUDA does (missing)" in r.stderr
    assert "nvidia-modprobe -u -c=0" in r.stderr


def test_fewer_gpu_devices_than_the_trainer_uses_fails(tmp_path):
    r = check(fake_root(tmp_path, gpus=5))
    assert r.returncode == 1 and "5 /dev/nvidiaN in the container, the trainer uses 8 GPUs" in r.stderr


def test_a_cpu_run_has_nothing_to_check(tmp_path):
    r = check(tmp_path, gpus="cpu,cpu")
    assert r.returncode == 0 and "CPU run" in r.stdout


def test_the_unit_runs_the_check_before_the_trainer_with_its_gpus(rendered):
    s = unit_settings(rendered / "dflash.service")
    assert s["ExecStartPre"] == ["/usr/bin/python3 /opt/dflash/bin/dflash-gpu-check --gpus 0,1,2,3,4,5,6,7"]
