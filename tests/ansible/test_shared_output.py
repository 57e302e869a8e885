"""The multi-node shared-output check (issue 41 item 6): deploy.yml runs it before the weights are
staged and the trainer installed, and its write is a real one, reported once (a token kept in the
output directory), so a second deploy changes nothing and the check still holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

PLAY = [{"name": "check", "hosts": "dflash_containers", "gather_facts": False,
         "tasks": [{"ansible.builtin.include_role": {"name": "dflash_service", "tasks_from": "shared_output"}}]}]


def _run(tmp_path, dirs):
    hosts = {f"n{i}": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                       "dflash_service_output_dir": str(d)} for i, d in enumerate(dirs)}
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"children": {"dflash_containers": {"hosts": hosts}}}}))
    (tmp_path / "check.yml").write_text(json.dumps(PLAY))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(REPO / "roles"),
               ANSIBLE_NOCOLOR="1", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    r = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
                        str(tmp_path / "check.yml")], capture_output=True, text=True, env=env, cwd=REPO)
    changed = {h: int(c) for h, c in re.findall(r"(n\d)\s*:\s*ok=\d+\s+changed=(\d+)", r.stdout)}
    return r, " ".join((r.stdout + r.stderr).split()), changed


def test_the_token_is_written_once_and_reported_and_a_second_deploy_changes_nothing(tmp_path):
    out = tmp_path / "shared" / "out"                   # node 0 makes the directory itself
    r, text, changed = _run(tmp_path, [out, out])
    assert r.returncode == 0, text[-3000:]
    assert changed["n0"] >= 1                           # the directory and the token: a real write, reported
    token = (out / ".dflash-shared-check").read_text()
    r, text, changed = _run(tmp_path, [out, out])
    assert r.returncode == 0 and changed == {"n0": 0, "n1": 0}, text[-3000:]
    assert (out / ".dflash-shared-check").read_text() == token
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / ".dflash-shared-check").write_text("stale\n")
    r, text, _ = _run(tmp_path, [out, other])
    assert r.returncode != 0 and f"node 1 of the job (n1) does not see node 0's {other} (another file there)" in text


def test_deploy_checks_the_shared_output_before_staging_and_installing():
    plays = yaml.safe_load((REPO / "playbooks/deploy.yml").read_text())
    deploy = next(p for p in plays if p.get("name") == "Deploy the DFlash trainer")
    pre = [t.get("ansible.builtin.include_role", {}).get("tasks_from") for t in deploy["pre_tasks"]]
    assert "shared_output" in pre
    assert [r["role"] for r in deploy["roles"]][:2] == ["dflash_weights", "dflash_trainer"]   # after the check
