"""The controller (the operator's machine, issue 41 item 2): what it needs is pinned in
requirements.txt (Python) and requirements.yml (collections), README and tests/setup-host.sh
install exactly those, and a controller Python without setuptools (a Python >= 3.12 venv, pipx)
gets one line naming the fix before the wheel build, not pip's traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _pins() -> dict:
    out = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.txt: {line!r} is not pinned with =="
            out[name.lower()] = version
    return out


def _collections_used() -> set:
    """Every collection an FQCN in the roles, playbooks, inventories and molecule scenarios names."""
    used = set()
    for top in ("roles", "playbooks", "inventory", "molecule", "deploy.yml", "restart.yml", "ansible.cfg"):
        for f in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*")):
            if f.is_file() and f.suffix in ("", ".yml", ".yaml", ".cfg", ".j2"):
                for ns, name in re.findall(r"\b([a-z_]+)\.([a-z_]+)\.[a-z_]+\b", f.read_text(errors="ignore")):
                    if ns in ("community", "ansible") and name != "builtin":
                        used.add(f"{ns}.{name}")
    return used


def test_requirements_pin_the_controller_and_the_collections_the_roles_use():
    pins = _pins()
    for need in ("ansible-core", "proxmoxer", "requests", "paramiko", "setuptools", "wheel"):
        assert need in pins, f"requirements.txt lacks {need}"
    cols = yaml.safe_load((REPO / "requirements.yml").read_text())["collections"]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", c["version"]) for c in cols), cols
    assert {c["name"] for c in cols} == _collections_used()     # none missing, none unused
    # the roles' meta says the same ansible-core the pin installs
    core = tuple(int(x) for x in pins["ansible-core"].split(".")[:2])
    for meta in (REPO / "roles").glob("*/meta/main.yml"):
        low = yaml.safe_load(meta.read_text())["galaxy_info"]["min_ansible_version"]
        assert tuple(int(x) for x in str(low).split(".")[:2]) <= core, meta


def test_readme_and_setup_host_install_exactly_the_requirements_files():
    readme = (REPO / "README.md").read_text()
    first = readme.split("## First deploy on a real node", 1)[1].split("\n2. ", 1)[0]
    assert "pip install -r requirements.txt" in first
    assert "ansible-galaxy collection install -r requirements.yml" in first
    assert "community.general" not in first and "ansible.posix" not in first
    setup = (REPO / "tests/setup-host.sh").read_text()
    assert '-r "$REPO/requirements.txt"' in setup and '-r "$REPO/requirements.yml"' in setup
    assert "ansible.posix" not in setup and "community.general" not in setup


def _venv_without_setuptools(tmp_path: Path) -> Path:
    """A venv as Python >= 3.12 makes one, with this venv's packages (ansible-core, ...) but
    no setuptools: the packages are linked in, setuptools and its .pth hook left out."""
    venv = tmp_path / "ctl"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    src = Path(sysconfig.get_paths()["purelib"])
    dst = Path(subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip())
    for entry in src.iterdir():
        if re.match(r"(setuptools|_distutils_hack|pkg_resources|distutils-precedence|wheel)", entry.name):
            continue
        (dst / entry.name).symlink_to(entry)
    return venv


def test_a_controller_without_setuptools_fails_before_the_build_naming_the_fix(tmp_path):
    venv = _venv_without_setuptools(tmp_path)
    py = str(venv / "bin/python")
    assert subprocess.run([py, "-c", "import setuptools"], capture_output=True).returncode == 1
    assert subprocess.run([py, "-c", "import ansible"], capture_output=True).returncode == 0
    (tmp_path / "play.yml").write_text(json.dumps([{
        "hosts": "localhost", "gather_facts": False, "connection": "local",
        "tasks": [{"ansible.builtin.include_role": {"name": "dflash_trainer", "tasks_from": "build"}}]}]))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_PYTHON_INTERPRETER": py}
    r = subprocess.run([py, str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,",
                        str(tmp_path / "play.yml")], capture_output=True, text=True, env=env, cwd=tmp_path)
    out = re.sub(r"\s+", " ", r.stdout + r.stderr)
    assert r.returncode == 2, out[-3000:]
    assert f"{py} (the Python running ansible-playbook) has no setuptools" in out
    assert f"{py} -m pip install -r requirements.txt" in out
    assert "No module named 'setuptools'" not in out          # stopped before pip's own error
    assert "Build | pip wheel the trainer" not in out


def test_ssh_to_the_node_sends_keepalives_through_the_longest_silent_command():
    """Issue 41 item 6: `pct reboot --timeout <stop timeout + 120>` and the unit stop before it run
    over SSH to the node silent for up to 1020 s; ServerAliveInterval keeps the connection alive.
    Read back through ansible-config, as ansible-playbook sees it from the repo root."""
    r = subprocess.run([str(Path(sys.executable).parent / "ansible-config"), "dump", "--only-changed", "-t", "connection",
                        "-f", "json"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")})
    assert r.returncode == 0, r.stderr
    ssh = next(opts for plugin in json.loads(r.stdout) for name, opts in plugin.items() if name == "ssh")
    args = next(o["value"] for o in ssh if o["name"] == "ssh_args")
    interval = int(re.search(r"ServerAliveInterval=(\d+)", args).group(1))
    count = int(re.search(r"ServerAliveCountMax=(\d+)", args).group(1))
    assert 0 < interval <= 60 and interval * count >= 120
    defaults = yaml.safe_load((REPO / "roles/dflash_node/defaults/main.yml").read_text())
    assert "dflash_service_timeout_stop_s | default(900)" in defaults["dflash_node_shutdown_timeout_s"]
