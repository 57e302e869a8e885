"""Process groups: made, first used and held together, the same way on every rank; the stop vote.

Groups (all built on every rank, in the same order):
  WORLD     NCCL on GPUs / gloo on the CPU: target->drafter point-to-point sends with --transport world
  control   gloo over all ranks: the roles' exchange at init, the asynchronous per-step stop vote and
            per-rank rates, the barriers after host phases, the in-training eval's messages
  drafters  the drafter ranks (FSDP2 mesh: reduce-scatter, all-gather, metrics all-reduce)
  dctl      gloo over the drafter ranks: checkpoint coordination (object broadcast/gather)
  pair:t-d  one per (target, drafter) pair, the default --transport pair: the hidden states
`init_rank` joins a launched rank to the job (launch.py starts the ranks).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import numpy as np

from trainer.distributed.launch import free_port
from trainer.distributed.topology import RANK_ENV, Topology, local_roles, role_name

log = logging.getLogger("trainer.dist")

# The host-side phases every rank enters at the same step (the startup load and warmup, checkpoints, tau
# evals) may outlast --dist-timeout; the gloo groups that hold the ranks together through them wait this long.
HOST_PHASE_TIMEOUT_S = 3 * 3600.0
# The first steps bring the compiles the warmup could not cover (inductor's own shape regimes; logged with their
# seconds by compiling.note_new_graphs), and a peer's receives wait on such a compile against the NCCL timeout.
# Until FIRST_STEPS steps have passed, the steps' groups time out after --dist-timeout plus FIRST_STEPS_EXTRA_S
# (a compile at its worst case: compile_warmup.COMPILED_SHAPE_S); then after --dist-timeout (Groups.settle).
FIRST_STEPS = 32
FIRST_STEPS_EXTRA_S = 1800.0


class Groups:
    """Process groups of the job; built once, on every rank, in the same order.

    `transport` ("pair", the default, or "world"): hidden states travel on a communicator per (target,
    drafter) pair, or on the world group's. With eager NCCL init (init_rank passes device_id) the world
    group serialises every point-to-point op of a rank on its one stream, so a target's send to one
    drafter waits behind its send to another (docs/distributed.md; streamcheck's timed replay measures
    the cost). `host_backend`: the backend of the host-side groups (gloo; the op replay passes None).
    `control`: the gloo group over all ranks when init_rank made it already (its exchange of roles).

    Startup is collective too. With eager init every new group is an `ncclCommSplit` of the world
    communicator on every rank: a member of an NCCL group splits with its color, a rank outside *any*
    new group (gloo included) splits with no color, and NCCL pairs the splits of all ranks by call order
    alone. A gloo group that some ranks are outside of (dctl) is therefore created with
    use_local_synchronization=True: torch then returns at once on the ranks outside it, with no split,
    and every rank makes the same number of splits (tests/distributed/test_groups.py counts them with torch's
    own group-creation code)."""

    def __init__(self, topo: Topology, timeout: datetime.timedelta, transport: str = "pair",
                 host_backend: str | None = "gloo", control=None, progress=None,
                 first_extra: datetime.timedelta = datetime.timedelta(seconds=FIRST_STEPS_EXTRA_S)):
        import torch.distributed as dist
        self.rank, self.world_size = topo.rank, topo.world
        self.timeout = timeout           # the steps' groups' NCCL timeout after the first steps (settle)
        self.settled = False
        self.progress = progress    # startup.StartupProgress: a note before each group (init_rank's)
        pairs = [(t, d) for t in topo.target_ranks for d in topo.drafter_ranks if t != d] \
            if transport != "world" and topo.world > 1 else []
        self._made, self._count = 0, (control is None) + (transport == "world" and topo.world > 1) + 2 + len(pairs)
        host_timeout = max(timeout, datetime.timedelta(seconds=HOST_PHASE_TIMEOUT_S))
        first = timeout + first_extra     # the steps' groups until FIRST_STEPS steps have passed
        self.control = control if control is not None else self.new("control", None, host_backend, host_timeout)
        # The default group was made with the host timeout (the startup is a host phase: init_rank); the
        # hidden states' group over all ranks, when there is one, counts against --dist-timeout.
        self.world = (self.new("WORLD", None, None, first) if transport == "world" and topo.world > 1
                      else dist.group.WORLD)
        self.drafters = self.new("drafters", topo.drafter_ranks, None, first)
        self.dctl = self.new("dctl", topo.drafter_ranks, host_backend, host_timeout)
        self.pairs: dict[tuple[int, int], object] = {}    # (target rank, drafter rank) -> its group
        self.heartbeat = None   # heartbeat.Heartbeat on a job over several nodes (init_rank starts it)
        for t, d in pairs:        # every rank creates every group, in this order
            self.pairs[(t, d)] = self.new(f"pair:{t}-{d}", [t, d], None, first)
        self.step_groups = ([self.world] if transport == "world" and topo.world > 1 else []) + [self.drafters,
                                                                                              *self.pairs.values()]

    def settle(self, step: int) -> bool:
        """After FIRST_STEPS steps: the steps' groups (those this rank is in) time out after --dist-timeout.
        Returns whether it changed them now."""
        if self.settled or step < FIRST_STEPS:
            return False
        from torch.distributed import distributed_c10d as c10d
        self.settled = True
        for g in self.step_groups:
            if g is not None and not c10d._rank_not_in_group(g):
                try:
                    c10d._set_pg_timeout(self.timeout, g)
                except Exception as e:  # noqa: BLE001  (a backend that cannot: it keeps the longer timeout)
                    log.debug("timeout of a step group: %s", e)
        if self.rank == 0:
            log.info("step %d: the steps' groups now time out after %.0fs (--dist-timeout); the first %d steps "
                     "allowed a compile after the warmup more", step, self.timeout.total_seconds(), FIRST_STEPS)
        return True

    def new(self, name: str, ranks: list[int] | None, backend: str | None, timeout):
        self._made += 1
        if self.progress is not None:
            self.progress.note("init", f"group {self._made} of {self._count} ({name})")
        return new_group(name, ranks, self.world_size, backend, timeout)

    def link(self, peer: int):
        """The group this rank's point-to-point ops with `peer` (a target or drafter rank) go through."""
        return self.pairs.get((self.rank, peer)) or self.pairs.get((peer, self.rank)) or self.world

    def named(self) -> dict:
        """Every group by the name oprecord and streamcheck use."""
        out = {"WORLD": self.world, "control": self.control, "drafters": self.drafters, "dctl": self.dctl}
        out.update({f"pair:{t}-{d}": g for (t, d), g in self.pairs.items()})
        return out

    def pair_members(self) -> dict[str, list[int]]:
        return {f"pair:{t}-{d}": [t, d] for t, d in self.pairs}


