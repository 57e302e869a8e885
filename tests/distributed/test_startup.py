"""The start-up proves progress (issue 54): ranks' notes travel through the job's store to rank 0's
status.json, the supervisor's relay extends systemd's start timeout only while a note moves, and a frozen
start-up ends with one line naming the rank and its phase, within the bound."""
import json
import re
import socket
import threading
import time

import pytest
import torch.distributed as dist

from trainer.distributed.launch import _NotifyRelay, free_port
from trainer.distributed.startup import HANG_ENV, STALL_ENV, WAITING, StartupProgress, StartupWatch
from trainer.status import Notifier, StatusWriter


class SystemdSocket:
    """A NOTIFY_SOCKET as systemd listens on it: every datagram the relay sends, with its arrival time."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.path = str(path)
        self.got: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            for line in data.decode().splitlines():
                self.got.append((time.monotonic(), line))

    def extends(self):
        return [t for t, line in self.got if line.startswith("EXTEND_TIMEOUT_USEC=")]

    def close(self):
        self._stop.set()
        self.thread.join()
        self.sock.close()


def test_a_frozen_warmup_stops_extending_and_fails_the_job_within_the_bound(tmp_path):
    stall_s = 1.5
    store = dist.TCPStore("127.0.0.1", free_port(), 2, True, wait_for_workers=False)
    status = StatusWriter(tmp_path / "status.json", "run", strict=True)
    status.update(phase="warmup", force=True)
    watch = StartupWatch(store, 2, lambda ranks: status.update(startup=ranks, force=True), interval=0.1)
    drafter, target = StartupProgress(0, "drafter", store), StartupProgress(1, "target", store)
    systemd = SystemdSocket(tmp_path / "notify")
    stalled = []
    relay = _NotifyRelay(str(tmp_path / "status.json"), Notifier(env={"NOTIFY_SOCKET": systemd.path}),
                         stall_s=stall_s, on_stall=lambda line: stalled.append((time.monotonic(), line)),
                         interval=0.1)
    watch.start()
    relay.start()
    try:
        drafter.note("warmup", "drafter shape 1 of 1 (1 sequences, compile and autotune)")
        drafter.note(WAITING, "waiting for every rank's load and warmup")
        for k in (1, 2):   # the target moves: shape 1, then shape 2, which never ends
            target.note("warmup", f"target shape {k} of 3 (1x4096, compile and autotune)")
            time.sleep(1.0)
        frozen_at = time.monotonic()
        deadline = frozen_at + stall_s + 3
        while not stalled and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)   # any extend after the stall would show now
    finally:
        relay.stop()
        watch.stop()
        systemd.close()
    # the notes reached rank 0's status.json, each rank's own
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["startup"]["1"]["detail"].startswith("target shape 2 of 3")
    assert st["startup"]["0"]["phase"] == WAITING
    # extended while the target moved, and not once the stall was seen
    ext = systemd.extends()
    assert ext and min(ext) < frozen_at
    assert len(stalled) == 1, "the relay must call the stall exactly once"
    t_stall, line = stalled[0]
    assert all(t <= t_stall for t in ext)
    # within the bound: the last note (the start of shape 2) plus the stall bound, with the relay's tick
    assert t_stall - (frozen_at - 1.0) <= stall_s + 1.0
    # one line naming the rank that stopped and its phase, not the drafter waiting at the barrier
    assert "\n" not in line and "rank 1 (target) in warmup (target shape 2 of 3" in line
    assert relay.stalled == line


def test_progress_that_keeps_moving_keeps_extending(tmp_path):
    status = StatusWriter(tmp_path / "status.json", "run", strict=True)
    systemd = SystemdSocket(tmp_path / "notify")
    stalled = []
    relay = _NotifyRelay(str(tmp_path / "status.json"), Notifier(env={"NOTIFY_SOCKET": systemd.path}),
                         stall_s=1.0, on_stall=stalled.append, interval=0.1)
    status.update(phase="loading", force=True)
    relay.start()
    try:
        t0 = time.monotonic()
        k = 0
        while time.monotonic() - t0 < 3.0:   # three stall bounds long, a note every 0.5 s
            k += 1
            status.update(startup={"0": {"role": "target+drafter", "phase": "warmup", "detail": f"shape {k}",
                                         "seq": k}}, phase="warmup", force=True)
            time.sleep(0.5)
    finally:
        relay.stop()
        systemd.close()
    assert not stalled
    assert max(systemd.extends()) > t0 + 2.5


def test_the_start_barrier_names_a_rank_that_never_comes_within_its_bound(tmp_path):
    """Two real gloo ranks: rank 1 never reaches the start barrier; rank 0 fails after the barrier's own
    bound (not the 3 h host-phase timeout), naming rank 1."""
    import subprocess
    import sys
    port = free_port()
    code = f"""
