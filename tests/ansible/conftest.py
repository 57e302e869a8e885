"""Fixtures of the Ansible tests: the production templates, rendered once for every module that reads them."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PLAYBOOK = """
- name: Render the dflash templates with the inventory's values
  hosts: ct200
  gather_facts: false
  tasks:
    - name: Load the weights role's defaults
      ansible.builtin.include_role:
        name: dflash_weights
        tasks_from: noop
        public: true
    - name: Load the service role (its flag check runs the trainer's own rules)
      ansible.builtin.include_role:
        name: dflash_service
        tasks_from: validate
        public: true
    - name: Render
      ansible.builtin.template:
        src: "{{ repo }}/roles/{{ item.role }}/templates/{{ item.src }}"
        dest: "{{ out }}/{{ item.dest }}"
        mode: "0644"
      loop:
        - {role: dflash_service, src: run.sh.j2, dest: run.sh}
        - {role: dflash_service, src: dflash.service.j2, dest: dflash.service}
        - {role: dflash_service, src: dflash.env.j2, dest: dflash.env}
        - {role: dflash_weights, src: dflash-stage-weights.service.j2, dest: dflash-stage-weights.service}
"""


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    """The production inventory's run.sh, dflash.service, dflash.env and the staging unit, rendered by Ansible
    once for the session (test_render.py and test_gpu_check.py read them; no test writes there)."""
    ansible_runner = pytest.importorskip("ansible_runner")
    work = tmp_path_factory.mktemp("render")
    out = work / "out"
    out.mkdir()
    (work / "project").mkdir()
    (work / "project" / "render.yml").write_text(PLAYBOOK)
    env = {
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "WANDB_API_KEY": "",
    }
    r = ansible_runner.run(
        private_data_dir=str(work),
        playbook="render.yml",
        inventory=str(REPO / "inventory" / "production"),
        extravars={
            "repo": str(REPO),
            "out": str(out),
            # Render on the controller instead of through pct on the real node.
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
        },
        envvars=env,
        quiet=True,
    )
    assert r.rc == 0, r.stdout.read()[-4000:]
    return out
