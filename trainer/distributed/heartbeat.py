"""Several nodes: a host that vanishes (power, a partition) ends the job on the others within a bound.

A dead rank on a live host ends the job through its launcher. A host that vanishes closes no connection:
its peers' gloo waits (the host phases' barriers, the stop vote, checkpoint coordination) run to
HOST_PHASE_TIMEOUT_S (3 h), and NCCL's only within --dist-timeout where an NCCL op is pending. So every
rank of a job over several nodes beats through the job's store (the rendezvous store on node 0) from a
thread of its own, which runs while the main thread waits in C++:

  beat    every `interval` s: this rank's counter up by one (`dflash/heartbeat/<rank>`), every other
          rank's counter read back; a counter that moved is a peer alive
  watch   a second thread: a peer whose counter has not moved for `bound_s`, or a store that answered
          nothing for `bound_s` (node 0 gone), ends this rank with one line naming the rank, its host and
          the silence; its launcher then stops the node's other ranks, and the unit restarts

The bound is under --dist-timeout (`heartbeat_bound`): on GPUs NCCL's watchdog aborts a rank whose op
waits that long (SIGABRT, a report that names no peer), so the heartbeat names a lost host first. A rank
that ends normally writes `done`, which no peer counts as silence. Short of the bound, whom a rank has not
heard from for three beats goes into its error file as it goes (the supervisor quotes that file for a rank
that died of a signal), and a rank that fails on a gloo or NCCL timeout (which names no peer) adds it to
its error (`Heartbeat.quiet`, `annotate`).

  abort   each beat also polls the job's store for ABORT_KEY: a supervisor that ends a stalled start-up
          (launch.py) leaves its line in its notes directory, its node's ranks put it in the store, and
          every rank of every node writes all its threads' stacks to its log, waits for the others' (at
          most ABORT_ACK_S) and ends. So a stall seen on node 0 brings node 1's stacks too."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("trainer.dist")

KEY = "dflash/heartbeat/{rank}"
ABORT_KEY = "dflash/abort"
DONE = "done"
MARGIN_S = 30.0           # under --dist-timeout: a few beats, and the store's own round trips
ABORT_ACK_S = 12.0        # an aborting rank waits this long for every rank's stacks (two beats and more)
ABORT_WAIT_S = ABORT_ACK_S + 3.0   # how long a supervisor leaves every node's ranks to take theirs and end
STOP_JOIN_S = 5.0         # a normal end waits this long for a store call in flight (Heartbeat.stop)


def heartbeat_bound(dist_timeout_s: float) -> float:
    """Silence that ends the job: under --dist-timeout, so the heartbeat names a lost host before NCCL's
    watchdog aborts a rank waiting on it."""
    t = float(dist_timeout_s)
    return max(t - MARGIN_S, t / 2)


def error_file() -> str | None:
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


class PeerSilent(RuntimeError):
    """A peer or the store went silent past the bound (the launcher's error file names it so)."""


def end_rank(line: str) -> None:
    """The default on a silence: one line, then this process ends (exit 1) without waiting for any group.
    The line goes into the launcher's error file too, so the supervisor's report (status.json on node 0)
    names the silent host, not only `exit 1`."""
    from trainer.errors import record
    record(PeerSilent(line))
    log.error("%s", line)
    print(f"dflash-train: error: {line}", file=sys.stderr, flush=True)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(1)


class Heartbeat:
    """This rank's beat and watch (module docstring). `hosts[r]`: rank r's host, for the line."""

    def __init__(self, store, rank: int, world: int, hosts: list[str], bound_s: float, interval: float = 5.0,
                 on_silent=end_rank, abort_file: str | None = None):
        self.store, self.rank, self.world, self.hosts = store, rank, world, hosts
        self.bound_s, self.interval, self.on_silent = bound_s, min(interval, bound_s / 4), on_silent
        self.abort_file = abort_file      # where this node's supervisor leaves the line of an abort
        self.noted: str | None = None     # the quiet peers last written into the error file
        now = time.monotonic()
        self.last_ok = now                                   # the store's last answer
        self.seen: dict[int, tuple[str | None, float]] = {r: (None, now) for r in range(world) if r != rank}
        self.count = 0
        self.silent: str | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._beat, name="heartbeat", daemon=True),
                         threading.Thread(target=self._watch, name="heartbeat-watch", daemon=True)]

    def start(self) -> "Heartbeat":
        log.info("heartbeat through the store: a rank or the store silent for %.0fs ends the job", self.bound_s)
        for t in self._threads:
            t.start()
        return self

    def stop(self, done: bool = True, join_s: float = STOP_JOIN_S) -> None:
        """A normal end: `done` in this rank's key, so its peers do not count its silence. Then the beat and the
        watch are waited for (at most `join_s` each): a daemon thread still inside a store call when the
        interpreter finalizes aborts the process as it takes the GIL back (pybind11's gil_scoped_release,
        pytorch/pytorch#38228: "terminate called without an active exception", SIGABRT after a clean run)."""
        self._halt.set()
        if done:
            try:
                self.store.set(KEY.format(rank=self.rank), DONE)
            except Exception:  # noqa: BLE001
                pass
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(join_s)

    def beat_once(self) -> None:
        self.count += 1
        self.store.set(KEY.format(rank=self.rank), str(self.count))
        keys = {r: KEY.format(rank=r) for r in self.seen}
        now = time.monotonic()
        for r, key in keys.items():
            if not self.store.check([key]):
                continue
            value = self.store.get(key).decode()
            with self._lock:
                if value != self.seen[r][0]:
                    self.seen[r] = (value, now)
        with self._lock:
            self.last_ok = time.monotonic()

    def _beat(self) -> None:
        while not self._halt.is_set():
            try:
                self.beat_once()
            except Exception as e:  # noqa: BLE001  (the store is gone or slow: the watch decides)
                log.debug("heartbeat: %s", e)
            abort = self.abort_line()
            if abort is not None and self.silent is None:
                self.silent = f"the job was ended: {abort}"
                self._halt.set()
                dump_stacks(self.rank)
                self.wait_for_every_dump()
                self.on_silent(self.silent)
                return
            self._halt.wait(self.interval)

    def check(self, now: float | None = None) -> str | None:
        """The silence to end on, or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self.last_ok > self.bound_s:
                return (f"the job's store (node 0, {self.hosts[0]}) answered nothing for {now - self.last_ok:.0f}s "
                        f"(bound {self.bound_s:.0f}s): node 0 is gone or cut off; rank {self.rank} ends")
            for r, (value, since) in sorted(self.seen.items()):
                if value != DONE and now - since > self.bound_s:
                    return (f"rank {r} ({self.hosts[r]}) silent for {now - since:.0f}s (bound {self.bound_s:.0f}s, "
                            f"heartbeat through the store): its host is gone or cut off; rank {self.rank} ends")
        return None

    def quiet(self, now: float | None = None, after_s: float | None = None) -> str | None:
        """Who this rank has not heard from for `after_s` (three beats by default), short of the bound: a
        rank that fails on a timeout says it beside its error (`annotate`), since a timeout names no peer."""
        now = time.monotonic() if now is None else now
        after_s = 3 * self.interval if after_s is None else after_s
        with self._lock:
            if now - self.last_ok > after_s:
                return f"the job's store (node 0, {self.hosts[0]}) unanswered for {now - self.last_ok:.0f}s"
            hosts: dict[str, tuple[list[int], float]] = {}
            for r, (value, since) in sorted(self.seen.items()):
                if value != DONE and now - since > after_s:
                    ranks, worst = hosts.get(self.hosts[r], ([], 0.0))
                    hosts[self.hosts[r]] = ([*ranks, r], max(worst, now - since))
        if not hosts:
            return None
        return "; ".join(f"no beat for {s:.0f}s from {h} (rank{'s' if len(rs) > 1 else ''} "
                         f"{', '.join(map(str, rs))})" for h, (rs, s) in hosts.items())

    def abort_line(self) -> str | None:
        """The job's abort (module docstring), or None: this node's supervisor's line goes into the store
        first, so every node's ranks see it."""
        try:
            if self.abort_file and os.path.exists(self.abort_file):
                with open(self.abort_file) as f:
                    self.store.set(ABORT_KEY, f.read())
            if self.store.check([ABORT_KEY]):
                return self.store.get(ABORT_KEY).decode()
        except Exception as e:  # noqa: BLE001  (the store is gone: the silence check decides)
            log.debug("heartbeat abort poll: %s", e)
        return None

    def wait_for_every_dump(self, limit: float = ABORT_ACK_S) -> None:
        """After this rank's stacks: until every rank has taken its own (`ABORT_KEY/<rank>`), at most `limit` s.
        A rank that ended first would have its launcher stop its node's other ranks before their next beat."""
        deadline = time.monotonic() + limit
        try:
            self.store.set(f"{ABORT_KEY}/{self.rank}", "1")
            keys = [f"{ABORT_KEY}/{r}" for r in range(self.world)]
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.2)
        except Exception as e:  # noqa: BLE001  (the store is gone: end now)
            log.debug("heartbeat abort wait: %s", e)

    def note_quiet(self) -> None:
        """Whom this rank has not heard from, into its error file as it goes: a rank that dies of a signal
        (NCCL's watchdog: SIGABRT) writes no error of its own, and the supervisor quotes this file."""
        path = error_file()
        if path is None:
            return
        import re
        quiet = self.quiet()
        who = re.sub(r"\d+s\b", "", quiet) if quiet else None   # rewritten when the quiet peers change
        if who == self.noted:
            return
        if quiet:
            from trainer.errors import record
            record(PeerSilent(f"rank {self.rank}: heartbeat: {quiet}"))
        else:   # heard from again: no stale note for a later failure to inherit
            try:
                os.remove(path)
            except OSError:
                pass
        self.noted = who

    def _watch(self) -> None:
        while not self._halt.wait(min(1.0, self.interval)):
            line = self.check()
            if line is not None and self.silent is None:
                self.silent = line
                self._halt.set()
                self.on_silent(line)
                return
            self.note_quiet()


def dump_stacks(rank: int) -> None:
    """Every thread's stack into this rank's stderr (the journal), the main thread's wherever it waits."""
    import faulthandler
    print(f"rank {rank}: stacks of every thread (the job's abort):", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def annotate(e: BaseException, note: str | None) -> BaseException:
    """`e` with `note` after its message (same type where it can be rebuilt from one string), for the
    error file the supervisor reads: `RuntimeError: ... Timed out waiting 120000ms ...; heartbeat: no beat
    for 121s from node1 (ranks 3, 4, 5)`."""
    if not note:
        return e
    msg = f"{e}; heartbeat: {note}"
    try:
        out = type(e)(msg)
        if str(out) != msg:
            raise TypeError(type(e).__name__)
    except Exception:  # noqa: BLE001  (an exception type whose constructor wants more than a message)
        out = RuntimeError(f"{type(e).__name__}: {msg}")
    out.__cause__ = e
    return out.with_traceback(e.__traceback__)
