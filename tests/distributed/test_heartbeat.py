"""Several nodes (issue 54, item 7): a host that vanishes ends the job on the others within --dist-timeout plus
a margin, through heartbeats in the job's store (trainer/distributed/heartbeat.py), instead of the 3 h the
gloo host phases wait. On a real TCPStore, in-process; the two-node stand-in with a traffic drop is the
molecule multinode scenario's to run."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from trainer.distributed.heartbeat import Heartbeat, heartbeat_bound
from trainer.distributed.launch import free_port


def _wait(pred, limit: float) -> float:
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < limit:
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_silent_rank_ends_its_peers_within_the_bound_naming_its_host():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    hosts = ["node0", "node0", "node1"]
    ended: dict[int, str] = {}
    beats = [Heartbeat(server if r == 0 else dist.TCPStore("127.0.0.1", port, 3, False), r, 3, hosts, bound_s=2.0,
                       interval=0.1, on_silent=lambda line, r=r: ended.setdefault(r, line)).start()
             for r in range(3)]
    time.sleep(1.0)
    assert not ended, "every rank beating: nobody ends"
    beats[2].stop(done=False)        # node 1 vanishes: no `done`, no more beats
    t_gone = time.monotonic()
    took = _wait(lambda: 0 in ended and 1 in ended, 10)
    assert took <= 2.0 + 1.5, took
    for r in (0, 1):
        assert "rank 2 (node1) silent for" in ended[r] and "\n" not in ended[r]
    assert time.monotonic() - t_gone >= 1.5            # not before the bound
    for b in beats[:2]:
        b.stop()


def test_a_rank_that_ends_normally_is_not_silence():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    ended = []
    a = Heartbeat(server, 0, 2, ["a", "b"], bound_s=1.0, interval=0.1, on_silent=ended.append).start()
    b = Heartbeat(dist.TCPStore("127.0.0.1", port, 2, False), 1, 2, ["a", "b"], bound_s=1.0, interval=0.1,
                  on_silent=ended.append).start()
    time.sleep(0.5)
    b.stop()                         # done
    time.sleep(2.0)
    assert not ended
    a.stop()


def test_a_stopped_heartbeat_leaves_no_thread_in_a_store_call():
    """stop() (atexit, after a clean run) returns once the beat is out of its store call: a daemon thread inside
    one when the interpreter finalizes aborts the rank (SIGABRT after "training complete", seen on a loaded
    host; pytorch/pytorch#38228). A store whose round trips take 0.5 s holds the beat in its call."""
    import threading

    class SlowStore:
        def __init__(self, store):
            self.store = store

        def set(self, key, value):
            time.sleep(0.5)
            return self.store.set(key, value)

        def __getattr__(self, name):
            return getattr(self.store, name)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    before = set(threading.enumerate())    # another test's heartbeat may still be on its way out
    hb = Heartbeat(SlowStore(server), 0, 1, ["a"], bound_s=60, interval=0.1, on_silent=lambda line: None).start()
    time.sleep(0.2)                  # the first beat is in its set
    hb.stop(done=False)
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("heartbeat")]


def test_node_0_vanishing_ends_the_other_nodes_ranks():
    """Node 0 (its rank and the store's host) vanishes: the other rank's round trips stop succeeding and rank
    0's counter stops; the rank ends within the bound, saying which."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    ended = []
    zero = Heartbeat(server, 0, 2, ["node0", "node1"], bound_s=1.5, interval=0.1, on_silent=ended.append).start()
    one = Heartbeat(dist.TCPStore("127.0.0.1", port, 2, False), 1, 2, ["node0", "node1"], bound_s=1.5,
                    interval=0.1, on_silent=ended.append).start()
    time.sleep(1.0)
    assert not ended
    zero.stop(done=False)
    del server                       # the store's host is gone
    took = _wait(lambda: bool(ended), 10)
    assert ended and ("store (node 0, node0) answered nothing" in ended[0] or "rank 0 (node0) silent" in ended[0])
    assert took <= 1.5 + 1.5
    one.stop(done=False)


def test_the_bound_is_under_the_dist_timeout():
    """NCCL's watchdog aborts a rank whose op waited --dist-timeout (SIGABRT: a report naming no peer); the
    heartbeat names a lost host before that (issue 61, item 5)."""
    assert 600 - 60 <= heartbeat_bound(600) < 600
    assert 0 < heartbeat_bound(10) < 10


def test_the_quiet_peers_reach_the_error_file_as_they_go(tmp_path, monkeypatch):
    """A rank that dies of a signal (NCCL's watchdog) writes no error; what its heartbeat knew is in its error
    file already, and the launcher's record of the failure quotes it instead of `Signal 6`."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    err = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    hb = Heartbeat(None, 0, 4, ["node0", "node0", "node1", "node1"], bound_s=150, interval=5,
                   on_silent=lambda line: None)
    now = time.monotonic()
    hb.seen = {1: ("40", now - 1), 2: ("38", now - 40), 3: ("37", now - 41)}
    hb.last_ok = now
    hb.note_quiet()
    assert "heartbeat: no beat for" in json.loads(err.read_text())["message"]["message"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-6, error_file=str(err))
    assert "from node1 (ranks 2, 3)" in failure.message["message"]
    hb.seen = {r: (v, time.monotonic()) for r, (v, _) in hb.seen.items()}   # heard from again
    hb.note_quiet()
    assert not err.exists()


