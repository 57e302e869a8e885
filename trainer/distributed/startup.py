"""The start-up's proof of progress: load, compile, autotune and warmup of every rank happen before step 0,
under systemd's start timeout, and a start-up that cannot prove progress must not hang silently.

  rank r   `StartupProgress.note(phase, detail)` before each piece of start-up work (init_rank's sub-steps:
           the process group, each group k of n, each connect t-d; the load; each warmup shape: "target
           shape 2 of 3 (1x4096, compile and autotune)"): one line in its log (the journal), a key in the
           job's store (`dflash/startup/<r>`, the rendezvous store on node 0, so a rank of any node reaches
           it) once there is one, and a file in its supervisor's notes directory (NOTES_DIR_ENV)
  rank 0   a thread (`StartupWatch`) reads every rank's key and puts them in status.json's `startup`,
           logging the other ranks' notes, until the start barrier passes
  a node's supervisor  `launch._NotifyRelay`, from the launch on, extends systemd's start timeout only while
           some rank's note moves (status.json's, or its own ranks' files before there is one); when none
           moved for `StartupBounds.stall_s`, it ends the job with one line naming the rank that stopped
           and its sub-step, and the others still working (`stall_line`)
  every rank  `start_barrier`: a monitored barrier on the gloo control group with its own bound
           (`StartupBounds.barrier_s`, from the config's worst-case warmup), not the 3 h host-phase timeout

Bounds are derived from the config (trainer/engine/compile_warmup.py `startup_bounds`): how many warmup
shapes each role runs and whether they compile."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger("trainer.dist")

KEY = "dflash/startup/{rank}"
START_PHASES = ("starting", "loading", "warmup")
INIT = "init"                 # init_rank's sub-steps: the process group, each group, each first-use connect
WAITING = "start barrier"     # a rank that finished its own start-up: not the one to blame for a stall
STARTED = "started"           # past the start barrier: this rank's start-up is over
EXTEND_MARGIN_S = 60.0        # what the relay asks of systemd beyond its own bound
# The supervisor's directory for its node's ranks' last notes (`<rank>.json`): the relay reads them from the
# launch on, before rank 0 writes status.json and before any rank reaches the job's store.
NOTES_DIR_ENV = "DFLASH_STARTUP_DIR"
# Test hooks, unset in production: a rank that hangs right after a note (its start-up stuck in that piece of
# work), and a shorter stall bound for the supervisor.
HANG_ENV = "DFLASH_FAULT_HANG_IN_STARTUP"      # "RANK:TEXT": rank RANK hangs after its note whose detail has TEXT
STALL_ENV = "DFLASH_TEST_STALL_S"


@dataclass(frozen=True)
class StartupBounds:
    stall_s: float         # no rank's progress moved for this long: the job ends
    barrier_s: float       # the start barrier's timeout
    why: str               # how they were derived, for the log
    compile: str = ""      # --compile as the ranks resolve it (the supervisor sizes the compile workers by it)

    def describe(self) -> str:
        return (f"start-up bounds: a rank with no progress for {self.stall_s:.0f}s ends the job; the start barrier "
                f"waits at most {self.barrier_s:.0f}s ({self.why})")


def with_test_stall(bounds: "StartupBounds", env=os.environ) -> "StartupBounds":
    """`bounds` with the stall bound of DFLASH_TEST_STALL_S, where a test sets it."""
    if env.get(STALL_ENV):
        s = float(env[STALL_ENV])
        return replace(bounds, stall_s=s, why=f"{bounds.why}; {STALL_ENV}={s:g}")
    return bounds


def default_store():
    """The job's key-value store (the rendezvous store every rank reaches), or None outside a job."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (a backend without one: the notes stay in the rank's log)
        return None


