"""README's "First deploy on a real node", read as the runbook it is (issue 52 items 10, 11, 13), and
walked step by step against the PVE API stand-in from a fresh controller venv (issue 52, "Done when").

Every command the walk runs is taken from the README's step, not copied here. A command that only
exists on a real PVE node with GPUs (the NVIDIA driver, `pveam`, `ssh-copy-id root@10.1.2.6`, a node
reboot) is not run: NOT_HERE names each one with the reason, the walk asserts that the README's step
still says it, and a step the walk does not know fails the test. The stand-in node is this machine
(fake LXC: containers are records, nothing boots), reached with a local connection.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SECTION = "## First deploy on a real node"
# What the walk copies into a fresh controller checkout (step 1 makes its .venv there, every run).
CHECKOUT = ("ansible.cfg", "deploy.yml", "restart.yml", "playbooks", "roles", "inventory", "trainer",
            "pyproject.toml", "requirements.txt", "requirements.yml")
VAULT_PASSWORD = "runbook-vault"

# Commands of the runbook that cannot run here, each with why. The walk checks that the step says it.
NOT_HERE = {
    1: {"ssh-copy-id root@10.1.2.6": "there is no node at 10.1.2.6: the stand-in node is this machine, reached "
                                     "with a local connection (ansible_connection: local), so no key to copy",
        "ssh root@10.1.2.6 true": "the same: no SSH to a node here, and so no host key to accept"},
    2: {"nvidia-smi": "no NVIDIA GPU or driver on this machine",
        "apt install proxmox-default-headers": "not a Proxmox node: no Proxmox kernel, and the driver's DKMS "
                                               "build needs its headers",
        "--dkms": "the NVIDIA driver's .run installer: no GPU here",
        "pveam update && pveam available --section system | grep debian-12-standard":
            "pveam exists on a PVE node only; the stand-in node holds the template the README names "
            "(its `local` storage is started with it), as `pveam download` leaves it",
        "pveam download local <that name>": "the same"},
    3: {"scp root@10.1.2.6:/etc/pve/pve-root-ca.pem inventory/production/":
            "no SSH to a node here: the walk copies the stand-in node's CA to where the scp puts it"},
    7: {"pct push 200 NVIDIA-Linux-x86_64-<version>.run /root/nvidia.run":
            "no NVIDIA driver to install: the node has no GPU, and the fake LXC container runs nothing; "
            "the walk checks instead that the role's in-container check names these very commands",
        "pct exec 200 -- sh /root/nvidia.run --no-kernel-module --silent": "the same"},
    8: {"ansible-playbook deploy.yml -J": "stages the weights and installs the trainer inside a booted container; "
                                         "the walk's containers are records (fake LXC). The same playbook runs "
                                         "against a real LXC container in molecule/default (test_molecule_default)"},
    9: {"ls -l /dev/nvidia-uvm": "a node reboot and GPUs: neither here",
        "pct exec 200 -- nvidia-smi -L": "no GPU here, and nothing runs in a fake container",
        "ansible-playbook playbooks/status.yml -J": "asks the trainer that step 8 would have started"},
}


def _section() -> str:
    return (REPO / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]


def _steps() -> dict:
    section = _section().split("\n**", 1)[0]          # the numbered list; NFS etc. follow in bold paragraphs
    parts = re.split(r"\n(\d+)\. ", "\n" + section)
    return {int(n): body for n, body in zip(parts[1::2], parts[2::2])}


def _block(step: str) -> list:
    """The commands of a step's ```bash block, one a line, without their comments."""
    m = re.search(r"```bash\n(.*?)```", step, re.S)
    assert m, step[:300]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in m[1].splitlines() if line.strip()]


def _spans(step: str) -> list:
    """The step's inline code, `...` (a span may wrap across lines)."""
    text = re.sub(r"```.*?```", "", step, flags=re.S)
    return [re.sub(r"\s*\n\s*", " ", x) for x in re.findall(r"`([^`]+)`", text)]


