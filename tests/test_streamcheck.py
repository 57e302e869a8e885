"""The NCCL-rules checker (trainer/streamcheck.py) on programs small enough to reason about by hand.

Each case is a rule of the real system: if the checker broke one, a hang on GPUs would pass CI."""

from __future__ import annotations

import pytest

from trainer.streamcheck import Program, main, simulate, with_p2p

G3 = {"WORLD": [0, 1, 2], "drafters": [0, 1]}


def _pipeline(mode: str, allgather_first: bool, depth: int = 2) -> list[Program]:
    """1 target (rank 2) feeding drafters A (rank 0: micro-batches 0, 1, 2) and B (rank 1: 3), the
    target sending in micro-batch order; each drafter posts `depth` receives ahead on its compute
    stream and all-gathers its parameters either at its first forward (after the first receive wait,
    FSDP's own order) or before any receive wait."""
    t, a, b = (Program(r, role, mode, G3) for r, role in ((2, "target"), (0, "drafter A"), (1, "drafter B")))
    for mb, dst in ((0, 0), (1, 0), (2, 0), (3, 1)):
        t.compute("target", f"forward mb {mb}")
        t.wait_event("sender", t.record("target"))
        t.send("sender", "WORLD", dst, f"send mb {mb}")
    for p, mbs in ((a, [0, 1, 2]), (b, [3])):
        if allgather_first:
            p.wait("drafter", p.collective("drafter", "drafters", "all_gather"))
        posted = [(mb, p.recv("drafter", "WORLD", 2, f"recv mb {mb}")) for mb in mbs[:depth]]
        for i, mb in enumerate(mbs):
            _, r = posted.pop(0)
            p.wait("drafter", r)
            if i == 0 and not allgather_first:
                p.wait("drafter", p.collective("drafter", "drafters", "all_gather"))
            p.compute("drafter", f"fwd+bwd mb {mb}")
            if i + depth < len(mbs):
                nxt = mbs[i + depth]
                posted.append((nxt, p.recv("drafter", "WORLD", 2, f"recv mb {nxt}")))
        p.wait("drafter", p.collective("drafter", "drafters", "reduce_scatter"))
    return [a, b, t]


def test_the_collective_behind_a_receive_wait_hangs_and_the_cycle_is_named():
    res = simulate(_pipeline("shared", allgather_first=False))
    assert not res.ok
    text = "\n".join(res.cycle)
    # the four edges of the cycle the issue describes
    assert "send mb 3  --queued behind-->" in text and "send mb 2" in text
    assert "recv mb 2" in text and "all_gather" in text and "recv mb 3" in text


def test_all_gather_before_the_first_receive_wait_cannot_hang():
    assert simulate(_pipeline("shared", allgather_first=True)).ok


def test_a_communicator_per_pair_removes_the_shared_fifo():
    assert simulate(_pipeline("pair", allgather_first=False)).ok
    assert simulate([with_p2p(p, "pair") for p in _pipeline("shared", allgather_first=False)]).ok


def test_one_receive_buffer_still_hangs_without_the_fix_and_not_with_it():
    assert not simulate(_pipeline("shared", allgather_first=False, depth=1)).ok
    assert simulate(_pipeline("shared", allgather_first=True, depth=1)).ok


def test_point_to_point_matches_in_order_per_pair_and_an_unmatched_send_is_named():
    """The k-th send a->b matches the k-th receive on b from a; a send whose receive is never posted
    (a count mismatch between the ends' plans) is reported with the rank that never posts it."""
    g = {"WORLD": [0, 1]}
    a, b = Program(0, "a", groups=g), Program(1, "b", groups=g)
    a.host_wait(a.send("s", "WORLD", 1, "send x"))
    a.send("s", "WORLD", 1, "send y")
    r0 = b.recv("s", "WORLD", 0, "recv x")
    b.recv("s", "WORLD", 0, "recv y")
    b.host_wait(r0)
    assert simulate([a, b]).ok
    a, b = Program(0, "a", groups=g), Program(1, "b", groups=g)
    a.host_wait(a.send(None, "WORLD", 1, "send x"))
    a.send(None, "WORLD", 1, "send y")
    b.host_wait(b.recv(None, "WORLD", 0, "recv x"))
    res = simulate([a, b])
    assert not res.ok and res.cycle == ["rank 0 (a) nccl:WORLD: send y: needs a peer op not yet issued by rank 1, "
                                        "which never issues it"]