class StartupProgress:
    """Rank side: `note` says what the rank starts now. The leader's own notes and the others' keys reach
    status.json through `StartupWatch`; each note also lands in the supervisor's notes directory (NOTES_DIR_ENV)
    for its relay; `extend(seconds)` tells systemd directly where this rank is the unit's main process (world
    size 1 without the supervisor). Made by init_rank before the process group exists (no store yet:
    `attach` adds it), and kept by the Trainer's Startup, so `seq` only grows."""

    def __init__(self, rank: int, role: str, store=None, extend=None, extend_s: float = 1800.0,
                 notes_dir: str | None = None):
        self.rank, self.role, self.store, self.extend, self.extend_s = rank, role, store, extend, extend_s
        self.notes_dir = notes_dir if notes_dir is not None else os.environ.get(NOTES_DIR_ENV) or None
        self.seq = 0
        self.last: dict | None = None
        self._hang = os.environ.get(HANG_ENV, "").partition(":")

    def attach(self, store, role: str | None = None) -> None:
        self.store = store
        self.role = role or self.role

    def note(self, phase: str, detail: str = "") -> dict:
        self.seq += 1
        log.info("start-up: rank %d (%s) %s%s", self.rank, self.role, phase, f": {detail}" if detail else "")
        rec = {"role": self.role, "phase": phase, "detail": detail, "seq": self.seq, "at": round(time.time(), 3)}
        self.last = rec
        if self.store is not None:
            try:
                self.store.set(KEY.format(rank=self.rank), json.dumps(rec))
            except Exception as e:  # noqa: BLE001  (progress reporting must not fail the start-up)
                log.debug("start-up note not stored: %s", e)
        if self.notes_dir:
            try:
                tmp = Path(self.notes_dir, f".{self.rank}.json.tmp")
                tmp.write_text(json.dumps(rec))
                os.replace(tmp, Path(self.notes_dir, f"{self.rank}.json"))
            except OSError as e:
                log.debug("start-up note not written: %s", e)
        if self.extend is not None:
            self.extend(self.extend_s)
        rank, _, text = self._hang
        if text and rank == str(self.rank) and text in detail:
            hang_for_test(f"{phase}: {detail}")
        return rec


def hang_for_test(where: str) -> None:
    """HANG_ENV's hang: this rank stops making progress (its threads run on), a frame its stacks name."""
    log.warning("fault injection: rank hangs in %s (%s)", where, HANG_ENV)
    while True:
        time.sleep(3600)


def read_notes(notes_dir: str | None) -> dict[str, dict]:
    """The supervisor's side of NOTES_DIR_ENV: {rank: its last note} of this node's ranks."""
    out: dict[str, dict] = {}
    if not notes_dir:
        return out
    try:
        names = os.listdir(notes_dir)
    except OSError:
        return out
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            try:
                out[name[:-5]] = json.loads(Path(notes_dir, name).read_text())
            except (OSError, ValueError):
                continue
    return out


class StartupWatch(threading.Thread):
    """Rank 0's thread during the start-up: every `interval` s, read each rank's key and, when one moved,
    `publish({rank: record})` (status.json's `startup`) and log the other ranks' notes."""

    def __init__(self, store, world: int, publish, interval: float = 1.0):
        super().__init__(name="startup-watch", daemon=True)
        self.store, self.world, self.publish, self.interval = store, world, publish, interval
        self.seen: dict[str, dict] = {}
        self._halt = threading.Event()

    def poll(self) -> bool:
        changed = False
        for r in range(self.world):
            key = KEY.format(rank=r)
            try:
                if not self.store.check([key]):
                    continue
                rec = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001  (the store is gone: the job is ending)
                continue
            if self.seen.get(str(r), {}).get("seq") != rec.get("seq"):
                self.seen[str(r)] = rec
                changed = True
                if r != 0:
                    log.info("start-up: rank %d (%s) %s%s", r, rec.get("role"), rec.get("phase"),
                             f": {rec['detail']}" if rec.get("detail") else "")
        if changed:
            self.publish(dict(self.seen))
        return changed

    def run(self):
        while not self._halt.wait(self.interval):
            self.poll()

    def stop(self):
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)
        self.poll()


def start_barrier(topo, groups, bounds: StartupBounds | None, progress: StartupProgress | None = None) -> None:
    """Every rank waits for every other's load and warmup, at most `bounds.barrier_s` (a monitored
    barrier on the gloo control group: past the bound it raises naming the ranks that never came)."""
    if topo.world <= 1:
        return
    import torch.distributed as dist
    if progress is not None:
        progress.note(WAITING, "waiting for every rank's load and warmup" + (
            f", at most {bounds.barrier_s:.0f}s" if bounds is not None else ""))
    t0 = time.perf_counter()
    if bounds is None or dist.get_backend(groups.control) != "gloo":
        dist.barrier(group=groups.control)   # the op replay (fake groups, no setup): the same collective
    else:
        dist.monitored_barrier(group=groups.control, timeout=datetime.timedelta(seconds=bounds.barrier_s),
                               wait_all_ranks=True)
    waited = time.perf_counter() - t0
    if waited > 5:
        log.info("waited %.0fs for every rank to finish the load and warmup", waited)


