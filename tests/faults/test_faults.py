"""Fault injection against the real dflash.service on the local stand-in (issue 6).

Each case breaks the running job on purpose and checks that nothing is lost; docs/reliability.md
has the table of expectations and observed results. The module brings up its own stand-in
(CT 201 behind an sshd on 127.0.0.1:2223, built by tests/standin/standin.sh like inventory/local's
CT 200), deploys with the real deploy.yml through ansible-runner (tests/faults/inventory: the
local stand-in's variables plus shorter WatchdogSec/save interval), runs the cases in order,
each starting from a healthy running job (one that begins by stopping it: or a job stopped cleanly),
and removes the stand-in at the end.

    pytest -m faults                      # all cases (root, lxc; about 15-20 min on 2 cores)
    pytest -m faults -k sigkill           # one case
    DFLASH_FAULTS_KEEP=1 ...              # leave CT 201 up afterwards
    DFLASH_FAULTS_SKIP_DEPLOY=1 ...       # reuse a CT 201 that is already up and deployed

Fault hooks: systemd drop-ins (/etc/systemd/system/dflash.service.d/fault.conf) set the
trainer's DFLASH_FAULT_* variables or append flags to run.sh; SIGKILL, `systemctl stop`,
`pct reboot`, tmpfs mounts and corrupted files do the rest. Evidence of every case (steps,
checkpoints, unit state, journal lines) is written as JSON to $DFLASH_FAULTS_EVIDENCE
(default /tmp/dflash-faults-evidence).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from faultlib import (  # noqa: E402
    DATA,
    ENV_FILE,
    OUT,
    RUN_SH,
    SCRATCH,
    STAGE_UNIT,
    STAGED,
    UNIT,
    UNIT_FILE,
    WATCHDOG_S,
    WEIGHTS_SOURCE,
    Standin,
    ckpt_step,
    parse_systemd_seconds,
    split_runs,
    wait,
)

pytestmark = [pytest.mark.faults, pytest.mark.standin, pytest.mark.slow]

EVIDENCE = Path(os.environ.get("DFLASH_FAULTS_EVIDENCE", "/tmp/dflash-faults-evidence"))


def _why_not() -> str | None:
    if os.environ.get("DFLASH_SKIP_STANDIN") == "1":
        return "DFLASH_SKIP_STANDIN=1"
    if os.geteuid() != 0:
        return "needs root (LXC container, mounts)"
    for tool in ("lxc-start", "lxc-attach", "lxc-info", "ssh"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (tests/setup-host.sh)"
    if not os.path.exists("/usr/sbin/sshd"):
        return "openssh-server not installed (tests/setup-host.sh)"
    if importlib.util.find_spec("ansible_runner") is None:
        return "ansible-runner not installed (tests/setup-host.sh)"
    return None


if _why_not():
    pytestmark.append(pytest.mark.skip(reason=_why_not()))


# ------------------------------------------------------------------------------------ fixtures

def _commit() -> str:
    """The commit under test, for the report (tests/faults/report.py); "" outside a git checkout."""
    import subprocess
    r = subprocess.run(["git", "-C", str(Path(__file__).parents[1]), "rev-parse", "--short=12", "HEAD"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """CT 201 up, deploy.yml applied, the job healthy; removed at the end of the module."""
    s = Standin()
    s.snapshot_sources(tmp_path_factory.mktemp("trainer-src"))
    t0 = time.time()
    stale, leftover = [], False
    if os.environ.get("DFLASH_FAULTS_SKIP_DEPLOY") != "1":
        # A CT 201 here was left by a run that never reached its teardown (killed): never reused. Its job,
        # output and any fault a case had put in place would be this run's starting point (a run that
        # booted one began its first case at step 356 of the old job and timed out waiting for the restart).
        leftover = s.exists()
        if leftover:
            s.down()
        stale = s.leave_stale_cgroups()     # the host as a killed earlier run leaves it
        s.up()
        r = s.playbook("deploy.yml")
        assert r.rc == 0, f"deploy.yml failed:\n{r.tail(80)}"
    s.restore()
    EVIDENCE.mkdir(parents=True, exist_ok=True)
    run = {"setup_s": round(time.time() - t0, 1), "started_at": t0, "commit": _commit(), "cpus": os.cpu_count(),
           "loadavg_at_start": os.getloadavg()[0], "stale_cgroups_left_before_up": stale,
           "leftover_ct_removed": leftover}
    (EVIDENCE / "00-setup.json").write_text(json.dumps(run, indent=1))
    yield s
    run.update(ended_at=time.time(), loadavg_at_end=os.getloadavg()[0])
    (EVIDENCE / "00-setup.json").write_text(json.dumps(run, indent=1))
    if os.environ.get("DFLASH_FAULTS_KEEP") != "1":
        s.down()


# The cases that begin by stopping the job (stop(): the trainer checkpoints and exits): the `job` fixture leaves a
# job the previous case stopped cleanly as it is (Standin.restore's stopped_ok), instead of starting it only to
# have it stopped again.
BEGIN_STOPPED = ("test_02_", "test_04_", "test_07_", "test_08_", "test_09_", "test_10_")


@pytest.fixture
def job(standin, request):
    """A healthy running job before the case (a case of BEGIN_STOPPED: or one stopped cleanly); the case's
    faults undone after it. Collects the case's evidence (a dict the test fills) into
    $DFLASH_FAULTS_EVIDENCE/<test>.json."""
    standin.restore(stopped_ok=request.node.name.startswith(BEGIN_STOPPED))
    ev: dict = {}
    standin.evidence = ev
    failed0 = request.session.testsfailed
    t0 = time.time()
    try:
        yield standin
    finally:
        ev["duration_s"] = round(time.time() - t0, 1)
        ev["outcome"] = "failed" if request.session.testsfailed > failed0 else "passed"
        name = request.node.name.replace("/", "_")
        EVIDENCE.mkdir(parents=True, exist_ok=True)
        (EVIDENCE / f"{name}.json").write_text(json.dumps(ev, indent=1, default=str))
        standin.clear_faults()


def _past_checkpoint(ct: Standin, lo: int, hi: int):
    """Status while the step is lo..hi steps past the last checkpoint (so a kill now lands
    between checkpoint writes)."""
    st = ct.status()
    last = ckpt_step(st.get("last_checkpoint"))
    if st.get("phase") == "training" and last is not None and lo <= st["step"] - last <= hi \
            and st.get("pid") == ct.main_pid():
        return st
    return None


def _lines(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in needles)]


# ------------------------------------------------------------------------------------ 1 SIGKILL

def test_01_sigkill_mid_run_resumes_from_newest_checkpoint(job):
    """SIGKILL of the trainer mid-run: systemd restarts it, it resumes from the newest complete
    checkpoint, the data position continues, no sample is trained twice or skipped past the
    checkpoint."""
    ct, ev = job, job.evidence
    st = wait(lambda: _past_checkpoint(ct, 3, 6), 120, "3-6 steps past a checkpoint", interval=0.3)
    pid, restarts = ct.main_pid(), ct.n_restarts()
    ct.sh(f"kill -KILL {pid}")
    t_kill = time.time()
    complete = ct.steps()
    newest = complete[-1]
    killed_run = split_runs(ct.metrics())[-1]
    killed_last = killed_run[-1]["step"]
    ev.update(killed_pid=pid, status_at_kill=st["step"], last_metrics_step_of_killed_run=killed_last,
              checkpoints_at_kill=complete)

    after = ct.wait_training(timeout=ct.start_timeout_s(), after_pid=pid, past_step=killed_last + 1)
    u = ct.unit()
    journal = ct.journal(t_kill - 1)
    ev.update(new_pid=u["MainPID"], n_restarts=f"{restarts} -> {u['NRestarts']}", resumed_from=after["resumed_from"],
              step_after=after["step"], journal=_lines(journal, "code=killed", "Scheduled restart", "resumed from"))
    assert "status=9/KILL" in journal and "Scheduled restart job" in journal
    assert int(u["NRestarts"]) == restarts + 1
    # the newest complete checkpoint is the one resumed
    assert after["resumed_from"] == f"{OUT}/step-{newest:08d}"
    ck = ct.load_checkpoint(after["resumed_from"])
    # one replica, --grad-accum 1: one batch per optimizer step, so the data position is the step
    assert ck["step"] == newest and ck["seq_next"] == newest, ck
    ev["checkpoint"] = ck

    # The resumed run starts at the step after the checkpoint and trains the same batches in the
    # same order as the killed run did past it: same tokens and (deterministic CPU run) same loss.
    # metrics.jsonl was cut back to the checkpoint on resume (issue 14): every step once
    recs = ct.metrics()
    assert len({r["step"] for r in recs}) == len(recs), "metrics.jsonl holds a step twice"
    resumed = [r for r in recs if r["step"] > newest]
    assert resumed[0]["step"] == newest + 1, [r["step"] for r in resumed[:3]]
    steps = [r["step"] for r in resumed]
    assert steps == list(range(newest + 1, newest + 1 + len(steps))), "a step was skipped or repeated"
    killed = {r["step"]: r for r in killed_run if r["step"] > newest}
    again = {r["step"]: r for r in resumed if r["step"] in killed}
    assert len(again) >= 2 and set(again) == set(killed), (sorted(killed), sorted(again))
    for s in sorted(again):
        assert again[s]["tokens"] == killed[s]["tokens"], s
        assert again[s]["loss"] == pytest.approx(killed[s]["loss"], rel=1e-5, abs=1e-6), s
    ev["replayed_steps"] = {s: [killed[s]["loss"], again[s]["loss"], again[s]["tokens"]] for s in sorted(again)}


# ------------------------------------------------------------------------ 2 SIGKILL in a save

def test_02_sigkill_during_checkpoint_write_keeps_previous(job):
    """SIGKILL during a checkpoint write: the previous checkpoint stays loadable and is the one
    resumed; the half-written one never looks complete."""
    ct, ev = job, job.evidence
    stopped = ct.stop()
    # Hold each checkpoint 25 s between its last fsync and its rename (< WatchdogSec 30 s).
    ct.set_dropin(env={"DFLASH_FAULT_SLOW_CHECKPOINT": "25"})
    ct.start()

    def in_write():
        tmp = ct.tmp_dirs()
        if tmp and ct.sh(f"test -f {OUT}/{tmp[0]}/meta.json", check=False).returncode == 0:
            return tmp
        return None
    tmp = wait(in_write, 180, "a checkpoint being written (.tmp-step-*/meta.json)", interval=0.3)
    complete = ct.steps()
    before = ct.checkpoints()
    pid = ct.main_pid()
    ct.clear_dropin()            # the restarted trainer runs without the fault
    ct.sh(f"kill -KILL {pid}")
    t_kill = time.time()
    tmp_files = ct.out(f"ls {OUT}/{tmp[0]}")
    writing = int(tmp[0].split("-")[2])
    ev.update(stopped_at=stopped["step"], tmp_dir_at_kill=tmp[0], tmp_files=tmp_files.split(),
              complete_at_kill=complete)
    assert f"step-{writing:08d}" not in before, "the checkpoint being written must not look complete"

    after = ct.wait_training(timeout=ct.start_timeout_s(), after_pid=pid)
    newest = complete[-1]
    ev.update(resumed_from=after["resumed_from"], step_after=after["step"])
    assert after["resumed_from"] == f"{OUT}/step-{newest:08d}"
    assert newest < writing
    ck = ct.load_checkpoint(after["resumed_from"])
    assert ck["step"] == newest and ck["finite"], ck
    journal = ct.journal(t_kill - 1)
    ev["journal"] = _lines(journal, "code=killed", "stale checkpoint temp dir", "resumed from")
    assert "removed stale checkpoint temp dir" in journal and tmp[0] in journal
    assert tmp[0] not in ct.ckpt_dirs()
    # the checkpoints that were complete at the kill are byte for byte what they were
    now = ct.checkpoints()
    for name, files in before.items():
        if name in now:
            assert now[name] == files, name


# ------------------------------------------------------------------------------- 3 clean stop

def test_03_systemctl_stop_checkpoints_and_ends_inactive(job):
    """`systemctl stop dflash`: a checkpoint within TimeoutStopSec, exit 0, the unit inactive, not
    failed."""
    ct, ev = job, job.evidence
    st0 = ct.status()
    timeout_stop = parse_systemd_seconds(ct.unit("TimeoutStopUSec")["TimeoutStopUSec"])
    t0 = time.time()
    ct.sh(f"systemctl stop {UNIT}", timeout=timeout_stop + 60)
    took = time.time() - t0
    u = ct.unit("ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus")
    st = ct.status()
    ck = ct.load_checkpoint(st["last_checkpoint"])
    journal = ct.journal(t0 - 1)
    ev.update(step_before=st0["step"], step_stopped=st["step"], stop_took_s=round(took, 1),
              timeout_stop_s=timeout_stop, unit=u, checkpoint=ck, is_failed=ct.out(f"systemctl is-failed {UNIT}",
                                                                                   check=False),
              checkpoint_after_s=round(ck["created_at"] - t0, 1),
              journal=_lines(journal, "SIGTERM", "stop requested", "stopped cleanly", "Deactivated", "Stopped"))
    assert u["ActiveState"] == "inactive" and u["Result"] == "success", u
    assert u["ExecMainCode"] == "1" and u["ExecMainStatus"] == "0", u      # CLD_EXITED, status 0
    assert ev["is_failed"] == "inactive"
    assert took < timeout_stop
    assert st["phase"] == "done" and st["step"] >= st0["step"]
    assert st["last_checkpoint"] == f"{OUT}/step-{st['step']:08d}"
    assert ck["step"] == st["step"] and ck["finite"] and ck["created_at"] > t0 - 2
    assert f"stopped cleanly at step {st['step']}" in journal


# ------------------------------------------------------------------------------- 4 crash loop

def test_04_crash_loop_stops_at_start_limit_and_restart_yml_reports_it(job):
    """Crash loop (corrupted config.json in the staged model): bad input is not restarted; a failing
    load stops at the start limit; restart.yml fails with the unit state and the log tail; no
    checkpoint touched."""
    ct, ev = job, job.evidence
    stopped = ct.stop()
    before = ct.checkpoints()
    cfg = f"{STAGED}/config.json"
    ct.sh(f"mkdir -p {SCRATCH} && cp -p {cfg} {SCRATCH}/config.json.orig")

    # (a) config.json that is not JSON: bad input, exit 2, systemd does not restart it.
    ct.sh(f"truncate -s 100 {cfg}")
    t_a = time.time()
    ct.start()
    wait(lambda: ct.unit()["ActiveState"] == "failed", 120, "dflash failed on the truncated config.json")
    time.sleep(7)  # longer than RestartSec: a restart would show now
    ua = ct.unit()
    ja = ct.journal(t_a - 1)
    ev["truncated_json"] = {"unit": ua, "journal": _lines(ja, "error:", "status=", "Scheduled restart")}
    assert ua["ActiveState"] == "failed" and ua["Result"] == "exit-code" and ua["ExecMainStatus"] == "2", ua
    assert "Scheduled restart job" not in ja
    assert f"dflash-train: error: --target-model: {cfg} is not valid JSON" in ja

    # (b) valid JSON, wrong shape (intermediate_size doubled): the load fails with exit 1 on every
    # start; Restart=on-failure retries until StartLimitBurst stops the loop.
    ct.sh(f"cp -p {SCRATCH}/config.json.orig {cfg} && python3 -c 'import json,sys; p=sys.argv[1]; "
          "c=json.load(open(p)); c[\"intermediate_size\"]*=2; json.dump(c, open(p, \"w\"))' " + cfg)
    # A target whose config differs from the one the checkpoints were trained on is refused at start
    # (exit 2, not restarted: trainer/model/identity.py); --allow-target-change lets each start go on to the
    # load, which fails on the wrong shape with exit 1, so systemd restarts it.
    ct.set_dropin(args="--allow-target-change")
    limits = ct.unit("StartLimitBurst", "StartLimitIntervalUSec", "RestartUSec")
    t_b = time.time()
    r = ct.playbook("restart.yml", {"dflash_service_health_timeout_s": 40})
    ev["restart_yml_failed"] = {"rc": r.rc, "seconds": round(r.seconds, 1), "failed_task": r.failed_task(),
                                "unit_state_lines": _lines(r.stdout, "Active:", "dflash did not become healthy"),
                                "log_tail_lines": _lines(r.stdout, "RuntimeError", "size mismatch",
                                                         "ignore_mismatched_sizes", "latest.log")}
    assert r.rc != 0, r.tail()
    assert "dflash did not become healthy" in r.stdout
    assert "Active:" in r.stdout and "dflash.service" in r.stdout                    # the unit state
    assert "latest.log (last" in r.stdout and "ignore_mismatched_sizes" in r.stdout  # the log tail
    # systemd 252 logs the refused auto-restart and leaves Result at the last failure's (exit-code)
    jb = wait(lambda: (lambda j: j if "Start request repeated too quickly" in j else None)(ct.journal(t_b - 1)),
              180, "the start limit to stop the loop")
    ub = wait(lambda: (lambda u: u if u["ActiveState"] == "failed" else None)(ct.unit()), 30, "dflash failed")
    starts = jb.count("Starting dflash.service")
    ev["crash_loop"] = {"limits": limits, "unit": ub, "starts": starts,
                        "journal": _lines(jb, "status=1/FAILURE", "Scheduled restart", "repeated too quickly",
                                          "start-limit-hit")}
    assert starts == int(limits["StartLimitBurst"]), starts
    assert int(ub["NRestarts"]) == starts and ub["Result"] in ("exit-code", "start-limit-hit"), ub
    time.sleep(7)
    assert ct.unit()["ActiveState"] == "failed", "the loop went on past the start limit"

    # no checkpoint was written, removed or touched by any of the failed starts
    after = ct.checkpoints()
    assert after == before
    ev["checkpoints_unchanged"] = sorted(after)

    # repair: re-stage (the boot-time staging unit copies what differs from the source), restart.yml
    ct.clear_dropin()
    t_r = time.time()
    ct.sh(f"systemctl restart {STAGE_UNIT}", timeout=300)
    staged = ct.journal(t_r - 1, unit=STAGE_UNIT)
    assert ct.out(f"sha256sum < {cfg}") == ct.out(f"sha256sum < {WEIGHTS_SOURCE}/config.json")
    r2 = ct.playbook("restart.yml")
    assert r2.rc == 0, r2.tail()
    st = ct.status()
    ev["repair"] = {"stage_journal": _lines(staged, "copied"), "restart_yml_s": round(r2.seconds, 1),
                    "resumed_from": st["resumed_from"], "step": st["step"]}
    assert st["resumed_from"] == f"{OUT}/step-{stopped['step']:08d}"


# --------------------------------------------------------------------------- 5 failed deploys

def _sharded_source(ct: Standin) -> str:
    src = f"{SCRATCH}/model-sharded"
    ct.sh(f"rm -rf {src} && mkdir -p {src} && cp -a {WEIGHTS_SOURCE}/. {src}/ && cd {src} && "
          "mv model.safetensors model-00001-of-00002.safetensors && "
          "printf '%s' '{\"metadata\": {}, \"weight_map\": {\"lm_head.weight\": \"model-00002-of-00002.safetensors\", "
          "\"model.norm.weight\": \"model-00001-of-00002.safetensors\"}}' > model.safetensors.index.json")
    return src


DEPLOY_FAULTS = {
    # id: (setup(ct) -> extravars, text the failure must contain, the task that must fail)
    "missing-shard": (lambda ct: {"dflash_weights_source": _sharded_source(ct)},
                      ["misses 1 of 2 shards", "model-00002-of-00002.safetensors"],
                      "Preflight | stop here when the weights cannot be staged"),
    # a 512 KiB tmpfs mounted over the container's /dev/shm: the 0.7 MB model does not fit
    "shm-too-small": (lambda ct: (ct.sh("mount -t tmpfs -o size=512k,mode=1777 tmpfs /dev/shm"), {})[1],
                      ["not enough room on /dev/shm"],
                      "Preflight | stop here when the weights cannot be staged"),
    "unknown-flag": (lambda ct: {"dflash_service_trainer_flags": {"no_such_flag": 1}},
                     # the role's argument spec (the trainer's flags, generated) refuses it first, before any host
                     ["Validation of arguments failed", "dflash_service_trainer_flags.no_such_flag"],
                     "Validating arguments against arg spec"),
    "bad-value": (lambda ct: {"dflash_service_trainer_flags": {"block_size": 1}},
                  ["dflash-train: error: --block-size: must be >= 2, got 1"],
                  "Validate | stop on a flag the trainer rejects"),
    "wrong-type": (lambda ct: {"dflash_weights_margin_bytes": "8GiB"},
                   ["dflash_weights_margin_bytes", "int"],
                   "Validating arguments against arg spec"),
}


@pytest.mark.parametrize("fault", list(DEPLOY_FAULTS))
def test_05_failed_deploy_leaves_the_job_running(job, fault):
    """deploy.yml with a fault (a shard missing, /dev/shm too small, an unknown flag, a bad value, a
    wrong type): fails in the named task with the reason, changes nothing, the running job keeps
    training."""
    ct, ev = job, job.evidence
    setup, needles, task = DEPLOY_FAULTS[fault]
    files = f"sha256sum {RUN_SH} {ENV_FILE} {UNIT_FILE} | cut -c1-16"
    files0 = ct.out(files)
    pid0, restarts0 = ct.main_pid(), ct.n_restarts()
    step0 = ct.status()["step"]
    try:
        extravars = setup(ct)
        r = ct.playbook("deploy.yml", extravars)
    finally:
        ct.clear_faults()   # unmount the small /dev/shm before the job could need the real one
    after = ct.wait_training(timeout=60, past_step=step0)
    fatal = [line for line in r.stdout.splitlines() if line.startswith("fatal:") or "msg:" in line
             or any(n in line for n in needles)]
    ev.update(extravars=extravars, rc=r.rc, seconds=round(r.seconds, 1), failed_task=r.failed_task(),
              changed_on_ct201=r.changed(), message=fatal[:12], pid=f"{pid0} -> {ct.main_pid()}",
              step=f"{step0} -> {after['step']}", n_restarts=f"{restarts0} -> {ct.n_restarts()}")
    assert r.rc != 0 and r.failed(), r.tail()
    for n in needles:
        assert n in r.stdout, f"{n!r} not in the deploy output:\n{r.tail()}"
    assert task in r.failed_task(), r.failed_task()
    assert r.changed() == 0, r.tail()
    # the running job was not touched and kept training across the failed deploy
    assert ct.main_pid() == pid0 and ct.n_restarts() == restarts0
    assert after["step"] > step0 and after["pid"] == pid0
    assert ct.out(files) == files0
    # the role's verdict, polled as its health handler polls it (one read can land mid-checkpoint)
    assert ct.wait_healthy(timeout=60)["ok"] and ct.main_pid() == pid0


# ----------------------------------------------------------------------------------- 6 reboot

def test_06_container_reboot_restages_weights_and_resumes(job):
    """Container reboot (`pct reboot 201`): the trainer checkpoints on the shutdown, the weights are
    re-staged into the empty /dev/shm before it starts, it resumes from that checkpoint."""
    ct, ev = job, job.evidence
    st0 = ct.status()
    init0 = ct.init_pid()
    t0 = time.time()
    r = ct.node("pct reboot 201", timeout=400)
    took = time.time() - t0
    assert r.returncode == 0, r.stderr
    assert ct.init_pid() != init0
    wait(lambda: ct.out("systemctl is-system-running", check=False) in ("running", "degraded"), 180,
         "CT 201 booted")
    after = ct.wait_training(timeout=300, past_step=None)
    after = ct.wait_training(timeout=120, past_step=ckpt_step(after["resumed_from"]))
    stage = ct.unit("ActiveState", "SubState", "Result", "ExecMainExitTimestampMonotonic", unit=STAGE_UNIT)
    started = ct.unit("ExecMainStartTimestampMonotonic")
    staged_log = ct.journal(t0 - 1, unit=STAGE_UNIT, boot=True)
    stamp = json.loads(ct.out(f"cat {STAGED}/.dflash-staged.json"))
    old_log = ct.log_tail(st0["log_file"], 5)
    stopped_at = [int(x) for x in __import__("re").findall(r"stopped cleanly at step (\d+)", old_log)]
    ev.update(step_before=st0["step"], reboot_s=round(took, 1), stage_unit=stage,
              stage_journal=_lines(staged_log, "copied", "staged"), stamp_verified_after_reboot_s=round(
                  stamp["verified_at"] - t0, 1), previous_run_log=_lines(old_log, "stopped cleanly", "checkpoint"),
              resumed_from=after["resumed_from"], step_after=after["step"], pid=f"{st0['pid']} -> {after['pid']}")
    assert stage["ActiveState"] == "active" and stage["Result"] == "success", stage
    # /dev/shm was empty after the reboot: every file was copied again and verified
    copied = json.loads([line for line in staged_log.splitlines() if '"copied"' in line][-1].split(": ", 1)[1])
    assert "model.safetensors" in copied["copied"] and "config.json" in copied["copied"]
    assert stamp["verified_at"] > t0
    # staged before the trainer started (Requires= + After=)
    assert int(stage["ExecMainExitTimestampMonotonic"]) <= int(started["ExecMainStartTimestampMonotonic"])
    # the trainer checkpointed on the shutdown (SIGTERM) and the new boot resumed from it
    assert stopped_at and after["resumed_from"] == f"{OUT}/step-{stopped_at[-1]:08d}"
    assert stopped_at[-1] >= st0["step"] and after["step"] > stopped_at[-1]


# -------------------------------------------------------------------------------- 7 disk full

@pytest.mark.parametrize("leave_bytes", [200 * 1024, 0], ids=["checkpoint-does-not-fit", "no-space-at-all"])
def test_07_disk_full_clear_error_older_checkpoints_intact(job, leave_bytes):
    """Disk full (a checkpoint does not fit / no space at all): a clear error, older checkpoints
    intact and loadable, no half-written directory."""
    ct, ev = job, job.evidence
    full = f"{SCRATCH}/full"
    stopped = ct.stop()
    s0 = stopped["step"]
    # a fresh output dir on a 4 MiB tmpfs, seeded with the job's newest checkpoint
    ct.sh(f"mkdir -p {full} && mount -t tmpfs -o size=4m tmpfs {full} && cp -a {OUT}/step-{s0:08d} {full}/")
    ct.set_dropin(args=f"--output-dir {full} --status-file {full}/status.json --log-dir {full}/logs")
    ct.start()
    st = ct.wait_training(timeout=180, status_file=f"{full}/status.json")
    assert st["resumed_from"] == f"{full}/step-{s0:08d}"
    pid = ct.main_pid()
    ct.sh(f"avail=$(df --output=avail -B1 {full} | tail -1); fallocate -l $((avail - {leave_bytes})) {full}/filler")
    df = ct.out(f"df -B1 --output=size,used,avail {full} | tail -1")
    old = ct.checkpoints(full)
    t_fill = time.time()

    def failed():
        j = ct.journal(t_fill - 1)
        return j if "training failed" in j else None
    journal = wait(failed, 120, "the trainer to fail on the full disk")
    wait(lambda: ct.unit()["MainPID"] != str(pid), 60, "the failed trainer to exit")
    st = ct.status(f"{full}/status.json")
    journal = ct.journal(t_fill - 1)
    u = ct.unit()
    ct.sh(f"systemctl stop {UNIT}")       # no further restarts into the full disk
    now = ct.checkpoints(full)
    ev.update(df_after_fill=df, status=st, journal=_lines(journal, "No space", "error", "status="),
              checkpoints_before=sorted(old), checkpoints_after=sorted(now), dirs_after=ct.ckpt_dirs(full), unit=u)
    err = _lines(journal, "training failed:")[0]
    assert "No space left on device" in err and "earlier checkpoints left intact" in err
    assert "checkpoint step " in err and f"not saved to {full}/step-" in err
    assert "status=1/FAILURE" in journal
    if leave_bytes:
        # room for status.json: the operator's view says failed, with the same reason
        assert st["phase"] == "failed" and "No space left on device" in st["error"]
    else:
        # not even status.json can be rewritten: the journal holds the reason; dflash-status
        # reports the file as stale once its heartbeat is older than --max-age
        assert "could not write status file" in journal
    # the older checkpoints are intact (same bytes) and loadable; no half-written dir is left
    for name, files in old.items():
        assert now.get(name) == files, name
    assert not ct.tmp_dirs(full)
    assert ct.load_checkpoint(f"{full}/{sorted(old)[-1]}")["finite"]


# ------------------------------------------------------------------------- 8 malformed shard

@pytest.mark.parametrize("damage", ["bytes-flipped", "not-parquet"])
def test_08_malformed_data_shard_clear_error_naming_it(job, damage):
    """Malformed data shard (bytes changed / not parquet): exit 2 with one line naming the shard, no
    restart, checkpoints untouched."""
    ct, ev = job, job.evidence
    bad = f"{SCRATCH}/data-bad"
    shard = f"{bad}/shard-00001.parquet"
    ct.sh(f"mkdir -p {SCRATCH} && cp -a {DATA} {bad}")
    if damage == "bytes-flipped":       # bit rot: the index's sha256 no longer matches
        ct.sh(f"python3 -c 'import sys; p=sys.argv[1]; b=bytearray(open(p,\"rb\").read()); "
              f"b[100:400]=bytes(300); open(p,\"wb\").write(b)' {shard}")
        needle = f"{shard}: sha256 mismatch"
    else:                               # a broken writer: index consistent, file not parquet
        ct.py("import hashlib, json, sys\n"
              "from trainer.data.dataset import _overall_hash\n"
              f"d = {bad!r}; shard = d + '/shard-00001.parquet'\n"
              "open(shard, 'wb').write(b'this is not parquet\\n' * 200)\n"
              "idx = json.load(open(d + '/index.json'))\n"
              "for s in idx['shards']:\n"
              "    if s['file'] == 'shard-00001.parquet':\n"
              "        s['sha256'] = hashlib.sha256(open(shard, 'rb').read()).hexdigest()\n"
              "idx['hash'] = _overall_hash(idx['shards'])\n"
              "json.dump(idx, open(d + '/index.json', 'w'))\n")
        needle = f"{shard}: not a readable parquet file"
    ct.stop()
    before = ct.checkpoints()
    # The refused run's status.json in the scratch dir: the job's own keeps the clean stop above, so the
    # next case that begins stopped finds the job as stop() left it (Standin.restore's stopped_ok) instead
    # of a trainer start to get a job to stop again (a supervisor and a rank importing torch, twice here).
    status = f"{SCRATCH}/status.json"
    ct.set_dropin(args=f"--data-dir {bad} --status-file {status}")
    restarts0 = ct.n_restarts()
    t0 = time.time()
    ct.start()
    wait(lambda: ct.unit()["ActiveState"] == "failed", 120, "dflash to fail on the bad shard")
    time.sleep(7)   # longer than RestartSec: a restart would show now
    u = ct.unit()
    journal = ct.journal(t0 - 1)
    rc, ds = ct.dflash_status(status)
    ev.update(unit=u, journal=_lines(journal, "error:", "status=", "Scheduled restart"),
              dflash_status={"rc": rc, "phase": ds.get("phase"), "error": ds.get("error")})
    assert f"dflash-train: error: --data-dir: {needle}" in journal
    assert u["ActiveState"] == "failed" and u["Result"] == "exit-code" and u["ExecMainStatus"] == "2", u
    assert int(u["NRestarts"]) == restarts0 and "Scheduled restart job" not in journal
    assert rc == 1 and ds["phase"] == "failed" and needle in ds["error"]
    assert ct.checkpoints() == before


# ------------------------------------------------------------------------------- 9 NaN storm

def test_09_nan_storm_fails_after_max_nan_skips_keeping_last_good_checkpoint(job):
    """NaN storm: the run fails after --max-nan-skips consecutive skipped steps with the reason in
    status.json; no checkpoint during the storm; systemd's restart resumes from the last good one."""
    ct, ev = job, job.evidence
    stopped = ct.stop()
    s0 = stopped["step"]
    nan_from, max_skips = s0 + 3, 4
    ct.set_dropin(env={"DFLASH_FAULT_NAN_FROM_STEP": str(nan_from)}, args=f"--max-nan-skips {max_skips}")
    before = ct.checkpoints()
    ct.start()
    st = wait(lambda: (lambda x: x if x.get("phase") == "failed" else None)(ct.status()), 180,
              "status failed", interval=0.3)
    pid = st["pid"]
    # the failed run's records, read before the restart cuts metrics.jsonl back to its checkpoint
    # (the trainer writes the last skipped step before it reports the failure)
    failed_run = [run for run in split_runs(ct.metrics()) if any(r["skipped"] for r in run)][-1]
    ct.clear_dropin()     # systemd's restart (Restart=on-failure) then runs without the fault
    t_fail = time.time()
    wait(lambda: ct.main_pid() != pid, 120, "the failed trainer to exit")
    storm = [r for r in failed_run if r["step"] > s0]
    complete = ct.steps()
    good = max(s for s in complete if s < nan_from)
    ev.update(stopped_at=s0, nan_from=nan_from, max_nan_skips=max_skips, status=st,
              metrics=[(r["step"], r["loss"], r["skipped"]) for r in storm], checkpoints=complete)
    assert st["step"] in (nan_from + max_skips - 1, nan_from + max_skips)   # metrics drain one step late at most
    assert f"{max_skips} consecutive optimizer steps had a non-finite loss" in st["error"]
    assert f"--max-nan-skips {max_skips}" in st["error"] and st["nan_skips"] >= max_skips
    assert [r["skipped"] for r in storm] == [False] * (nan_from - s0 - 1) + [True] * max_skips
    # no checkpoint during the storm; the last good one is intact and loads with finite weights
    assert all(s < nan_from for s in complete), complete
    for name, files in before.items():
        if name in ct.checkpoints():
            assert ct.checkpoints()[name] == files
    ck = ct.load_checkpoint(f"{OUT}/step-{good:08d}")
    assert ck["finite"]
    ev["last_good_checkpoint"] = ck
    # exit 1 -> systemd restarts the job from the last good checkpoint
    after = ct.wait_training(timeout=ct.start_timeout_s(), after_pid=pid, past_step=st["step"])
    journal = ct.journal(t_fail - 30)
    ev.update(resumed_from=after["resumed_from"], step_after=after["step"],
              journal=_lines(journal, "training failed", "status=1/FAILURE", "Scheduled restart"))
    assert after["resumed_from"] == f"{OUT}/step-{good:08d}"


