"""What a rank tells the world, rank 0 mostly: status.json and the systemd notifier, metrics.jsonl, the
W&B/TensorBoard sinks (one interface, one set of tags: metrics_sinks.py), the progress line, the profile
and split tables, eval.json; and the per-step metrics on their way to the host (read when their event
has fired, never by a sync on a compute stream) with the non-finite-step counters they feed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from trainer.config.options import TrainConfig
from trainer.distributed.groups import StopVote
from trainer.distributed.topology import Topology
from trainer.engine.evaltrain import eval_scalars, eval_status
from trainer.engine.feed import Feed
from trainer.engine.metrics import HeadTailLog, MetricsFile, Profiler, StepMetrics
from trainer.engine.metrics_sinks import open_tensorboard, open_wandb
from trainer.engine.runlog import Progress, format_table
from trainer.errors import TrainingFailed
from trainer.fsutil import atomic_write_text
from trainer.model.checkpoint_format import step_dir_name
from trainer.status import Notifier, StatusWriter

log = logging.getLogger("trainer")


class _NoStatus:
    """Ranks other than 0 keep no status file."""

    def update(self, *a, **k):
        return False


class Reporter:
    """Owns: the status file and notifier (rank 0), metrics.jsonl and the sinks (rank 0, from open()), the
    step metrics pending on their way to the host, the NaN-skip counters and the last good loss, the
    bounded step logs (time, memory, step-end events), the progress line and the eval-pause clock."""

    def __init__(self, cfg: TrainConfig, topo: Topology, run_id: str, device: torch.device, profiler: Profiler,
                 feed: Feed, vote: StopVote):
        self.cfg, self.topo, self.run_id, self.device = cfg, topo, run_id, device
        self.profiler, self.feed, self.vote = profiler, feed, vote
        self.notifier: Notifier | None = Notifier() if topo.leader else None
        # pid: the supervisor's (what systemd watches and dflash-status checks), this rank's when it runs alone
        job_pid = int(os.environ.get("DFLASH_SUPERVISOR_PID") or os.getpid())
        self.status = (StatusWriter(cfg.status_file, run_id, min_interval=1.0, notifier=self.notifier,
                                    pid=job_pid) if topo.leader else _NoStatus())
        self.metrics_file: MetricsFile | None = None
        self.sinks: list = []                       # WandbSink, TensorBoardSink: write(step, scalars), close()
        self.pending: deque[StepMetrics] = deque()  # optimizer steps whose numbers are still on the GPU
        self.nan_skips = 0
        self.nan_streak = 0
        self.last_loss: float | None = None
        self.last_acc: list | None = None
        self.rate = 0.0                              # tokens/s over the last 50 steps (rank 0)
        self.step = 0                                # the last step reported
        self.step_log = HeadTailLog()                # (time, step, tokens_seen), bounded
        self.mem_log = HeadTailLog()
        self.step_events = HeadTailLog(keep=20)      # (step, timing event at the end of its optimizer step)
        self.final_eval: dict | None = None          # the end-of-run eval's record (leader), for eval.json
        self.paused_s = 0.0    # seconds training stood still for evals: kept out of tokens/s and the profile
        self.recompiles = 0    # graphs compiled after the warmup, all ranks, as of the newest stop vote (leader)
        self.progress: Progress | None = None
        self.tok_window: deque = deque(maxlen=50)
        self.t_start = self.t_prof = 0.0
        self.ready_sent = False

    def open(self, resume_step: int | None) -> None:
        """Rank 0's files and sinks; a resumed run's metrics.jsonl is cut back to its checkpoint's step."""
        if not self.topo.leader:
            return
        cfg = self.cfg
        self.metrics_file = MetricsFile(Path(cfg.output_dir) / "metrics.jsonl", resume_step)
        if "eval" in self.metrics_file.last:   # a resumed run's status shows its last eval from the start
            self.status.update(eval=eval_status(self.metrics_file.last["eval"]))
        wandb = open_wandb(cfg.wandb_mode, cfg.wandb_project, cfg.to_dict(), self.run_id, cfg.output_dir)
        tensorboard = open_tensorboard(cfg.tensorboard_dir, self.run_id)
        self.sinks = [s for s in (wandb, tensorboard) if s is not None]

    def extend(self, seconds: float):
        """Tell systemd the start-up is still going (rank 0)."""
        if self.notifier is not None:
            self.notifier.extend_timeout(seconds)

    def clock(self) -> float:
        """Seconds of training: the wall clock less the eval pauses (tokens/s, the profile, progress)."""
        return time.perf_counter() - self.paused_s

    def begin(self, step: int, total_steps: int, resumed_from: str | None, last_checkpoint: str | None):
        self.status.update(phase="training", step=step, resumed_from=resumed_from,
                           last_checkpoint=last_checkpoint, nan_skips=self.nan_skips, force=True)
        self.progress = Progress(total_steps, desc="train", interval=min(30.0, self.cfg.profile_interval),
                                 clock=self.clock) if self.topo.leader else None
        self.t_start = self.t_prof = self.clock()

    def after_step(self, step: int, epoch: int, tokens_seen: int):
        """Rank 0, after every optimizer step: rate, logs, watchdog, status, progress, the periodic profile."""
        now = self.clock()
        if not self.topo.leader:
            return
        self.step = step
        self.tok_window.append((now, tokens_seen))
        self.step_log.append((now, step, tokens_seen))
        self.mem_log.append(self.memory())
        tw = self.tok_window
        rate = (tw[-1][1] - tw[0][1]) / (tw[-1][0] - tw[0][0]) if len(tw) > 1 else 0.0
        self.rate = rate
        self.notifier.watchdog()
        if not self.ready_sent:
            self.notifier.ready(f"training: step {step}")
            self.ready_sent = True
        ranks = self.rank_rates(now - self.t_start)
        recompiles = sum(r["recompiles"] for r in ranks) if ranks else None
        if recompiles and recompiles != self.recompiles:
            for sink in self.sinks:
                sink.write(step, {"recompiles": recompiles})
            self.recompiles = recompiles
        self.status.update(phase="training", step=step, epoch=epoch, tokens_seen=tokens_seen,
                           tokens_per_s=rate, loss=self.last_loss, nan_skips=self.nan_skips,
                           nan_streak=self.nan_streak, ranks=ranks, recompiles=recompiles)
        acc1 = self.last_acc[1] if self.last_acc and len(self.last_acc) > 1 else None
        self.progress.update(step, loss=self.last_loss if self.last_loss is not None else float("nan"),
                             acc1=acc1 if acc1 is not None else float("nan"), tok_s=rate)
        if now - self.t_prof >= self.cfg.profile_interval:
            self.profile(now - self.t_prof, rate, now - self.t_start)
            self.t_prof = now

    def elapsed(self) -> float:
        return self.clock() - self.t_start

    def end(self):
        if self.progress is not None:
            self.progress.close()

    def drain(self, last_ckpt: str | None, block: bool = False):
        """Step metrics whose event has fired (all, waiting, with block) into metrics.jsonl and the sinks;
        too many non-finite steps in a row fail the run."""
        lines = []
        while self.pending and (block or self.pending[0].event.query()):
            m = self.pending.popleft()
            if block:
                m.event.synchronize()
            rec = m.record()
            if rec["skipped"]:
                self.nan_skips += 1
                self.nan_streak += 1
                log.warning("step %d: non-finite loss/gradient (loss %s, grad norm %s): step skipped (%d in a row)",
                            m.step, rec["loss"], rec["grad_norm"], self.nan_streak)
            else:
                self.nan_streak = 0
                self.last_loss, self.last_acc = rec["loss"], [None] + rec["acc"]
            lines.append(json.dumps(rec) + "\n")
            scalars = {"loss": rec["loss"], "grad_norm": rec["grad_norm"], "lr": m.lr, "tokens_per_s": self.rate,
                       "acc": rec["acc"]}
            for sink in self.sinks:
                sink.write(m.step, scalars)
            if self.nan_streak >= self.cfg.max_nan_skips:
                if self.metrics_file is not None:
                    self.metrics_file.write(lines)
                raise TrainingFailed(f"{self.nan_streak} consecutive optimizer steps had a non-finite loss or "
                                     f"gradient (--max-nan-skips {self.cfg.max_nan_skips}); "
                                     + (f"last good checkpoint {last_ckpt} left untouched" if last_ckpt
                                        else "no checkpoint was written"))
        if self.metrics_file is not None:
            self.metrics_file.write(lines)

    def record_eval(self, rec: dict, secs: float):
        log.info("eval at step %d: tau %.3f over %d verify steps (%d prompts); per-position acceptance %s; "
                 "training paused %.1fs (not counted in tokens/s)", rec["step"], rec["tau"], rec["verify_steps"],
                 rec["prompts"], [round(x, 3) for x in rec["per_position_acceptance"]], secs)
        if self.metrics_file is not None:
            self.metrics_file.write([json.dumps(rec) + "\n"])
        self.status.update(eval=eval_status(rec), force=True)
        for sink in self.sinks:
            sink.write(rec["step"], eval_scalars(rec))
        if rec["final"]:
            self.final_eval = rec

    def write_eval_json(self, last_ckpt: str | None):
        """The end-of-run eval as eval.json (as dflash-eval writes it), with the checkpoint of its weights."""
        if self.final_eval is None:
            return
        rec = {k: v for k, v in self.final_eval.items() if k not in ("kind", "final")}
        ckpt = last_ckpt if (last_ckpt or "").endswith(step_dir_name(rec["step"])) else None
        atomic_write_text(Path(self.cfg.output_dir) / "eval.json", json.dumps(dict(rec, checkpoint=ckpt), indent=2) + "\n")

    def rank_rates(self, wall: float) -> list[dict] | None:
        """Per rank, from the newest stop vote: micro-batches, busy and waiting seconds, peak GPU memory, graphs
        compiled after the warmup."""
        v = self.vote.last
        if v is None or wall <= 0:
            return None
        out = []
        for r, role in enumerate(self.topo.roles):
            kind = "target+drafter" if role.target and role.drafter else ("target" if role.target else "drafter")
            out.append({"rank": r, "role": kind, "items": int(v[r, 1]), "busy_s": round(float(v[r, 3]), 3),
                        "wait_s": round(float(v[r, 4]), 3), "peak_gib": round(float(v[r, 5]) / 2 ** 30, 2),
                        "recompiles": int(v[r, 6])})
        return out

    def split_table(self, wall: float) -> str:
        """Measured work per rank and the recommended target/drafter split for this data."""
        rows, t_rate, d_rate = [], [], []
        rates = self.rank_rates(wall) or []
        per_item_rows = np.mean([a.rows for a in self.feed.dispatch.step(max(0, self.step - 1))]) or 1.0
        per_item_tok = np.mean([a.tokens for a in self.feed.dispatch.step(max(0, self.step - 1))]) or 1.0
        for x in rates:
            rate = x["items"] / max(x["busy_s"], 1e-9)     # per second of its own stage's (GPU) time
            rows.append([x["rank"], x["role"], x["items"], f"{x['busy_s']:.1f}", f"{rate:.2f}", f"{x['wait_s']:.1f}"])
            (t_rate if x["role"] == "target" else d_rate).append(rate)
        table = format_table(["rank", "role", "micro-batches", "stage s", "per stage s", "waiting s"], rows)
        rec = recommend_split(t_rate, d_rate)
        table += (f"\nblock rows per token: {per_item_rows / per_item_tok:.2f}" +
                  (f"\n{rec}" if rec else ""))
        return table

    def memory(self) -> dict:
        out = {"step": self.step, "rss": _rss(), "batch shapes seen": len(self.feed.batch_shapes)}
        if self.device.type == "cuda":
            out[str(self.device)] = torch.cuda.memory_allocated(self.device)
            out[f"{self.device} reserved"] = torch.cuda.memory_reserved(self.device)
            try:
                out["pinned host (allocator)"] = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
            except Exception:  # noqa: BLE001
                pass
        return out

    def profile(self, wall: float, rate: float, since_start: float):
        extra = [["tok/s", "", "", "", f"{rate:,.0f}"]]
        for sink in self.sinks:
            sink.write(self.step, {"stage_s": {k: v["total_s"] for k, v in self.profiler.snapshot().items()}})
        log.info("profile over %.0fs:\n%s\n%s", wall, self.profiler.table(wall, extra), self.split_table(since_start))
        self.profiler.reset()

    def close(self):
        if self.metrics_file is not None:
            self.metrics_file.close()
        for sink in self.sinks:
            sink.close()


