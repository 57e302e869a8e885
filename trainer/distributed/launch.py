"""The supervisor: `python -m trainer <flags>` on one machine starts this node's ranks through PyTorch's
launcher API (torch.distributed.launcher.elastic_launch, the engine behind torchrun), relays the job's
health to systemd (the process systemd watches is the one that sends READY/WATCHDOG) and turns a failed
rank into a status.json naming it. Under `torchrun ... -m trainer` the ranks run without it."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

from trainer.distributed.topology import local_roles

log = logging.getLogger("trainer.dist")


ECHO_S = 5   # a signal death this long after the first failure is the launcher's own escalation
# The supervisor's exit status when it ended a start-up that made no progress: the unit lists it in
# RestartPreventExitStatus, since a restart would stall the same way (a start-up cycle lasts as long as its
# bound, too long for any start limit to count).
STALL_EXIT = 3
# between two ranks' SIGUSR1: each rank's faulthandler writes its stacks straight to the shared journal, and
# dumps taken at once interleave line by line (seen: two ranks' "in recv" cut apart)
STACKS_GAP_S = 0.2
ABORT_FILE = "abort"   # in the notes directory: node 0's ranks hand the line to every node (heartbeat.py)


def failure_cause(failures: dict) -> tuple:
    """(local rank, failure) that caused the others, not its echoes: a rank killed by a signal (the OOM
    killer's SIGKILL: its peers' errors follow within a second or so) first, else the earliest error. The
    launcher's own signals are echoes: the SIGTERM it sends the survivors when it shuts the job down, and the
    SIGKILL that follows after its shutdown wait for a rank that did not stop (elastic records those after
    that wait, so well after the first failure: a target stuck in a send to a vanished node, seen in the
    two-node stand-in, whose report then blamed its SIGKILL instead of the timeout that ended rank 0)."""
    first = min(f.timestamp for f in failures.values())

    def key(item):
        local_rank, f = item
        launchers = f.exitcode == -15 or (f.exitcode < 0 and f.timestamp - first > ECHO_S)
        return (launchers, f.exitcode >= 0, f.timestamp, local_rank)
    return min(failures.items(), key=key)


def _launch_config(cfg, nproc: int, endpoint: str, run_id: str, multi: bool):
    """elastic_launch's LaunchConfig for this node's ranks (the launcher's own signal handling off)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig
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
                      start_method="spawn", **extra)
    return lc


def _frame_name(depth: int = 2) -> str:
    """torch's dynamic_rendezvous.get_method_name, without inspect.stack(): the name of the function `depth`
    frames above this one (its caller's caller: the rendezvous step that records an event)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def cheap_rendezvous_names() -> None:
    """The c10d rendezvous names each of its events after the method that records it, through
    inspect.stack(), which reads the source file of every frame on the stack, twice per event: 0.3-0.4
    CPU-seconds of a tiny job's supervisor for names that go to a null event handler. The same names from
    the frames themselves (_frame_name); nothing else of the rendezvous changes."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _frame_name


def _report_failure(cfg, e, relay, stopper) -> int:
    """The exit status and the one line (status.json's error, stderr) of a launch whose rank failed."""
    from trainer.status import record_failure
    rank, failure = failure_cause(e.failures)
    why = failure.message
    if isinstance(why, dict):
        why = why.get("message", why)
    why = str(why)
    if failure.exitcode == 2:   # bad input found by a rank: its one line, once, from here
        rc = 2
        msg = why.split(": ", 1)[1] if why.startswith(("BadInput: ", "ValueError: ")) else why
        print(f"dflash-train: error: {msg}", file=sys.stderr, flush=True)
    elif relay.stalled:   # the relay ended a stalled start-up: its line, not the SIGKILL that followed
        rc = STALL_EXIT
        record_failure(cfg.status_file, relay.stalled)
    elif stopper.startup_line:   # stopped (SIGTERM: systemd's start timeout) before training began
        rc = 1
        record_failure(cfg.status_file, stopper.startup_line)
        print(f"dflash-train: error: {stopper.startup_line}", file=sys.stderr, flush=True)
    else:
        rc = 1
        sig = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit {failure.exitcode}"
        err = f"rank {rank} failed ({sig}): {why or 'see the log'}"
        record_failure(cfg.status_file, err, merge_rank_error=True)   # the rank's own reason kept
        print(f"dflash-train: error: {err}", file=sys.stderr, flush=True)
    return rc