# --------------------------------------------------------------------------- 10 hung trainer

def test_10_hung_trainer_is_killed_by_the_watchdog_and_restarted(job):
    """Hung trainer (alive, no progress): the systemd watchdog kills it (SIGABRT) and it restarts
    and resumes."""
    ct, ev = job, job.evidence
    stopped = ct.stop()
    hang_at = stopped["step"] + 3
    ct.set_dropin(env={"DFLASH_FAULT_HANG_AT_STEP": str(hang_at)})
    t0 = time.time()
    ct.start()
    wait(lambda: "fault injection: hanging at step" in ct.journal(t0 - 1), 180, "the trainer to hang")
    pid, restarts = ct.main_pid(), ct.n_restarts()
    t_hang = time.time()
    ct.clear_dropin()     # the restarted trainer runs without the fault
    assert ct.unit()["ActiveState"] == "active"      # alive, READY=1 sent, no progress
    after = ct.wait_training(timeout=WATCHDOG_S + 180, after_pid=pid, past_step=hang_at)
    journal = ct.journal(t0 - 1)
    u = ct.unit()
    wd = ct.unit("WatchdogUSec")["WatchdogUSec"]
    kill_line = _lines(journal, "Watchdog timeout")
    ev.update(hang_at=hang_at, watchdog=wd, hung_pid=pid, n_restarts=f"{restarts} -> {u['NRestarts']}",
              journal=_lines(journal, "hanging at step", "Watchdog timeout", "Killing process", "status=6/ABRT",
                             "result 'watchdog'", "Scheduled restart", "resumed from"),
              resumed_from=after["resumed_from"], step_after=after["step"],
              detected_after_hang_s=round(time.time() - t_hang, 1))
    assert kill_line, journal[-3000:]
    assert f"Killing process {pid} (python) with signal SIGABRT" in journal
    assert "Failed with result 'watchdog'" in journal and "Scheduled restart job" in journal
    assert int(u["NRestarts"]) == restarts + 1
    assert ckpt_step(after["resumed_from"]) < hang_at and after["step"] > hang_at