import datetime, os, sys, time
import torch.distributed as dist
from types import SimpleNamespace
from trainer.distributed.startup import StartupBounds, start_barrier
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(hours=3))
control = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=3))
if rank == 1:
    time.sleep(30)
    os._exit(0)
t0 = time.monotonic()
try:
    start_barrier(SimpleNamespace(world=2), SimpleNamespace(control=control), StartupBounds(3.0, 3.0, "test"))
except RuntimeError as e:
    print("FAILED after %.1f: %s" % (time.monotonic() - t0, str(e).splitlines()[0]), flush=True)
    os._exit(0)
print("PASSED", flush=True)
os._exit(0)
"""
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    out0 = procs[0].communicate(timeout=600)[0]
    procs[1].kill()
    line = [x for x in out0.splitlines() if x.startswith(("FAILED", "PASSED"))]
    assert line and line[0].startswith("FAILED"), out0
    took = float(line[0].split()[2].rstrip(":"))
    assert took < 15 and "Ranks 1 failed to pass monitoredBarrier" in line[0], line[0]


def _journal_of_a_stalled_job(tiny, tmp_path, capfd, hang: str, *extra: str, stall_s: float = 45.0):
    """A real job under the supervisor (3 gloo ranks: drafters 0 and 1, target 2) whose rank hangs after the
    note `hang` names (startup.HANG_ENV), with the stall bound `stall_s` (more than a rank's imports on a busy CPU): (exit status, journal, status.json,
    seconds the supervisor ran). This process supervises (as `python -m trainer` would, without a second torch
    import): the journal is what it and its ranks write to stdout and stderr (`capfd`); the environment and the
    signal handlers the supervisor sets are put back."""
    import os
    import signal

    from tests.engine.test_trainer import tiny_args
    from trainer.__main__ import main as train_main
    out = tmp_path / "out"
    argv = tiny_args(tiny, out, "--max-steps", "1", "--cpu-target-workers", "1", "--cpu-drafter-replicas", "2",
                     *extra)
    env, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    os.environ.update({"OMP_NUM_THREADS": "1", HANG_ENV: hang, STALL_ENV: str(stall_s)})
    capfd.readouterr()
    t0 = time.monotonic()
    try:
        rc = train_main(argv)
    finally:
        took = time.monotonic() - t0
        os.environ.clear()
        os.environ.update(env)
        for sig, h in handlers.items():
            signal.signal(sig, h)
    journal = "".join(capfd.readouterr())
    st = json.loads((out / "status.json").read_text())
    return rc, journal, st, took


def _dumps(journal: str) -> int:
    """faulthandler dumps in the journal: one `Current thread` block per rank that took its stacks (the lines
    carry no rank; each rank's main thread names where it waits), each whole: the supervisor asks the ranks
    one at a time, so no two dumps interleave (a cut block would not match)."""
    blocks = re.findall(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):\n(?:  File .*\n)+", journal, re.M)
    assert len(blocks) == journal.count("Current thread 0x"), journal[-3000:]
    return len(blocks)


@pytest.mark.slow
def test_a_hang_in_init_ends_within_the_bound_naming_the_rank_and_its_sub_step(tiny_small_dir, tmp_path, capfd):
    """Issue 61, item 1: init_rank's sub-steps are start-up notes, and the supervisor's stall clock runs from the
    launch (rank 0 has written no status.json yet). The target hangs in its first connect: the job ends within
    the bound, with one line naming the rank and the sub-step, every rank's stacks, status.json's error and
    the exit status the unit does not restart on."""
    from trainer.distributed.launch import STALL_EXIT
    rc, journal, st, took = _journal_of_a_stalled_job(tiny_small_dir, tmp_path, capfd, "2:connect 2-0")
    assert rc == STALL_EXIT, journal[-3000:]
    lines = [ln for ln in journal.splitlines() if ln.startswith("dflash-train: error: start-up stalled")]
    assert len(lines) == 1, journal[-3000:]
    # ranks in one wait are all named with their sub-steps (which of them is stuck, a line cannot know)
    assert "rank 2 (target) in init (connect 2-0)" in lines[0] and "made no progress for" in lines[0]
    assert "hang_for_test" in journal
    assert _dumps(journal) == 3, journal[-3000:]
    assert journal.count("in recv") >= 2   # the drafters, each waiting for its target
    assert st["phase"] == "failed" and st["error"] == lines[0].removeprefix("dflash-train: error: ")
    hung = [ln for ln in journal.splitlines() if "fault injection: rank hangs in init: connect 2-0" in ln]
    assert hung and took < 45 + 120, took


@pytest.mark.slow
def test_a_hang_in_warmup_ends_within_the_bound_naming_the_rank_and_its_shape(tiny_small_dir, tmp_path, capfd):
    """The warmup's twin: the target stuck in its second warmup shape while the drafters wait at the start
    barrier. Up to the hang it is a real job's start-up, which reports every rank's progress: each rank's
    warmup notes (shape k of n) reach the journal (the supervisor's output), the supervisor logs the bounds it
    derived, rank 0's status.json holds every rank's notes, and the start barrier is bounded. (That a job goes
    on to train with all this in place, every multi-rank job of the suite shows: the notes are not optional.)"""
    from trainer.distributed.launch import STALL_EXIT
    rc, journal, st, _ = _journal_of_a_stalled_job(tiny_small_dir, tmp_path, capfd, "2:target shape 2 of")
    assert rc == STALL_EXIT, journal[-3000:]
    lines = [ln for ln in journal.splitlines() if ln.startswith("dflash-train: error: start-up stalled")]
    assert len(lines) == 1 and "rank 2 (target) in warmup (target shape 2 of" in lines[0], journal[-3000:]
    assert "still working" not in lines[0]    # the drafters wait at the barrier: not the ones to blame
    assert _dumps(journal) == 3 and "hang_for_test" in journal and "monitored_barrier" in journal, journal[-3000:]
    assert st["error"] == lines[0].removeprefix("dflash-train: error: ")
    # the progress it reported on its way
    assert "start-up bounds: a rank with no progress for" in journal
    target = [line for line in journal.splitlines() if "start-up: rank 2 (target) warmup: target shape" in line]
    assert len(target) >= 2 and "shape 1 of " in target[0], journal[-3000:]
    barrier = [line for line in journal.splitlines() if "start-up: rank 0 (drafter) start barrier" in line]
    assert barrier and "at most " in barrier[0], journal[-3000:]
    assert st["startup"]["2"]["role"] == "target" and st["startup"]["0"]["phase"] == WAITING


@pytest.mark.slow
def test_a_stop_before_training_takes_every_ranks_stacks_and_says_where_the_start_up_stood(tiny_small_dir,
                                                                                          tmp_path):
    """Issue 61, item 1: systemd's start timeout sends the supervisor SIGTERM while a rank hangs in init (the
    stall bound far off). Every rank's stacks come first (the handlers are in place before init), and the report
    names the rank and its sub-step, not `rank 0 failed (signal 15)`."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.engine.test_trainer import tiny_args
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]),
               **{HANG_ENV: "2:connect 2-0", STALL_ENV: "900"})
    argv = tiny_args(tiny_small_dir, out, "--max-steps", "1", "--cpu-target-workers", "1",
                     "--cpu-drafter-replicas", "2")
    p = subprocess.Popen([sys.executable, "-m", "trainer", *argv], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    journal = []
    try:
        for line in p.stdout:
            journal.append(line)
            if "fault injection: rank hangs in init: connect 2-0" in line:
                time.sleep(2.0)       # the others reach their own connect
                p.send_signal(signal.SIGTERM)
                break
        journal.append(p.communicate(timeout=600)[0])
    finally:
        if p.poll() is None:
            p.kill()
    text = "".join(journal)
    assert p.returncode == 1, text[-3000:]
    report = [ln for ln in text.splitlines() if ln.startswith("dflash-train: error: stopped by SIGTERM during the "
                                                              "start-up: ")]
    assert len(report) == 1 and "rank 2 (target) in init (connect 2-0)" in report[0], text[-3000:]
    assert "signal 15" not in report[0]
    assert text.count("Current thread 0x") >= 3 and "hang_for_test" in text, text[-3000:]
    st = json.loads((out / "status.json").read_text())
    assert st["phase"] == "failed" and "stopped by SIGTERM during the start-up" in st["error"]
