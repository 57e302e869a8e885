"""Recording layer: the ops a rank really issues, with the stream each would run on under NCCL.

With `DFLASH_RECORD_OPS=<dir>` set, a rank (on the CPU, gloo) runs unchanged but logs, in issue order,
from the moment its default group exists:
  - the creation of every process group (`dist.new_group`, as `groups.new_group` calls it), as the
    production ranks make it under eager NCCL init: a split of the world communicator on every rank (with
    the group's members as its color on a member of an NCCL group, without on a rank outside the group
    unless it was made with local synchronization), and the members' connection of a gloo group;
  - streams: `transport.new_stream` hands out a named logical stream instead of None; `stream_ctx` makes it
    current; `wait_event`/`wait_stream`/`synchronize` on it are logged;
  - events: `transport.new_event` hands out an event that logs `record` (the stream's tail), `wait`
    (a stream dependency) and `synchronize` (a host wait);
  - every torch.distributed call of the trainer and of FSDP2/DTensor (point-to-point, blocking or not,
    collectives, object calls, functional collectives), with the element count it moves: on a group that
    is NCCL in production ("WORLD", "drafters", "pair:t-d") it is an NCCL op posted after the current
    stream's work, and `work.wait()` (or a blocking call) is a dependency of the current stream; on a gloo
    group ("control", "dctl") it runs on the group's gloo queue and a blocking call or `wait()` blocks the
    host. An object call is the two messages torch sends (the sizes, then the pickled bytes);
  - FSDP2's root pre-forward: its all-gather streams wait on the current stream (or on the event given
    to `set_post_optim_event`), so an all-gather issued in a forward depends on what the stream waited on
    before it; the all-gather's result is waited on by the current stream;
  - compute markers (`compute(stream, label)`) the loop places after each stage's work, for readable cycles.
At exit it writes `<dir>/ops-rank<r>.json`, a `streamcheck.Program`; `python -m trainer.tools.streamcheck_cli
check <dir>` decides whether those programs can hang under NCCL's rules.

Nothing here changes what the rank computes: every call still goes to gloo. Without the variable every
hook is a no-op (`RECORDER is None`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
from pathlib import Path

from trainer.distributed.streamcheck import Program

ENV = "DFLASH_RECORD_OPS"
NCCL_GROUPS = ("WORLD", "drafters")       # NCCL on GPUs (and every "pair:t-d"); the others are gloo everywhere
FSDP_AG = "fsdp_all_gather"               # FSDP2's all-gather stream

RECORDER: "Recorder | None" = None


class LogicalStream:
    """Stands in for a torch.cuda.Stream while recording: a name the program's ops are placed on."""

    def __init__(self, rec: "Recorder", name: str):
        self.rec, self.name = rec, name

    def wait_event(self, ev) -> None:
        if isinstance(ev, RecEvent):
            self.rec.program.wait_event(self.name, ev.op)

    def wait_stream(self, other) -> None:
        if isinstance(other, LogicalStream):
            self.rec.program.wait_event(self.name, self.rec.program.record(other.name))

    def synchronize(self) -> None:
        self.rec.program.host_wait(self.rec.program.record(self.name))

    def query(self) -> bool:
        return True

    def __repr__(self):
        return f"LogicalStream({self.name})"


class RecEvent:
    """Stands in for torch.cuda.Event (and transport.HostEvent) while recording."""

    def __init__(self, rec: "Recorder"):
        self.rec, self.op = rec, None

    def record(self, stream=None):
        self.op = self.rec.program.record(self.rec.stream_name(stream))
        return self

    def synchronize(self):
        self.rec.program.host_wait(self.op)

    def query(self):
        return True

    def wait(self, stream=None):
        self.rec.program.wait_event(self.rec.stream_name(stream), self.op)

    def elapsed_time(self, other):
        return 0.0


def _work_base():
    import torch.distributed as dist
    return dist.distributed_c10d.Work


class RecWork(_work_base()):
    """A torch.distributed Work whose wait() is logged (a stream dependency for NCCL groups, a host wait
    for gloo ones) before the real (gloo) wait. A Work subclass: FSDP2 waits on an all-gather's work only
    when it is one (isinstance), and a wrapper that is not would skip the wait (and the recorded edge)."""

    def __init__(self, rec: "Recorder", work, op: int, nccl: bool):
        super().__init__()
        self._rec, self._work, self._op, self._nccl = rec, work, op, nccl

    def wait(self, *a, **k):
        self._rec.waited(self._op, self._nccl)
        return self._work.wait(*a, **k) if self._work is not None else True

    def is_completed(self):
        return self._work.is_completed() if self._work is not None else True

    def is_success(self):
        return self._work.is_success() if self._work is not None else True

    def result(self):
        return self._work.result() if self._work is not None else []

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self.__dict__["_work"], name)


