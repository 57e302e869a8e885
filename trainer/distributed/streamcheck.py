"""A model of NCCL's rules, to decide on the CPU whether the op order the trainer issues can hang on GPUs.

gloo on the CPU blocks the host at every wait, so a gloo run that finishes says nothing about NCCL, where
ops are enqueued on CUDA streams and wait on each other *on the device*. This module takes each rank's
program (the ops its host issues, in order, each placed on a stream) and replays it under these rules:

  - the ops of one stream run in FIFO order (a CUDA stream; also each NCCL communicator's stream);
  - an NCCL op is enqueued on its communicator's stream, after the issuing stream's work so far
    (ProcessGroupNCCL makes its stream wait on the current stream when the op is posted);
  - a point-to-point op completes only when both ends have reached it (the k-th send from a to b on a
    communicator matches the k-th receive on b from a there); a collective only when every member has,
    and the k-th collectives of the members must be the same kind (else NCCL hangs or corrupts);
  - both ends of a point-to-point op, and every member of a collective, give the same element count
    (NCCL has no length on the wire: a 10-element send against a 20-element receive hangs or corrupts);
  - the first op on an NCCL communicator with a peer (the first collective on it, with every member)
    blocks the *host* until the peer's host reaches its own first op there: NCCL_RUNTIME_CONNECT (the
    default since 2.22) connects on first use, so two ranks that first use two communicators in
    opposite orders deadlock before anything is enqueued;
  - a process group's creation is a host collective of every rank: under eager init each rank splits
    the world communicator (`comm_split`, its color the new group's members, or no color outside it),
    paired across ranks by call order alone; a gloo group's members connect to each other when it is made;
  - `work.wait()` and `stream.wait_event(ev)` block the later work of *that stream*, not the host;
  - host waits (`event.synchronize()`, a gloo collective, a blocking `.wait()` on gloo) block the host,
    which then issues nothing more until the op completed;
  - launch order (`NCCL_LAUNCH_ORDER_IMPLICIT=1`, which run.sh sets; `launch_order=True`, the default):
    a rank's NCCL kernels *start* in host issue order across all its communicators (NCCL's launch-order
    stream, src/enqueue.cc): an NCCL op whose own dependencies are done still waits until the rank's
    previous NCCL op, on whatever communicator, has started. Independent queues per communicator
    (`launch_order=False`) pass programs that deadlock under this order.

Communicators: with eager init (`device_id` passed to `init_process_group`) ProcessGroupNCCL sends
unbatched P2P through the group's own communicator, serialised with every other op of that group
(`p2p="shared"`); without it each pair of ranks gets a communicator of its own (`p2p="pair"`); a
process group per (target, drafter) pair is the same as "pair" for our traffic.

`simulate` returns whether every rank's program completes; when it cannot, `Result.cycle` names the
wait cycle (or the op a peer never issues), one line per edge. With `dur` set on ops it is also a
timed replay: every op starts when its dependencies and its peers are ready, so the makespan shows what
an ordering costs (head-of-line blocking of one stream shared by several peers, for example).

Programs come from two places (trainer/distributed/oprecord.py): recorded from the real trainer on the CPU (gloo)
under a layer that logs our transport's and FSDP's calls with the stream they would run on, or built
from a DispatchPlan for hundreds of steps by driving the same loop with stages that only record.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Iterable


@dataclass(slots=True)
class Op:
    """One op on one rank's device queue (a CUDA stream or an NCCL communicator's stream)."""
    id: int
    rank: int
    queue: str                 # e.g. "drafter", "sender", "nccl:WORLD", "gloo:control"
    kind: str                  # compute | wait | send | recv | coll
    label: str
    deps: list[int] = field(default_factory=list)   # other ops (this rank's) that must complete first
    key: tuple | None = None   # comm ops: what all participants share
    dur: float = 0.0
    coll: str = ""             # collectives: the op's name (all_gather, reduce_scatter, ...), checked per key
    count: int | None = None   # elements the op moves (per rank), compared between the ends; None: not known
    color: tuple | None = None  # comm_split: the members of the group this rank splits for (None: no color)


class Program:
    """One rank's host program: device ops placed on queues, and host waits, in issue order.

    The builder methods mirror what our code calls: `compute` (kernels on a stream), `record`/`wait_event`
    (a CUDA event), `comm` (an NCCL/gloo op posted from a stream), `wait` (`work.wait()` on a stream),
    `host_wait` (the host blocks until an op completed)."""

    def __init__(self, rank: int, role: str = "", p2p: str = "shared", groups: dict | None = None):
        self.rank, self.role, self.p2p = rank, role, p2p
        self.ops: list[Op] = []
        self.actions: list[tuple[str, int]] = []      # ("issue", op index) | ("wait", op index)
        self._tail: dict[str, int | None] = {}
        self._pending_deps: dict[str, list[int]] = defaultdict(list)
        self._counts: dict[tuple, int] = defaultdict(int)
        self.groups = groups if groups is not None else {}

    # -- device ops ---------------------------------------------------------------------------------
    def _add(self, queue: str, kind: str, label: str, deps: Iterable[int] = (), key=None, dur=0.0,
             coll: str = "", count: int | None = None) -> int:
        deps = [d for d in deps if d is not None]
        pending = self._pending_deps.pop(queue, None)
        if pending:
            deps = list(dict.fromkeys(deps + pending))
        op = Op(len(self.ops), self.rank, queue, kind, label, deps, key, dur, coll, count)
        self.ops.append(op)
        self._tail[queue] = op.id
        self.actions.append(("issue", op.id))
        return op.id

    def tail(self, stream: str) -> int | None:
        """The last op on `stream` so far (what an event recorded now would mark)."""
        if self._pending_deps.get(stream):   # a wait with nothing after it yet: materialise it
            self._add(stream, "wait", "wait", ())
        return self._tail.get(stream)

    def compute(self, stream: str, label: str, dur: float = 0.0) -> int:
        return self._add(stream, "compute", label, dur=dur)

    def record(self, stream: str) -> int | None:
        return self.tail(stream)

    def wait_event(self, stream: str, ev: int | None) -> None:
        if ev is not None:
            self._pending_deps[stream].append(ev)

    def wait(self, stream: str, op: int) -> None:
        self._pending_deps[stream].append(op)

    def comm_queue(self, group: str, peer: int | None) -> str:
        if peer is not None and self.p2p == "pair":
            lo, hi = sorted((self.rank, peer))
            return f"nccl:{group}:{lo}-{hi}"
        return f"nccl:{group}"

    def send(self, stream: str | None, group: str, dst: int, label: str, dur: float = 0.0,
             count: int | None = None, queue: str | None = None) -> int:
        return self._p2p("send", stream, group, self.rank, dst, label, dur, count, queue)

    def recv(self, stream: str | None, group: str, src: int, label: str, dur: float = 0.0,
             count: int | None = None, queue: str | None = None) -> int:
        return self._p2p("recv", stream, group, src, self.rank, label, dur, count, queue)

    def _p2p(self, kind, stream, group, src, dst, label, dur, count=None, queue=None) -> int:
        q = queue or self.comm_queue(group, dst if kind == "send" else src)
        n = self._counts[(q, src, dst)]
        self._counts[(q, src, dst)] += 1
        after = self.tail(stream) if stream is not None else None
        return self._add(q, kind, label, [after], key=(group, q, src, dst, n), dur=dur, count=count)

    def collective(self, stream: str | None, group: str, name: str, label: str = "", dur: float = 0.0,
                   queue: str | None = None, count: int | None = None) -> int:
        q = queue or f"nccl:{group}"
        n = self._counts[(q, "coll")]
        self._counts[(q, "coll")] += 1
        after = self.tail(stream) if stream is not None else None
        return self._add(q, "coll", label or f"{name} #{n} on {group}", [after], key=(group, q, n), dur=dur,
                         coll=name, count=count)

    def split(self, color: list[int] | None, label: str = "") -> int:
        """One `ncclCommSplit` of the world communicator (a process group's creation under eager init): a
        host collective of every rank, `color` the members of the new group (None: this rank is outside)."""
        op = self.collective(None, "WORLD", "comm_split", label or f"comm_split for {color or 'no group'}",
                             queue="split:WORLD")
        self.ops[op].color = tuple(color) if color is not None else None
        self.host_wait(op)
        return op

    # -- host ---------------------------------------------------------------------------------------
    def host_wait(self, op: int | None) -> None:
        if op is not None:
            self.actions.append(("wait", op))

    def mark(self, text: str) -> None:
        """A boundary in the host program (a step's start); the replay ignores it."""
        self.actions.append(("mark", text))

    def marks(self) -> dict[str, int]:
        """Each mark's text -> the number of ops issued before it."""
        out, n = {}, 0
        for kind, x in self.actions:
            if kind == "issue":
                n += 1
            elif kind == "mark":
                out[x] = n
        return out

    def host_collective(self, group: str, name: str, label: str = "", count: int | None = None) -> int:
        """A blocking gloo collective: issued on the group's gloo queue, the host waits for it."""
        op = self.collective(None, group, name, label, queue=f"gloo:{group}", count=count)
        self.host_wait(op)
        return op

    # -- (de)serialisation ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"rank": self.rank, "role": self.role, "p2p": self.p2p, "groups": self.groups,
                "ops": [[o.queue, o.kind, o.label, o.deps, list(o.key) if o.key else None, o.dur, o.coll, o.count,
                         list(o.color) if o.color is not None else None] for o in self.ops],
                "actions": self.actions}

    @classmethod
    def from_json(cls, d: dict) -> "Program":
        p = cls(d["rank"], d.get("role", ""), d.get("p2p", "shared"), d.get("groups") or {})
        for i, (q, kind, label, deps, key, dur, coll, *more) in enumerate(d["ops"]):
            count, color = (more + [None, None])[:2]
            p.ops.append(Op(i, p.rank, q, kind, label, list(deps), tuple(key) if key else None, dur, coll, count,
                            tuple(color) if color is not None else None))
        p.actions = [tuple(a) for a in d["actions"]]
        return p


@dataclass
class Result:
    ok: bool
    cycle: list[str]            # empty when ok
    stuck: dict[int, str]       # rank -> what its host waits for / where it stopped (when not ok)
    makespan: float = 0.0
    done: dict[int, int] = field(default_factory=dict)   # rank -> ops completed
    times: dict = field(default_factory=dict)             # (rank, op id) -> end time, for rates

    def explain(self) -> str:
        if self.ok:
            return "no deadlock"
        return "deadlock:\n  " + "\n  ".join(self.cycle)


def is_nccl_kernel(op: Op) -> bool:
    """An op NCCL launches as a kernel (point-to-point or collective on a communicator's stream), the ops
    the launch order ties together; not a process group's creation, not gloo."""
    return op.queue.startswith("nccl:")


def simulate(programs: list[Program], groups: dict[str, list[int]] | None = None,
             launch_order: bool = True) -> Result:
    """Replay every rank's program under NCCL's rules (module docstring). `groups`: members per group
    name (collectives need every member); defaults to the union of the programs' own `groups`.
    `launch_order`: each rank's NCCL kernels start in host issue order across its communicators
    (NCCL_LAUNCH_ORDER_IMPLICIT=1, run.sh's environment)."""
    groups = dict(groups or {})
    for p in programs:
        for g, members in p.groups.items():
            groups.setdefault(g, members)
    by_rank = {p.rank: p for p in programs}
    # global op ids: (rank, local id)
    complete: dict[tuple, float] = {}          # op -> end time
    ready_at: dict[tuple, float] = {}          # comm op -> time it reached the front with deps done
    issued: set[tuple] = set()
    host_time = {r: 0.0 for r in by_rank}
    pc = {r: 0 for r in by_rank}               # next host action
    waiting_on: dict[tuple, list[int]] = defaultdict(list)   # op -> hosts blocked on it
    dependents: dict[tuple, list[tuple]] = defaultdict(list)
    remaining: dict[tuple, int] = {}
    prev_on_queue: dict[tuple, tuple | None] = {}
    last_on_queue: dict[tuple, tuple] = {}
    parts: dict[tuple, list[tuple]] = defaultdict(list)   # comm key -> ops that reached it (ready)
    issued_parts: dict[tuple, list[tuple]] = defaultdict(list)
    mismatch: list[str] = []
    work: deque = deque()
    launch_prev: dict[tuple, tuple | None] = {}    # NCCL op -> the rank's NCCL op issued before it
    last_nccl: dict[int, tuple] = {}
    started: dict[tuple, float] = {}                # NCCL op -> time its kernel started
    after_start: dict[tuple, list[tuple]] = defaultdict(list)   # op -> NCCL ops waiting for it to start

    def expected(op: Op) -> int:
        if op.kind in ("send", "recv"):
            return 2
        members = groups.get(op.key[0])
        if members is None:
            raise ValueError(f"rank {op.rank}: collective on unknown group {op.key[0]!r}")
        return len(members)

    def finish(gid: tuple, t: float):
        complete[gid] = t
        for d in dependents.pop(gid, ()):
            remaining[d] -= 1
            if remaining[d] == 0:
                work.append(("ready", d))
        for r in waiting_on.pop(gid, ()):
            host_time[r] = max(host_time[r], t)
            work.append(("host", r))

    def on_ready(gid: tuple):
        op = by_rank[gid[0]].ops[gid[1]]
        deps = [prev_on_queue[gid]] + [(gid[0], d) for d in op.deps]
        t = max([complete[d] for d in deps if d is not None] + [issue_time[gid]])
        if gid in launch_prev:   # launch order: not before the rank's previous NCCL kernel started
            before = launch_prev[gid]
            if before is not None and before not in started:
                after_start[before].append(gid)
                return
            t = max(t, started.get(before, t)) if before is not None else t
            started[gid] = t
            for d in after_start.pop(gid, ()):
                work.append(("ready", d))
        if op.key is None:
            finish(gid, t + op.dur)
            return
        ready_at[gid] = t
        key = op.key
        parts[key].append(gid)
        if len(parts[key]) == expected(op):
            ops = [by_rank[g[0]].ops[g[1]] for g in parts[key]]
            if op.kind == "coll" and len({o.coll for o in ops}) > 1:
                mismatch.append("collective mismatch on " + key[0] + ": " + ", ".join(
                    f"rank {o.rank} {o.label}" for o in ops))
                return
            if op.kind != "coll" and {o.kind for o in ops} != {"send", "recv"}:
                mismatch.append("point-to-point mismatch: " + ", ".join(f"rank {o.rank} {o.label}" for o in ops))
                return
            if len({o.count for o in ops if o.count is not None}) > 1:
                mismatch.append(f"size mismatch on {key[1]}: " + ", ".join(
                    f"rank {o.rank} {o.label} ({o.count} elements)" for o in ops))
                return
            if op.coll == "comm_split":
                for color in {o.color for o in ops if o.color is not None}:
                    givers = sorted(o.rank for o in ops if o.color == color)
                    if givers != sorted(color):
                        mismatch.append(f"comm_split #{key[2]} of the world communicator: ranks {givers} split for "
                                        f"group {list(color)}, whose other members split for something else: "
                                        + ", ".join(f"rank {o.rank} {o.label}" for o in ops))
                        return
            end = max(ready_at[g] for g in parts[key]) + max(o.dur for o in ops)
            for g in parts[key]:
                finish(g, end)

    issue_time: dict[tuple, float] = {}
    connected: dict[int, set] = defaultdict(set)          # rank -> communicator links it has used
    arrived: dict[tuple, dict[int, float]] = defaultdict(dict)   # link -> rank -> host time it got there
    connecting: dict[int, tuple] = {}                     # rank -> (link, parties) its host is blocked on

    def first_use(r: int, op: Op) -> bool:
        """NCCL_RUNTIME_CONNECT: the first op on a communicator with a peer (a collective: with every member)
        blocks the host until the peer's host reached its own. True when this rank must wait."""
        if not op.queue.startswith("nccl:") or op.key is None:
            return False
        link = (op.queue, frozenset(op.key[2:4])) if op.kind in ("send", "recv") else (op.queue, "coll")
        if link in connected[r]:
            return False
        connected[r].add(link)
        parties = set(link[1]) if op.kind in ("send", "recv") else set(groups.get(op.key[0], ()))
        arrived[link][r] = host_time[r]
        if not parties <= set(arrived[link]):
            connecting[r] = (link, parties)
            return True
        t = max(arrived[link].values())
        host_time[r] = max(host_time[r], t)
        for x in [x for x, (lk, _) in connecting.items() if lk == link]:
            del connecting[x]
            host_time[x] = max(host_time[x], t)
            work.append(("host", x))
        return False

    def run_host(r: int):
        p = by_rank[r]
        if r in connecting:
            return
        while pc[r] < len(p.actions):
            kind, i = p.actions[pc[r]]
            if kind == "mark":
                pc[r] += 1
                continue
            gid = (r, i)
            if kind == "wait":
                if gid not in complete:
                    if r not in waiting_on[gid]:
                        waiting_on[gid].append(r)
                    return
                host_time[r] = max(host_time[r], complete[gid])
                pc[r] += 1
                continue
            op = p.ops[i]
            issued.add(gid)
            issue_time[gid] = host_time[r]
            if launch_order and is_nccl_kernel(op):
                launch_prev[gid] = last_nccl.get(r)
                last_nccl[r] = gid
            qk = (r, op.queue)
            prev = last_on_queue.get(qk)
            prev_on_queue[gid] = prev
            last_on_queue[qk] = gid
            deps = [prev] + [(r, d) for d in op.deps]
            n = 0
            for d in deps:
                if d is not None and d not in complete:
                    dependents[d].append(gid)
                    n += 1
            remaining[gid] = n
            if op.key is not None:
                issued_parts[op.key].append(gid)
            if n == 0:
                work.append(("ready", gid))
            pc[r] += 1
            if first_use(r, op):
                return
            # drain device work as we go keeps the queues short
            while work:
                w = work.popleft()
                if w[0] == "ready":
                    on_ready(w[1])
                else:
                    other.append(w[1])

    other: list[int] = []
    for r in by_rank:
        work.append(("host", r))
    while work or other:
        while work:
            w = work.popleft()
            if w[0] == "ready":
                on_ready(w[1])
            else:
                run_host(w[1])
        while other:
            run_host(other.pop())

    total = sum(len(p.ops) for p in programs)
    hosts_done = all(pc[r] == len(by_rank[r].actions) for r in by_rank)
    makespan = max(complete.values(), default=0.0)
    done = defaultdict(int)
    for g in complete:
        done[g[0]] += 1
    if hosts_done and len(complete) == total and not mismatch:
        return Result(True, [], {}, makespan, dict(done), complete)
    return Result(False, mismatch or _find_cycle(by_rank, complete, issued, prev_on_queue, issued_parts, pc,
                                                 groups, connecting, arrived, launch_prev, started),
                  _stuck(by_rank, pc, connecting, arrived), makespan, dict(done), complete)


def _describe(by_rank, gid) -> str:
    if gid[0] == "host":
        r = gid[1]
        return f"rank {r} ({by_rank[r].role}) host"
    op = by_rank[gid[0]].ops[gid[1]]
    return f"rank {op.rank} ({by_rank[op.rank].role}) {op.queue}: {op.label}"


def _stuck(by_rank, pc, connecting=None, arrived=None) -> dict[int, str]:
    out = {}
    for r, p in by_rank.items():
        if connecting and r in connecting:
            link, parties = connecting[r]
            out[r] = f"host connecting {link[0]} (first use) with rank(s) {sorted(parties - set(arrived[link]))}"
        elif pc[r] < len(p.actions):
            kind, i = p.actions[pc[r]]
            out[r] = f"host blocked on {_describe(by_rank, (r, i))}" if kind == "wait" else "host stopped"
    return out


def _find_cycle(by_rank, complete, issued, prev_on_queue, issued_parts, pc, groups, connecting=None,
                arrived=None, launch_prev=None, started=None) -> list[str]:
    """A wait-for cycle among incomplete ops and blocked hosts, one line per edge."""
    connecting = connecting or {}
    launch_prev, started = launch_prev or {}, started or {}

    def edges(node):
        if node[0] == "host":
            r = node[1]
            p = by_rank[r]
            if r in connecting:
                link, parties = connecting[r]
                return [(("host", x), f"first use of {link[0]} waits for the host of")
                        for x in sorted(parties - set(arrived[link]))]
            if pc[r] < len(p.actions):
                kind, i = p.actions[pc[r]]
                if kind == "wait":
                    return [((r, i), "host waits for")]
            return []
        op = by_rank[node[0]].ops[node[1]]
        out = []
        prev = prev_on_queue.get(node)
        if prev is not None and prev not in complete:
            out.append((prev, "queued behind"))
        for d in op.deps:
            if (node[0], d) not in complete:
                out.append(((node[0], d), "waits on"))
        before = launch_prev.get(node)
        if before is not None and before not in started and node not in started:
            out.append((before, "starts after (launch order)"))
        if out or op.key is None:
            return out
        # deps done: waiting for peers
        have = {g[0] for g in issued_parts[op.key]}
        if op.kind in ("send", "recv"):
            src, dst = op.key[2], op.key[3]
            want = [dst if op.kind == "send" else src]
        else:
            want = groups.get(op.key[0], [])
        for r in want:
            if r == node[0]:
                continue
            peer = [g for g in issued_parts[op.key] if g[0] == r]
            if peer:
                if peer[0] not in complete:
                    out.append((peer[0], "needs its peer"))
            elif r not in have:
                out.append((("host", r), "needs a peer op not yet issued by"))
        return out

    starts = [("host", r) for r in by_rank if pc[r] < len(by_rank[r].actions)]
    starts += [g for g in issued if g not in complete]
    color: dict = {}

    def dfs(start):
        stack = [(start, iter(edges(start)))]
        color[start] = 1
        path = [(start, None)]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = 2
                stack.pop()
                path.pop()
                continue
            child, why = nxt
            path[-1] = (node, why)
            if color.get(child) == 1:
                i = [n for n, _ in path].index(child)
                cyc = path[i:]
                return [f"{_describe(by_rank, n)}  --{w}-->" for n, w in cyc] + [_describe(by_rank, child)]
            if color.get(child) is None:
                color[child] = 1
                stack.append((child, iter(edges(child))))
                path.append((child, None))
        return None

    for s in starts:
        if color.get(s) is None:
            c = dfs(s)
            if c:
                return c
    # no cycle: someone waits for an op a peer never issues (a count mismatch)
    lines = []
    for r, (link, parties) in sorted(connecting.items()):
        missing = ", ".join(f"rank {x}" for x in sorted(parties - set(arrived[link])))
        lines.append(f"{_describe(by_rank, ('host', r))}: first use of {link[0]} waits for {missing}, "
                     "which never issues it")
    for g in sorted(issued - set(complete))[:5]:
        for child, why in edges(g):
            if child[0] == "host":
                lines.append(f"{_describe(by_rank, g)}: {why} rank {child[1]}, which never issues it")
    return lines or ["no progress (no cycle found): " + "; ".join(_stuck(by_rank, pc).values())]


def window(p: Program, start: str, end: str) -> list[tuple]:
    """What `p`'s host did between two marks, in a form two programs can be compared in: each op as
    (queue, kind, label, collective, its dependencies as offsets back from itself, or "before" for an op
    issued before `start`, its comm key without the running counter), each host wait likewise."""
    marks = p.marks()
    if start not in marks or end not in marks:
        raise KeyError(f"rank {p.rank}: no mark {start!r} or {end!r}")
    lo = marks[start]                       # op ids are issue order: ops before `start` have ids < lo
    rel = lambda d, me: "before" if d < lo else str(me - d)   # noqa: E731
    out, inside = [], False
    for kind, x in p.actions:
        if kind == "mark":
            if x in (start, end):
                inside = x == start
            continue
        if not inside:
            continue
        if kind == "wait":
            out.append(("host waits", rel(x, lo)))
            continue
        o = p.ops[x]
        key = None if o.key is None else (o.key[:2] if o.kind == "coll" else o.key[:-1])
        out.append((o.queue, o.kind, o.label, o.coll, tuple(sorted(rel(d, o.id) for d in set(o.deps))), key))
    return out


def load_programs(paths) -> list[Program]:
    return [Program.from_json(json.loads(open(p).read())) for p in paths]


def check_dir(path) -> Result:
    """Check the programs a recorded run wrote (`DFLASH_RECORD_OPS=<path>`, one ops-rank<r>.json per rank)."""
    from pathlib import Path
    files = sorted(Path(path).glob("ops-rank*.json"))
    if not files:
        raise FileNotFoundError(f"{path}: no ops-rank*.json (record a run with DFLASH_RECORD_OPS={path})")
    return simulate(load_programs(files))


def timing(res: Result, programs: list[Program]) -> dict:
    """A timed replay's figures. busiest_rank_s: the largest sum of one rank's compute durations (the slower
    stage, if nothing ever waited); step_bound_s: the sum over steps of the busiest drafter rank's compute
    in that step (the best any schedule with a per-step optimizer barrier can do). efficiency =
    busiest / makespan; pipeline_efficiency = step bound / makespan (what the op order itself costs)."""
    busy = {p.rank: sum(o.dur for o in p.ops if o.kind == "compute") for p in programs}
    worst = max(busy.values(), default=0.0)
    per_step: dict[int, float] = {}
    for p in programs:
        if "drafter" not in p.role:
            continue
        bounds = sorted((n, int(t.split()[1])) for t, n in p.marks().items() if t.startswith("step "))
        for k, (lo, step) in enumerate(bounds):
            hi = bounds[k + 1][0] if k + 1 < len(bounds) else len(p.ops)
            d = sum(o.dur for o in p.ops[lo:hi] if o.kind == "compute" and o.label.startswith("drafter"))
            per_step[step] = max(per_step.get(step, 0.0), d)
    bound = sum(per_step.values())
    ok = res.ok and res.makespan > 0
    return {"makespan_s": round(res.makespan, 3), "busiest_rank_s": round(worst, 3), "step_bound_s": round(bound, 3),
            "efficiency": round(worst / res.makespan, 4) if ok else None,
            "pipeline_efficiency": round(bound / res.makespan, 4) if ok and bound else None}


def with_p2p(p: Program, mode: str) -> Program:
    """The same program with its point-to-point ops on the group's communicator ("shared") or on one
    communicator per pair of ranks ("pair")."""
    q = Program(p.rank, p.role, mode, p.groups)
    remap = {}
    for o in p.ops:
        queue, key = o.queue, o.key
        if o.kind in ("send", "recv"):
            group, src, dst, n = key[0], key[2], key[3], key[4]
            peer = dst if o.kind == "send" else src
            queue = q.comm_queue(group, peer)
            key = (group, queue, src, dst, n)
        remap[o.id] = Op(o.id, o.rank, queue, o.kind, o.label, list(o.deps), key, o.dur, o.coll)
    q.ops = [remap[o.id] for o in p.ops]
    q.actions = list(p.actions)
    return q

