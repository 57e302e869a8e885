"""The training loop of one rank, top to bottom, and its wiring. The components beside it own their
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
import signal
import sys
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
from trainer.distributed.groups import Groups, StopVote, abort_groups, hold_together, init_rank
from trainer.distributed.startup import Startup
from trainer.distributed.topology import Topology
from trainer.distributed.transport import Receiver, Sender, device_ctx, new_event, stream_ctx, unpack
from trainer.engine.checkpoint import Checkpointer, consolidated_state
from trainer.engine.compile_warmup import check_target_coverage, hybrid_target, startup_bounds, warmup
from trainer.engine.drafter_stage import DrafterStage, build_stage, target_embed_head
from trainer.engine.evaltrain import InTrainingEval, eval_record
from trainer.engine.faults import Faults
from trainer.engine.feed import Feed
from trainer.engine.metrics import Profiler, StepMetrics
from trainer.engine.optim import guarded_step, lr_at, warmup_steps
from trainer.engine.report import Reporter
from trainer.engine.runlog import setup_logging
from trainer.engine.target_stage import TargetStage
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
from trainer.errors import BadInput, CheckpointErrorBase, TrainingFailed, die_with_supervisor, record
from trainer.model import identity
from trainer.model.checkpoint_format import CheckpointError
from trainer.model.dflash2 import as_dflash2
from trainer.model.drafter import DFlashConfig
from trainer.model.target import decoder, load_target
from trainer.ops.compiling import compile_layers, compile_reason, note_new_graphs, resolve_compile, wants
from trainer.status import beating

log = logging.getLogger("trainer")


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
        self.dtype: torch.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.stop_requested: threading.Event = threading.Event()   # SIGTERM/SIGINT; the vote makes it the job's
        self.profiler: Profiler = Profiler()       # stage times: the loop, the feed and the report write them
        self.faults: Faults = Faults(topo.rank)
        self.feed: Feed = Feed(cfg, topo, self.device, self.profiler, dataset)
        self.vote: StopVote = StopVote(topo, groups.control)
        self.report: Reporter = Reporter(cfg, topo, self.run_id, self.device, self.profiler, self.feed, self.vote)
        self.ckpt: Checkpointer = Checkpointer(Path(cfg.output_dir), cfg.keep_checkpoints, topo, groups)
        self.startup: Startup = Startup(cfg, topo, self.report.status, self.report.extend)   # proof of progress
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

    @property
    def step(self) -> int:
        return self.loop.step

    @step.setter
    def step(self, value: int):
        self.loop.step = value

    @property
    def tokens_seen(self) -> int:
        return self.loop.tokens_seen

    @tokens_seen.setter
    def tokens_seen(self, value: int):
        self.loop.tokens_seen = value

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, value: int):
        self.schedule.warmup_steps = value

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
        self.report.open(self.step if self.ckpt.resumed_from else None)
        return facts

    def _build_stages(self):
        cfg, topo, dev = self.cfg, self.topo, self.device
        self.report.status.update(phase="loading", force=True)
        self.startup.note("loading", "the target" if topo.is_target else "the target's config, embedding and head")
        t0 = time.perf_counter()
        model = None
        if self.target_factory is not None:
            model = self.target_factory(dev)
            tc = model.config
        else:
            from transformers import AutoConfig
            tc = AutoConfig.from_pretrained(cfg.target_model, local_files_only=True)
            if topo.is_target:
                try:
                    model = load_target(cfg.target_model, dev, self.dtype, cfg.allow_slow_linear_attention)
                except BadInput:   # e.g. a hybrid target without its fast kernels on a GPU: one line, exit 2
                    raise
                except Exception as e:  # noqa: BLE001  a truncated or corrupt shard: name it, exit 2
                    from trainer.config.options import ConfigError
                    from trainer.config.preflight import check_target_shards
                    try:
                        check_target_shards(cfg.target_model)
                    except ConfigError as bad:
                        raise BadInput(str(bad)) from None
                    raise TrainingFailed(f"--target-model: {cfg.target_model} failed to load: {e}") from e
                log.info("loaded the target on %s in %.1fs", dev, time.perf_counter() - t0)
        tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        # preflight filled the open choices in and logged their sources (trainer/model/contract.py); a run
        # without preflight (an injected target) takes the same MASK rule here
        mask = identity.resolve_mask_token(cfg.target_model, tc.vocab_size, cfg.mask_token_id)
        mask_token = mask.token_id
        self.feed.mask_token = mask_token
        self.dcfg = DFlashConfig.from_target(tc, num_draft_layers=cfg.num_draft_layers, block_size=cfg.block_size,
                                             mask_token_id=mask_token, target_layer_ids=cfg.target_layers,
                                             layer_types=cfg.draft_layer_types, sliding_window=cfg.sliding_window,
                                             num_heads=cfg.draft_heads, num_kv_heads=cfg.draft_kv_heads,
                                             head_dim=cfg.draft_head_dim)
        if cfg.arch == "dflash2":
            try:
                self.dcfg = as_dflash2(self.dcfg)
            except ValueError as e:
                raise BadInput(f"--arch dflash2: {e}") from None
        log.info("drafter: %d layers, taps %s, block %d, mask token %d", self.dcfg.num_hidden_layers,
                 self.dcfg.target_layer_ids, cfg.block_size, mask_token)
        rows, k, hidden = self.feed.rows, len(self.dcfg.target_layer_ids), self.dcfg.hidden_size
        if topo.is_target:
            self.target = TargetStage(model, dev, self.dcfg.target_layer_ids, cfg.use_soft_labels, rows,
                                      cfg.slots_per_worker, self.dtype, sdpa_backend=cfg.sdpa_backend)
            self.sender = Sender(dev, self.groups.link)
            if wants(cfg.compile, "target"):
                n = compile_layers(decoder(self.target.model).layers)
                log.info("--compile %s: %d target layers compiled (regional; compiles during warmup)", cfg.compile, n)
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
        self.warmup_steps = warmup_steps(cfg.warmup_ratio, self.total_steps)

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
            log.info("resumed from %s: step %d of %d (warmup %d steps)", path, self.step, self.total_steps,
                     self.warmup_steps)
            if self.cfg.init_drafter:
                log.info("--init-drafter %s: not used, the run resumes its own checkpoint", self.cfg.init_drafter)
        elif self.cfg.init_drafter:
            self._warm_start()

    def _warm_start(self):
        """--init-drafter: the published drafter's weights (preflight checked its contract) into this rank's
        shard; AdamW's moments and the schedule start fresh."""
        from trainer.model import published
        if self.state.drafter is not None:
            try:
                pub = published.read(self.cfg.init_drafter)
                shapes = {n: tuple(p.shape) for n, p in self.drafter.model.named_parameters()}
                weights = published.load_weights(pub, shapes)
            except published.PublishedError as e:
                raise BadInput(str(e)) from None
            self.state.drafter.load_full_weights(weights)
            del weights
            if self.topo.leader:
                log.info("warm start from %s (%s): %d tensors; AdamW moments start fresh, the schedule at step 0 "
                         "(warmup %d of %d steps, peak lr %g)", pub.source, pub.arch, len(shapes), self.warmup_steps,
                         self.total_steps, self.cfg.lr)

    def save_checkpoint(self, reason: str):
        """Drafter ranks, together (checkpoint.py has the protocol)."""
        self.report.status.update(phase="checkpointing", step=self.step, force=True)
        path = self.ckpt.save(self.state, reason, self.device)
        self.report.status.update(phase="training", last_checkpoint=path, force=True)

    # ------------------------------------------------------------------------------ tau eval
    def _quiesce(self):
        """Nothing of this rank's pipeline in flight: the step's sends complete, the device idle. (No
        receive is posted across a step boundary: Feed.post_receives.)"""
        if self.target is not None:
            for slot in self.target.slots:
                Sender.reclaim(slot)
        if self.receiver is not None and self.receiver.posted:
            raise RuntimeError(f"eval at step {self.step}: receives still posted across the step boundary")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def evaluate_now(self, final: bool) -> float:
        """Every rank, at an eval step's boundary (evaltrain.py has the message flow): tau of the current
        weights, measured by the eval owner, recorded by the leader. Returns the seconds it took."""
        t0 = time.perf_counter()
        if self.topo.is_drafter:
            self._drain_metrics(block=True)   # step records first: W&B drops a step below the last logged
        # status.json says eval and keeps moving (systemd's watchdog is petted while rank 0 waits)
        with beating(self.report.status, phase="eval", step=self.step):
            self._quiesce()
            state = consolidated_state(self.drafter.model, self.device, self.topo.leader) if self.topo.is_drafter \
                else None
            res = self.evaluator.run(self.step, state, self.target, self.dcfg, final)
            del state
        secs = time.perf_counter() - t0
        if self.topo.leader:
            if "error" in res:
                log.warning("eval at step %d failed on rank %d: %s (training goes on)", self.step,
                            self.evaluator.owner, res["error"])
            else:
                self.report.record_eval(eval_record(self.step, res, final), secs)
        return secs

    # ----------------------------------------------------------------------------------- the step
    def _noise(self) -> float:
        prog = min(1.0, self.step / max(1, self.total_steps - 1))
        return self.cfg.noise_start + (self.cfg.noise_end - self.cfg.noise_start) * prog

    def train_step(self):
        """This rank's share of one optimizer step."""
        topo = self.topo
        work = self.feed.mine(self.step)
        di = topo.drafter_index if topo.is_drafter else -1
        ti = topo.target_index if topo.is_target else -1
        mine_d = [a.seq for a in work if a.drafter == di]
        noise, scale = self._noise(), len(topo.drafter_ranks) / self.batches_per_step
        if topo.is_drafter:
            self.drafter.begin_step()
        for a in work:
            if a.drafter == di and a.target != ti:
                self.feed.post_receives(self.receiver, self.drafter.stream, self.step)
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
                    self.feed.post_receives(self.receiver, self.drafter.stream, self.step)
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
            lr = lr_at(self.step, cfg.lr, self.warmup_steps, self.total_steps)
            gnorm, bad = guarded_step(d.model, self.opt, lr, cfg.grad_clip, loss)
            out = d.layout.host(vec, bad, gnorm)
            host = torch.empty(out.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(out, non_blocking=True)
            ev = new_event(self.device)
            ev.record()
            e1.record()
            self.profiler.add_events("optimizer", e0, e1)
        self.report.step_events.append((self.step + 1, e1))   # GPU timestamps of step ends (rates over many steps)
        d.reset_counters()
        self.report.pending.append(StepMetrics(self.step + 1, host, ev, lr, d.layout))

    def _drain_metrics(self, block: bool = False):
        self.report.drain(self.ckpt.last, block)

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
        if self.step >= self.total_steps:
            log.info("nothing to do: step %d of %d", self.step, self.total_steps)
            report.status.update(phase="done", step=self.step, force=True)
            return 0
        self.startup.barrier(self.groups)   # bounded by the config's worst-case warmup
        self.feed.start(self.step, self.total_steps)
        report.begin(self.step, self.total_steps, self.ckpt.resumed_from, self.ckpt.last)
        try:
            while self.step < self.total_steps:
                self.faults.before_step(self.step, self.drafter)
                oprecord.mark(f"step {self.step}")   # streamcheck's step boundary (no-op unless recording)
                epoch, _ = self.feed.position(self.step * self.batches_per_step)
                self.train_step()
                note_new_graphs(self.step)
                self.tokens_seen += sum(a.real_tokens for a in self.feed.dispatch.step(self.step))  # known on every rank
                self.step += 1
                counters = {"items": self.items_done,
                            "busy_s": self.profiler.busy(("target fwd+pack", "drafter fwd+bwd", "optimizer")),
                            "wait_s": self.wait_s,
                            "peak_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                            else 0}
                self.vote.post(self.step, self.stop_requested.is_set(), counters)
                stop = self.vote.verdict(self.step)
                if topo.is_drafter:
                    self._drain_metrics()
                report.after_step(self.step, epoch, self.tokens_seen)
                last = self.step == self.total_steps
                if self.evaluator is not None and not stop and self.evaluator.due(self.step, last):
                    # before the step's checkpoint: a run killed between the two re-evaluates this step
                    # after the resume (metrics.jsonl is cut back to the checkpoint), so each eval is once
                    report.paused_s += self.evaluate_now(final=last)
                final = last and cfg.save_final
                checkpoint_due = self.step % cfg.save_interval == 0 or final or stop   # known on every rank
                if topo.is_drafter and checkpoint_due:
                    self._drain_metrics(block=True)
                    if report.nan_streak == 0 and not (self.ckpt.last or "").endswith(f"{self.step:08d}"):
                        self.save_checkpoint("SIGTERM" if stop else ("interval" if not final else "final"))
                if checkpoint_due:
                    hold_together(self.topo, self.groups, "the checkpoint")
                if stop:
                    log.info("stop requested: stopped cleanly at step %d", self.step)
                    report.status.update(phase="done", step=self.step, error=None, force=True)
                    return 0
            if topo.is_drafter:
                self._drain_metrics(block=True)
            log.info("training complete: %d steps, %d tokens in %.1fs%s", self.step, self.tokens_seen,
                     report.elapsed(), f" (+ {report.paused_s:.1f}s of tau evals)" if report.paused_s else "")
            report.write_eval_json(self.ckpt.last)
            report.status.update(phase="done", step=self.step, force=True)
            return 0
        finally:
            report.end()
            self.feed.stop()

    def shutdown(self):
        self.stop_requested.set()
        self.startup.close()
        self.feed.close()
        self.report.close()


def install_signal_handlers(trainer: Trainer):
    def handler(signum, frame):
        log.info("received %s: the job stops after an agreed step, with a checkpoint", signal.Signals(signum).name)
        trainer.stop_requested.set()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def train_rank(cfg: TrainConfig, target_factory=None, dataset=None, on_done=None) -> int:
    """Entry point of one rank (started by the launcher, or in-process at world size 1). on_done(trainer)
    runs on every rank after a successful run, before shutdown (the benchmark reads its figures there)."""
    import torch.distributed as dist
    die_with_supervisor()
    try:
        topo, groups = init_rank(cfg)
    except ValueError as e:
        record(e)
        if not os.environ.get("DFLASH_SUPERVISED"):
            print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        return 2
    trainer = Trainer(cfg, topo, groups, target_factory, dataset)
    install_signal_handlers(trainer)
    status = trainer.report.status
    rc = 1
    try:
        trainer.setup()
        rc = trainer.run()
        if on_done is not None and rc == 0:
            on_done(trainer)
        return rc
    except BadInput as e:
        record(e)
        log.error("bad input: %s", e, extra={"console": False})
        status.update(phase="failed", error=str(e), step=trainer.step, force=True)
        if not os.environ.get("DFLASH_SUPERVISED"):
            print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        rc = 2
        return rc
    except (TrainingFailed, CheckpointError) as e:
        record(e)
        log.error("training failed: rank %d: %s", topo.rank, e)
        status.update(phase="failed", error=f"rank {topo.rank}: {e}", step=trainer.step,
                      nan_skips=trainer.report.nan_skips, nan_streak=trainer.report.nan_streak, force=True)
        return 1
    except (Exception, CheckpointErrorBase) as e:
        record(e)
        log.exception("training failed on rank %d", topo.rank)
        status.update(phase="failed", error=f"rank {topo.rank}: {type(e).__name__}: {e}", force=True)
        return 1
    finally:
        trainer.shutdown()
        if rc == 0:
            try:
                trainer.vote.drain()
                dist.barrier(group=groups.control)
            except Exception:  # noqa: BLE001
                pass
            dist.destroy_process_group()
        else:
            abort_groups()   # not destroy: NCCL's would wait for the ops a dead peer never completes

