"""Several nodes (issue 54, item 7): a host that vanishes ends the job on the others within --dist-timeout plus
a margin, through heartbeats in the job's store (trainer/distributed/heartbeat.py), instead of the 3 h the
gloo host phases wait. On a real TCPStore, in-process; the two-node stand-in with a traffic drop is the
molecule multinode scenario's to run."""
from __future__ import annotations

import time

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


def test_the_bound_is_the_dist_timeout_plus_a_margin():
    assert 600 < heartbeat_bound(600) <= 600 + 60