def _one(step: str, prefix: str) -> str:
    found = [x for x in _spans(step) if x.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


def test_step_1_makes_the_venv_on_a_python_ansible_core_accepts_and_copies_the_key():
    step = _steps()[1]
    assert "python3 -m venv .venv && . .venv/bin/activate" in step
    assert "apt install python3-venv" in step                      # Debian's python3 has no venv module
    need = importlib.metadata.metadata("ansible-core")["Requires-Python"]        # the pinned ansible-core's floor
    floor = re.search(r">=\s*(\d+\.\d+)", need).group(1)
    assert f"Python {floor} or later" in step, (need, step[:300])
    assert "ssh-copy-id root@" in step


def test_step_2_installs_the_driver_with_dkms_and_looks_the_template_up():
    step = _steps()[2]
    assert "--dkms" in step and "proxmox-default-headers" in step
    assert "pveam available --section system | grep debian-12-standard" in step
    assert "dflash_provision_ostemplate" in step


def test_the_nfs_paragraph_names_the_store_mount_point_inside_the_workspace():
    """Issue 52 item 1: PVE would make /workspace/models as the node's root, which root_squash refuses."""
    readme = (REPO / "README.md").read_text()
    nfs = readme.split("**NFS (a shared workspace or output directory, several nodes).**", 1)[1].split("\n\n", 1)[0]
    assert "mkdir -p /export/dflash/models && chown 100000:100000 /export/dflash\n/export/dflash/models" in nfs


def test_the_walk_knows_every_step_and_every_command_it_does_not_run_is_in_its_step():
    """A step added to the README, or a command it no longer says, fails here (fast) before the walk."""
    steps = _steps()
    assert sorted(steps) == list(range(1, len(steps) + 1)) == sorted(WALK), sorted(steps)
    for n, commands in NOT_HERE.items():
        text = re.sub(r"\s*\n\s*", " ", steps[n])
        for command in commands:
            assert command in text, (n, command)


# --------------------------------------------------------------------------- the walk

def _bash(script: str, ctx: dict, stdin: str = "", check: bool = True) -> subprocess.CompletedProcess:
    """A README line as the operator types it, in the controller checkout, with the venv step 1
    made active (after step 1) and the node's tools (the `pveum` stand-in) on PATH."""
    activate = ". .venv/bin/activate && " if (ctx["ctl"] / ".venv/bin/activate").exists() else ""
    r = subprocess.run(["bash", "-c", f"set -e\n{activate}{script}"], cwd=ctx["ctl"], env=ctx["env"], input=stdin,
                       capture_output=True, text=True, timeout=900)
    r.text = re.sub(r"\s+", " ", r.stdout + " " + r.stderr)
    if check:
        assert r.returncode == 0, (script, r.text[-4000:])
    return r


def _not_here(n: int, ctx: dict) -> None:
    for command, why in NOT_HERE[n].items():
        ctx["not_run"].append(f"step {n}: `{command}`: {why}")


def step_1(step: str, ctx: dict) -> None:
    """The operator's machine: a fresh venv from the pinned requirements, the pinned collection."""
    lines = _block(step)
    ssh = [x for x in lines if x.startswith("ssh-copy-id")]
    assert ssh == ["ssh-copy-id root@10.1.2.6"], lines
    galaxy = [x for x in lines if x.startswith("ansible-galaxy")]
    rest = [x for x in lines if x not in ssh + galaxy]
    assert rest[0] == "python3 -m venv .venv && . .venv/bin/activate", rest
    _bash("\n".join(rest), ctx)
    py = ctx["ctl"] / ".venv/bin/python"
    floor = re.search(r"Python (\d+)\.(\d+) or later", step).groups()
    assert subprocess.run([py, "-c", f"import sys; assert sys.version_info >= {tuple(map(int, floor))}"]).returncode == 0
    pins = dict(x.split("==") for x in (REPO / "requirements.txt").read_text().split() if "==" in x)
    frozen = _bash("pip freeze --all", ctx).stdout.lower()
    for name, version in pins.items():
        assert f"{name.lower()}=={version}" in frozen, (name, version)
    # the collection: Galaxy, where it can be reached; this CI reaches a package index only
    (line,) = galaxy
    r = _bash(line, ctx, check=False)
    want = yaml.safe_load((REPO / "requirements.yml").read_text())["collections"]
    if r.returncode != 0:
        assert re.search(r"urlopen error|Name or service not known|Temporary failure in name resolution|timed out",
                         r.text), r.text[-2000:]
        ctx["not_run"].append(f"step 1: `{line}`: Galaxy cannot be reached from here (a package index only); "
                              "the walk uses the collection installed at the pinned version instead")
        have = json.loads(subprocess.run([Path(sys.executable).parent / "ansible-galaxy", "collection", "list",
                                          "--format", "json"], capture_output=True, text=True).stdout)
        paths = [p for p, cols in have.items() for c in want if cols.get(c["name"], {}).get("version") == c["version"]]
        assert paths, (want, have)
        ctx["env"]["ANSIBLE_COLLECTIONS_PATH"] = str(Path(paths[0]).parent)
    listed = json.loads(_bash("ansible-galaxy collection list --format json", ctx).stdout)
    for c in want:
        assert c["version"] in {cols[c["name"]]["version"] for cols in listed.values() if c["name"] in cols}, c
    _not_here(1, ctx)


def step_2(step: str, ctx: dict) -> None:
    """The node: driver, template and the weights store. Only the store and the template are the stand-in's."""
    name = re.search(r"where it is not `([^`]+)`", step)[1]
    default = yaml.safe_load((REPO / "roles/dflash_provision/defaults/main.yml").read_text())["dflash_provision_ostemplate"]
    assert default == f"local:vztmpl/{name}" == ctx["template"], (name, default)
    assert "`/srv/dflash/models/<model>` (world-readable" in re.sub(r"\s*\n\s*", " ", step)
    ctx["models"].mkdir(mode=0o755)                 # the store, in this walk's node directory (o+x down to it)
    _not_here(2, ctx)


def step_3(step: str, ctx: dict) -> None:
    """The token and its ACL: the README's pveum lines, verbatim, on the stand-in node."""
    lines = _block(step)
    assert all(x.startswith("pveum ") for x in lines), lines
    r = _bash("\n".join(lines), ctx)
    # the secret is in pveum's box table, the row `value`, as a real node prints it
    ctx["secret"] = re.search(r"^│ value\s+│ (\S+)\s+│$", r.stdout, re.M)[1]
    user_cfg = (ctx["etc"] / "user.cfg").read_text()
    assert "token:root@pam!ansible:0:1::" in user_cfg and user_cfg.count("\nacl:") == 4, user_cfg
    (scp,) = NOT_HERE[3]
    shutil.copy(ctx["state"] / "pve-ssl.pem", ctx["ctl"] / scp.split()[-1] / "pve-root-ca.pem")
    _not_here(3, ctx)


def step_4(step: str, ctx: dict) -> None:
    """The secret in a vault file: `ansible-vault encrypt_string` reads the vault password twice and
    then the secret (stdin); its output, the variable by name, is appended to the file the step names.
    The secret is pasted as most operators paste it, with Enter before ctrl-d: the vault then holds
    it with a newline, which the inventory trims (issue 62 A1; steps 5 and 6 use it)."""
    command = _one(step, "ansible-vault encrypt_string")
    path = ctx["ctl"] / command.split(">> ", 1)[1]
    _bash(command, ctx, stdin=f"{VAULT_PASSWORD}\n{VAULT_PASSWORD}\n{ctx['secret']}\n")
    vault = yaml.safe_load(path.read_text().replace("!vault", ""))
    assert list(vault) == ["vault_dflash_provision_api_token_secret"], path.read_text()
    assert "-J" in step and "--ask-vault-password" in step


def _playbook(step: str, prefix: str, ctx: dict) -> subprocess.CompletedProcess:
    command = _one(step, prefix)
    assert " -J" in command, command                   # the vault password, asked for on stdin
    return _bash(command, ctx, stdin=f"{VAULT_PASSWORD}\n", check=False)


def step_5(step: str, ctx: dict) -> None:
    """What would happen: check mode on a fresh node changes nothing, exits 0, says what it would create,
    and the deploy says what it would do in CT 200 instead of running `pct exec` (the weights preflight)
    into a container that is not there (issue 27 item 1)."""
    r = _playbook(step, "ansible-playbook deploy.yml -J --check --diff", ctx)
    assert r.returncode == 0, r.text[-4000:]
    says = re.search(r"says `(would create CT 200 from) \.\.\.`", step)[1]
    assert f"{says} {ctx['template']}" in r.text, r.text[-3000:]
    assert "CT 200 does not exist on pve-node yet (check mode): once provisioning has created it" in r.text
    assert "would stage the weights into /dev/shm, install the trainer wheel" in r.text
    recap = re.search(r"ct200\s*:\s*ok=\d+\s+changed=(\d+)\s+unreachable=\d+\s+failed=(\d+)", r.stdout)
    assert recap and int(recap[2]) == 0 and int(recap[1]) >= 1, r.text[-3000:]
    assert not (ctx["etc"] / "lxc" / "200.conf").exists()


def step_6(step: str, ctx: dict) -> None:
    """Create the container: CT 200 is made through the token and configured on the node."""
    r = _playbook(step, "ansible-playbook deploy.yml -J --tags provision", ctx)
    assert r.returncode == 0, r.text[-4000:]
    conf = (ctx["etc"] / "lxc" / "200.conf").read_text()
    assert "unprivileged: 1" in conf and "startup: down=1020" in conf, conf
    assert "lxc.prlimit.memlock: unlimited" in conf and f"mp0: {ctx['node'] / 'workspace'},mp=/workspace" in conf
    dropin = ctx["node"] / "systemd" / "pve-container@200.service.d" / "dflash-mounts.conf"
    # the start guard the step describes: every source checked on its own mount, no Requires= on a mount
    text = dropin.read_text()
    assert "ExecStartPre=" in text and not [x for x in text.splitlines() if x.startswith("Requires")], text
    status = subprocess.run([sys.executable, str(ctx["pve_api"]), "pct", "status", "200"], env=ctx["env"],
                            capture_output=True, text=True).stdout
    assert status.strip() == "status: running"
    # no GPU on the stand-in node: the role says so, and skips what the step says about the driver
    assert "NO GPU on pve-node" in r.text
    assert "CT 200: 1 IPv4 address(es); default via 10.1.2.1 dev eth0" in r.text       # the network check ran
    ctx["not_run"].append("step 6: dflash-nvidia-devices.service, persistence mode and the in-container driver "
                          "check: GPU steps, which the role skips on a node without GPUs (it says NO GPU)")


def step_7(step: str, ctx: dict) -> None:
    """NVIDIA userspace: not installed here; the role's in-container check names the step's commands."""
    # the checks inside the container: tasks/container.yml and the GPU part it includes
    role = "".join((REPO / "roles/dflash_node/tasks" / f).read_text() for f in ("container.yml", "container_gpu.yml"))
    for command in NOT_HERE[7]:
        templated = command.replace("200", "{{ dflash_node_vmid }}").replace("<version>", "{{ dflash_node_driver_version }}")
        assert f"`{templated}`" in role, templated
    _not_here(7, ctx)


def step_8(step: str, ctx: dict) -> None:
    assert (REPO / "molecule/default/converge.yml").read_text().count("deploy.yml") >= 1
    _not_here(8, ctx)


def step_9(step: str, ctx: dict) -> None:
    _not_here(9, ctx)


WALK = {1: step_1, 2: step_2, 3: step_3, 4: step_4, 5: step_5, 6: step_6, 7: step_7, 8: step_8, 9: step_9}


def _inventory(ctx: dict) -> None:
    """What step 1 says to put in the inventory (the node's address, how to reach it), for the stand-in:
    inventory/production's hosts reached locally, the node's paths and API port in a group_vars file
    beside provision.yml."""
    prod = ctx["ctl"] / "inventory" / "production"
    py = str(ctx["ctl"] / ".venv/bin/python")
    hosts = yaml.safe_load((prod / "hosts.yml").read_text())
    for group in hosts["all"]["children"].values():
        for host in group["hosts"].values():
            host.update({"ansible_connection": "local", "ansible_python_interpreter": py})
            host.pop("ansible_host", None)
    (prod / "hosts.yml").write_text(yaml.safe_dump(hosts))
    node = ctx["node"]
    (prod / "group_vars" / "dflash_containers" / "standin.yml").write_text(yaml.safe_dump({
        "dflash_provision_api_host": "127.0.0.1", "dflash_provision_api_port": ctx["port"],
        "dflash_provision_api_timeout": 30,
        "dflash_node_pct_command": [sys.executable, str(ctx["pve_api"]), "pct"],
        "dflash_node_pve_conf_dir": str(ctx["etc"] / "lxc"),
        "dflash_node_models_host_path": str(ctx["models"]), "dflash_node_workspace_host_path": str(node / "workspace"),
        "dflash_node_gpus": [], "dflash_node_gpu_required": False,
        "dflash_node_restart_timeout": 10, "dflash_node_systemd_dir": str(node / "systemd"),
        "dflash_node_systemctl_command": [sys.executable, str(ctx["pve_api"]), "systemctl"], "dflash_node_mount_check": str(node / "dflash-mount-check"),
        "dflash_service_target_gpus": "cpu", "dflash_service_drafter_gpus": "cpu"}))


@pytest.fixture()
def walk():
    from tests.pve.test_provision import PVE_API, TEMPLATE, _free_port
    from tests.standin.zipenv import zipcode_env
    if os.geteuid() != 0:
        pytest.skip("the node role chowns the workspace to the CT's root (uid 100000)")
    ctl = Path(tempfile.mkdtemp(prefix="dflash-controller."))
    for name in CHECKOUT:                            # the checkout as it is now, without a venv
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, ctl / name)
    # the node: not under pytest's temp root (0700): the CT's root must search down to the stores
    node = Path(tempfile.mkdtemp(prefix="dflash-runbook."))
    node.chmod(0o711)
    etc, state, bin_ = node / "etc", node / "state", node / "bin"
    for d in (etc, bin_):
        d.mkdir()
    (etc / "user.cfg").write_text("user:root@pam:1:0:::root@pam::\n")
    port = _free_port()
    # the CT's DHCP lease comes 3 s after each start, after basic.target as on a real CT: the network check
    # of step 6 runs as on a real node, and has to wait for it
    node_env = {"PVE_STANDIN_ETC": str(etc), "PVE_STANDIN_LXCPATH": str(node / "lxc"), "PVE_STANDIN_FAKE_LXC": "1",
                "PVE_STANDIN_SYSTEMD_DIR": str(node / "systemd"), "PVE_STANDIN_DHCP_AFTER": "3"}
    (bin_ / "pveum").write_text(f'#!/bin/sh\nexec {sys.executable} {PVE_API} pveum "$@"\n')
    (bin_ / "pveum").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "VIRTUAL_ENV", "PYTHON", "PROXMOX_"))}
    env.update(node_env, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               PATH=f"{bin_}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
    # the module runs of steps 5 and 6 load module_utils' compiled code, not compile it (the same code)
    env = zipcode_env(env, node / "zipcode")
    # the server knows no token but a throwaway one it must be started with; the walk's token comes from
    # step 3's pveum, whose secret the server reads from <etc>/priv/token.cfg as PVE does
    proc = subprocess.Popen([sys.executable, str(PVE_API), "serve", "--port", str(port), "--state-dir", str(state),
                             "--token", "root@pam!standin-start=unused"],
                            env={**os.environ, **node_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if (state / "pve-ssl.pem").exists():
            break
        time.sleep(0.05)
    ctx = {"ctl": ctl, "env": env, "node": node, "etc": etc, "state": state, "port": port, "pve_api": PVE_API,
           "models": node / "models", "template": TEMPLATE, "not_run": []}
    _inventory(ctx)
    yield ctx
    proc.terminate()
    proc.wait(5)
    shutil.rmtree(node, ignore_errors=True)
    shutil.rmtree(ctl, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.provision
def test_first_deploy_walked_step_by_step_against_the_stand_in(walk):
    """Each step of the README's first deploy, in order, as far as the stand-in allows: a fresh venv
    from step 1's commands, step 3's pveum lines on the stand-in node, step 4's vault, steps 5 and 6's
    playbooks run verbatim; what cannot run here is listed with the reason."""
    for n, body in sorted(_steps().items()):
        WALK[n](body, walk)
    print("\nnot run here, and why:\n  " + "\n  ".join(walk["not_run"]))
    assert len(walk["not_run"]) >= sum(len(v) for v in NOT_HERE.values())