def test_a_stream_wait_blocks_only_that_stream_a_host_wait_blocks_everything_after_it():
    g = {"WORLD": [0, 1]}
    # rank 0 waits (on its compute stream) for a receive whose send rank 1 issues later: fine
    a, b = Program(0, "a", groups=g), Program(1, "b", groups=g)
    r = a.recv("compute", "WORLD", 1, "recv")
    a.wait("compute", r)
    a.compute("compute", "use it")
    a.send("comm", "WORLD", 1, "reply")
    b.compute("compute", "work")
    b.send("comm", "WORLD", 0, "send")
    b.recv("comm", "WORLD", 0, "recv reply")
    # rank 0's reply is posted on the "comm" stream of the shared communicator, behind its receive: fine
    assert simulate([a, b]).ok
    # the same wait on the host, with the peer's send issued only after the peer's host waits for
    # our reply: a host cycle
    a, b = Program(0, "a", groups=g), Program(1, "b", groups=g)
    r = a.recv(None, "WORLD", 1, "recv")
    a.host_wait(r)
    a.send(None, "WORLD", 1, "reply")
    rr = b.recv(None, "WORLD", 0, "recv reply")
    b.host_wait(rr)
    b.send(None, "WORLD", 0, "send")
    res = simulate([a, b])
    assert not res.ok and any("host waits for" in line for line in res.cycle)


def test_collectives_need_every_member_and_the_same_kind():
    g = {"drafters": [0, 1]}
    a, b = Program(0, "a", groups=g), Program(1, "b", groups=g)
    a.collective("s", "drafters", "all_gather")
    b.collective("s", "drafters", "reduce_scatter")
    res = simulate([a, b])
    assert not res.ok and "collective mismatch" in res.cycle[0]
    a, b = Program(0, "a", groups=g), Program(1, "b", groups=g)
    a.host_wait(a.collective("s", "drafters", "all_gather"))
    res = simulate([a, b])
    assert not res.ok and "never issues it" in res.cycle[0] and "rank 1" in res.cycle[0]


def test_ops_of_one_communicator_run_in_fifo_order_across_peers():
    """Rank 0 posts a send to rank 1 then one to rank 2 on one communicator; rank 2 must receive
    before it can let rank 1 receive (rank 1 waits for rank 2's signal on its stream)."""
    g = {"WORLD": [0, 1, 2]}
    def build(mode):
        r0, r1, r2 = (Program(r, str(r), mode, g) for r in range(3))
        r0.send("comm", "WORLD", 1, "send to 1")
        r0.send("comm", "WORLD", 2, "send to 2")
        sig = r2.recv("c", "WORLD", 0, "recv from 0")
        r2.wait("c", sig)
        r2.send("c", "WORLD", 1, "signal 1")
        w = r1.recv("c", "WORLD", 2, "wait for 2's signal")
        r1.wait("c", w)
        r1.recv("c", "WORLD", 0, "recv from 0")
        return [r0, r1, r2]
    assert not simulate(build("shared")).ok    # rank 1's signal receive and its data receive share a FIFO
    assert simulate(build("pair")).ok


def test_timed_replay_charges_head_of_line_blocking():
    """One target sending to two drafters: with one FIFO the second drafter's data waits behind the first
    drafter's transfer; with a communicator per pair it does not."""
    g = {"WORLD": [0, 1, 2]}
    def build(mode):
        t, a, b = Program(2, "t", mode, g), Program(0, "a", mode, g), Program(1, "b", mode, g)
        for k in range(4):
            t.compute("target", f"fwd {k}", dur=1.0)
            ev = t.record("target")
            t.wait_event("sender", ev)
            t.send("sender", "WORLD", k % 2, f"send {k}", dur=3.0 if k % 2 == 0 else 0.1)
        for p, ks in ((a, (0, 2)), (b, (1, 3))):
            for k in ks:
                p.wait("d", p.recv("d", "WORLD", 2, f"recv {k}", dur=3.0 if k % 2 == 0 else 0.1))
                p.compute("d", f"train {k}", dur=1.0)
        return [a, b, t]
    shared, pair = simulate(build("shared")), simulate(build("pair"))
    assert shared.ok and pair.ok
    assert pair.makespan < shared.makespan


def test_the_cli_exits_2_on_a_directory_without_programs(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 2
    assert "no ops-rank" in capsys.readouterr().err


def test_programs_round_trip_through_json():
    progs = _pipeline("shared", False)
    again = [Program.from_json(p.to_json()) for p in progs]
    assert simulate(again).cycle == simulate(progs).cycle


@pytest.mark.parametrize("mode", ["shared", "pair"])
def test_sender_slot_ring_bounds_what_is_in_flight(mode):
    """A target with one slot cannot pack micro-batch k+1 before micro-batch k's send completed; with the
    drafter all-gathering first the pipeline still completes."""
    t, a, b = Program(2, "t", mode, G3), Program(0, "a", mode, G3), Program(1, "b", mode, G3)
    sends = []
    for mb, dst in ((0, 0), (1, 0), (2, 0), (3, 1)):
        if sends:
            t.wait("target", sends[-1])       # reclaim the only slot
        t.compute("target", f"fwd {mb}")
        t.wait_event("sender", t.record("target"))
        sends.append(t.send("sender", "WORLD", dst, f"send {mb}"))
    for p, mbs in ((a, [0, 1, 2]), (b, [3])):
        p.wait("d", p.collective("d", "drafters", "all_gather"))
        for mb in mbs:
            p.wait("d", p.recv("d", "WORLD", 2, f"recv {mb}"))
            p.compute("d", f"train {mb}")
        p.wait("d", p.collective("d", "drafters", "reduce_scatter"))
    assert simulate([a, b, t]).ok