class Recorder:
    def __init__(self, rank: int, role: str, groups: dict, members: dict[str, list[int]], out_dir: str):
        self.rank, self.out_dir = rank, (Path(out_dir) if out_dir else None)
        self.program = Program(rank, role, "shared", dict(members))
        self.by_pg: dict[int, str] = {}
        self.names: dict = {}
        self.name(role, groups, members)
        self.stack: list[str] = []
        self.post_optim: dict[int, int | None] = {}   # FSDP state id -> event op given by set_post_optim_event
        self._label: str | None = None
        self._undo: list = []

    def name(self, role: str, groups: dict, members: dict[str, list[int]]) -> None:
        """Our names of the process groups (and the role, once known)."""
        if role:
            self.program.role = role
        self.by_pg.update({id(pg): name for name, pg in groups.items() if pg is not None})
        self.names.update({getattr(pg, "group_name", None): name for name, pg in groups.items() if pg is not None})
        self.program.groups.update({k: list(v) for k, v in members.items()})

    def created(self, name: str, members: list[int], nccl: bool, local: bool, pg) -> None:
        """A new process group (module docstring: what each rank does under eager NCCL init)."""
        self.program.groups[name] = list(members)
        if pg is not None and pg is not _non_member():
            self.by_pg[id(pg)] = name
            self.names[getattr(pg, "group_name", None)] = name
        if self.rank in members:
            if nccl:
                self.program.split(members, f"comm_split for {name}")
            elif len(members) > 1:
                self.program.host_collective(name, "gloo_connect", f"gloo connect of {name}")
        elif not local:
            self.program.split(None, f"comm_split (no color) for {name}")

    # -- streams -----------------------------------------------------------------------------------
    def stream_name(self, stream=None) -> str:
        if isinstance(stream, LogicalStream):
            return stream.name
        return self.stack[-1] if self.stack else "default"

    @contextlib.contextmanager
    def on(self, stream: LogicalStream):
        self.stack.append(stream.name)
        try:
            yield stream
        finally:
            self.stack.pop()

    def label(self, text: str) -> None:
        """The label of the next logged op (our transport names the micro-batch it moves)."""
        self._label = text

    def _take_label(self, default: str) -> str:
        lab, self._label = self._label, None
        return lab or default

    def waited(self, op: int, nccl: bool) -> None:
        if nccl:
            self.program.wait(self.stream_name(), op)
        else:
            self.program.host_wait(op)

    # -- torch.distributed -----------------------------------------------------------------------------
    def group(self, group) -> str:
        import torch.distributed as dist
        if group is None or group is dist.group.WORLD:
            return "WORLD"
        if isinstance(group, tuple):         # DTensor: (mesh, dim)
            mesh, dim = group
            group = mesh.get_group(dim)
        if isinstance(group, str):
            return self.names.get(group, group)
        return self.by_pg.get(id(group)) or self.names.get(getattr(group, "group_name", None), "WORLD")

    def p2p(self, kind: str, peer: int, group, work, count: int | None = None, blocking: bool = False,
            host: bool = False):
        """A send or receive with `peer` (a global rank). `blocking`: dist.send/recv (the current stream waits
        on an NCCL one, the host on a gloo one); `host`: the host waits whatever the backend (an object call
        unpickles what it received)."""
        g = self.group(group)
        peer = int(peer)
        nccl = _nccl(g)
        stream = self.stream_name() if nccl else None
        lab = self._take_label(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}")
        queue = None if nccl else f"gloo:{g}"
        if kind == "send":
            op = self.program.send(stream, g, peer, lab, count=count, queue=queue)
        else:
            op = self.program.recv(stream, g, peer, lab, count=count, queue=queue)
        if host or (blocking and not nccl):
            self.program.host_wait(op)
        elif blocking:
            self.program.wait(stream, op)
        return work if blocking or host else RecWork(self, work, op, nccl)

    def coll(self, name: str, group, work, async_op: bool, functional: bool = False, count: int | None = None,
             host: bool = False):
        g = self.group(group)
        nccl = _nccl(g)
        lab = self._take_label(f"{name} on {g}")
        if not nccl:
            op = self.program.collective(None, g, name, lab, queue=f"gloo:{g}", count=count)
            if not async_op:
                self.program.host_wait(op)
            return RecWork(self, work, op, False) if async_op else work
        stream = self.stream_name()
        op = self.program.collective(stream, g, name, lab, count=count)
        if host:
            self.program.host_wait(op)
        elif not async_op or functional:     # a synchronous NCCL call = the current stream waits on it
            self.program.wait(stream, op)
        return RecWork(self, work, op, True) if async_op else work

    def root_pre_forward(self, state) -> None:
        """FSDP2's root pre-forward: the all-gather streams wait on the post-optim event or the current stream."""
        if getattr(state._state_ctx, "iter_forward_root", None) is not None:
            return
        ev = getattr(state._state_ctx, "post_optim_event", None)
        dep = ev.op if isinstance(ev, RecEvent) else self.program.record(self.stream_name())
        self.program.wait_event(FSDP_AG, dep)

    # -- output ------------------------------------------------------------------------------------
    def write(self) -> Path | None:
        if self.out_dir is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"ops-rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.program.to_json()))
        os.replace(tmp, path)
        return path

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _nccl(group_name: str) -> bool:
    return group_name in NCCL_GROUPS or group_name.startswith("pair:")