def new_group(name: str, ranks: list[int] | None, world: int, backend: str | None, timeout):
    """One process group (`ranks` None: every rank), made on every rank. `backend` None: the default
    group's (NCCL on GPUs). A host-side (gloo) group that leaves some ranks out is made with local
    synchronization, so the ranks outside it make no split of the world communicator (Groups). The op
    recorder, when on, names the group and logs its creation."""
    import torch.distributed as dist

    from trainer.distributed import oprecord
    members = range(world) if ranks is None else ranks
    host_side = backend not in (None, "nccl")
    oprecord.label(name)
    kw = {"use_local_synchronization": True} if host_side and len(set(members)) < world else {}
    return dist.new_group(ranks, timeout=timeout, backend=backend, **kw)


def connect(topo: Topology, groups: Groups, device, progress=None) -> None:
    """The first use of every communicator of the steps, in one order on every rank. NCCL connects a
    communicator's peers on its first op there (NCCL_RUNTIME_CONNECT, the default), and that op blocks
    the host until the peer reaches its own first op: ranks that first use two communicators in opposite
    orders deadlock before anything is enqueued (streamcheck models it). The micro-batches' order alone
    does not fix one order (--transport world hangs so at step 0 at 5+3 when a drafter reaches FSDP's
    first all-gather first), so every (target, drafter) link carries one element here, links in
    (target, drafter) order, then the drafter group gathers one element per rank. A total order of
    pairwise rendezvous cannot deadlock: the least pending link has both ends at it."""
    if topo.world == 1:
        return
    import torch
    import torch.distributed as dist
    one = torch.ones(1, device=device)
    for t in topo.target_ranks:
        for d in topo.drafter_ranks:
            if topo.rank in (t, d) and progress is not None:
                progress.note("init", f"connect {t}-{d}")
            if topo.rank == t:
                dist.send(one, d, group=groups.link(d))
            elif topo.rank == d:
                dist.recv(one, t, group=groups.link(t))
    if topo.is_drafter and len(topo.drafter_ranks) > 1:
        if progress is not None:
            progress.note("init", f"connect the {len(topo.drafter_ranks)} drafters (all-gather)")
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # (renamed in 2.13)
        gather(torch.empty(len(topo.drafter_ranks), device=device), one, group=groups.drafters)


