"""Ranks, process groups, the launcher, the dispatch plan and the stop vote.

One process per GPU. `python -m trainer <flags>` on one machine is the *supervisor*: it starts this
node's ranks through PyTorch's launcher API (torch.distributed.launcher.elastic_launch, the engine
behind torchrun), relays the job's health to systemd (the process systemd watches is the one that
sends READY/WATCHDOG) and turns a failed rank into a status.json naming it. Under `torchrun ... -m
trainer` the same code runs as a rank directly.

Roles follow the flags of each node. Local ranks 0..D-1 are this node's drafter GPUs, D..D+T-1 its
target GPUs, so the first node's first drafter is global rank 0 (it writes status.json, metrics and
the consolidated checkpoint files). One GPU named in both lists (or a CPU run with one target worker
and one drafter replica) is world size 1: one rank holds both roles and nothing is sent.

Groups (all built on every rank, in the same order):
  WORLD     NCCL on GPUs / gloo on the CPU: target->drafter point-to-point sends
  control   gloo over all ranks: the asynchronous per-step stop vote and per-rank rates
  drafters  the drafter ranks (FSDP2 mesh: reduce-scatter, all-gather, metrics all-reduce)
  dctl      gloo over the drafter ranks: checkpoint coordination (object broadcast/gather)
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("trainer.dist")

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# ------------------------------------------------------------------------------------------ roles

@dataclass(frozen=True)
class LocalRole:
    """What one local rank of this node does, from the flags alone."""
    target: bool
    drafter: bool
    device: str            # "cpu" or "cuda:<index>"


def local_roles(cfg) -> list[LocalRole]:
    """This node's ranks in local-rank order: drafters first, then targets; a shared device is one rank."""
    if cfg.on_cpu:
        nt, nd = max(1, cfg.cpu_target_workers), max(1, cfg.cpu_drafter_replicas)
        if nt == 1 and nd == 1:
            return [LocalRole(True, True, "cpu")]
        return [LocalRole(False, True, "cpu")] * nd + [LocalRole(True, False, "cpu")] * nt
    if cfg.target_gpus == cfg.drafter_gpus and len(cfg.target_gpus) == 1:
        return [LocalRole(True, True, f"cuda:{cfg.target_gpus[0]}")]
    return ([LocalRole(False, True, f"cuda:{g}") for g in cfg.drafter_gpus]
            + [LocalRole(True, False, f"cuda:{g}") for g in cfg.target_gpus])


@dataclass
class Topology:
    """The whole job as every rank sees it (identical on all ranks after init)."""
    rank: int
    world: int
    local_rank: int
    role: LocalRole
    host: str
    roles: list[LocalRole] = field(default_factory=list)      # by global rank
    hosts: list[str] = field(default_factory=list)

    @property
    def target_ranks(self) -> list[int]:
        return [r for r, x in enumerate(self.roles) if x.target]

    @property
    def drafter_ranks(self) -> list[int]:
        return [r for r, x in enumerate(self.roles) if x.drafter]

    @property
    def is_target(self) -> bool:
        return self.role.target

    @property
    def is_drafter(self) -> bool:
        return self.role.drafter

    @property
    def leader(self) -> bool:
        """Global rank 0: a drafter by construction (status.json, metrics, checkpoint files)."""
        return self.rank == 0

    @property
    def target_index(self) -> int:
        return self.target_ranks.index(self.rank)

    @property
    def drafter_index(self) -> int:
        return self.drafter_ranks.index(self.rank)

    def describe(self) -> str:
        parts = []
        for r, (x, h) in enumerate(zip(self.roles, self.hosts)):
            kind = "target+drafter" if x.target and x.drafter else ("target" if x.target else "drafter")
            parts.append(f"rank {r} {kind} {h}/{x.device}")
        return "; ".join(parts)