def _non_member():
    import torch.distributed as dist
    return dist.GroupMember.NON_GROUP_MEMBER


def _numel(x) -> int | None:
    n = getattr(x, "numel", None)
    return int(n()) if callable(n) else None


def _patch(rec: Recorder, obj, name: str, make):
    old = getattr(obj, name)
    setattr(obj, name, make(old))
    rec._undo.append(lambda: setattr(obj, name, old))


def install(rank: int, role: str, groups: dict, members: dict[str, list[int]], out_dir: str) -> Recorder:
    """Start recording this rank (module docstring). `groups`: our name -> process group."""
    global RECORDER
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    rec = Recorder(rank, role, groups, members, out_dir)

    def peer_group(kind, args, kw):
        """(global peer rank, group) of a point-to-point call, its peer given by position or keyword."""
        group = kw.get("group", args[1] if len(args) > 1 else None)
        peer = kw.get("dst" if kind == "send" else "src", args[0] if args else None)
        if peer is None:           # the group_dst= / group_src= form: a rank within `group`
            peer = dist.get_global_rank(group, kw["group_dst" if kind == "send" else "group_src"])
        return peer, group

    def p2p(kind, blocking):
        def make(old):
            def wrapped(tensor, *args, **kw):
                peer, group = peer_group(kind, args, kw)
                return rec.p2p(kind, peer, group, old(tensor, *args, **kw), _numel(tensor), blocking)
            return wrapped
        return make

    _patch(rec, dist, "isend", p2p("send", False))
    _patch(rec, dist, "irecv", p2p("recv", False))
    _patch(rec, dist, "send", p2p("send", True))
    _patch(rec, dist, "recv", p2p("recv", True))

    def object_p2p(kind):
        # torch sends an object list as two messages: the sizes (one per object), then the pickled bytes (their
        # total, which the receiver learns from the first); the receiver's host unpickles, so it waits
        def make(old):
            def wrapped(object_list, *args, **kw):
                peer, group = peer_group(kind, args, kw)
                out = old(object_list, *args, **kw)
                for what, count in (("sizes", len(object_list)), ("objects", None)):
                    rec.label(f"{kind}_object_list ({what}) {'to' if kind == 'send' else 'from'} rank {peer}")
                    rec.p2p(kind, peer, group, None, count, blocking=True, host=True)
                return out
            return wrapped
        return make

    _patch(rec, dist, "send_object_list", object_p2p("send"))
    _patch(rec, dist, "recv_object_list", object_p2p("recv"))

    def object_coll(name, group_pos, count_of):
        # the sizes, then the objects padded to the largest (torch's object collectives), the host waiting
        def make(old):
            def wrapped(*args, **kw):
                group = kw.get("group", args[group_pos] if len(args) > group_pos else None)
                out = old(*args, **kw)
                for what, count in (("sizes", count_of(args, kw)), ("objects", None)):
                    rec.label(f"{name} ({what})")
                    rec.coll(name, group, None, False, count=count, host=True)
                return out
            return wrapped
        return make

    one = lambda args, kw: 1   # noqa: E731  (one size per rank)
    for name, pos, count_of in (
            ("all_gather_object", 2, one), ("gather_object", 3, one),
            ("broadcast_object_list", 2, lambda args, kw: len(args[0] if args else kw["object_list"])),
            ("scatter_object_list", 3, one)):
        if hasattr(dist, name):
            _patch(rec, dist, name, object_coll(name, pos, count_of))

    def new_group(old):
        def wrapped(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                    *a, **kw):
            name = rec._take_label(f"group{len(rec.program.groups)}")
            pg = old(ranks, timeout, backend, pg_options, use_local_synchronization, *a, **kw)
            world = dist.get_world_size()
            members = sorted(ranks) if ranks is not None else list(range(world))
            rec.created(name, members, backend in (None, "nccl"), bool(use_local_synchronization), pg)
            return pg
        return wrapped

    _patch(rec, dist, "new_group", new_group)

    def coll(name, group_pos, data_pos):
        def make(old):
            def wrapped(*args, **kw):
                group = kw.get("group", args[group_pos] if len(args) > group_pos else None)
                async_op = bool(kw.get("async_op", False))
                count = _numel(args[data_pos]) if data_pos is not None and len(args) > data_pos else None
                if name == "all_gather_single" and not async_op:
                    # FSDP2's implicit all-gather (in a forward): on its all-gather stream, which waited at
                    # the root pre-forward; the forward then waits for the parameters
                    with rec.on(LogicalStream(rec, FSDP_AG)):
                        w = rec.coll(name, group, old(*args, **kw), True, count=count)
                    rec.waited(w._op, True)
                    return w._work
                return rec.coll(name, group, old(*args, **kw), async_op, count=count)
            return wrapped
        return make

    # (name, position of the group argument, position of the tensor whose size every member gives alike)
    for name, pos, data in (("all_reduce", 2, 0), ("broadcast", 2, 0), ("all_gather_single", 2, 1),
                            ("reduce_scatter_single", 3, 1), ("all_gather_into_tensor", 2, 1),
                            ("reduce_scatter_tensor", 3, 1), ("barrier", 0, None), ("all_gather", 2, 1)):
        if hasattr(dist, name):
            _patch(rec, dist, name, coll(name, pos, data))
    # the start barrier (startup.start_barrier): gloo's monitored barrier is a barrier to every rule the
    # checker applies, so it is recorded as one (the op replay's fake groups run the plain barrier)
    _patch(rec, dist, "monitored_barrier", coll("barrier", 0, None))

    def fcoll(name, group_pos):
        def make(old):
            def wrapped(*args, **kw):
                group = kw.get("group", args[group_pos] if len(args) > group_pos else None)
                rec.coll(name, group, None, True, functional=True, count=_numel(args[0]) if args else None)
                return old(*args, **kw)
            return wrapped
        return make

    for name, pos in (("all_reduce", 2), ("all_gather_single", 2), ("reduce_scatter_single", 3),
                      ("all_gather_tensor", 2), ("reduce_scatter_tensor", 3)):
        if hasattr(funcol, name):
            _patch(rec, funcol, name, fcoll(name, pos))

    from torch.distributed.fsdp._fully_shard import _fsdp_state
    old_rpf = _fsdp_state.FSDPState._root_pre_forward

    def root_pre_forward(self, module, args, kwargs):
        rec.root_pre_forward(self)
        return old_rpf(self, module, args, kwargs)
    _fsdp_state.FSDPState._root_pre_forward = root_pre_forward
    rec._undo.append(lambda: setattr(_fsdp_state.FSDPState, "_root_pre_forward", old_rpf))

    RECORDER = rec
    if out_dir:
        atexit.register(rec.write)
    return rec