class Startup:
    """A rank's start-up (the Trainer's component): its notes, rank 0's watch, the bounds, the barrier.
    `status`: rank 0's StatusWriter (others': one that writes nothing); `extend(seconds)`: systemd's start
    timeout where this rank is the unit's main process."""

    def __init__(self, cfg, topo, status, extend=None, progress: StartupProgress | None = None):
        self.cfg, self.topo, self.status = cfg, topo, status
        store = default_store() if topo.world > 1 else None
        if progress is None:
            progress = StartupProgress(topo.rank, topo.role_name, store, extend)
        else:   # init_rank's: its notes go on, now with the unit's start timeout where this rank is main
            progress.attach(store, topo.role_name)
            progress.extend = extend
        self.progress = progress
        self.watch: StartupWatch | None = (StartupWatch(store, topo.world, self._publish)
                                           if topo.leader and store is not None else None)
        self.bounds: StartupBounds | None = None

    def _publish(self, ranks: dict) -> None:
        self.status.update(startup=ranks, force=True)

    def begin(self, bounds: StartupBounds) -> None:
        """Once --compile is resolved: the bounds (compile_warmup.startup_bounds; logged by rank 0), and
        rank 0's watch."""
        self.bounds = bounds
        if self.topo.leader:
            log.info("%s", self.bounds.describe())
        if self.watch is not None:
            self.watch.start()

    def note(self, phase: str, detail: str = "") -> None:
        rec = self.progress.note(phase, detail)
        if self.watch is None and self.topo.leader:   # world size 1: rank 0's own note, straight in
            self._publish({str(self.topo.rank): rec})

    def barrier(self, groups) -> None:
        start_barrier(self.topo, groups, self.bounds, self.progress)
        self.close()
        self.progress.note(STARTED, "training")   # the relay of a node without status.json stops its clock

    def close(self) -> None:
        if self.watch is not None and self.watch.is_alive():
            self.watch.stop()


class StallClock:
    """The supervisor's view (launch._NotifyRelay): per rank, when its note last changed, on this
    process's clock (ranks of other nodes keep their own clocks)."""

    def __init__(self, stall_s: float, now: float):
        self.stall_s = stall_s
        self.moved = now                     # when any progress was last seen
        self.ranks: dict[str, tuple] = {}    # rank -> (seq, phase, detail, role, when it changed)
        self.phase: str | None = None

    def update(self, st: dict, now: float, local: dict | None = None) -> None:
        """`st`: status.json (every rank's notes through rank 0, once it writes them); `local`: this node's
        ranks' own notes (read_notes), from the launch on. Per rank the newer of the two counts."""
        if st.get("phase") != self.phase:
            self.phase, self.moved = st.get("phase"), now
        notes = dict(st.get("startup") or {})
        for r, rec in (local or {}).items():
            if r not in notes or (rec.get("seq") or 0) > (notes[r].get("seq") or 0):
                notes[r] = rec
        for r, rec in notes.items():
            old = self.ranks.get(r)
            if old is None or old[0] != rec.get("seq"):
                self.ranks[r] = (rec.get("seq"), rec.get("phase"), rec.get("detail"), rec.get("role"), now)
                self.moved = now

    def left(self, now: float) -> float:
        """Seconds until the stall bound (<= 0: stalled)."""
        return self.stall_s - (now - self.moved)

    def where(self, now: float, most: int = 8) -> tuple[str, float, str]:
        """(the rank that stopped: the one still working whose note is oldest, with its phase and sub-step;
        seconds since its note; the other ranks still working and theirs, at most `most`)."""
        working = sorted(((r, v) for r, v in self.ranks.items() if v[1] not in (WAITING, STARTED)),
                         key=lambda kv: (kv[1][4], int(kv[0])))
        if not working:
            if not self.ranks:   # nothing noted since the launch: the ranks' imports, or before init_rank
                return "no rank noted any start-up progress since the launch", now - self.moved, ""
            return f"rank 0 in {self.phase or 'starting'}", now - self.moved, ""

        def name(r, v):
            return f"rank {r} ({v[3]}) in {v[1]}" + (f" ({v[2]})" if v[2] else "")
        (r, v), rest = working[0], working[1:]
        others = ", ".join(name(r2, v2) for r2, v2 in rest[:most]) + (f" and {len(rest) - most} more"
                                                                       if len(rest) > most else "")
        return name(r, v), now - v[4], others

    def stall_line(self, now: float) -> str:
        """One line: the rank that stopped and its phase and sub-step, then the other ranks still working."""
        what, since, others = self.where(now)
        if not self.ranks:
            return f"start-up stalled: {what} ({since:.0f}s, bound {self.stall_s:.0f}s); the job ends"
        return (f"start-up stalled: {what} made no progress for {since:.0f}s (bound {self.stall_s:.0f}s)"
                + (f"; still working: {others}" if others else "") + "; the job ends")