# The host-side phases every rank enters at the same step (the startup load and warmup, checkpoints, tau
# evals) may outlast --dist-timeout; the gloo groups that hold the ranks together through them wait this long.
HOST_PHASE_TIMEOUT_S = 3 * 3600.0


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
    and every rank makes the same number of splits (tests/test_dist_startup.py counts them with torch's
    own group-creation code)."""

    def __init__(self, topo: Topology, timeout: datetime.timedelta, transport: str = "pair",
                 host_backend: str | None = "gloo", control=None):
        import torch.distributed as dist
        self.rank, self.world_size = topo.rank, topo.world
        host_timeout = max(timeout, datetime.timedelta(seconds=HOST_PHASE_TIMEOUT_S))
        self.control = control if control is not None else self.new("control", None, host_backend, host_timeout)
        # The default group was made with the host timeout (the startup is a host phase: init_rank); the
        # hidden states' group over all ranks, when there is one, counts against --dist-timeout.
        self.world = (self.new("WORLD", None, None, timeout) if transport == "world" and topo.world > 1
                      else dist.group.WORLD)
        self.drafters = self.new("drafters", topo.drafter_ranks, None, timeout)
        self.dctl = self.new("dctl", topo.drafter_ranks, host_backend, host_timeout)
        self.pairs: dict[tuple[int, int], object] = {}    # (target rank, drafter rank) -> its group
        if transport != "world" and topo.world > 1:
            for t in topo.target_ranks:        # every rank creates every group, in this order
                for d in topo.drafter_ranks:
                    if t != d:
                        self.pairs[(t, d)] = self.new(f"pair:{t}-{d}", [t, d], None, timeout)

    def new(self, name: str, ranks: list[int] | None, backend: str | None, timeout):
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
    from . import oprecord
    members = range(world) if ranks is None else ranks
    host_side = backend not in (None, "nccl")
    oprecord.label(name)
    kw = {"use_local_synchronization": True} if host_side and len(set(members)) < world else {}
    return dist.new_group(ranks, timeout=timeout, backend=backend, **kw)


def connect(topo: Topology, groups: Groups, device) -> None:
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
            if topo.rank == t:
                dist.send(one, d, group=groups.link(d))
            elif topo.rank == d:
                dist.recv(one, t, group=groups.link(t))
    if topo.is_drafter and len(topo.drafter_ranks) > 1:
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


def in_launched_rank() -> bool:
    """True inside a process started by torchrun / elastic_launch (it sets RANK etc.)."""
    return all(k in os.environ for k in RANK_ENV)


def init_rank(cfg) -> tuple[Topology, Groups]:
    """Join the job: process group, device, roles of every rank, groups. Raises ValueError on a
    flag that does not fit the launch (e.g. --nproc-per-node disagrees with the GPU lists)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    mine = local_roles(cfg)
    if local_world != len(mine):
        raise ValueError(f"--nproc-per-node: this node runs {local_world} rank(s) but its --target-gpus/"
                         f"--drafter-gpus give {len(mine)} (one per GPU; a GPU in both lists counts once)")
    role = mine[local_rank]
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
    dist.init_process_group(backend, timeout=startup_timeout, device_id=device if device.type == "cuda" else None)
    from . import oprecord
    oprecord.install_from_env(rank, world)   # DFLASH_RECORD_OPS: log the ops this rank issues (streamcheck)
    # The roles travel on the gloo control group (the first group, made by every rank): an object exchange
    # on the NCCL world group would connect its ring and keep its buffers, which --transport pair never uses.
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
    groups = Groups(topo, timeout, cfg.transport, control=control)
    oprecord.name_groups(topo, groups)
    connect(topo, groups, device)
    return topo, groups


# --------------------------------------------------------------------------------------- dispatch

def eligible_anchors(dataset, max_seq_len: int) -> np.ndarray:
    """Per sequence: positions p (within the first max_seq_len tokens) where p and p+1 are supervised,
    i.e. the anchor candidates plan.sample_anchors draws from. Pure numpy, computed once."""
    m = (np.asarray(dataset.mask) != 0)
    pair = np.zeros(len(m) + 1, np.int64)
    if len(m) > 1:
        pair[1:len(m)] = np.cumsum(m[:-1] & m[1:])
        pair[len(m)] = pair[len(m) - 1]
    starts = np.asarray(dataset.offsets[:len(dataset.lengths)], np.int64)
    n = np.minimum(np.asarray(dataset.lengths, np.int64), max_seq_len)
    last = np.maximum(starts + n - 1, starts)            # pairs (p, p+1) with p in [start, start+n-2]
    return np.where(n >= 2, pair[last] - pair[starts], 0)