def launch(argv: list[str], cfg, bounds=None) -> int:
    """Supervisor: start this node's ranks with elastic_launch and wait. Owns sd_notify (READY,
    WATCHDOG and EXTEND_TIMEOUT relayed from status.json, which rank 0 writes) and reports a failed
    rank in status.json. SIGTERM/SIGINT stay with this process, which passes SIGTERM on to this node's ranks
    and SIGKILLs those still running after --stop-timeout (_Stopper; the launcher's own signal handling is
    off). `bounds` (startup.StartupBounds, derived from the config by compile_warmup.startup_bounds): how long
    the relay lets the start-up go without progress."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from trainer.status import Notifier, read_status, record_failure

    notifier = Notifier(env=dict(os.environ))   # its own copy: the ranks' environment loses the socket
    os.environ.pop("NOTIFY_SOCKET", None)      # ranks must not notify: only this process is watched
    os.environ.pop("WATCHDOG_USEC", None)
    os.environ.pop("WATCHDOG_PID", None)
    roles = local_roles(cfg)
    nproc = len(roles)
    bound_omp_threads(os.environ, nproc)
    bound_compile_threads(os.environ, nproc, compiling=compiling_ranks(cfg, roles, bounds))
    multi = cfg.nnodes > 1
    if not multi:   # one node: gloo on loopback (a container's hostname may not resolve to any interface)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    endpoint = cfg.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    os.environ.setdefault("DFLASH_RUN_ID", uuid.uuid4().hex[:8])   # one run id for this node's ranks
    os.environ["DFLASH_SUPERVISED"] = "1"     # ranks leave the stderr line of a failure to this process
    os.environ["DFLASH_SUPERVISOR_PID"] = str(os.getpid())   # status.json's pid; ranks die with it
    run_id = f"dflash-{cfg.rdzv_endpoint}" if multi else os.environ["DFLASH_RUN_ID"]
    lc = _launch_config(cfg, nproc, endpoint, run_id, multi)
    cheap_rendezvous_names()
    import shutil
    import tempfile

    from trainer.distributed.heartbeat import ABORT_WAIT_S
    from trainer.distributed.startup import NOTES_DIR_ENV, with_test_stall
    if bounds is not None:
        bounds = with_test_stall(bounds)
    # the ranks' notes from their first line on: the relay's stall clock runs from the launch, init included
    notes = tempfile.mkdtemp(prefix="dflash-startup-")
    os.environ[NOTES_DIR_ENV] = notes
    os.makedirs(os.path.dirname(os.path.abspath(cfg.status_file)), exist_ok=True)   # a stall in init is recorded
    stopper = _Stopper(cfg.stop_timeout)
    if bounds is not None:
        log.info("%s", bounds.describe())

    def on_stall(line: str) -> None:
        record_failure(cfg.status_file, line)
        print(f"dflash-train: error: {line}", file=sys.stderr, flush=True)
        grace = 0.0
        if multi:   # every node's ranks take their stacks: node 0's ranks put the line in the job's store
            with open(os.path.join(notes, ABORT_FILE), "w") as f:
                f.write(line)
            grace = ABORT_WAIT_S
        stopper.abort(after=grace)

    relay = _NotifyRelay(cfg.status_file, notifier, bounds.stall_s if bounds is not None else 1800.0, on_stall,
                         notes_dir=notes, nproc=nproc)
    stopper.before_stop = relay.startup_stop   # a stop before training: stacks first, and where it stood
    stopper.install()
    relay.start()
    log.info("launching %d rank(s) on this node (node %d of %d, rendezvous %s)", nproc, cfg.node_rank, cfg.nnodes,
             endpoint)
    rc = 0
    try:
        elastic_launch(lc, sys.executable)("-u", "-m", "trainer", *argv)
    except ChildFailedError as e:
        rc = _report_failure(cfg, e, relay, stopper)
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
        stopper.cancel()
        notifier.stopping()
        shutil.rmtree(notes, ignore_errors=True)
        os.environ.pop(NOTES_DIR_ENV, None)
    if rc == 0 and relay.stalled:
        rc = STALL_EXIT
    return rc


COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"
OMP_THREADS_ENV = "OMP_NUM_THREADS"


def compiling_ranks(cfg, roles, bounds=None) -> int:
    """This node's ranks that compile: those whose role --compile (resolved as the rank will: auto on a hybrid
    target compiles the drafter only) covers; at least 1."""
    from trainer.ops.compiling import resolve_compile, wants
    on_cpu = not cfg.target_gpus and not cfg.drafter_gpus
    resolved = bounds.compile if bounds is not None and bounds.compile else resolve_compile(cfg.compile, on_cpu,
                                                                                            False)
    return max(1, sum(1 for r in roles if (r.target and wants(resolved, "target"))
                      or (r.drafter and wants(resolved, "drafter"))))


def _share(env, name: str, nproc: int, cpus: int | None, using: int | None = None, what: str = "run") -> int:
    """`name` in `env`: each of the `using` ranks (default all `nproc` of this node) that use it gets an equal
    share of the cores this process may run on (`cpus`, default its affinity). A value given (run.sh's list,
    the operator) is each of the `nproc` ranks' share of the node: the ranks that do not use it leave theirs
    to those that do, and the cores here cap it. Returns the value set."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    using = max(1, using if using is not None else nproc)
    given = env.get(name, "")
    budget = min(cpus, int(given) * max(1, nproc)) if given.strip().isdigit() and int(given) > 0 else cpus
    value = max(1, budget // using)
    if str(value) != given:
        log.info("%s=%d: %d core(s) among the %d rank(s) on this node that %s%s", name, value, budget, using, what,
                 f" (was {given})" if given else "")
    env[name] = str(value)
    return value


def bound_compile_threads(env, nproc: int, cpus: int | None = None, compiling: int | None = None) -> int:
    """Inductor's compile workers per rank: unset, each rank starts as many as it sees cores, all of them at
    once during the warmup. `compiling`: the ranks of this node's `nproc` that compile (compiling_ranks: on a
    hybrid target only the drafters do); a rank that does not compile starts no workers."""
    return _share(env, COMPILE_THREADS_ENV, nproc, cpus, compiling, "compile")


def bound_omp_threads(env, nproc: int, cpus: int | None = None) -> int:
    """Each rank's intra-op threads (the CPU side of checkpoint serialization and copies; all the work on the
    CPU): unset, every rank takes every core, `nproc` times over."""
    return _share(env, OMP_THREADS_ENV, nproc, cpus)


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
        self.before_stop = None            # () -> a line when the job is still starting (the relay's), else None
        self.startup_line: str | None = None
        self.timers: list[threading.Timer] = []   # SIGKILLs (and an abort's stacks) still to come
        self.cancelled = False

    def _later(self, delay: float, fn, *args) -> None:
        if self.cancelled:
            return
        t = threading.Timer(delay, fn, args=args)
        t.daemon = True
        self.timers.append(t)
        t.start()

    def cancel(self) -> None:
        """The launch returned, its ranks are gone: what is still to come would hit the next launch's ranks
        (another job this process supervises, as a test does), since it signals this process's children."""
        self.cancelled = True
        for t in self.timers:
            t.cancel()

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

    def _signal_children(self, sig, gap: float = 0.0) -> None:
        """`sig` to every rank of this node; `gap` seconds after each one that got it (the stacks: one rank's
        dump at a time, STACKS_GAP_S)."""
        for pid in self._children():
            try:
                os.kill(pid, sig)
            except OSError:
                continue
            if gap:
                time.sleep(gap)

    def abort(self, grace: float = 3.0, after: float = 0.0) -> None:
        """End the ranks: `after` seconds from now (the other nodes' ranks take their stacks meanwhile),
        SIGUSR1 (each rank's faulthandler writes every thread's stack to its log: rank.train_rank registers
        it first thing), SIGKILL `grace` seconds later."""
        import signal
        self.requested.set()

        def stacks_then_kill():
            self._signal_children(signal.SIGUSR1, gap=STACKS_GAP_S)
            self._later(grace, self._signal_children, signal.SIGKILL)
        if after > 0:
            self._later(after, stacks_then_kill)
        else:
            stacks_then_kill()

    def _handle(self, signum, frame):
        import signal
        if self.requested.is_set():
            return
        self.requested.set()
        line = self.before_stop() if self.before_stop is not None else None
        if line is not None:
            # no step yet, so nothing to checkpoint: every rank's stacks, and the line that says where the
            # start-up stood (systemd's start timeout would otherwise read as "rank 0 failed (signal 15)")
            self.startup_line = f"stopped by {signal.Signals(signum).name} during the start-up: {line}"
            log.error("%s", self.startup_line)
            self._signal_children(signal.SIGUSR1, gap=STACKS_GAP_S)
            time.sleep(1.0)
        log.info("supervisor: %s: asking every rank to stop after an agreed step (SIGKILL after %.0fs)",
                 signal.Signals(signum).name, self.timeout)
        self._signal_children(signal.SIGTERM)
        self._later(self.timeout, self._signal_children, signal.SIGKILL)


class _NotifyRelay(threading.Thread):
    """Supervisor thread: READY=1 once rank 0 reports training, WATCHDOG=1 whenever status.json moves.
    Before READY, EXTEND_TIMEOUT only while the start-up proves progress (startup.py): some rank's note moved
    within `stall_s`, in status.json's `startup` or in this node's notes directory (`notes_dir`, written by
    its `nproc` ranks from their first line on). The clock starts at the launch: no status.json yet (ranks in
    init) is the phase "starting". When no note moved for `stall_s`, it stops extending and calls
    on_stall(one line naming the rank and its sub-step), once; `stalled` keeps the line. A node whose ranks
    all passed the start barrier (a node other than 0 sees no "training" of its own) stops its clock."""

    def __init__(self, status_file: str, notifier, stall_s: float = 1800.0, on_stall=None, interval: float = 1.0,
                 notes_dir: str | None = None, nproc: int = 0):
        from trainer.distributed.startup import StallClock
        super().__init__(name="notify-relay", daemon=True)
        self.path, self.notifier = status_file, notifier
        self.stall_s, self.on_stall, self.interval = stall_s, on_stall, interval
        self.notes_dir, self.nproc = notes_dir, nproc
        self.stalled: str | None = None
        self.started = False          # READY sent, or every rank of this node past the start barrier
        self.clock = StallClock(stall_s, time.monotonic())
        self._stop = threading.Event()

    def stop(self):
        self._stop.set()

    def startup_stop(self) -> str | None:
        """Where the start-up stands (None once training began): for a stop that comes before READY."""
        if self.started:
            return None
        what, since, others = self.clock.where(time.monotonic())
        return f"{what}, its last progress {since:.0f}s ago" + (f"; still working: {others}" if others else "")

    def run(self):
        from trainer.distributed.startup import EXTEND_MARGIN_S, START_PHASES, STARTED, read_notes
        from trainer.status import read_status
        ready, last = False, None
        start = time.time()
        clock = self.clock
        while not self._stop.wait(self.interval):
            try:
                st = read_status(self.path)
            except Exception:  # noqa: BLE001  (none yet: the ranks are in init)
                st = {}
            if (st.get("updated_at") or 0) < start:
                st = {}   # a previous run's file
            phase = st.get("phase") or "starting"
            local = read_notes(self.notes_dir)
            if self.nproc and len(local) >= self.nproc and all(r.get("phase") == STARTED for r in local.values()):
                self.started = True
            if phase in START_PHASES and not ready and not self.started and self.stalled is None:
                now = time.monotonic()
                clock.update(st, now, local)
                left = clock.left(now)
                if left > 0:
                    self.notifier.extend_timeout(left + EXTEND_MARGIN_S)
                else:
                    self.stalled = clock.stall_line(now)
                    log.error("%s", self.stalled)
                    if self.on_stall is not None:
                        self.on_stall(self.stalled)
            if not ready and phase in ("training", "checkpointing", "done"):
                self.notifier.ready(f"training: step {st.get('step')}")
                ready = self.started = True
            stamp = st.get("updated_at")
            if st and stamp != last:
                last = stamp
                self.notifier.watchdog()
                if ready:
                    self.notifier.status(f"{phase}: step {st.get('step')}")
