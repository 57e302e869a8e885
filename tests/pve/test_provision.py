"""Provisioning: the Proxmox VE API stand-in and the node role's GPU / config rendering.

The API stand-in runs here with --fake-lxc (containers are records, nothing boots), so these
checks take seconds; molecule/provision drives the same server with real LXC containers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

requests = pytest.importorskip("requests")

REPO = Path(__file__).resolve().parents[2]
PVE_API = REPO / "tests" / "standin" / "pve_api.py"
TEMPLATE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
TOKEN = ("root@pam", "ansible", "s3cret-for-tests")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pve_api = _load("pve_api", PVE_API)
node_filters = _load("dflash_node_filters", REPO / "roles" / "dflash_node" / "filter_plugins" / "dflash_node.py")
prov_filters = _load("dflash_provision_filters",
                     REPO / "roles" / "dflash_provision" / "filter_plugins" / "dflash_provision.py")

# user.cfg of the stand-in: the fixture's token may do anything a token may (Administrator on /,
# still privilege-separated); "noacl" has no ACL at all; "nosdn" has the role the README documents
# for CT 3xx minus SDN.Use; "shared" is not privilege-separated (root@pam's privileges).
USER_CFG = """user:root@pam:1:0:::root@pam::
token:root@pam!ansible:0:1::
token:root@pam!noacl:0:1::
token:root@pam!nosdn:0:1::
token:root@pam!shared:0:0::
role:DFlashProvision:{privs}:
acl:1:/:root@pam!ansible:Administrator:
acl:1:/vms:root@pam!nosdn:DFlashProvision:
acl:1:/storage:root@pam!nosdn:DFlashProvision:
"""
ROLE_PRIVS = prov_filters.dflash_token_role_privs(
    prov_filters.dflash_token_acl(300, "local-lvm", TEMPLATE, {"net0": "name=eth0,bridge=vmbr0,ip=dhcp"}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A stand-in API on a free port: (session with the token, base url, env for its pct face)."""
    tmp = tmp_path_factory.mktemp("pve")
    port = _free_port()
    env = {**os.environ, "PVE_STANDIN_ETC": str(tmp / "etc"), "PVE_STANDIN_LXCPATH": str(tmp / "lxc"),
           "PVE_STANDIN_FAKE_LXC": "1"}
    (tmp / "etc").mkdir()
    (tmp / "etc" / "user.cfg").write_text(USER_CFG.format(privs=",".join(ROLE_PRIVS)))
    proc = subprocess.Popen(
        [sys.executable, str(PVE_API), "serve", "--port", str(port), "--state-dir", str(tmp / "state"),
         "--token", "%s!%s=%s" % TOKEN, "--token", "root@pam!noacl=n", "--token", "root@pam!nosdn=n",
         "--token", "root@pam!shared=n", "--token", "root@pam!unlisted=n"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"https://127.0.0.1:{port}/api2/json"
    cert = tmp / "state" / "pve-ssl.pem"
    s = requests.Session()
    s.headers["Authorization"] = "PVEAPIToken=%s!%s=%s" % TOKEN
    s.verify = str(cert)
    s.trust_env = False     # else REQUESTS_CA_BUNDLE from the environment overrides s.verify
    for _ in range(100):
        try:
            if cert.exists() and s.get(base + "/version", timeout=1).ok:
                break
        except requests.exceptions.ConnectionError:
            pass
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("stand-in did not come up: " + proc.stderr.read().decode())
    yield s, base, env
    proc.terminate()
    proc.wait(5)


def _wait(s, base, upid):
    for _ in range(100):
        st = s.get(f"{base}/nodes/pve/tasks/{upid}/status").json()["data"]
        if st["status"] == "stopped":
            return st
        time.sleep(0.05)
    raise AssertionError("task did not finish")


def _create(s, base, vmid, **extra):
    params = {"vmid": vmid, "ostemplate": TEMPLATE, "hostname": f"ct{vmid}", "cores": 2, "memory": 1024,
              "swap": 256, "rootfs": "local-lvm:4", "net0": "name=eth0,bridge=vmbr0,ip=dhcp",
              "features": "nesting=1", "onboot": 1, "unprivileged": 1, **extra}
    r = s.post(f"{base}/nodes/pve/lxc", data=params)
    assert r.status_code == 200, r.reason
    return _wait(s, base, r.json()["data"])


# ------------------------------------------------------------------ authentication and TLS

def test_serves_https_with_a_certificate_that_verifies_for_127_0_0_1(api):
    s, base, _ = api
    data = s.get(base + "/version").json()["data"]
    assert data["version"].startswith("8.") and data["repoid"] == "standin"


@pytest.mark.parametrize("header, reason", [
    (None, "No ticket"),
    ("PVEAPIToken=root@pam!ansible=wrong", "invalid token value!"),
    ("PVEAPIToken=root@pam!other=s3cret-for-tests", "no such token 'other' for user 'root@pam'"),
])
def test_a_missing_or_wrong_token_is_refused_with_401_and_a_pve_like_reason(api, header, reason):
    s, base, _ = api
    headers = {"Authorization": header} if header else {}
    r = requests.get(base + "/version", headers=headers, verify=s.verify)
    assert r.status_code == 401
    assert r.reason == reason
    # the lifecycle endpoints are guarded too, not only /version
    assert requests.get(base + "/cluster/resources", headers=headers, verify=s.verify).status_code == 401


# ------------------------------------------------------------------ container lifecycle

def test_create_stores_what_pve_stores_and_lists_the_container(api):
    s, base, _ = api
    assert _create(s, base, 301)["exitstatus"] == "OK"
    cfg = s.get(f"{base}/nodes/pve/lxc/301/config").json()["data"]
    assert cfg["rootfs"] == "local-lvm:vm-301-disk-0,size=4G"      # allocated, as PVE does
    assert cfg["net0"].startswith("name=eth0,bridge=vmbr0,ip=dhcp,hwaddr=")
    assert (cfg["cores"], cfg["memory"], cfg["swap"], cfg["onboot"]) == (2, 1024, 256, 1)
    assert cfg["features"] == "nesting=1" and cfg["hostname"] == "ct301" and "digest" in cfg
    res = s.get(base + "/cluster/resources", params={"type": "vm"}).json()["data"]
    assert {"id": "lxc/301", "vmid": 301, "node": "pve", "type": "lxc", "status": "stopped"}.items() \
        <= next(r for r in res if r["vmid"] == 301).items()
    assert any(c["vmid"] == 301 for c in s.get(base + "/nodes/pve/lxc").json()["data"])
    assert s.get(base + "/cluster/nextid").json()["data"] != "301"


def test_create_refuses_an_existing_vmid_and_an_unknown_template(api):
    s, base, _ = api
    _create(s, base, 302)
    r = s.post(f"{base}/nodes/pve/lxc", data={"vmid": 302, "ostemplate": TEMPLATE})
    assert r.status_code == 500 and "already exists" in r.reason
    r = s.post(f"{base}/nodes/pve/lxc", data={"vmid": 303, "ostemplate": "local:vztmpl/nope.tar.zst"})
    assert r.status_code == 500 and "does not exist" in r.reason
    # the module checks ostemplate against the storage content first
    content = s.get(f"{base}/nodes/pve/storage/local/content").json()["data"]
    assert [c["volid"] for c in content] == [TEMPLATE]


def test_start_shutdown_stop_and_destroy_are_tasks(api):
    s, base, _ = api
    _create(s, base, 304)
    cur = f"{base}/nodes/pve/lxc/304/status/current"
    assert _wait(s, base, s.post(f"{base}/nodes/pve/lxc/304/status/start").json()["data"])["exitstatus"] == "OK"
    assert s.get(cur).json()["data"]["status"] == "running"
    assert s.delete(f"{base}/nodes/pve/lxc/304").status_code == 500        # running: refused
    _wait(s, base, s.post(f"{base}/nodes/pve/lxc/304/status/shutdown", data={"timeout": 5}).json()["data"])
    assert s.get(cur).json()["data"]["status"] == "stopped"
    _wait(s, base, s.post(f"{base}/nodes/pve/lxc/304/status/start").json()["data"])
    _wait(s, base, s.post(f"{base}/nodes/pve/lxc/304/status/stop").json()["data"])
    assert s.get(cur).json()["data"]["status"] == "stopped"
    assert _wait(s, base, s.delete(f"{base}/nodes/pve/lxc/304").json()["data"])["exitstatus"] == "OK"
    r = s.get(f"{base}/nodes/pve/lxc/304/config")
    assert r.status_code == 500 and "does not exist" in r.reason


def test_config_put_updates_and_deletes_keys(api):
    s, base, _ = api
    _create(s, base, 305)
    assert s.put(f"{base}/nodes/pve/lxc/305/config", data={"memory": 2048, "delete": "swap"}).ok
    cfg = s.get(f"{base}/nodes/pve/lxc/305/config").json()["data"]
    assert cfg["memory"] == 2048 and "swap" not in cfg


@pytest.mark.parametrize("params, status, words", [
    ({"mp0": "/srv/models,mp=/workspace/models,ro=1"}, 403,
     "Permission check failed (mount point type bind is only allowed for root@pam)"),
    ({"dev0": "/dev/nvidia0"}, 403, "Permission check failed (configuring device passthrough is only allowed for root@pam)"),
    ({"features": "nesting=1,mount=nfs"}, 403,
     "Permission check failed (changing feature flags (except nesting) is only allowed for root@pam)"),
    ({"lxc.mount.entry": "tmpfs dev/shm tmpfs size=1G 0 0"}, 400, "Parameter verification failed."),
])
def test_tokens_may_not_set_what_pve_reserves_for_root(api, params, status, words):
    """Why bind mounts, GPUs and /dev/shm live in the node-side role."""
    s, base, _ = api
    _create(s, base, 306) if s.get(f"{base}/nodes/pve/lxc/306/config").status_code != 200 else None
    r = s.put(f"{base}/nodes/pve/lxc/306/config", data=params)
    assert r.status_code == status and words in r.reason


def test_the_pct_face_sets_root_only_keys_that_the_api_then_reports(api):
    s, base, env = api
    _create(s, base, 307)
    pct = [sys.executable, str(PVE_API), "pct"]
    subprocess.run(pct + ["set", "307", "-mp1", "/srv/models,mp=/workspace/models,ro=1"], env=env, check=True)
    out = subprocess.run(pct + ["config", "307"], env=env, check=True, capture_output=True, text=True).stdout
    assert "mp1: /srv/models,mp=/workspace/models,ro=1" in out
    assert s.get(f"{base}/nodes/pve/lxc/307/config").json()["data"]["mp1"] == "/srv/models,mp=/workspace/models,ro=1"
    bad = subprocess.run(pct + ["config", "399"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_the_lxc_config_mounts_parents_first_and_appends_raw_keys(tmp_path):
    lxc = pve_api.FakeLxc(str(tmp_path / "lxc"), None)
    node = pve_api.Node("pve", str(tmp_path / "etc"), lxc, [TEMPLATE], ["local"])
    node.write(201, {"hostname": "ct", "memory": 1024, "swap": 0, "cores": 1,
                     "mp1": "/srv/models,mp=/workspace/models,ro=1", "mp0": "/srv/ws,mp=/workspace"},
               [["lxc.mount.entry", "tmpfs dev/shm tmpfs rw,size=256M,create=dir 0 0"]])
    text = node.lxc_config(201)
    ws = text.index("/srv/ws workspace none bind,create=dir 0 0")
    models = text.index("/srv/models workspace/models none bind,create=dir,ro 0 0")
    assert ws < models < text.index("lxc.mount.entry = tmpfs dev/shm")
    assert str(1024 * 1048576) in text and "lxc.net.0.type = empty" in text
    # pve-container's cgroup layout: limits on lxc/<vmid>, the container in its inner `ns` group
    # (issue 41 item 5: inside, memory.max is `max`); the shim stand-in (standin.sh) says the same
    for line in ("lxc.cgroup.relative = 0", "lxc.cgroup.dir.container = lxc/201", "lxc.cgroup.dir.container.inner = ns"):
        assert line in text
    standin = (REPO / "tests/standin/standin.sh").read_text()
    assert "lxc.cgroup.dir.container = lxc/$VMID" in standin and "lxc.cgroup.dir.container.inner = ns" in standin


# ------------------------------------------------------------------ node role: GPU lines

PROC_DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
234 nvidia-nvswitch
237 nvidia-uvm
238 nvidia-caps

Block devices:
  7 loop
237 blkext
"""


def test_gpu_lines_take_the_uvm_major_from_proc_devices():
    lines = node_filters.dflash_nvidia_lxc_lines(PROC_DEVICES, [0, 5])
    assert lines[:2] == ["lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 237:* rwm"]
    mounts = [line.split()[1] for line in lines[2:]]
    assert mounts == ["/dev/nvidia0", "/dev/nvidia5", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert all(line.endswith("none bind,optional,create=file") for line in lines[2:])
    other = PROC_DEVICES.replace("237 nvidia-uvm", "511 nvidia-uvm")
    assert "lxc.cgroup2.devices.allow: c 511:* rwm" in node_filters.dflash_nvidia_lxc_lines(other, [0])


# /proc/devices of a real H200 host (driver 580.159.04): "nvidia" and "nvidiactl" share 195,
# nvidia-uvm got 238 there; and the nvidia-smi query line the role parses.
PROC_DEVICES_H200 = """Character devices:
  1 mem
136 pts
195 nvidia
195 nvidiactl
203 cpu/cpuid
238 nvidia-uvm
239 nvidia-nvswitch
240 nvidia-nvlink
241 nvidia-caps
242 nvidia-caps-imex-channels

Block devices:
  7 loop
"""


def test_majors_of_a_real_driver_580_host():
    assert node_filters.dflash_nvidia_majors(PROC_DEVICES_H200) == {"nvidia": 195, "nvidia-uvm": 238}
    assert "lxc.cgroup2.devices.allow: c 238:* rwm" in node_filters.dflash_nvidia_lxc_lines(PROC_DEVICES_H200, [0])


def test_a_node_without_nvidia_uvm_loaded_fails_clearly():
    with pytest.raises(ValueError, match="nvidia-uvm"):
        node_filters.dflash_nvidia_majors("Character devices:\n195 nvidia\n")


def test_gpus_pass_through_as_dev_entries_by_default():
    """PVE >= 8.1 `devN:` entries are looked up at every container start; the `lxc` lines freeze the
    majors /proc/devices had when the role ran (issue 27 item 3)."""
    import yaml
    defaults = yaml.safe_load((REPO / "roles/dflash_node/defaults/main.yml").read_text())
    assert defaults["dflash_node_gpu_passthrough"] == "dev"
    prod = yaml.safe_load((REPO / "inventory/production/group_vars/dflash_containers/provision.yml").read_text())
    assert prod.get("dflash_node_gpu_passthrough", "dev") == "dev"


def test_lxc_lines_carry_a_prestart_hook_that_refuses_a_moved_major(tmp_path):
    hook = REPO / "roles/dflash_node/files/dflash-nvidia-prestart"
    lines = node_filters.dflash_nvidia_lxc_lines(PROC_DEVICES, [0], hook=str(hook))
    assert lines[-1] == (f"lxc.hook.pre-start: {hook} 195 237 "
                         "/dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools")
    # a stale hook line (other majors) is replaced, as the other GPU lines are
    stale = lines[-1].replace(" 237 ", " 511 ")
    assert node_filters.dflash_stale_lines([stale], lines) == [stale]

    def run(proc_devices, *devices):
        # as LXC runs a hook (lxc.hook.version 0, src/lxc/utils.c run_script_argv): through a shell,
        # `exec <the line's value> <name> lxc pre-start`
        (tmp_path / "devices").write_text(proc_devices)
        value = " ".join([str(hook), "195", "237", *devices])
        return subprocess.run(["/bin/sh", "-c", f"exec {value} 200 lxc pre-start"], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "LXC_NAME": "200",
                                   "DFLASH_PROC_DEVICES": str(tmp_path / "devices")})
    assert run(PROC_DEVICES, "/dev/null").returncode == 0          # /dev/null: a character device that exists
    moved = run(PROC_DEVICES.replace("237 nvidia-uvm", "236 nvidia-uvm"), "/dev/null")
    assert moved.returncode == 1
    assert ("CT 200: the nvidia-uvm major is 236 now, the container config allows 237: "
            "run playbooks/provision.yml") in moved.stderr
    gone = run(PROC_DEVICES, "/dev/nvidia-uvm-not-here")
    assert gone.returncode == 1 and "/dev/nvidia-uvm-not-here is missing on the node" in gone.stderr
    # the name, section and hook type LXC appends are not device paths (issue 41 item 1)
    assert "200 is missing" not in gone.stderr
    assert run(PROC_DEVICES, "/dev/null", "/dev/zero").returncode == 0
    # without LXC's words (lxc.hook.version 1 passes them in the environment) every word is a device
    assert subprocess.run(["sh", str(hook), "195", "237", "/dev/null", "200", "lxc", "pre-start"], capture_output=True,
                          env={"PATH": "/usr/bin:/bin", "DFLASH_PROC_DEVICES": str(tmp_path / "devices")}).returncode == 0


REAL_LXC = os.geteuid() == 0 and all(shutil.which(t) for t in ("lxc-start", "lxc-info"))


@pytest.mark.skipif(not REAL_LXC, reason="needs root and LXC")
def test_the_prestart_hook_line_passes_under_real_lxc(tmp_path):
    """The role's hook line, run by lxc-start itself (issue 41 item 1). A second pre-start hook
    records that the first let the start through, then stops it: nothing boots (milliseconds)."""
    hook = REPO / "roles/dflash_node/files/dflash-nvidia-prestart"
    line = node_filters.dflash_nvidia_lxc_lines(PROC_DEVICES, [0], hook=str(hook))[-1]
    key, _, value = line.partition(": ")
    # the node's /dev/nvidia* stand in as character devices that exist here
    value = value.replace("/dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools",
                          "/dev/null /dev/zero /dev/full /dev/urandom")
    (tmp_path / "devices").write_text(PROC_DEVICES)
    reached = tmp_path / "reached"

    def start(hook_value):
        ct = tmp_path / "hk"
        (ct / "rootfs").mkdir(parents=True, exist_ok=True)
        reached.unlink(missing_ok=True)
        (ct / "config").write_text(
            f"lxc.uts.name = hk\nlxc.rootfs.path = dir:{ct}/rootfs\nlxc.net.0.type = empty\n"
            f"{key} = {hook_value}\n"
            f"{key} = /bin/sh -c 'echo \"$*\" > {reached}; exit 1' sh\n")
        r = subprocess.run(["lxc-start", "-n", "hk", "-P", str(tmp_path), "-F", "-o", str(tmp_path / "log"),
                            "-l", "DEBUG", "--", "/bin/true"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "DFLASH_PROC_DEVICES": str(tmp_path / "devices")})
        return r.returncode, (reached.read_text().strip() if reached.exists() else None), \
            (tmp_path / "log").read_text()

    rc, args, _ = start(value)
    assert args == "hk lxc pre-start"          # the hook passed; the recorder saw LXC's trailing words
    assert rc != 0                             # (the recorder stopped the start)
    rc, args, log = start(value.replace("/dev/full", "/dev/nvidia-not-here"))
    assert rc != 0 and args is None
    assert "CT hk: /dev/nvidia-not-here is missing on the node" in log


def test_dev_entries_and_stale_lines():
    assert node_filters.dflash_nvidia_dev_entries([2]) == {
        "dev0": "/dev/nvidia2", "dev1": "/dev/nvidiactl", "dev2": "/dev/nvidia-uvm", "dev3": "/dev/nvidia-uvm-tools"}
    want = node_filters.dflash_nvidia_lxc_lines(PROC_DEVICES, [0])
    current = want + ["lxc.mount.entry: /dev/nvidia7 dev/nvidia7 none bind,optional,create=file",
                      "lxc.mount.entry: tmpfs dev/shm tmpfs rw,size=1M,create=dir 0 0",
                      "lxc.apparmor.profile: unconfined"]
    stale = node_filters.dflash_stale_lines(current, want, node_filters.dflash_nvidia_majors(PROC_DEVICES))
    assert stale == current[len(want):len(want) + 2]       # someone else's raw line is left alone


def test_pct_config_parsing_and_option_comparison():
    parsed = node_filters.dflash_pct_config(
        "#note\narch: amd64\nmp0: /srv/ws,mp=/workspace\nlxc.mount.entry: a b none bind 0 0\n\n[snap1]\nmemory: 1\n")
    assert parsed == {"keys": {"arch": "amd64", "mp0": "/srv/ws,mp=/workspace"},
                      "raw": ["lxc.mount.entry: a b none bind 0 0"]}
    assert node_filters.dflash_same_opts("/m,ro=1,mp=/w", "/m,mp=/w,ro=1")
    assert not node_filters.dflash_same_opts(None, "/m,mp=/w")
    assert not node_filters.dflash_same_opts("/m,mp=/w", "/m,mp=/w,ro=1")


# ------------------------------------------------------------------ tokens, ACLs and privileges (issue 13, item 1)

def _as(s, token):
    t = requests.Session()
    t.headers["Authorization"] = "PVEAPIToken=root@pam!%s=n" % token
    t.verify, t.trust_env = s.verify, False
    return t


def test_a_privilege_separated_token_without_an_acl_may_do_nothing(api):
    """Tokens are privilege-separated by default: root@pam's own rights do not pass to the token."""
    s, base, _ = api
    for name in ("noacl", "unlisted"):      # unlisted: given a secret, not in user.cfg = `token add` defaults
        t = _as(s, name)
        assert t.get(base + "/version").ok                     # authenticated ...
        r = t.post(f"{base}/nodes/pve/lxc", data={"vmid": 340, "ostemplate": TEMPLATE, "hostname": "x",
                                                  "unprivileged": 1})
        assert (r.status_code, r.reason) == (403, "Permission check failed")   # ... but no VM.Allocate
        # the API's default is a privileged CT (unprivileged: 0); PVE 8 checks VM.Allocate first
        # there too (Sys.Modify on / is PVE 9's rule)
        r = t.post(f"{base}/nodes/pve/lxc", data={"vmid": 340, "ostemplate": TEMPLATE, "hostname": "x"})
        assert (r.status_code, r.reason) == (403, "Permission check failed")
        assert t.get(base + "/access/permissions").json()["data"] == {}
    _create(s, base, 341)
    assert all(c.get("vmid") != 341 for c in _as(s, "noacl").get(base + "/cluster/resources").json()["data"])
    r = _as(s, "noacl").get(f"{base}/nodes/pve/lxc/341/config")
    assert (r.status_code, r.reason) == (403, "Permission check failed (/vms/341, VM.Audit)")


def test_a_token_sharing_its_users_privileges_may_create():
    """privsep=0: the token has root@pam's privileges (still not root@pam for root-only keys)."""
    acl = pve_api.AccessControl(None)
    acl.parse("token:root@pam!shared:0:0::\n")
    assert "VM.Allocate" in acl.permissions("root@pam!shared", "/vms/1")


def test_a_net_on_a_bridge_needs_sdn_use_on_the_bridge(api):
    s, base, _ = api
    t = _as(s, "nosdn")
    params = {"vmid": 342, "ostemplate": TEMPLATE, "hostname": "ct342", "cores": 2, "memory": 1024, "swap": 256,
              "rootfs": "local-lvm:4", "net0": "name=eth0,bridge=vmbr0,ip=dhcp", "features": "nesting=1",
              "onboot": 1, "unprivileged": 1}
    r = t.post(f"{base}/nodes/pve/lxc", data=params)
    assert (r.status_code, r.reason) == (403, "Permission check failed (/sdn/zones/localnetwork/vmbr0, SDN.Use)")
    r = t.post(f"{base}/nodes/pve/lxc", data={**params, "net0": "name=eth0,bridge=vmbr0,tag=20,ip=dhcp"})
    assert r.reason == "Permission check failed (/sdn/zones/localnetwork/vmbr0/20, SDN.Use)"
    # without a netN the same token creates the container: the role covers everything else
    r = t.post(f"{base}/nodes/pve/lxc", data={k: v for k, v in params.items() if k != "net0"})
    assert r.status_code == 200, r.reason
    perms = t.get(base + "/access/permissions", params={"path": "/vms/342"}).json()["data"]
    assert sorted(perms["/vms/342"]) == sorted(p for p in ROLE_PRIVS if p.startswith(("VM.", "Datastore.", "SDN.")))
    assert t.get(base + "/access/permissions", params={"path": "/sdn/zones/localnetwork/vmbr0"}).json()["data"] \
        == {"/sdn/zones/localnetwork/vmbr0": {}}


def test_privilege_names_are_pves_and_acls_propagate_only_when_asked():
    with pytest.raises(SystemExit, match="invalid privilege 'VM.Config.\\*'"):
        pve_api.AccessControl(None).parse("role:Bad:VM.Allocate,VM.Config.*:\n")
    acl = pve_api.AccessControl(None)
    acl.parse("token:u@pve!t:0:1::\nuser:u@pve:1:0::::::\nrole:R:VM.Audit:\n"
              "acl:0:/vms:u@pve!t,u@pve:R:\nacl:1:/storage:u@pve!t:R:\nacl:1:/storage/x:u@pve!t:NoAccess:\n")
    assert acl.permissions("u@pve!t", "/vms") == {"VM.Audit"}
    assert acl.permissions("u@pve!t", "/vms/1") == set()                    # propagate 0
    assert acl.permissions("u@pve!t", "/storage/y") == set()                # the user itself has nothing there
    assert acl.permissions("u@pve!t", "/storage/x") == set()


def test_the_documented_pveum_lines_grant_one_role_per_kind_of_path():
    """Issue 52 item 7: one role with every privilege granted on every path put
    Datastore.AllocateSpace on the template storage, VM.* on storage paths and SDN.Use on every VLAN
    of the bridge. Each kind of path now gets its own role, and the SDN paths do not propagate."""
    acl = prov_filters.dflash_token_acl(200, "local-lvm", "local:vztmpl/d.tar.zst",
                                        {"net0": "name=eth0,bridge=vmbr0,ip=dhcp", "net1": "bridge=vmbr1,tag=7"})
    assert [e["path"] for e in acl] == ["/vms/200", "/storage/local-lvm", "/storage/local",
                                        "/sdn/zones/localnetwork/vmbr0", "/sdn/zones/localnetwork/vmbr1/7"]
    lines = prov_filters.dflash_pveum_lines(acl, "root@pam!ansible", "DFlashProvision")
    assert lines[:4] == [
        'pveum role add DFlashProvisionVM --privs "VM.Allocate VM.Audit VM.Config.CPU VM.Config.Disk VM.Config.Memory'
        ' VM.Config.Network VM.Config.Options"',
        'pveum role add DFlashProvisionDisk --privs "Datastore.AllocateSpace"',
        'pveum role add DFlashProvisionTemplate --privs "Datastore.Audit"',
        'pveum role add DFlashProvisionSDN --privs "SDN.Use"']
    assert not [p for p in prov_filters.dflash_token_role_privs(acl) if p not in pve_api.PRIVILEGES]
    assert "pveum acl modify /storage/local --tokens 'root@pam!ansible' --roles DFlashProvisionTemplate" in lines
    assert "pveum acl modify /sdn/zones/localnetwork/vmbr0 --tokens 'root@pam!ansible' --roles DFlashProvisionSDN" \
        " --propagate 0" in lines
    # what those lines leave in user.cfg gives the token exactly its privileges on each path, no more
    ac = pve_api.AccessControl(None)
    ac.parse("\n".join(prov_filters.dflash_user_cfg_lines(acl, "root@pam!ansible", "DFlashProvision")))
    for e in acl:
        assert ac.permissions("root@pam!ansible", e["path"]) == set(e["privs"]), e["path"]
    assert ac.permissions("root@pam!ansible", "/storage/local") == {"Datastore.Audit"}
    assert ac.permissions("root@pam!ansible", "/sdn/zones/localnetwork/vmbr0/20") == set()
    assert ac.permissions("root@pam!ansible", "/") == set()
    # a dedicated user: its token has only what both are granted, so the user gets the ACLs too
    ded = prov_filters.dflash_pveum_lines(acl, "dflash@pve!ansible", "DFlashProvision")
    assert "pveum acl modify /vms/200 --users dflash@pve --tokens 'dflash@pve!ansible' --roles DFlashProvisionVM" in ded
    ac = pve_api.AccessControl(None)
    ac.parse("\n".join(prov_filters.dflash_user_cfg_lines(acl, "dflash@pve!ansible", "DFlashProvision")))
    assert ac.permissions("dflash@pve!ansible", "/vms/200") == set(prov_filters.VM_PRIVILEGES)


def test_a_token_holding_more_than_it_needs_is_named_path_by_path():
    """Issue 52 item 8, issue 62 C2: the whole effective map (GET /access/permissions without a
    path) is compared, so a grant on /nodes, a pool, /mapping or another VM is named, not only one
    on the paths the token needs and /."""
    acl = prov_filters.dflash_token_acl(200, "local", TEMPLATE, {"net0": "bridge=vmbr0"})
    ac = pve_api.AccessControl(None)
    ac.parse("\n".join(prov_filters.dflash_user_cfg_lines(acl, "root@pam!ansible", "DFlashProvision")))
    assert prov_filters.dflash_excess_privs(ac.effective("root@pam!ansible"), acl) == []
    for extra, path, privs in (("acl:1:/nodes/pve:root@pam!ansible:PVEAuditor:", "/nodes/pve", ["Sys.Audit"]),
                               ("acl:1:/vms/300:root@pam!ansible:PVEVMUser:", "/vms/300", ["VM.PowerMgmt"]),
                               ("acl:1:/mapping/pci/gpu:root@pam!ansible:PVEAuditor:", "/mapping/pci/gpu",
                                ["Mapping.Audit"]),
                               ("pool:lab::300:\nacl:1:/pool/lab:root@pam!ansible:PVEAuditor:", "/pool/lab",
                                ["Pool.Audit"]),
                               ("acl:1:/:root@pam!ansible:Administrator:", "/", ["Sys.Modify"])):
        more = pve_api.AccessControl(None)
        more.parse("\n".join(prov_filters.dflash_user_cfg_lines(acl, "root@pam!ansible", "DFlashProvision"))
                   + "\n" + extra)
        excess = {x["path"]: x["excess"] for x in prov_filters.dflash_excess_privs(more.effective("root@pam!ansible"),
                                                                                 acl)}
        assert path in excess and set(privs) <= set(excess[path]), (extra, excess)
    # a grant above the needed path propagates to it, and is named where it was made
    wide = [{**e, "path": "/vms"} if e["path"] == "/vms/200" else e for e in acl]
    more = pve_api.AccessControl(None)
    more.parse("\n".join(prov_filters.dflash_user_cfg_lines(wide, "root@pam!ansible", "DFlashProvision")))
    assert [x["path"] for x in prov_filters.dflash_excess_privs(more.effective("root@pam!ansible"), acl)] == ["/vms"]
    # what is missing is read path by path
    res = [{"json": {"data": {e["path"]: {p: 1 for p in e["privs"]}}}} for e in acl]
    assert prov_filters.dflash_missing_privs(res, acl) == []
    res[0]["json"]["data"]["/vms/200"].pop("VM.Audit")
    assert prov_filters.dflash_missing_privs(res, acl) == [{"path": "/vms/200", "missing": ["VM.Audit"]}]


def test_the_token_needs_no_power_management():
    """Issue 62 C1: nothing starts, stops or reboots through the token (dflash_node starts the CT
    as root on the node), so VM.PowerMgmt is neither asked for nor granted, and a token holding it
    holds more than it needs."""
    acl = prov_filters.dflash_token_acl(200, "local-lvm", TEMPLATE, {}, False, "9.0")
    assert "VM.PowerMgmt" not in prov_filters.dflash_token_role_privs(acl)
    assert not [x for x in prov_filters.dflash_pveum_lines(acl, "root@pam!t", "R") if "PowerMgmt" in x]
    with_power = {"/vms/200": {p: 1 for p in acl[1]["privs"] + ["VM.PowerMgmt"]}}
    assert prov_filters.dflash_excess_privs(with_power, acl) == [{"path": "/vms/200", "excess": ["VM.PowerMgmt"]}]


# ------------------------------------------------------------------ pct reboot/shutdown (issue 13, item 3)

class _RecordingLxc(pve_api.FakeLxc):
    stops: list = []

    def stop(self, vmid, timeout, force, log):
        self.stops.append((timeout, force))
        super().stop(vmid, timeout, force, log)


def test_reboot_kills_after_60_s_unless_given_a_timeout(tmp_path):
    """PVE's vm_reboot: lxc-stop with its default 60 s, then kill; a longer TimeoutStopSec inside
    the container does not count. `pct reboot --timeout N` waits N seconds."""
    lxc = _RecordingLxc(str(tmp_path / "lxc"), None)
    node = pve_api.Node("pve", str(tmp_path / "etc"), lxc, [TEMPLATE], ["local"], pve_api.AccessControl(None))
    node.write(209, {"hostname": "ct"}, [])
    for timeout, expect in ((None, (60, True)), (1200, (1200, True))):
        lxc.stops.clear()
        lxc.start(209, print)
        assert node.wait(node.reboot(209, timeout, "root@pam"))["exitstatus"] == "OK"
        assert lxc.stops == [expect] and lxc.state(209) == "running"
    lxc.stops.clear()
    node.wait(node.shutdown(209, 60, False, "root@pam"))
    assert lxc.stops == [(60, False)]          # pct shutdown: 60 s, then fail (no kill without --forceStop)


def test_the_readme_grants_what_the_role_checks_for_the_production_inventory():
    import yaml
    # the production values: the role's defaults under what the inventory changes
    prod = {**yaml.safe_load((REPO / "roles/dflash_provision/defaults/main.yml").read_text()),
            **yaml.safe_load((REPO / "inventory/production/group_vars/dflash_containers/provision.yml").read_text())}
    acl = prov_filters.dflash_token_acl(200, prod["dflash_provision_storage"], prod["dflash_provision_ostemplate"],
                                        prod["dflash_provision_netif"])
    want = [line.split("   #")[0] for line in prov_filters.dflash_pveum_lines(acl, "root@pam!ansible", "DFlashProvision")]
    readme = [line.strip().split("     #")[0].strip() for line in (REPO / "README.md").read_text().splitlines()
              if line.strip().startswith("pveum ")]
    assert readme == want


def test_a_privileged_ct_needs_sys_modify_on_root_from_pve_9_on_granted_without_propagation(tmp_path):
    """Issue 41 item 3, issue 52 item 6: pve-container's create_vm wants Sys.Modify on / for a
    privileged CT from PVE 9 on (master 4cc73b7); PVE 8 does not check it, and on / it would let the
    token change datacenter options. The role asks the node's version (GET /version)."""
    assert prov_filters.dflash_token_acl(200, "local-lvm", TEMPLATE, {}, False, "8.2.4") \
        == prov_filters.dflash_token_acl(200, "local-lvm", TEMPLATE, {})
    acl = prov_filters.dflash_token_acl(200, "local-lvm", TEMPLATE, {}, False, "9.0.3")
    assert acl[0] == {"path": "/", "privs": ["Sys.Modify"], "kinds": ["sys"], "propagate": False}
    assert acl[1:] == prov_filters.dflash_token_acl(200, "local-lvm", TEMPLATE, {})
    lines = prov_filters.dflash_pveum_lines(acl, "root@pam!ansible", "R")
    assert "pveum acl modify / --tokens 'root@pam!ansible' --roles RSys --propagate 0" in lines
    assert "pveum acl modify /vms/200 --tokens 'root@pam!ansible' --roles RVM" in lines
    # the stand-in: the same rule by its version
    cfg = "\n".join(prov_filters.dflash_user_cfg_lines(
        prov_filters.dflash_token_acl(200, "local-lvm", TEMPLATE, {}), "root@pam!t", "R"))
    for version, reason in (("8.2.4", None), ("9.0.3", "Permission check failed (/, Sys.Modify)")):
        ac = pve_api.AccessControl(None)
        ac.parse(cfg)
        node = pve_api.Node("pve", str(tmp_path / version), pve_api.FakeLxc(str(tmp_path / version / "lxc"), None),
                            [TEMPLATE], ["local", "local-lvm"], ac, version)
        params = {"ostemplate": TEMPLATE, "hostname": "ct", "rootfs": "local-lvm:4", "storage": "local-lvm"}
        if reason is None:
            assert node.wait(node.create(200, params, "root@pam!t"))["exitstatus"] == "OK"
        else:
            with pytest.raises(pve_api.ApiError, match=reason.replace("(", r"\(").replace(")", r"\)")):
                node.create(200, params, "root@pam!t")


def test_the_workspace_belongs_to_the_cts_root_and_is_not_chowned_on_nfs():
    unpriv = "arch: amd64\nunprivileged: 1\n"
    assert node_filters.dflash_ct_root_ids(unpriv) == [100000, 100000]
    assert node_filters.dflash_ct_root_ids(unpriv + "lxc.idmap: u 0 200000 65536\nlxc.idmap: g 0 300000 65536\n") \
        == [200000, 300000]
    assert node_filters.dflash_ct_root_ids("arch: amd64\n") == [0, 0]                 # privileged (PVE's API default)
    assert node_filters.dflash_ct_root_ids("arch: amd64\nlxc.idmap: u 0 100000 65536\nlxc.idmap: g 0 100000 65536\n") \
        == [100000, 100000]                                                       # custom idmap: unprivileged
    owner = node_filters.dflash_workspace_owner
    assert owner("auto", [100000, 100000], "ext2/ext3") == [100000, 100000]
    assert owner("auto", [0, 0], "xfs") == [0, 0]
    assert owner("auto", [100000, 100000], "nfs") == []                              # root_squash: no chown
    assert owner(1000, [100000, 100000], "nfs") == [1000, 1000]                      # asked for: always
    assert owner([1000, 2000], [0, 0], "ext2/ext3") == [1000, 2000]


def test_eight_gpus_then_four_leaves_exactly_the_wanted_dev_keys():
    """Issue 41 item 4: the role deletes the devN entries it made and no longer wants; someone
    else's devN (here /dev/fuse) is left alone."""
    eight = node_filters.dflash_nvidia_dev_entries(range(8))
    hca = node_filters.dflash_dev_entries(["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0"], len(eight))
    current = {**eight, **hca, "dev20": "/dev/fuse,mode=0666", "mp0": "/srv/ws,mp=/workspace"}
    four = node_filters.dflash_nvidia_dev_entries(range(4))
    stale = node_filters.dflash_stale_dev_keys(current, four)
    assert stale == ["dev7", "dev8", "dev9", "dev10", "dev11", "dev12"]
    after = {k: v for k, v in current.items() if k not in stale} | four
    assert {k for k in after if k.startswith("dev")} == set(four) | {"dev20"}
    assert sorted(v for k, v in after.items() if k in four) == sorted(set(four.values()))   # no device twice
    assert node_filters.dflash_stale_dev_keys({"dev0": "path=/dev/nvidia0"}, {}) == ["dev0"]


def test_the_roles_dev_entries_go_around_an_operators_own():
    """Issue 52 item 5: the numbering started at dev0, so an operator's own dev7 was overwritten."""
    want = {**node_filters.dflash_nvidia_dev_entries(range(8)), "mp0": "/srv/ws,mp=/workspace"}
    current = {"dev7": "/dev/fuse,mode=0666", "dev2": "/dev/nvidia1"}
    placed = node_filters.dflash_place_dev_entries(want, current)
    assert sorted(v for k, v in placed.items() if k.startswith("dev")) == sorted(
        v for k, v in want.items() if k.startswith("dev"))
    assert "dev7" not in placed and placed["mp0"] == want["mp0"]
    assert node_filters.dflash_place_dev_entries(want, {}) == want                 # nothing in the way: as before
    after = {**current, **placed}
    assert after["dev7"] == "/dev/fuse,mode=0666"
    assert node_filters.dflash_stale_dev_keys(after, placed) == []


def _pct(tmp_path, *args):
    env = {**os.environ, "PVE_STANDIN_ETC": str(tmp_path / "etc"), "PVE_STANDIN_LXCPATH": str(tmp_path / "lxc"),
           "PVE_STANDIN_FAKE_LXC": "1"}
    return subprocess.run([sys.executable, str(PVE_API), "pct", *map(str, args)], capture_output=True, text=True,
                          env=env)


def test_the_stand_in_passes_through_only_devices_as_pve_does(tmp_path):
    """Issue 41, the stand-in's devN rules (pve-container, PVE 8): a devN path must exist and be a
    device; on a running CT a devN change (set or delete) is pending until the next start; a device
    passed twice, or gone by the start, fails the start."""
    (tmp_path / "etc" / "lxc").mkdir(parents=True)
    conf = tmp_path / "etc" / "lxc" / "210.conf"
    conf.write_text("arch: amd64\nhostname: ct210\nmemory: 512\nostype: debian\nrootfs: local-lvm:vm-210-disk-0,size=4G\n")
    r = _pct(tmp_path, "set", 210, "-dev0", "/dev/nvidia-not-here")
    assert r.returncode == 2 and "Device /dev/nvidia-not-here does not exist" in r.stderr
    r = _pct(tmp_path, "set", 210, "-dev0", str(conf))
    assert r.returncode == 2 and f"{conf} is not a device" in r.stderr
    assert _pct(tmp_path, "set", 210, "-dev0", "/dev/null", "-dev1", "/dev/zero").returncode == 0
    assert "dev0: /dev/null\n" in conf.read_text()                                # stopped: applied at once
    assert _pct(tmp_path, "start", 210).returncode == 0
    lxc = (tmp_path / "lxc" / "210" / "config").read_text()
    assert f"lxc.mount.entry = {tmp_path}/lxc/210/passthrough/dev/null dev/null none bind,create=file 0 0" \
        in lxc                                     # a node made for the CT, never an optional bind mount
    # running: pending until the next start
    assert _pct(tmp_path, "set", 210, "-dev2", "/dev/full", "--delete", "dev1").returncode == 0
    main, _, pending = conf.read_text().partition("[pve:pending]")
    assert "dev1: /dev/zero" in main and "dev2" not in main
    assert "delete: dev1" in pending and "dev2: /dev/full" in pending
    assert _pct(tmp_path, "reboot", 210).returncode == 0
    text = conf.read_text()
    assert "[pve:pending]" not in text and "dev1" not in text and "dev2: /dev/full" in text
    # the same device twice fails the start, as the pre-start hook's mknod does
    assert _pct(tmp_path, "stop", 210).returncode == 0
    assert _pct(tmp_path, "set", 210, "-dev3", "/dev/null").returncode == 0
    r = _pct(tmp_path, "start", 210)
    assert r.returncode == 2 and "failed to mknod /var/lib/lxc/210/passthrough/dev/null: File exists" in r.stderr
    # a device gone by the start fails it
    assert _pct(tmp_path, "set", 210, "--delete", "dev3").returncode == 0
    if os.geteuid() == 0:          # mknod
        os.mknod(tmp_path / "gone", 0o600 | 0o020000, os.makedev(1, 3))
        assert _pct(tmp_path, "set", 210, "-dev3", tmp_path / "gone").returncode == 0
        (tmp_path / "gone").unlink()
        r = _pct(tmp_path, "start", 210)
        assert r.returncode == 2 and f"Device {tmp_path / 'gone'} does not exist" in r.stderr


def test_the_stand_in_drops_raw_keys_pve_does_not_allow(tmp_path):
    """pve-container's is_valid_lxc_conf_key: lxc.cgroup2.*, lxc.prlimit.*, lxc.mount.entry and the
    hooks are allowed; lxc.rootfs.path and unknown keys are left out with PVE's warning."""
    warnings = []
    keys, raw, _ = pve_api.parse_conf("arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\n"
                                      "lxc.prlimit.memlock: unlimited\nlxc.hook.pre-start: /x 1 2\n"
                                      "lxc.rootfs.path: dir:/elsewhere\nlxc.bogus.key: 1\n", warnings)
    assert [k for k, _ in raw] == ["lxc.cgroup2.devices.allow", "lxc.prlimit.memlock", "lxc.hook.pre-start"]
    assert warnings == ["lxc.rootfs.path: lxc.rootfs.path is auto generated from rootfs",
                        "unable to parse config: lxc.bogus.key: 1"]


def _walk_tasks(tasks, base: Path, whens: tuple = ()):
    """Every task under `tasks` (blocks and include/import_tasks followed), with the `when`s above it."""
    for task in tasks or []:
        own = task.get("when")
        w = whens + tuple(own if isinstance(own, list) else [own] if own else [])
        inc = task.get("ansible.builtin.include_tasks") or task.get("ansible.builtin.import_tasks")
        if "block" in task:
            yield from _walk_tasks(task["block"] + (task.get("rescue") or []) + (task.get("always") or []), base, w)
        elif inc:
            yield from _walk_tasks(yaml.safe_load((base / str(inc)).read_text()), base, w)
        else:
            yield task, w


def test_the_lxc_prestart_hook_is_installed_whether_or_not_the_boot_units_are():
    """Issue 52 item 5: lxc mode writes the hook line into the CT config; with
    dflash_node_nvidia_boot_units: false the hook itself was never installed, and every start failed."""
    base = REPO / "roles/dflash_node/tasks"
    hooks = [w for t, w in _walk_tasks(yaml.safe_load((base / "main.yml").read_text()), base)
             if (t.get("ansible.builtin.copy") or {}).get("src") == "dflash-nvidia-prestart"]
    assert hooks, "no task installs the pre-start hook"
    for whens in hooks:
        assert not [w for w in whens if "nvidia_boot_units" in str(w)], whens


def test_an_operators_shared_flag_on_the_bind_mounts_is_kept():
    """Issue 62 B4: PVE refuses to migrate a CT with local bind mounts unless they say shared=1; a
    rerun used to strip it (the wanted mpN value has no such part, and the comparison is of sets)."""
    want = {"mp0": "/srv/dflash/workspace,mp=/workspace", "mp1": "/srv/m,mp=/workspace/models,ro=1", "dev0": "/dev/x"}
    current = {"mp0": "/srv/dflash/workspace,mp=/workspace,shared=1", "mp1": "/srv/m,mp=/workspace/models,ro=1"}
    kept = node_filters.dflash_keep_mount_opts(want, current)
    assert kept["mp0"] == "/srv/dflash/workspace,mp=/workspace,shared=1"
    assert node_filters.dflash_same_opts(current["mp0"], kept["mp0"])
    assert kept["mp1"] == want["mp1"] and kept["dev0"] == "/dev/x"
    assert node_filters.dflash_keep_mount_opts(want, {}) == want


@pytest.mark.slow
def test_each_container_talks_to_its_own_nodes_api_by_default(tmp_path):
    """Issue 62: one dflash_provision_api_host served every container, even across standalone nodes
    (two APIs). By default it is the ansible_host of the container's proxmox_node; PROXMOX_HOST wins."""
    inv = {"all": {"children": {
        "proxmox_nodes": {"hosts": {"n1": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2"}}},
        "dflash_containers": {"hosts": {"c1": {"proxmox_node": "n1"}, "c2": {"proxmox_node": "n2"}}}}}}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
    (tmp_path / "show.yml").write_text(yaml.safe_dump([{
        "hosts": "dflash_containers", "gather_facts": False, "connection": "local",
        "vars_files": [str(REPO / "roles/dflash_provision/defaults/main.yml")],
        "tasks": [{"ansible.builtin.debug": {"msg": "API {{ inventory_hostname }} {{ dflash_provision_api_host }}"}}]}]))
    ansible = Path(sys.executable).parent / "ansible-playbook"
    env = {k: v for k, v in os.environ.items() if k != "PROXMOX_HOST"}
    for extra, want in (({}, {"c1": "10.0.0.1", "c2": "10.0.0.2"}), ({"PROXMOX_HOST": "10.9.9.9"},
                                                                       {"c1": "10.9.9.9", "c2": "10.9.9.9"})):
        r = subprocess.run([str(ansible), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "show.yml")],
                           env={**env, **extra}, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        for host, api in want.items():
            assert f"API {host} {api}" in r.stdout, r.stdout