@dataclass(frozen=True)
class Assignment:
    seq: int          # global micro-batch number
    step: int         # optimizer step it belongs to
    target: int       # index among target ranks
    drafter: int      # index among drafter ranks
    rows: int         # planned block rows (drafter work)
    tokens: int       # padded tokens (target work)
    real_tokens: int  # tokens of the sequences (what tokens/s counts)


class DispatchPlan:
    """Which target rank computes, and which drafter rank trains on, each micro-batch. Every rank
    computes the same plan from the batch plan alone (no messages): per optimizer step, the step's
    micro-batches go to the drafter ranks by longest-processing-time-first over their planned block
    rows (each drafter rank gets at least one), and to the target ranks the same way by padded
    tokens. Each rank then works through its micro-batches in increasing sequence number, so the
    point-to-point operations are posted in the same order at both ends."""

    def __init__(self, planner, dataset, cfg, num_targets: int, num_drafters: int):
        self.planner, self.dataset, self.cfg = planner, dataset, cfg
        self.T, self.D = num_targets, num_drafters
        self.per_step = num_drafters * cfg.grad_accum
        self.elig = eligible_anchors(dataset, cfg.max_seq_len)
        self._cache: dict[int, list[Assignment]] = {}

    def _work(self, seq: int) -> tuple[int, int, int]:
        n = self.planner.num_batches
        idx = np.asarray(self.planner.batch(seq // n, seq % n), np.int64)
        rows = int(np.minimum(self.elig[idx], self.cfg.max_anchors).sum()) * self.cfg.block_size
        lens = np.minimum(np.asarray(self.dataset.lengths)[idx], self.cfg.max_seq_len)
        pm = self.cfg.pad_multiple
        tokens = len(idx) * (-(-int(lens.max()) // pm) * pm)
        return rows, tokens, int(lens.sum())

    @staticmethod
    def _lpt(work: list[int], bins: int) -> list[int]:
        """Longest processing time first; ties in load go to the bin with fewer items, so with at least
        as many items as bins every bin gets one even when items weigh nothing (a micro-batch with no
        anchors): a drafter rank with no micro-batch would skip the step's FSDP collectives."""
        order = sorted(range(len(work)), key=lambda i: (-work[i], i))
        load = [0] * bins
        count = [0] * bins
        out = [0] * len(work)
        for i in order:
            b = min(range(bins), key=lambda j: (load[j], count[j], j))
            out[i] = b
            load[b] += work[i]
            count[b] += 1
        return out

    def step(self, step: int) -> list[Assignment]:
        # the main and prefetch threads both ask: one read of the cache, the answer kept in a local, and a
        # full cache replaced rather than cleared, so no thread loses an entry it has just looked up
        cached = self._cache.get(step)
        if cached is None:
            seq0 = step * self.per_step
            work = [self._work(s) for s in range(seq0, seq0 + self.per_step)]
            d = self._lpt([w[0] for w in work], self.D)
            t = self._lpt([w[1] for w in work], self.T)
            cached = [Assignment(seq0 + i, step, t[i], d[i], *w) for i, w in enumerate(work)]
            if len(self._cache) > 64:
                self._cache = {}
            self._cache[step] = cached
        return cached

    def for_target(self, index: int, step: int) -> list[Assignment]:
        return [a for a in self.step(step) if a.target == index]

    def for_drafter(self, index: int, step: int) -> list[Assignment]:
        return [a for a in self.step(step) if a.drafter == index]


# ------------------------------------------------------------------------------------ stop vote

class StopVote:
    """The job's agreement on when to stop, without a per-step barrier: after each step every rank
    posts an asynchronous all-reduce (gloo, control group) of [stop flag, items, tokens, busy s, wait s]
    per rank; after step k it reads the vote of step k - lag, so every rank sees the same verdict at
    the same step, and target ranks running ahead rarely wait. Rates per rank come for free."""

    FIELDS = ("stop", "items", "tokens", "busy_s", "wait_s", "peak_bytes")

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


# ------------------------------------------------------------------------------------- launcher

def launch(argv: list[str], cfg) -> int:
    """Supervisor: start this node's ranks with elastic_launch and wait. Owns sd_notify (READY,
    WATCHDOG and EXTEND_TIMEOUT relayed from status.json, which rank 0 writes) and reports a failed
    rank in status.json. SIGTERM/SIGINT stay with this process, which passes SIGTERM on to this node's ranks
    and SIGKILLs those still running after --stop-timeout (_Stopper; the launcher's own signal handling is
    off)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .status import Notifier, read_status

    notifier = Notifier(env=dict(os.environ))   # its own copy: the ranks' environment loses the socket
    os.environ.pop("NOTIFY_SOCKET", None)      # ranks must not notify: only this process is watched
    os.environ.pop("WATCHDOG_USEC", None)
    os.environ.pop("WATCHDOG_PID", None)
    nproc = len(local_roles(cfg))
    multi = cfg.nnodes > 1
    if not multi:   # one node: gloo on loopback (a container's hostname may not resolve to any interface)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    endpoint = cfg.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    os.environ.setdefault("DFLASH_RUN_ID", uuid.uuid4().hex[:8])   # one run id for this node's ranks
    os.environ["DFLASH_SUPERVISED"] = "1"     # ranks leave the stderr line of a failure to this process
    os.environ["DFLASH_SUPERVISOR_PID"] = str(os.getpid())   # status.json's pid; ranks die with it
    run_id = f"dflash-{cfg.rdzv_endpoint}" if multi else os.environ["DFLASH_RUN_ID"]
    import dataclasses
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    extra = {}
    # SIGTERM/SIGINT stay with this process (_Stopper below): the launcher's own handling SIGKILLs the
    # ranks after a fixed 30 s on older torch, too short for a checkpoint of a 27B-width drafter
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    if "signals_to_handle" in known:
        extra["signals_to_handle"] = "SIGHUP,SIGQUIT"
    if "shutdown_timeout" in known:
        extra["shutdown_timeout"] = int(cfg.stop_timeout)
    lc = LaunchConfig(min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, nproc_per_node=nproc, run_id=run_id,
                      # several nodes: the static rendezvous, whose node ranks are the --node-rank each node was
                      # given (c10d's dynamic one ignores it and numbers the nodes by sorting their addresses,
                      # which could make a target node's first rank global rank 0); node rank 0 hosts the
                      # store at the endpoint. One node: c10d on a free loopback port.
                      rdzv_backend="static" if multi else "c10d", rdzv_endpoint=endpoint, max_restarts=0,
                      monitor_interval=0.5,
                      rdzv_configs={"rank": cfg.node_rank, "timeout": int(cfg.dist_timeout)} if multi else {},
                      # the workers' store is node 0's too: at the endpoint's address, not at whatever
                      # this host's name resolves to (a container's name may be loopback on every node)
                      local_addr=endpoint.rsplit(":", 1)[0].strip("[]") if multi and cfg.node_rank == 0 else None,
                      start_method="spawn", log_line_prefix_template="[rank${rank}]:" if nproc > 1 or multi else None,
                      **extra)
    stopper = _Stopper(cfg.stop_timeout)
    stopper.install()
    relay = _NotifyRelay(cfg.status_file, notifier)
    relay.start()
    log.info("launching %d rank(s) on this node (node %d of %d, rendezvous %s)", nproc, cfg.node_rank, cfg.nnodes,
             endpoint)
    rc = 0
    try:
        elastic_launch(lc, sys.executable)("-u", "-m", "trainer", *argv)
    except ChildFailedError as e:
        # the cause, not its echoes: a rank killed by a signal other than the launcher's own SIGTERM
        # (sent to the survivors while it shuts the job down) first, else the earliest error
        rank, failure = min(e.failures.items(),
                            key=lambda kv: (kv[1].exitcode == -15, kv[1].exitcode >= 0, kv[1].timestamp, kv[0]))
        why = failure.message
        if isinstance(why, dict):
            why = why.get("message", why)
        why = str(why)
        if failure.exitcode == 2:   # bad input found by a rank: its one line, once, from here
            rc = 2
            msg = why.split(": ", 1)[1] if why.startswith(("BadInput: ", "ValueError: ")) else why
            print(f"dflash-train: error: {msg}", file=sys.stderr, flush=True)
        else:
            rc = 1
            sig = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit {failure.exitcode}"
            err = f"rank {rank} failed ({sig}): {why or 'see the log'}"
            _mark_failed(cfg.status_file, err)
            print(f"dflash-train: error: {err}", file=sys.stderr, flush=True)
    except SignalException as e:
        # (a signal the launcher handles itself: it stopped the ranks); report how they ended
        st = {}
        try:
            st = read_status(cfg.status_file)
        except Exception:  # noqa: BLE001
            pass
        rc = 0 if st.get("phase") == "done" else 1
        log.info("supervisor: %s; ranks stopped (phase %s)", e.sigval.name, st.get("phase"))
    finally:
        relay.stop()
        notifier.stopping()
    return rc


def _mark_failed(path: str, error: str) -> None:
    from .status import atomic_write_json, read_status
    try:
        st = read_status(path)
    except Exception:  # noqa: BLE001
        st = {}
    if st.get("phase") == "failed" and st.get("error"):
        rank_why = st["error"].split(": ", 1)[-1]     # the rank wrote "rank N: <why>"
        if rank_why not in error:                      # the supervisor's line may quote it already
            error = f"{error}; {st['error']}"
    st.update(phase="failed", error=error)
    st["updated_at"] = time.time()
    st["pid"] = os.getpid()
    try:
        atomic_write_json(path, st)
    except OSError as e:
        log.warning("could not write %s: %s", path, e)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stopper:
    """SIGTERM/SIGINT to the supervisor: pass SIGTERM on to this node's ranks (each finishes an agreed
    step, the drafters checkpoint, all exit 0, and the launcher returns normally); SIGKILL the ranks
    still running `timeout` seconds later."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.requested = threading.Event()

    def install(self):
        import signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    @staticmethod
    def _children() -> list[int]:
        me, out = os.getpid(), []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    with open(f"/proc/{p}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            out.append(int(p))
                except (OSError, ValueError, IndexError):
                    continue
        return out

    def _signal_children(self, sig) -> None:
        for pid in self._children():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _handle(self, signum, frame):
        import signal
        if self.requested.is_set():
            return
        self.requested.set()
        log.info("supervisor: %s: asking every rank to stop after an agreed step (SIGKILL after %.0fs)",
                 signal.Signals(signum).name, self.timeout)
        self._signal_children(signal.SIGTERM)
        t = threading.Timer(self.timeout, self._signal_children, args=(signal.SIGKILL,))
        t.daemon = True
        t.start()


class _NotifyRelay(threading.Thread):
    """Supervisor thread: READY=1 once rank 0 reports training, WATCHDOG=1 whenever status.json moves,
    EXTEND_TIMEOUT while the job loads or warms up (a 27B load takes minutes)."""

    def __init__(self, status_file: str, notifier):
        super().__init__(name="notify-relay", daemon=True)
        self.path, self.notifier = status_file, notifier
        self._stop = threading.Event()

    def stop(self):
        self._stop.set()

    def run(self):
        from .status import read_status
        ready, last = False, None
        start = time.time()
        while not self._stop.wait(1.0):
            try:
                st = read_status(self.path)
            except Exception:  # noqa: BLE001
                continue
            if (st.get("updated_at") or 0) < start:
                continue   # a previous run's file
            phase = st.get("phase")
            if phase in ("starting", "loading", "warmup"):
                self.notifier.extend_timeout(900)
            if not ready and phase in ("training", "checkpointing", "done"):
                self.notifier.ready(f"training: step {st.get('step')}")
                ready = True
            stamp = st.get("updated_at")
            if stamp != last:
                last = stamp
                self.notifier.watchdog()
                if ready:
                    self.notifier.status(f"{phase}: step {st.get('step')}")


def init_single(cfg) -> tuple[Topology, Groups]:
    """World size 1 inside this process (tests, the benchmark): the launcher's environment for one rank,
    then the same init_rank every launched rank runs."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k, v in env.items():
        os.environ[k] = v
    if len(local_roles(cfg)) != 1:
        raise ValueError("in-process runs are world size 1: one GPU for both roles, or the CPU with one "
                         "target worker and one drafter replica")
    return init_rank(cfg)


def finish_single() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    for k in RANK_ENV + ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