def recommend_split(target_rates: list[float], drafter_rates: list[float]) -> str:
    """From per-rank micro-batch rates: the split of the same number of GPUs that maximises the pipeline
    rate min(T x target rate, D x drafter rate), and what it would gain. Advice only: ranks are never
    re-assigned automatically (change --target-gpus/--drafter-gpus)."""
    if not target_rates or not drafter_rates:
        return ""
    rt, rd = float(np.mean(target_rates)), float(np.mean(drafter_rates))
    T, D = len(target_rates), len(drafter_rates)
    now = min(T * rt, D * rd)
    best = max(((t, T + D - t) for t in range(1, T + D)), key=lambda s: (min(s[0] * rt, s[1] * rd), -abs(s[0] - T)))
    gain = min(best[0] * rt, best[1] * rd) / max(now, 1e-12)
    bound = "drafter" if D * rd < T * rt else "target"
    if best == (T, D):
        return (f"split: {T} target + {D} drafter GPUs is the best for this data "
                f"({bound}-bound; the other side has {max(T * rt, D * rd) / max(now, 1e-12):.2f}x the capacity)")
    return (f"split: {T} target + {D} drafter GPUs is {bound}-bound; {best[0]} target + {best[1]} drafter "
            f"would run {gain:.2f}x faster on this data")


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0
