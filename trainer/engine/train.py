"""The training loop of one rank, top to bottom, and its wiring (rank.py starts it, answers its stop signals and
maps its failures to exit codes). The components beside it own their
state: topology.py, groups.py and dispatch.py (ranks, groups, stop vote, dispatch plan), target_stage.py and
drafter_stage.py (the two stages), transport.py (slots, sends, receives), feed.py (this rank's micro-batches),
compile_warmup.py, optim.py,
train_state.py (what a checkpoint holds: one typed state whose parts their owners declare),
checkpoint.py (the checkpoint protocol; checkpoint_format.py its files on disk),
report.py (status, metrics, sinks, tables), faults.py, errors.py.

Owners on a rank (one each):
  main thread      the step loop (here): target forwards and sends, drafter receives (posted by feed.py)
                   and micro-steps, optimizer step, stop vote; checkpoints (checkpoint.py); status and
                   metrics (report.py, rank 0); the tau eval at eval steps with the pipeline quiescent
                   (evaltrain.py; the lowest target rank runs it)
  prefetch thread  feed.py: collate + plan of this rank's micro-batches, in order, into a bounded queue
  streams          TargetStage.stream (forward + pack), Sender.stream (sends), DrafterStage.stream
                   (receives are ordered onto it; forward/backward/optimizer)
  buffers          TargetStage.slots, Receiver.bufs, DrafterStage.metric, Reporter.pending (pinned)
No host sync on a compute stream in the steady state: metrics reach the host through pinned buffers,
read when their event has fired (Reporter.drain).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path

import torch

from trainer import __version__
from trainer.config.options import TrainConfig
from trainer.config.preflight import validate
from trainer.data.dataset import DataError
from trainer.distributed import oprecord
from trainer.distributed.groups import Groups, StopVote, hold_together
from trainer.distributed.startup import Startup
from trainer.distributed.topology import Topology
from trainer.distributed.transport import Receiver, Sender, device_ctx, new_event, stream_ctx, unpack
from trainer.engine.checkpoint import Checkpointer
from trainer.engine.compile_warmup import check_target_coverage, hybrid_target, startup_bounds, warmup
from trainer.engine.drafter_stage import DrafterStage, build_stage, target_embed_head
from trainer.engine.evaltrain import InTrainingEval
from trainer.engine.faults import Faults
from trainer.engine.feed import Feed
from trainer.engine.metrics import Profiler, StepMetrics
from trainer.engine.optim import guarded_step, lr_at, warmup_steps
from trainer.engine.report import Reporter
from trainer.engine.runlog import setup_logging
from trainer.engine.target_stage import TargetStage, build_target_stage, load_for_run
from trainer.engine.train_state import (
    DataFeedState,
    DrafterState,
    LoopState,
    NanSkips,
    RNGState,
    RunInfo,
    ScheduleState,
    TrainState,
)
from trainer.errors import BadInput, TrainingFailed
from trainer.model import identity
from trainer.model.drafter import DFlashConfig
from trainer.ops.compiling import compile_reason, note_new_graphs, resolve_compile
from trainer.status import beating

log = logging.getLogger("trainer")

# status.json is rewritten this often while the drafters write a checkpoint (tens of GB through DCP on slow
# storage), so the supervisor keeps petting systemd's watchdog (WatchdogSec) through the write
CHECKPOINT_BEAT_S = 30.0


class Trainer:
    """One rank of the job. target_factory(device) -> model and dataset let the benchmark and tests
    inject random-init targets and synthetic data (world size 1 only)."""

    def __init__(self, cfg: TrainConfig, topo: Topology, groups: Groups, target_factory=None, dataset=None):
        self.cfg: TrainConfig = cfg
        self.topo: Topology = topo
        self.groups: Groups = groups
        self.target_factory = target_factory   # model for world size 1 (benchmark, tests), else loaded
        self.run_id: str = os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex[:8]
        self.device: torch.device = torch.device(topo.role.device)
        # the compute dtype: bf16 on GPUs; on the CPU --cpu-dtype (float32 unless asked)
        self.dtype: torch.dtype = getattr(torch, cfg.cpu_dtype) if self.device.type == "cpu" else torch.bfloat16
        self.stop_requested: threading.Event = threading.Event()   # SIGTERM/SIGINT; the vote makes it the job's
        self.profiler: Profiler = Profiler()       # stage times: the loop, the feed and the report write them
        self.faults: Faults = Faults(topo.rank)
        self.feed: Feed = Feed(cfg, topo, self.device, self.profiler, dataset)
        self.vote: StopVote = StopVote(topo, groups.control)
        self.report: Reporter = Reporter(cfg, topo, self.run_id, self.device, self.profiler, self.feed, self.vote)
        self.ckpt: Checkpointer = Checkpointer(Path(cfg.output_dir), cfg.keep_checkpoints, topo, groups)
        # the start-up's proof of progress, init_rank's notes carried on
        self.startup: Startup = Startup(cfg, topo, self.report.status, self.report.extend, groups.progress)
        # built in setup()
        self.dcfg: DFlashConfig | None = None
        self.target: TargetStage | None = None
        self.sender: Sender | None = None
        self.drafter: DrafterStage | None = None
        self.receiver: Receiver | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.evaluator: InTrainingEval | None = None     # with --eval-data-dir (evaltrain.py)
        self.batches_per_step: int = 0
        self.total_steps: int = 0
        self.state: TrainState | None = None    # what a checkpoint holds, built once in setup()
        # the loop's state (step, tokens_seen and warmup_steps live in the train state's parts)
        self.loop: LoopState = LoopState()
        self.schedule: ScheduleState = ScheduleState()
        self.wait_s: float = 0.0     # seconds the main thread waited for received hidden states
        self.items_done: int = 0     # micro-batches this rank worked on (as target, drafter or both)

    # ------------------------------------------------------------------------------------- setup
    def setup(self) -> dict:
        cfg, topo = self.cfg, self.topo
        hybrid = hybrid_target(cfg)
        reason = compile_reason(cfg.compile, self.device.type == "cpu", hybrid)
        cfg.compile = resolve_compile(cfg.compile, self.device.type == "cpu", hybrid)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        log_file = setup_logging(cfg.log_dir, self.run_id if topo.leader else f"{self.run_id}-rank{topo.rank}",
                                 link_latest=topo.leader)
        self.report.status.update(phase="starting", force=True, log_file=str(log_file), world_size=topo.world)
        log.info("dflash trainer %s run %s rank %d of %d: %s", __version__, self.run_id, topo.rank, topo.world,
                 json.dumps(cfg.to_dict(), default=str))
        log.info("ranks: %s", topo.describe())
        log.info("%s", reason)
        self.startup.begin(startup_bounds(cfg, cfg.compile, hybrid))
        facts = validate(cfg) if self.target_factory is None else {}
        if topo.leader:
            self.ckpt.manager.cleanup_stale_tmp()
            self.faults.slow_checkpoint(self.ckpt.manager)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        self.feed.load()
        self._build_stages()
        self._build_schedule()
        self._build_state()
        self._resume()
        if cfg.eval_data_dir:
            try:
                self.evaluator = InTrainingEval(cfg, topo, self.groups, self.device, self.dtype)
            except (DataError, ValueError) as e:
                raise BadInput(f"--eval-data-dir: {e}") from None
        self.report.open(self.loop.step if self.ckpt.resumed_from else None)
        return facts

    def _build_stages(self):
        cfg, topo, dev = self.cfg, self.topo, self.device
        self.report.status.update(phase="loading", force=True)
        self.startup.note("loading", "the target" if topo.is_target else "the target's config, embedding and head")
        model = None
        if self.target_factory is not None:
            model = self.target_factory(dev)
            tc = model.config
        else:
            from transformers import AutoConfig
            tc = AutoConfig.from_pretrained(cfg.target_model, local_files_only=True)
            if topo.is_target:
                model = load_for_run(cfg, dev, self.dtype)
        tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        # preflight filled the open choices in and logged their sources (trainer/config/drafter_choices.py); a run
        # without preflight (an injected target) takes the same MASK rule here
        mask = identity.resolve_mask_token(cfg.target_model, tc.vocab_size, cfg.mask_token_id)
        mask_token = mask.token_id
        self.feed.mask_token = mask_token
        self.dcfg = DFlashConfig.from_target(tc, num_draft_layers=cfg.num_draft_layers, block_size=cfg.block_size,
                                             mask_token_id=mask_token, target_layer_ids=cfg.target_layers,
                                             layer_types=cfg.draft_layer_types, sliding_window=cfg.sliding_window,
                                             num_heads=cfg.draft_heads, num_kv_heads=cfg.draft_kv_heads,
                                             head_dim=cfg.draft_head_dim)
        try:
            self.dcfg = self.dcfg.with_architecture(cfg.arch)
        except ValueError as e:
            raise BadInput(f"--arch {cfg.arch}: {e}") from None
        log.info("drafter: %d layers, taps %s, block %d, mask token %d", self.dcfg.num_hidden_layers,
                 self.dcfg.target_layer_ids, cfg.block_size, mask_token)
        rows, k, hidden = self.feed.rows, len(self.dcfg.target_layer_ids), self.dcfg.hidden_size
        if topo.is_target:
            self.target, self.sender = build_target_stage(cfg, model, dev, self.dtype, self.dcfg.target_layer_ids, rows,
                                                          self.groups.link)
        if topo.is_drafter:
            embed, head = target_embed_head(model, cfg.target_model, dev, self.dtype)
            self.drafter, self.opt = build_stage(self.dcfg, cfg, dev, self.dtype, self.groups.drafters, embed, head,
                                                 "flex" if self.feed.flex else "sdpa")
            if not topo.is_target:   # receive buffers; a rank holding both roles reads its own slots
                cap = (rows * k * hidden) + (rows * hidden if cfg.use_soft_labels else 0)
                self.receiver = Receiver(dev, cap, self.dtype, cfg.queue_depth, k, hidden, self.groups.link)
        del model

    def _build_schedule(self):
        cfg = self.cfg
        per_epoch = self.feed.planner.num_batches
        self.batches_per_step = self.feed.dispatch.per_step
        total = (per_epoch * cfg.epochs) // self.batches_per_step
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        if self.total_steps < 1:
            raise TrainingFailed(f"--data-dir: {per_epoch} batches/epoch x {cfg.epochs} epochs is less than one "
                                 f"optimizer step ({self.batches_per_step} batches)")
        self.schedule.warmup_steps = warmup_steps(cfg.warmup_ratio, self.total_steps)

    # ------------------------------------------------------------------------------ checkpointing
    def _build_state(self):
        """The train state, once: each part is its owner's (train_state.py), the checkpointer reads it."""
        topo = self.topo
        self.state = TrainState(
            loop=self.loop, schedule=self.schedule,
            data=DataFeedState(self.feed, self.loop, self.batches_per_step, self.total_steps),
            health=NanSkips(self.report),
            run=RunInfo(self.run_id, self.cfg, len(topo.drafter_ranks)),
            rng=RNGState(topo.drafter_index if topo.is_drafter else None, len(topo.drafter_ranks),
                         self.groups.dctl, topo.leader),
            drafter=DrafterState(self.drafter.model, self.opt, self.dcfg) if topo.is_drafter else None)

    def _resume(self):
        path = self.ckpt.resume(self.state, self.cfg.resume)
        if path is not None:
            log.info("resumed from %s: step %d of %d (warmup %d steps)", path, self.loop.step, self.total_steps,
                     self.schedule.warmup_steps)
            if self.cfg.init_drafter:
                log.info("--init-drafter %s: not used, the run resumes its own checkpoint", self.cfg.init_drafter)
        elif self.cfg.init_drafter and self.state.drafter is not None:   # AdamW and the schedule start fresh
            pub, n = self.state.drafter.warm_start(self.cfg.init_drafter)
            if self.topo.leader:
                log.info("warm start from %s (%s): %d tensors; AdamW moments start fresh, the schedule at step 0 "
                         "(warmup %d of %d steps, peak lr %g)", pub.source, pub.arch, n, self.schedule.warmup_steps,
                         self.total_steps, self.cfg.lr)

    def save_checkpoint(self, reason: str):
        """Drafter ranks, together (checkpoint.py has the protocol). status.json moves every 30 s meanwhile
        (status.beating, as for the tau eval), so systemd's watchdog is fed through a slow write."""
        with beating(self.report.status, CHECKPOINT_BEAT_S, phase="checkpointing", step=self.loop.step):
            path = self.ckpt.save(self.state, reason, self.device)
        self.report.status.update(phase="training", last_checkpoint=path, force=True)

    # ----------------------------------------------------------------------------------- the step
    def _noise(self) -> float:
        prog = min(1.0, self.loop.step / max(1, self.total_steps - 1))
        return self.cfg.noise_start + (self.cfg.noise_end - self.cfg.noise_start) * prog

    def train_step(self):
        """This rank's share of one optimizer step."""
        topo = self.topo
        work = self.feed.mine(self.loop.step)
        di = topo.drafter_index if topo.is_drafter else -1
        ti = topo.target_index if topo.is_target else -1
        mine_d = [a.seq for a in work if a.drafter == di]
        noise, scale = self._noise(), len(topo.drafter_ranks) / self.batches_per_step
        if topo.is_drafter:
            self.drafter.begin_step()
        for a in work:
            if a.drafter == di and a.target != ti:
                self.feed.post_receives(self.receiver, self.drafter.stream, self.loop.step)
            item = self.feed.next(a.seq)
            slot = None
            if a.target == ti:
                slot = self.target.next_slot()
                ev = self.target.forward_pack(item, slot)
                self.profiler.add_events("target fwd+pack", ev["start"], ev["done"])
                if not self.cfg.async_pipeline:   # --no-async: the baseline, every stage waited for
                    ev["done"].synchronize()
                if a.drafter != di:
                    self.sender.send(slot, topo.drafter_ranks[a.drafter], self.target.numel(slot))
            if a.drafter == di:
                if slot is not None:
                    taps, final = unpack(slot.flat, slot.rows, slot.final_rows, self.target.k, self.target.hidden)
                    ready, buf = slot.ready, None
                else:
                    t1 = time.perf_counter()
                    taps, final, buf = self.receiver.take(a.seq, self.drafter.stream)
                    self.wait_s += time.perf_counter() - t1
                    ready = None
                e0, e1 = self.drafter.micro_step(item, taps, final, noise, scale, last=a.seq == mine_d[-1],
                                                 ready=ready)
                self.profiler.add_events("drafter fwd+bwd", e0, e1)
                if not self.cfg.async_pipeline:
                    e1.synchronize()
                if slot is not None:
                    slot.work = e1          # the target reuses this slot only after the drafter read it
                else:
                    self.receiver.release(buf)
                    self.feed.post_receives(self.receiver, self.drafter.stream, self.loop.step)
            self.items_done += 1
        if topo.is_drafter:
            self.optimizer_step()

    def optimizer_step(self):
        import torch.distributed as dist
        cfg, d = self.cfg, self.drafter
        with device_ctx(self.device), stream_ctx(d.stream):
            e0, e1 = new_event(self.device, True), new_event(self.device, True)
            e0.record()
            vec = d.step_vector()   # metrics.StepLayout: [w * CE, tokens, w, correct per slot, rows per slot]
            dist.all_reduce(vec, group=self.groups.drafters)
            loss = vec[0]
            lr = lr_at(self.loop.step, cfg.lr, self.schedule.warmup_steps, self.total_steps)
            gnorm, bad = guarded_step(d.model, self.opt, lr, cfg.grad_clip, loss)
            out = d.layout.host(vec, bad, gnorm)
            host = torch.empty(out.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(out, non_blocking=True)
            ev = new_event(self.device)
            ev.record()
            e1.record()
            self.profiler.add_events("optimizer", e0, e1)
        self.report.step_events.append((self.loop.step + 1, e1))   # GPU timestamps of step ends (rates over many steps)
        d.reset_counters()
        self.report.pending.append(StepMetrics(self.loop.step + 1, host, ev, lr, d.layout))

    # --------------------------------------------------------------------------------------- run
    def warmup(self):
        """Compile/autotune surprises before step 1 (compile_warmup.py)."""
        self.report.status.update(phase="warmup", force=True)
        if self.target is not None:
            try:
                check_target_coverage(self.cfg, self.feed.planner)
            except ValueError as e:
                raise BadInput(str(e)) from None
        warmup(self.cfg, self.dcfg, self.feed, self.target, self.drafter, self.opt, self.device, self.dtype,
               self.startup.note)
        self.profiler.reset()

    def run(self) -> int:
        cfg, topo, report = self.cfg, self.topo, self.report
        self.warmup()
        if self.loop.step >= self.total_steps:
            log.info("nothing to do: step %d of %d", self.loop.step, self.total_steps)
            report.status.update(phase="done", step=self.loop.step, force=True)
            return 0
        self.startup.barrier(self.groups)   # bounded by the config's worst-case warmup
        self.feed.start(self.loop.step, self.total_steps)
        report.begin(self.loop.step, self.total_steps, self.ckpt.resumed_from, self.ckpt.last)
        try:
            while self.loop.step < self.total_steps:
                self.faults.before_step(self.loop.step, self.drafter)
                oprecord.mark(f"step {self.loop.step}")   # streamcheck's step boundary (no-op unless recording)
                epoch, _ = self.feed.position(self.loop.step * self.batches_per_step)
                self.train_step()
                recompiles = note_new_graphs(self.loop.step)   # logged with its guard here; counted in status.json
                self.loop.tokens_seen += sum(a.real_tokens for a in self.feed.dispatch.step(self.loop.step))  # known on every rank
                self.loop.step += 1
                self.groups.settle(self.loop.step)   # the longer NCCL timeout of the first steps ends
                counters = {"items": self.items_done,
                            "busy_s": self.profiler.busy(("target fwd+pack", "drafter fwd+bwd", "optimizer")),
                            "wait_s": self.wait_s,
                            "peak_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                            else 0, "recompiles": recompiles}
                self.vote.post(self.loop.step, self.stop_requested.is_set(), counters)
                stop = self.vote.verdict(self.loop.step)
                if topo.is_drafter:
                    report.drain(self.ckpt.last)
                report.after_step(self.loop.step, epoch, self.loop.tokens_seen)
                last = self.loop.step == self.total_steps
                if self.evaluator is not None and not stop and self.evaluator.due(self.loop.step, last):
                    # before the step's checkpoint: a run killed between the two re-evaluates this step
                    # after the resume (metrics.jsonl is cut back to the checkpoint), so each eval is once
                    report.paused_s += self.evaluator.at_boundary(self.loop.step, last, report, self.ckpt.last,
                                                                  self.drafter, self.target, self.receiver, self.dcfg)
                final = last and cfg.save_final
                checkpoint_due = self.loop.step % cfg.save_interval == 0 or final or stop   # known on every rank
                if topo.is_drafter and checkpoint_due:
                    report.drain(self.ckpt.last, block=True)
                    if report.nan_streak == 0 and not (self.ckpt.last or "").endswith(f"{self.loop.step:08d}"):
                        self.save_checkpoint("SIGTERM" if stop else ("interval" if not final else "final"))
                if checkpoint_due:
                    hold_together(self.topo, self.groups, "the checkpoint")
                if stop:
                    log.info("stop requested: stopped cleanly at step %d", self.loop.step)
                    report.status.update(phase="done", step=self.loop.step, error=None, force=True)
                    return 0
            if topo.is_drafter:
                report.drain(self.ckpt.last, block=True)
            log.info("training complete: %d steps, %d tokens in %.1fs%s", self.loop.step, self.loop.tokens_seen,
                     report.elapsed(), f" (+ {report.paused_s:.1f}s of tau evals)" if report.paused_s else "")
            report.write_eval_json(self.ckpt.last)
            report.status.update(phase="done", step=self.loop.step, force=True)
            return 0
        finally:
            report.end()
            self.feed.stop()

    def shutdown(self):
        self.stop_requested.set()
        self.startup.close()
        self.feed.close()
        self.report.close()