def install_from_env(rank: int, world: int) -> Recorder | None:
    """groups.init_rank's hook, right after the default group: record when DFLASH_RECORD_OPS names a directory
    (the groups' creation included; name_groups gives the role and our names once they are known)."""
    out = os.environ.get(ENV)
    if not out:
        return None
    return install(rank, "", {}, {"WORLD": list(range(world))}, out)


def name_groups(topo, groups) -> None:
    if RECORDER is not None:
        RECORDER.name(role_name(topo), groups.named(), group_members(topo, groups))


def group_members(topo, groups) -> dict[str, list[int]]:
    return {"WORLD": list(range(topo.world)), "control": list(range(topo.world)),
            "drafters": list(topo.drafter_ranks), "dctl": list(topo.drafter_ranks), **groups.pair_members()}


def role_name(topo) -> str:
    if topo.is_target and topo.is_drafter:
        return "target+drafter"
    return f"target {topo.target_index}" if topo.is_target else f"drafter {topo.drafter_index}"


# -- hooks our own code calls (no-ops unless recording) ---------------------------------------------------
def stream(name: str):
    return LogicalStream(RECORDER, name) if RECORDER is not None else None


def event():
    return RecEvent(RECORDER) if RECORDER is not None else None


def label(text: str) -> None:
    if RECORDER is not None:
        RECORDER.label(text)


def mark(text: str) -> None:
    """A boundary in the host program (the loop marks each step), for comparing programs step by step."""
    if RECORDER is not None:
        RECORDER.program.mark(text)


def compute(stream_obj, text: str, dur: float = 0.0) -> None:
    """A marker for the work a stage just queued on `stream_obj` (readable cycles; `dur` for a timed replay)."""
    if RECORDER is not None:
        RECORDER.program.compute(RECORDER.stream_name(stream_obj), text, dur)
