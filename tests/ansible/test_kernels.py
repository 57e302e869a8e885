"""roles/dflash_trainer/tasks/kernels.yml (issue 39 item 6): the fast kernels of a hybrid target
(flash-linear-attention, pinned) go into the trainer's venv on a GPU node only, where torch is a
CUDA build; a CPU build (the stand-in) gets none, so nothing built for CUDA is pulled; an optional
kernel that does not build (causal-conv1d) is reported and the deploy goes on.

The real tasks run under ansible-playbook on localhost; the venv's python is a recorder standing in
for pip (it logs its argv, and fails for causal-conv1d as a node without nvcc would)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def run(tmp_path, cuda: str):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    log = tmp_path / "pip.log"
    log.write_text("")
    (venv / "bin" / "python").write_text(
        f"#!/bin/sh\necho \"$*\" >> {log}\n"
        "case \"$*\" in *causal-conv1d*) echo 'error: nvcc was not found' >&2; exit 1 ;; esac\n")
    (venv / "bin" / "python").chmod(0o755)
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable,
                      "dflash_trainer_venv": str(venv), "dflash_trainer_home": str(tmp_path),
                      "dflash_trainer_gpu_optional_packages": ["causal-conv1d==1.7.0"],
                      "_dflash_trainer_cuda": {"stdout": json.dumps({"cuda": cuda})}},
             "tasks": [{"ansible.builtin.include_role": {"name": "dflash_trainer", "tasks_from": "kernels"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    r = subprocess.run(["ansible-playbook", "-i", "localhost,", str(tmp_path / "play.yml")],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    return r, re.sub(r"\s+", " ", r.stdout + r.stderr), log.read_text().splitlines()


def test_a_gpu_node_gets_the_pinned_kernels_and_goes_on_without_an_optional_one_that_does_not_build(tmp_path):
    r, out, calls = run(tmp_path, "12.8")
    assert r.returncode == 0, out[-3000:]
    assert calls[0].startswith("-m pip install") and calls[0].endswith(
        f"--constraint {tmp_path}/constraints.txt flash-linear-attention==0.6.0")
    assert "--no-build-isolation" in calls[1] and calls[1].endswith("causal-conv1d==1.7.0")
    assert "causal-conv1d==1.7.0 did not install" in out and "nvcc was not found" in out


def test_a_cpu_build_of_torch_gets_no_kernels(tmp_path):
    r, out, calls = run(tmp_path, "")
    assert r.returncode == 0, out[-3000:]
    assert calls == []


def test_the_kernels_are_pinned_and_the_production_inventory_says_what_the_target_needs():
    defaults = yaml.safe_load((REPO / "roles/dflash_trainer/defaults/main.yml").read_text())
    assert defaults["dflash_trainer_gpu_packages"] == ["flash-linear-attention==0.6.0"]
    assert all(re.fullmatch(r"[\w.-]+==[\w.]+", p) for p in defaults["dflash_trainer_gpu_packages"])
    weights = yaml.safe_load((REPO / "roles/dflash_weights/defaults/main.yml").read_text())
    assert weights["dflash_weights_name"] == "Qwen3.6-27B"
    prod = yaml.safe_load((REPO / "inventory/production/group_vars/dflash_containers/dflash.yml").read_text())
    assert "causal-conv1d==1.7.0" in prod.get("dflash_trainer_gpu_optional_packages", [])
