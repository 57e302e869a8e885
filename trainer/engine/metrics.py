"""Metrics of the run: stage timings (Profiler), bounded step logs (HeadTailLog) and metrics.jsonl.

metrics.jsonl is written by rank 0 only: one record per optimizer step, and one with "kind": "eval" per
tau eval (docs/contracts.md). On resume it is cut back to the checkpoint's step first (records of both
kinds), so a reader never sees the steps between the checkpoint and a kill twice.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.engine.runlog import format_table

log = logging.getLogger("trainer.metrics")


class HeadTailLog:
    """Append-only log that keeps the first `keep` and the last `keep` entries (memory stays bounded
    however long the run); reads as the list head + tail, in order, without overlap."""

    def __init__(self, keep: int = 100):
        self.keep = keep
        self.head: list = []
        self.tail: deque = deque(maxlen=keep)
        self.total = 0

    def append(self, x):
        self.total += 1
        (self.head if len(self.head) < self.keep else self.tail).append(x)

    def entries(self) -> list:
        return self.head + list(self.tail)

    def __len__(self):
        return len(self.head) + len(self.tail)

    def __getitem__(self, i):
        return self.entries()[i]

    def __iter__(self):
        return iter(self.entries())


class Profiler:
    """Per-stage time: host seconds, or CUDA event pairs resolved lazily (never synchronised)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.pending: deque = deque()
        self.t0 = time.perf_counter()
        self.lifetime: dict[str, float] = {}   # totals since start (reset() leaves them)

    def add(self, stage: str, seconds: float):
        with self.lock:
            self.totals[stage] = self.totals.get(stage, 0.0) + seconds
            self.counts[stage] = self.counts.get(stage, 0) + 1
            self.lifetime[stage] = self.lifetime.get(stage, 0.0) + seconds

    def add_events(self, stage: str, start, end):
        with self.lock:
            self.pending.append((stage, start, end))
            n = len(self.pending)
        if n >= 64:  # fold finished pairs in as we go (query() never blocks): pending stays bounded
            self.resolve()

    def resolve(self):
        done = []
        with self.lock:
            keep = deque()
            while self.pending:
                stage, s, e = self.pending.popleft()
                (done if e.query() else keep).append((stage, s, e))
            self.pending = keep
        for stage, s, e in done:
            self.add(stage, s.elapsed_time(e) / 1000.0)

    def table(self, wall: float, extra: list[list] | None = None) -> str:
        self.resolve()
        rows = []
        with self.lock:
            for stage in sorted(self.totals):
                tot, n = self.totals[stage], self.counts[stage]
                rows.append([stage, n, tot, 1000 * tot / max(n, 1), 100 * tot / max(wall, 1e-9)])
        rows += extra or []
        return format_table(["stage", "count", "total s", "ms each", "% of wall"], rows)

    def snapshot(self) -> dict:
        self.resolve()
        with self.lock:
            return {k: {"total_s": v, "count": self.counts[k]} for k, v in self.totals.items()}

    def busy(self, stages: tuple[str, ...]) -> float:
        """Seconds spent in `stages` since the start (GPU time where events were recorded)."""
        self.resolve()
        with self.lock:
            return sum(self.lifetime.get(k, 0.0) for k in stages)

    def reset(self):
        with self.lock:
            self.totals.clear()
            self.counts.clear()
            self.t0 = time.perf_counter()


class StepLayout:
    """The per-step metric vector of the drafter ranks, one layout for the three places that touch it.
    A drafter rank accumulates [sum of w * CE, correct per block slot] on its stream (DrafterStage.metric,
    `acc`) and counts [tokens, sum of loss weights w, supervised rows per block slot] on the host
    (`counts`); summed() lays both out as the drafter ranks all-reduce them, [w * CE, tokens, w, correct
    per slot, rows per slot]; host() puts the optimizer's skipped flag and grad norm after the first, the
    vector copied to the host; record() reads that copy (one metrics.jsonl record). The logged loss is
    sum(w * CE) / sum(w) over the step: the mean per supervised block token (weighted by the position
    decay, as the recipe's loss), the same figure for any layout, grad accum or number of drafter ranks."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.acc_size = 1 + block_size
        self.loss, self.correct = 0, slice(1, 1 + block_size)   # in `acc`

    def summed(self, acc, counts):
        return torch.cat([acc[:1], counts[:2], acc[1:], counts[2:]])

    def host(self, summed, skipped, grad_norm):
        return torch.cat([summed[:1], skipped.float().reshape(1), grad_norm.float().reshape(1).to(summed.device),
                          summed[1:]])

    def record(self, step: int, lr: float, values: list[float]) -> dict:
        bs = self.block_size
        wce, skipped, gnorm, tokens, weight = values[0], values[1] > 0, values[2], values[3], values[4]
        correct = values[5:5 + bs]
        counts = values[5 + bs:5 + 2 * bs]
        acc = [c / n if n else None for c, n in zip(correct, counts)]
        loss = wce / weight if weight > 0 else float("nan")
        return {"step": step, "loss": loss if math.isfinite(loss) else None, "skipped": skipped,
                "grad_norm": gnorm if math.isfinite(gnorm) else None, "lr": lr, "tokens": int(tokens),
                "loss_weight": weight, "acc": acc[1:]}


@dataclass
class StepMetrics:
    """One optimizer step's numbers, still on their way to the host (read when `event` has fired)."""
    step: int
    host: object          # pinned, in layout.host() order
    event: object
    lr: float
    layout: StepLayout

    def record(self) -> dict:
        return self.layout.record(self.step, self.lr, self.host.tolist())


class MetricsFile:
    """Append-only metrics.jsonl, cut back to a checkpoint's step on resume. A failed write (a full
    disk) warns once and training goes on; the next checkpoint save is what fails the run."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = Path(path)
        self.last: dict[str, dict] = {}   # on resume: the last kept record of each kind ("step", "eval")
        if resume_step is not None:
            self.truncate_after(resume_step)
        self.f = open(self.path, "a")
        self.error = False

    def truncate_after(self, step: int) -> int:
        """Drop records of steps > step (written after the checkpoint we resume from), of every kind (step
        records, eval records). Returns how many."""
        if not self.path.exists():
            return 0
        keep, dropped = [], 0
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                rec = json.loads(line)
                rec_step = rec.get("step")
            except (ValueError, AttributeError):
                dropped += 1     # a torn last line from a kill
                continue
            if rec_step is not None and rec_step > step:
                dropped += 1
            else:
                keep.append(line)
                self.last[rec.get("kind", "step")] = rec
        if dropped:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(keep))
            tmp.replace(self.path)
            log.info("%s: dropped %d record(s) after step %d (resumed from that checkpoint)", self.path, dropped, step)
        return dropped

    def write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self.f.write("".join(lines))
            self.f.flush()
            if self.error:
                log.info("%s is writable again", self.path)
            self.error = False
        except OSError as e:
            if not self.error:
                log.warning("could not write %s: %s (training goes on; the next checkpoint save will tell "
                            "whether the disk can hold it)", self.path, e)
            self.error = True

    def close(self):
        try:
            self.f.close()
        except OSError as e:
            log.warning("could not close %s: %s", self.path, e)