def test_an_abort_in_the_store_takes_every_ranks_stacks_and_ends_them(tmp_path, capfd):
    """A supervisor that ends a stalled start-up leaves its line in its notes directory: its node's rank puts it
    in the job's store, and every rank (here one on each node) writes its stacks and ends with the line."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    ended: dict[int, str] = {}
    abort = tmp_path / "abort"
    beats = [Heartbeat(server if r == 0 else dist.TCPStore("127.0.0.1", port, 2, False), r, 2, ["n0", "n1"],
                       bound_s=60, interval=0.1, on_silent=lambda line, r=r: ended.setdefault(r, line),
                       abort_file=str(abort) if r == 0 else None).start() for r in range(2)]
    time.sleep(0.5)
    assert not ended
    abort.write_text("start-up stalled: rank 1 (target) in warmup (target shape 2 of 3)")
    took = _wait(lambda: len(ended) == 2, 10)
    assert took < 2, took
    for r in (0, 1):
        assert ended[r] == "the job was ended: start-up stalled: rank 1 (target) in warmup (target shape 2 of 3)"
    err = capfd.readouterr().err
    assert err.count("stacks of every thread (the job's abort)") == 2 and err.count("Thread 0x") >= 2
    for b in beats:
        b.stop()


def _tree(pid: int) -> list[int]:
    """`pid` and every descendant (the GPU smoke script's own walk of /proc)."""
    import importlib.util
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "trainer" / "lab" / "gpu" / "first_multi_gpu_run.py"
    spec = importlib.util.spec_from_file_location("first_multi_gpu_run", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [pid, *mod.children(pid)]


def test_a_vanished_node_ends_the_job_on_the_other_within_the_dist_timeout_and_a_margin(tiny_small_dir, tmp_path):
    """Two supervisors on loopback, a drafter and a target rank each. While the leader holds a checkpoint (fault injection), node 1
    vanishes: SIGSTOP to its supervisor and ranks, which closes no connection, as a host that loses power or
    its network. Node 0's ranks wait for it in gloo host phases whose timeout is 3 h (the checkpoint's
    barrier); the heartbeats end node 0 within their bound (under --dist-timeout 40 s: a bound of a few
    seconds would take a busy test machine's slow beat for a silence) and a margin."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.distributed.test_multi_rank import PER_NODE  # a drafter and a target rank a node
    from tests.engine.test_trainer import tiny_args
    port = free_port()
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]),
               DFLASH_FAULT_SLOW_CHECKPOINT="240")
    args = [*tiny_args(tiny_small_dir, out, "--max-steps", "50", "--save-interval", "2", "--stop-timeout", "60"),
            *PER_NODE, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--dist-timeout", "40"]
    node1 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "1",
                              "--status-file", str(tmp_path / "node1" / "status.json"),
                              "--log-dir", str(tmp_path / "node1")],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node0 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "0"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    frozen: list[int] = []
    try:
        gone = None
        deadline = time.time() + 400
        while node0.poll() is None and time.time() < deadline:
            if gone is None and any("before its rename" in f.read_text(errors="replace")
                                    for f in (out / "logs").glob("*.log")):
                frozen = _tree(node1.pid)
                for p in frozen:
                    os.kill(p, signal.SIGSTOP)
                gone = time.time()
            if gone is not None and time.time() - gone > 120:
                break
            time.sleep(0.2)
        assert gone is not None, "the leader never held its checkpoint"
        assert node0.poll() is not None, f"node 0 still running {time.time() - gone:.0f}s after node 1 vanished"
        took = time.time() - gone
        journal = node0.stdout.read()
        assert node0.returncode != 0
        assert took < heartbeat_bound(40) + 30, took
        assert "silent for" in journal and "heartbeat through the store" in journal, journal[-3000:]
        # each of node 0's ranks said its bound at start (init_rank runs before the run's log file exists)
        said = f"heartbeat through the store: a rank or the store silent for {heartbeat_bound(40):.0f}s ends the job"
        assert journal.count(said) == 2, journal[:3000]
        # the supervisor's report (status.json's error too) carries the silence, not only `exit 1`
        assert "failed (exit 1): PeerSilent: rank " in journal, journal[-3000:]
    finally:
        for p in frozen:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()


def test_a_rank_that_fails_on_a_timeout_names_the_peers_it_no_longer_hears():
    """A gloo or NCCL timeout names no peer. The heartbeat knows which ranks went quiet before its bound
    (three beats): the failing rank's error carries them, grouped by host, beside the timeout."""
    from trainer.distributed.heartbeat import annotate
    hb = Heartbeat(None, 0, 5, ["node0", "node0", "node1", "node1", "node1"], bound_s=150, interval=5,
                   on_silent=lambda line: None)
    now = time.monotonic()
    hb.last_ok = now - 1
    hb.seen = {1: ("40", now - 2), 2: ("38", now - 121), 3: ("37", now - 119), 4: ("done", now - 200)}
    assert hb.quiet(now) == "no beat for 121s from node1 (ranks 2, 3)"
    assert hb.quiet(now, after_s=130) is None
    hb.last_ok = now - 30
    assert hb.quiet(now) == "the job's store (node 0, node0) unanswered for 30s"
    try:
        raise RuntimeError("Timed out waiting 120000ms for send operation to complete")
    except RuntimeError as e:
        out = annotate(e, "no beat for 121s from node1 (ranks 2, 3)")
    assert type(out) is RuntimeError and out.__cause__ is not None and out.__traceback__ is not None
    assert str(out) == ("Timed out waiting 120000ms for send operation to complete; "
                        "heartbeat: no beat for 121s from node1 (ranks 2, 3)")

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")
    assert str(annotate(Odd(1, 2), "x")) == "Odd: 1/2; heartbeat: x"
    e = ValueError("v")
    assert annotate(e, None) is e


@pytest.mark.slow
def test_a_stall_on_node_1_takes_node_1s_stacks_through_the_abort_key(tiny_small_dir, tmp_path):
    """Issue 61, item 4: two supervisors on loopback, a drafter and a target rank each; node 1's target (rank 3) hangs in
    its second warmup shape. Node 0's supervisor sees it (the ranks' notes reach its status.json through the store) and
    ends the job with one line naming rank 3 and its shape. Node 1's own stall bound is far off, so its ranks' stacks come
    from the abort key alone: each writes them and ends with node 0's line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.distributed.test_multi_rank import PER_NODE  # a drafter and a target rank a node
    from tests.engine.test_trainer import tiny_args
    from trainer.distributed.launch import STALL_EXIT
    from trainer.distributed.startup import HANG_ENV, STALL_ENV
    port = free_port()
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]),
               **{HANG_ENV: "3:target shape 2 of"})
    args = [*tiny_args(tiny_small_dir, out, "--max-steps", "2"), *PER_NODE, "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--dist-timeout", "60"]
    node1 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "1",
                              "--status-file", str(tmp_path / "node1" / "status.json"),
                              "--log-dir", str(tmp_path / "node1")],
                             env={**env, STALL_ENV: "900"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node0 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "0"],
                             env={**env, STALL_ENV: "120"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        journal0 = node0.communicate(timeout=500)[0]
        journal1 = node1.communicate(timeout=120)[0]
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
    assert node0.returncode == STALL_EXIT, journal0[-3000:]
    lines = [ln for ln in journal0.splitlines() if ln.startswith("dflash-train: error: start-up stalled")]
    assert len(lines) == 1 and "rank 3 (target) in warmup (target shape 2 of" in lines[0], journal0[-3000:]
    assert json.loads((out / "status.json").read_text())["error"] == lines[0].removeprefix("dflash-train: error: ")
    # node 1: both ranks took their stacks on the abort (the hung frame among them) and ended with node 0's line
    assert journal1.count("stacks of every thread (the job's abort)") == 2, journal1[-3000:]
    assert "hang_for_test" in journal1 and "the job was ended: start-up stalled: rank 3 (target)" in journal1
    assert node1.returncode != 0