def hold_together(topo: Topology, groups: Groups, phase: str) -> None:
    """Every rank waits here for the others (a barrier on the gloo control group, whose timeout is
    HOST_PHASE_TIMEOUT_S) after a host-side phase some ranks spend longer in: the startup load and warmup
    (a 27B target loads for minutes), a checkpoint (drafter ranks write tens of GB). A rank that went on
    would post point-to-point ops that count against --dist-timeout (NCCL's watchdog times an op from
    its enqueue) while the peer is still busy."""
    if topo.world > 1:
        import torch.distributed as dist
        t0 = time.perf_counter()
        dist.barrier(group=groups.control)
        waited = time.perf_counter() - t0
        if waited > 5:
            log.info("waited %.0fs for every rank to finish %s", waited, phase)


def abort_groups() -> None:
    """A failing rank's way out: abort every process group instead of destroying it. With a dead peer,
    destroy_process_group waits for NCCL ops that will never complete (until the NCCL timeout, 10 minutes
    by default), while the rank's exit is what tells the launcher, and through it every node, that the job
    is over. Aborting frees the communicators at once."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:  # noqa: BLE001  (a backend without abort: the process exits anyway)
        log.debug("abort of the process groups: %s", e)


def init_rank(cfg) -> tuple[Topology, Groups]:
    """Join the job: process group, device, roles of every rank, groups. Raises ValueError on a
    flag that does not fit the launch (e.g. --nproc-per-node disagrees with the GPU lists). Each sub-step
    is a start-up note (startup.StartupProgress: the supervisor's stall clock counts it): the process group,
    the roles' exchange, each group k of n, each first-use connect; `groups.progress` carries them on."""
    import torch
    import torch.distributed as dist

    from trainer.distributed.startup import INIT, StartupProgress
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    mine = local_roles(cfg)
    if local_world != len(mine):
        raise ValueError(f"--nproc-per-node: this node runs {local_world} rank(s) but its --target-gpus/"
                         f"--drafter-gpus give {len(mine)} (one per GPU; a GPU in both lists counts once)")
    role = mine[local_rank]
    progress = StartupProgress(rank, role_name(role))
    device = torch.device(role.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The startup is a host phase: ranks reach the rendezvous when their imports end, nodes when their
    # units start, so the default group waits as long as the other host phases (a rank that came 4 s
    # after another failed the job under --dist-timeout 4); the groups the steps use carry --dist-timeout.
    startup_timeout = max(timeout, datetime.timedelta(seconds=HOST_PHASE_TIMEOUT_S))
    if device.type == "cuda":
        if rank == 0:
            log.info("point-to-point: eager NCCL init, so a process group's unbatched sends and receives run in "
                     "order with all its other ops; hidden states travel on %s", "a communicator per (target, drafter)"
                     " pair" if cfg.transport == "pair" else "the world group's one communicator (--transport world)")
        # said once above; torch would repeat it for every process group
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    progress.note(INIT, f"process group: the rendezvous of {world} rank(s) and {backend} init")
    dist.init_process_group(backend, timeout=startup_timeout, device_id=device if device.type == "cuda" else None)
    from trainer.distributed import oprecord
    from trainer.distributed.startup import default_store
    progress.attach(default_store() if world > 1 else None)
    oprecord.install_from_env(rank, world)   # DFLASH_RECORD_OPS: log the ops this rank issues (streamcheck)
    # The roles travel on the gloo control group (the first group, made by every rank): an object exchange
    # on the NCCL world group would connect its ring and keep its buffers, which --transport pair never uses.
    progress.note(INIT, "the control group (gloo) and the roles' exchange")
    control = new_group("control", None, world, "gloo", startup_timeout)
    host = socket.gethostname()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (role, host, cfg.node_rank), group=control)
    topo = Topology(rank, world, local_rank, role, host, [r for r, _, _ in everyone], [h for _, h, _ in everyone])
    nodes = [n for _, _, n in everyone]
    if nodes != sorted(nodes) or nodes[0] != 0:
        raise ValueError(f"--node-rank: global ranks are not in node-rank order (node of each rank: {nodes}); the "
                         "launcher numbered the nodes some other way (torchrun's c10d rendezvous sorts them by "
                         "address): start every node with `python -m trainer ... --node-rank N`, or torchrun "
                         "--rdzv-backend static --node-rank N")
    if not topo.roles[0].drafter:
        raise ValueError("--drafter-gpus: the first node (node rank 0) must have at least one drafter GPU "
                         "(its first drafter rank writes status.json and the checkpoints)")
    if not topo.target_ranks:
        raise ValueError("--target-gpus: no node has a target GPU")
    if world > 1 and any(x.target and x.drafter for x in topo.roles):
        raise ValueError("--target-gpus/--drafter-gpus: a GPU may hold both roles only when it is the job's "
                         "only GPU (world size 1)")
    # several nodes: a vanished host must not hold the others in a gloo wait for hours, and a stall seen by
    # one node's supervisor reaches every node's ranks (the heartbeat's abort); from here, so the group
    # splits and the connects are covered
    heartbeat = start_heartbeat(topo, cfg.dist_timeout) if len(set(nodes)) > 1 else None
    groups = Groups(topo, timeout, cfg.transport, control=control, progress=progress)
    groups.heartbeat = heartbeat
    oprecord.name_groups(topo, groups)
    connect(topo, groups, device, progress)
    return topo, groups


def start_heartbeat(topo: Topology, dist_timeout_s: float):
    """Every rank of a job over several nodes beats through the job's store (heartbeat.py); a normal exit
    writes `done`. Returns the Heartbeat, or None where the job has no store."""
    import atexit

    from trainer.distributed.heartbeat import Heartbeat, heartbeat_bound
    from trainer.distributed.launch import ABORT_FILE
    from trainer.distributed.startup import NOTES_DIR_ENV, default_store
    store = default_store()
    if store is None:
        return None
    notes = os.environ.get(NOTES_DIR_ENV)
    hb = Heartbeat(store, topo.rank, topo.world, topo.hosts, heartbeat_bound(dist_timeout_s),
                   abort_file=os.path.join(notes, ABORT_FILE) if notes else None).start()
    atexit.register(hb.stop)
    return hb


class StopVote:
    """The job's agreement on when to stop, without a per-step barrier: after each step every rank
    posts an asynchronous all-reduce (gloo, control group) of [stop flag, items, tokens, busy s, wait s,
    peak bytes, graphs compiled after the warmup] per rank; after step k it reads the vote of step k - lag,
    so every rank sees the same verdict at the same step, and target ranks running ahead rarely wait. Rates
    per rank come for free."""

    FIELDS = ("stop", "items", "tokens", "busy_s", "wait_s", "peak_bytes", "recompiles")

    def __init__(self, topo: Topology, group, lag: int = 2):
        self.topo, self.group, self.lag = topo, group, lag
        self.pending: dict[int, tuple] = {}
        self.last: np.ndarray | None = None   # [world, len(FIELDS)] of the newest vote read

    def post(self, step: int, stop: bool, counters: dict) -> None:
        import torch
        import torch.distributed as dist
        t = torch.zeros(self.topo.world, len(self.FIELDS), dtype=torch.float64)
        t[self.topo.rank] = torch.tensor([float(stop)] + [float(counters.get(k, 0.0)) for k in self.FIELDS[1:]],
                                         dtype=torch.float64)
        self.pending[step] = (t, dist.all_reduce(t, group=self.group, async_op=True))

    def verdict(self, step: int) -> bool:
        """Stop after `step`? Waits for the vote of step - lag (posted by every rank long ago)."""
        k = step - self.lag
        for old in [s for s in self.pending if s < k]:
            self.pending.pop(old)[1].wait()
        if k not in self.pending:
            return False
        t, work = self.pending.pop(k)
        work.wait()
        self.last = t.numpy()
        return bool(self.last[:, 0].max() > 0)

    def drain(self) -> None:
        for s in sorted(self.pending):
            self.pending.pop(s)[1].wait()


def single_env(cfg) -> dict[str, str]:
    """The launcher's environment for the one rank of a world-size-1 job run inside this process (tests, the
    benchmark); ValueError for a job of more ranks."""
    if len(local_roles(cfg)) != 1:
        raise ValueError("in-process runs are world size 1: one GPU for both roles, or the CPU with one "
                         "target worker and one drafter replica")
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def init_single(cfg) -> tuple[Topology, Groups]:
    """World size 1 inside this process (tests, the benchmark): single_env, then the same init_rank every
    launched rank runs."""
    os.environ.update(single_env(cfg))
    return init_rank(cfg)


def finish_single() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    for k in RANK_ENV + ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
