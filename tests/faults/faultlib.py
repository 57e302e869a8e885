"""Helpers of the fault-injection suite (tests/faults/test_faults.py, docs/reliability.md).

The suite runs against its own local stand-in: LXC container 201 (booted with systemd) and an
sshd on 127.0.0.1:2223 playing the Proxmox node, built by tests/standin/standin.sh exactly like
the CT 200 of inventory/local, so that molecule/default and tests/demo.sh (CT 200) can run at
the same time. Ansible (deploy.yml, restart.yml) goes through ansible-runner with
tests/faults/inventory; the observations (systemctl, status.json, checkpoints, journal) are
read on the node with lxc-attach, the way `pct exec` does it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.standin.zipenv import zipcode_env

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "tests" / "faults" / "inventory"
STANDIN = REPO / "tests" / "standin" / "standin.sh"
PCT_SHIM = REPO / "tests" / "standin" / "pct"

# Must match tests/faults/inventory/hosts.yml.
VMID = "201"
NODE_PORT = "2223"
NODE_DIR = "/var/lib/dflash-standin/node-faults"
LXCPATH = "/var/lib/lxc"

# The deployed job (inventory/local's group_vars + tests/faults/inventory's faults.yml).
UNIT = "dflash.service"
STAGE_UNIT = "dflash-stage-weights.service"
OUT = "/workspace/checkpoints"
STATUS = f"{OUT}/status.json"
VENV = "/opt/dflash/venv"
RUN_SH = "/opt/dflash/run.sh"
ENV_FILE = "/etc/default/dflash"
UNIT_FILE = f"/etc/systemd/system/{UNIT}"
STAGED = "/dev/shm/tiny-qwen3"
WEIGHTS_SOURCE = "/workspace/models/tiny-qwen3"
DATA = "/workspace/data/tiny"
DROPIN_DIR = f"/etc/systemd/system/{UNIT}.d"
DROPIN = f"{DROPIN_DIR}/fault.conf"
SCRATCH = "/workspace/faults"          # per-case files inside the container; removed after each case
SAVE_INTERVAL = 10                      # tests/faults/inventory/group_vars/dflash_containers/faults.yml
WATCHDOG_S = 30                         # idem

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def standin_env() -> dict:
    return {**os.environ, "DFLASH_STANDIN_VMID": VMID, "DFLASH_STANDIN_PORT": NODE_PORT,
            "DFLASH_STANDIN_NODE": NODE_DIR}


def wait(pred, timeout: float, what: str, interval: float = 0.5):
    """Poll pred() until it returns something truthy; return that. AssertionError on timeout."""
    t0 = time.time()
    last = None
    while True:
        try:
            last = pred()
        except subprocess.SubprocessError as e:  # e.g. the container is rebooting
            last = e
        else:
            if last:
                return last
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def ckpt_step(path: str | None) -> int | None:
    m = re.search(r"step-(\d{8,})$", path or "")
    return int(m.group(1)) if m else None


@dataclass
class PlaybookResult:
    rc: int
    status: str
    stdout: str
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0

    def changed(self, host: str = "ct201") -> int:
        return int((self.stats.get("changed") or {}).get(host, 0))

    def failed(self, host: str = "ct201") -> bool:
        return bool((self.stats.get("failures") or {}).get(host, 0))

    def failed_task(self) -> str:
        """Name of the task that failed (the TASK header before the first `fatal:`)."""
        task = ""
        for line in self.stdout.splitlines():
            m = re.match(r"^(?:TASK|RUNNING HANDLER) \[(.*)\] \**$", line)
            if m:
                task = m.group(1)
            elif line.startswith("fatal:"):
                return task
        return ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.stdout.splitlines()[-n:])


class Standin:
    """The fault suite's CT 201 and its node."""

    def __init__(self):
        self.src = None   # snapshot of trainer/ + pyproject.toml the deploys build the wheel from

    # ------------------------------------------------------------------ life cycle
    def up(self):
        subprocess.run([str(STANDIN), "up"], env=standin_env(), check=True, timeout=1800)

    def leave_stale_cgroups(self) -> list:
        """What a run killed with its host session leaves for CT 201 when the CT is not running: the
        LXC monitor's cgroup under pve-container's fixed name (lxc.monitor/201), empty, in every
        hierarchy. A CI run lost its container lanes to exactly this (lxc-start: "Failed to create
        monitor cgroup"); up() must start the CT anyway (tests/standin/lxc-stale-cgroups). Returns
        the directories made."""
        if self.running():
            return []
        made = []
        for line in Path("/proc/self/mounts").read_text().splitlines():
            f = line.split()
            if f[2] in ("cgroup", "cgroup2"):
                d = Path(f[1]) / "lxc.monitor" / VMID
                try:
                    d.mkdir(parents=True, exist_ok=True)
                except OSError:
                    continue
                made.append(str(d))
        return made

    def down(self):
        """standin.sh down for CT 201, but keep /usr/sbin/pct when another stand-in container
        (CT 200 of molecule/default or demo.sh) still uses it: standin.sh down removes the shim."""
        others = [d for d in os.listdir(LXCPATH)
                  if d != VMID and os.path.isfile(os.path.join(LXCPATH, d, "config"))]
        if not others:
            subprocess.run([str(STANDIN), "down"], env=standin_env(), check=False, timeout=600)
            return
        if self.running():
            subprocess.run(["lxc-stop", "-n", VMID, "-P", LXCPATH, "-k"], check=False, timeout=120)
        # Root removes the files itself, as standin.sh's ct_down: lxc-destroy deletes an unprivileged CT's
        # rootfs from inside its user namespace, and beside CT 200 on a loaded host it ran past a 120 s
        # timeout (the module's teardown failed, 2026-12-06).
        subprocess.run(["rm", "-rf", "--one-file-system", os.path.join(LXCPATH, VMID)], check=False, timeout=600)
        # the node's sshd, if its pid file still names it (after a killed run the number may be another
        # process's: standin.sh node_sshd)
        try:
            pid = int((Path(NODE_DIR) / "sshd.pid").read_text().strip())
            if f"{NODE_DIR}/sshd_config" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                os.kill(pid, 15)
        except (OSError, ValueError):
            pass
        shutil.rmtree(NODE_DIR, ignore_errors=True)

    def exists(self) -> bool:
        return os.path.isfile(os.path.join(LXCPATH, VMID, "config"))

    def running(self) -> bool:
        r = subprocess.run(["lxc-info", "-n", VMID, "-P", LXCPATH, "-sH"], capture_output=True, text=True)
        return r.stdout.strip() == "RUNNING"

    def init_pid(self) -> int:
        r = subprocess.run(["lxc-info", "-n", VMID, "-P", LXCPATH, "-pH"], capture_output=True, text=True)
        return int(r.stdout.strip() or 0)

    def snapshot_sources(self, dest: Path):
        """The trainer sources the deploys build from, copied once (like molecule's create step),
        so that edits to trainer/ while the suite runs cannot change the wheel between deploys."""
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(REPO / "trainer", dest / "trainer",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
        shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
        self.src = str(dest)

    @staticmethod
    def ensure_shim():
        """/usr/sbin/pct is shared with the CT 200 stand-in, whose teardown removes it."""
        if not os.path.exists("/usr/sbin/pct"):
            subprocess.run(["install", "-m", "0755", str(PCT_SHIM), "/usr/sbin/pct"], check=True)

    # ------------------------------------------------------------------ commands
    def sh(self, cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """bash -c CMD inside the container (lxc-attach, as the pct shim's `pct exec`)."""
        r = subprocess.run(
            ["lxc-attach", "-n", VMID, "-P", LXCPATH, "--clear-env", "--set-var", f"PATH={CONTAINER_PATH}",
             "--set-var", "LANG=C.UTF-8", "--set-var", "HOME=/root", "--", "bash", "-c", cmd],
            capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
        return r

    def out(self, cmd: str, **kw) -> str:
        return self.sh(cmd, **kw).stdout.strip()

    def py(self, code: str, timeout: float = 120) -> str:
        """Run CODE with the trainer's venv python in the container; its stdout."""
        return self.out(f"{VENV}/bin/python -c {shlex.quote(code)}", timeout=timeout)

    def node(self, cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """A command on the 'Proxmox node' (ssh root@127.0.0.1:2223), e.g. `pct reboot 201`."""
        self.ensure_shim()
        return subprocess.run(
            ["ssh", "-q", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={NODE_DIR}/known_hosts",
             "-i", f"{NODE_DIR}/id_ed25519", "-p", NODE_PORT, "root@127.0.0.1", cmd],
            capture_output=True, text=True, timeout=timeout)

    # ------------------------------------------------------------------ observations
    def unit(self, *props: str, unit: str = UNIT) -> dict:
        props = props or ("ActiveState", "SubState", "Result", "MainPID", "NRestarts", "ExecMainStatus",
                          "ExecMainCode")
        text = self.out(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def main_pid(self) -> int:
        return int(self.unit("MainPID")["MainPID"] or 0)

    def n_restarts(self) -> int:
        return int(self.unit("NRestarts")["NRestarts"] or 0)

    def start_timeout_s(self) -> float:
        """The unit's TimeoutStartSec in seconds (the stand-in's inventory: dflash_service_timeout_start_s):
        as long as systemd itself gives a (re)start to reach READY, and so as long as a case waits for one.
        Under the suite's lanes a trainer's start took 270 s where it takes 60-90 s on a quieter host."""
        text = self.unit("TimeoutStartUSec")["TimeoutStartUSec"]     # e.g. "10min", "1min 30s", "infinity"
        units = {"h": 3600.0, "min": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
        parts = re.findall(r"(\d+)(h|min|ms|us|s)", text)
        if not parts:
            raise AssertionError(f"{UNIT}: TimeoutStartUSec={text!r}: a finite start timeout was expected")
        return sum(int(n) * units[u] for n, u in parts)

    def main_pid_and_status(self, path: str = STATUS) -> tuple[int, dict]:
        """The unit's MainPID and status.json, read in one lxc-attach (0 and {} for what cannot be read)."""
        r = self.sh(f"systemctl show {UNIT} -p MainPID --value; cat {path}", check=False)
        first, _, rest = r.stdout.partition("\n")
        try:
            pid = int(first.strip() or 0)
        except ValueError:
            pid = 0
        try:
            return pid, json.loads(rest)
        except ValueError:
            return pid, {}

    def status(self, path: str = STATUS) -> dict:
        r = self.sh(f"cat {path}", check=False)
        try:
            return json.loads(r.stdout) if r.returncode == 0 else {}
        except ValueError:
            return {}

    def dflash_status(self, path: str = STATUS) -> tuple[int, dict]:
        """`dflash-status --json` (the operator's view) of status file PATH: (exit code, JSON)."""
        r = self.sh(f"{VENV}/bin/dflash-status --status-file {path} --max-age 120 --json", check=False)
        try:
            return r.returncode, json.loads(r.stdout)
        except ValueError:
            return r.returncode, {}

    def health(self) -> dict:
        """The role's own verdict, the one its health handler polls (dflash-status --unit --training:
        unit active, status.json from the unit's main pid, alive, phase training, fresh heartbeat,
        finite loss); `ok` is its `healthy`."""
        r = self.sh(f"{VENV}/bin/dflash-status --unit {UNIT} --training --status-file {STATUS} "
                    f"--max-age 120 --json", check=False)
        try:
            v = json.loads(r.stdout)
        except ValueError:
            return {"ok": False, "problems": [r.stderr.strip()]}
        v["ok"] = bool(v.get("healthy"))
        return v

    def metrics(self, out: str = OUT) -> list[dict]:
        text = self.out(f"cat {out}/metrics.jsonl", check=False)
        recs = []
        for line in text.splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
        return recs

    def checkpoints(self, out: str = OUT) -> dict[str, dict[str, str]]:
        """Complete checkpoints: {"step-XXXXXXXX": {path below it: "<sha256> <size> <mtime_ns>"}} (the files of
        dcp/, the drafter ranks' sharded state, included)."""
        code = (
            "import hashlib, json, os, sys\n"
            "out = sys.argv[1]; res = {}\n"
            "for d in sorted(os.listdir(out) if os.path.isdir(out) else []):\n"
            "    p = os.path.join(out, d)\n"
            "    if not d.startswith('step-') or not os.path.isdir(p): continue\n"
            "    res[d] = {}\n"
            "    for root, _, files in sorted(os.walk(p)):\n"
            "        for f in sorted(files):\n"
            "            q = os.path.join(root, f); st = os.stat(q)\n"
            "            h = hashlib.sha256(open(q, 'rb').read()).hexdigest()\n"
            "            res[d][os.path.relpath(q, p)] = f'{h} {st.st_size} {st.st_mtime_ns}'\n"
            "print(json.dumps(res))\n")
        return json.loads(self.out(f"python3 -c {shlex.quote(code)} {shlex.quote(out)}"))

    def steps(self, out: str = OUT) -> list[int]:
        return sorted(int(d.split("-")[1]) for d in self.checkpoints(out))

    def ckpt_dirs(self, out: str = OUT) -> list[str]:
        return sorted(self.out(f"ls -A {out} 2>/dev/null | grep -E '^(step-|\\.tmp-step-)' || true").split())

    def tmp_dirs(self, out: str = OUT) -> list[str]:
        return [d for d in self.ckpt_dirs(out) if d.startswith(".tmp-step-")]

    def load_checkpoint(self, path: str) -> dict:
        """Load a checkpoint with the trainer's own loader in the container: step, data position,
        and whether every weight is finite."""
        code = (
            "import json, math, torch\n"
            "from trainer.model.checkpoint_format import load\n"
            f"state, cfg, ts, meta = load({path!r})\n"
            "finite = all(bool(torch.isfinite(t.float()).all()) for t in state.values())\n"
            "print(json.dumps({'step': ts['step'], 'seq_next': ts['seq_next'], 'data_position': ts['data_position'],"
            " 'tokens_seen': ts.get('tokens_seen'), 'meta_step': meta['step'], 'reason': meta.get('reason'),"
            " 'created_at': meta.get('created_at'), 'tensors': len(state), 'finite': finite}))\n")
        return json.loads(self.py(code).splitlines()[-1])

    def journal(self, since: float, unit: str = UNIT, boot: bool = False) -> str:
        b = " -b" if boot else ""
        return self.out(f"journalctl -u {unit}{b} --since @{since:.3f} --no-pager -o short-precise", check=False)

    def log_tail(self, path: str, n: int = 40) -> str:
        return self.out(f"tail -n {n} {shlex.quote(path)}", check=False)

    # ------------------------------------------------------------------ faults
    def set_dropin(self, env: dict | None = None, args: str = "", extra: str = ""):
        """A systemd drop-in for dflash.service: Environment= (the trainer's DFLASH_FAULT_* hooks)
        and/or run.sh with extra trainer flags (run.sh appends "$@" to the deployed flags)."""
        lines = ["[Service]"]
        for k, v in (env or {}).items():
            lines.append(f"Environment={k}={v}")
        if args:
            lines += ["ExecStart=", f"ExecStart={RUN_SH} {args}"]
        if extra:
            lines.append(extra)
        text = "\n".join(lines) + "\n"
        self.sh(f"mkdir -p {DROPIN_DIR} && cat > {DROPIN} <<'EOF'\n{text}EOF\nsystemctl daemon-reload")

    def clear_dropin(self):
        self.sh(f"if [ -e {DROPIN_DIR} ]; then rm -rf {DROPIN_DIR}; systemctl daemon-reload; fi")

    def clear_faults(self):
        """Undo every fault a case may have left: the drop-in, mounts over /dev/shm and under the
        scratch dir, the scratch dir, a corrupted staged model (re-staged by the boot unit)."""
        if self.sh(f"test -e {DROPIN_DIR}", check=False).returncode == 0:
            # a trainer started with the fault: stop it before its files go away (SIGKILL when
            # it cannot checkpoint, e.g. hung)
            self.sh(f"timeout 60 systemctl stop {UNIT} || systemctl kill -s SIGKILL {UNIT}; "
                    f"timeout 60 systemctl stop {UNIT}", check=False, timeout=180)
        self.clear_dropin()
        # Only a second mount stacked on /dev/shm is ours; the first is the container's own.
        self.sh("while [ \"$(awk '$5==\"/dev/shm\"' /proc/self/mountinfo | wc -l)\" -gt 1 ]; do umount /dev/shm; done; "
                f"for m in $(awk '$5 ~ \"^{SCRATCH}/\" {{print $5}}' /proc/self/mountinfo | sort -r); do umount \"$m\"; done; "
                f"rm -rf {SCRATCH}", check=False)
        src = self.out(f"sha256sum < {WEIGHTS_SOURCE}/config.json", check=False)
        dst = self.out(f"sha256sum < {STAGED}/config.json", check=False)
        if src != dst:
            self.sh(f"systemctl restart {STAGE_UNIT}", timeout=300)

    def stop(self, timeout: float = 300) -> dict:
        """systemctl stop (the trainer checkpoints on SIGTERM); the final status."""
        self.sh(f"systemctl stop {UNIT}", timeout=timeout)
        return self.status()

    def start(self):
        self.sh(f"systemctl reset-failed {UNIT}; systemctl start --no-block {UNIT}")

    def wait_training(self, timeout: float = 240, after_pid: int | None = None, past_step: int | None = None,
                      status_file: str = STATUS) -> dict:
        """Until the unit's current main process trains (status.json written by it, phase training,
        finite loss), optionally past a step."""
        def ok():
            pid, st = self.main_pid_and_status(status_file)
            if not pid or st.get("pid") != pid or st.get("phase") != "training":
                return None
            if after_pid is not None and pid == after_pid:
                return None
            if past_step is not None and (st.get("step") or 0) <= past_step:
                return None
            if not isinstance(st.get("loss"), (int, float)) or not math.isfinite(st["loss"]):
                return None
            return st
        return wait(ok, timeout, f"{UNIT} training" + (f" past step {past_step}" if past_step is not None else ""))

    def wait_healthy(self, timeout: float | None = None) -> dict:
        """Until dflash-status says healthy; by default as long as the unit's start timeout. Until the unit's
        main process writes status.json in phase training (wait_training's look: one lxc-attach, no Python in
        the container) dflash-status cannot say healthy, so it is asked only from then on."""
        t0 = time.time()
        total = self.start_timeout_s() if timeout is None else timeout
        try:
            self.wait_training(timeout=total)
        except AssertionError:
            pass        # the verdict below says what is wrong
        return wait(lambda: (lambda h: h if h.get("ok") else None)(self.health()),
                    max(1.0, total - (time.time() - t0)), "dflash-status healthy", interval=1.0)

    def stopped_cleanly(self) -> dict | None:
        """The status of a job that `systemctl stop` ended as a clean stop does (what a case that begins by
        stopping the job gets from stop()): the unit not running, status.json phase `done` at the step of its
        last checkpoint, and that checkpoint complete. None otherwise."""
        if self.unit("ActiveState")["ActiveState"] not in ("inactive", "failed"):
            return None
        st = self.status()
        if st.get("phase") != "done" or not isinstance(st.get("step"), int):
            return None
        if st.get("last_checkpoint") != f"{OUT}/step-{st['step']:08d}" or st["step"] not in self.steps():
            return None
        return st

    def restore(self, timeout: float | None = None, stopped_ok: bool = False) -> dict:
        """A healthy running job, as each case expects to find it: clear the faults, forget a
        failed state and the start-limit counter, start the unit if it is not running.
        stopped_ok (a case that begins by stopping the job): a job the previous case left stopped cleanly
        (stopped_cleanly) stays stopped; starting it only to stop it again cost a trainer start (a supervisor
        and two ranks importing torch) and the wait until it trains."""
        self.clear_faults()
        h = self.health()
        # reset-failed also resets the start-rate counter (StartLimitBurst), so the restarts
        # the previous case caused do not count against this one.
        self.sh(f"systemctl reset-failed {UNIT}", check=False)
        if h.get("ok"):
            return h
        if stopped_ok:
            st = self.stopped_cleanly()
            if st is not None:
                return st
        if h.get("unit", {}).get("ActiveState") not in ("active", "activating", "reloading"):
            self.sh(f"systemctl start --no-block {UNIT}")
        return self.wait_healthy(timeout)

    # ------------------------------------------------------------------ ansible
    def playbook(self, name: str, extravars: dict | None = None, timeout: float = 1200) -> PlaybookResult:
        """ansible-runner: NAME (deploy.yml, restart.yml at the repo root) against
        tests/faults/inventory, provisioning skipped as in molecule/default."""
        import ansible_runner

        self.ensure_shim()
        pd = tempfile.mkdtemp(prefix="dflash-faults-runner-")
        env = {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        }
        if self.src:
            env["DFLASH_TRAINER_SRC"] = self.src
        # the module runs on the controller (the wheel's build tasks) load module_utils' code compiled by an
        # earlier run, not compile it from their zip (tests/standin/zipcode; CT 201's get theirs from the node):
        # kept beside the sources' snapshot (pytest's temp dir) for all the suite's runs
        env = zipcode_env(env, (Path(self.src).parent if self.src else Path(pd)) / "zipcode")
        t0 = time.time()
        try:
            r = ansible_runner.run(private_data_dir=pd, project_dir=str(REPO), playbook=name,
                                   inventory=str(INVENTORY), cmdline="--skip-tags provision",
                                   envvars=env, extravars=extravars or {}, quiet=True, timeout=int(timeout))
            text = r.stdout.read()
            return PlaybookResult(r.rc, r.status, text, r.stats or {}, time.time() - t0)
        finally:
            shutil.rmtree(pd, ignore_errors=True)


def split_runs(recs: list[dict]) -> list[list[dict]]:
    """metrics.jsonl split where the step goes back (a run resumed from an older checkpoint)."""
    runs: list[list[dict]] = []
    for r in recs:
        if not runs or r["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(r)
    return runs


def parse_systemd_seconds(text: str) -> float:
    """'2min', '1min 30s', '900ms', '15s' -> seconds."""
    total = 0.0
    for num, unit in re.findall(r"([\d.]+)\s*(ms|us|min|h|s)", text):
        total += float(num) * {"us": 1e-6, "ms": 1e-3, "s": 1, "min": 60, "h": 3600}[unit]
    return total
