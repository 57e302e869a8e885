"""The training loop, top to bottom. Moving parts live beside it: plan.py (examples), pipeline.py
(target workers and transport), model.py (drafter and loss), checkpoint.py, status.py, runlog.py.

Threads: feeder (data -> WorkItem), one per target worker, two EventWaiters (copy done -> publish;
drafter done with slot -> release), one per drafter replica (micro-steps), and this main thread
(optimizer steps, metrics, status, checkpoints). The main thread never blocks on the GPU in the
steady state: metrics come back through pinned buffers and are read when their event has fired.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .checkpoint import CheckpointError, CheckpointManager, capture_rng_state, load as load_checkpoint, restore_rng_state
from .config import TrainConfig, validate
from .data import BatchPlanner, DataError, DataPosition, collate, load_dataset
from .fast import compile_layers, freeze_compiled, resolve_compile, wants
from .model import DFlashConfig, DFlashDrafter, PackedMeta, dflash_loss, init_drafter_weights
from .pipeline import (Delivered, Dispatcher, EventWaiter, TargetWorker, _decoder, device_ctx, make_item,
                       new_event, np_seed, stream_ctx)
from .plan import plan_micro_batch
from .runlog import Progress, format_table, setup_logging
from .status import Notifier, StatusWriter

log = logging.getLogger("trainer")


class TrainingFailed(RuntimeError):
    pass


class Stop(Exception):
    pass


class BadInput(TrainingFailed):
    """Input found bad only when it is read (e.g. a malformed data shard): exit 2 like the cheap
    checks in config.validate, since restarting will not fix it (the unit's RestartPreventExitStatus=2)."""


# --------------------------------------------------------------------------------------------- setup

def resolve_mask_token(target_dir: str, vocab_size: int, override: int | None) -> int:
    if override is not None:
        if not 0 <= override < vocab_size:
            raise ValueError(f"--mask-token-id: {override} outside the vocabulary ({vocab_size})")
        return override
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
        for name in ("<|mask|>", "<|MASK|>", "<mask>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tok.unk_token_id and 0 <= tid < vocab_size:
                return tid
    except Exception as e:  # a model without tokenizer files still trains
        log.warning("no tokenizer in %s (%s); using the Qwen3 mask id", target_dir, e)
    return 151669 if vocab_size > 151669 else vocab_size - 1


def load_target(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, use_safetensors=True, attn_implementation="sdpa",
        device_map={"": str(device)} if device.type == "cuda" else None)
    model.eval().requires_grad_(False)
    return model


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

    def add(self, stage: str, seconds: float):
        with self.lock:
            self.totals[stage] = self.totals.get(stage, 0.0) + seconds
            self.counts[stage] = self.counts.get(stage, 0) + 1

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

    def reset(self):
        with self.lock:
            self.totals.clear()
            self.counts.clear()
            self.t0 = time.perf_counter()


class DrafterReplica:
    """One copy of the drafter on one device, its stream and its flat gradient buffer."""

    def __init__(self, index: int, device: torch.device, module: DFlashDrafter, embed: torch.Tensor,
                 lm_head: torch.Tensor, cfg: TrainConfig, dcfg: DFlashConfig, dtype, rows: int, k_taps: int,
                 profiler: Profiler, release_waiter: EventWaiter, attention: str):
        self.index, self.device, self.model = index, device, module
        self.embed, self.lm_head, self.cfg, self.dcfg, self.dtype = embed, lm_head, cfg, dcfg, dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.params = [p for p in module.parameters()]
        self.profiler, self.release_waiter, self.attention = profiler, release_waiter, attention
        self.recv_taps = None
        self.recv_final = None
        self.fused_loss = wants(cfg.compile, "drafter")
        self.rows, self.k_taps = rows, k_taps
        self.gen = torch.Generator(device=device)
        bs = dcfg.block_size
        self.metric = torch.zeros(1 + bs, device=device, dtype=torch.float32)  # loss, correct per slot
        self.done_event = None
        self.flat_grad = torch.zeros(sum(p.numel() for p in self.params), device=device, dtype=torch.float32)
        self.poison = False
        self.tokens = 0                                   # host-side counters of the current step
        self.pos_counts = np.zeros(bs, np.int64)

    def _recv(self, slot, rows, nf):
        """Pinned path: copy the slot to this device, then hand the slot back once the copy is done."""
        if slot.mode != "pinned":
            return slot.dst_taps, slot.dst_final
        if self.recv_taps is None:
            self.recv_taps = torch.empty(self.rows, slot.dst_taps.shape[1], device=self.device, dtype=self.dtype)
            if slot.dst_final is not None:
                self.recv_final = torch.empty(self.rows, slot.dst_final.shape[1], device=self.device, dtype=self.dtype)
        self.recv_taps[:rows].copy_(slot.dst_taps[:rows], non_blocking=True)
        if nf:
            self.recv_final[:nf].copy_(slot.dst_final[:nf], non_blocking=True)
        ev = new_event(self.device)
        ev.record()
        self.release_waiter.put(ev, lambda s=slot: s.owner.release(s))
        return self.recv_taps, self.recv_final

    def micro_step(self, d: Delivered, noise_amp: float, norm_scale: float):
        cfg, bs = self.cfg, self.dcfg.block_size
        item = d.item
        plan = item.plan
        self.tokens += plan.num_tokens
        self.pos_counts += plan.pos_counts
        with device_ctx(self.device), stream_ctx(self.stream):
            e0, e1 = new_event(self.device, True), new_event(self.device, True)
            e0.record()
            taps, final = self._recv(d.slot, d.rows, d.final_rows)
            norm = plan.weight_total * norm_scale
            if plan.weight_total > 0:
                self.gen.manual_seed(np_seed(cfg.seed, item.seq_no + 1))
                for c, h in zip(plan.chunks, item.host["chunks"]):
                    dev = {k: v.to(self.device, non_blocking=True) for k, v in h.items()}
                    meta = PackedMeta(dev["ctx_seq"], dev["ctx_pos"], dev["q_seq"], dev["q_anchor"], dev["q_pos"],
                                      bs, dev.get("kv_num_blocks"), dev.get("kv_indices"))
                    x = taps[c.c0:c.c1]
                    if noise_amp > 0 and cfg.noise_type != "none":
                        if cfg.noise_type == "uniform":
                            noise = torch.rand(x.shape, generator=self.gen, device=self.device, dtype=torch.float32)
                            noise = (noise * 2 - 1) * noise_amp
                        else:
                            noise = torch.randn(x.shape, generator=self.gen, device=self.device,
                                                dtype=torch.float32) * noise_amp
                        x = x + noise.to(x.dtype)
                    emb = self.embed[dev["block_tokens"]]
                    hidden = self.model(x, emb, meta, backend=self.attention)
                    soft = final[dev["soft_index"]] if final is not None and "soft_index" in dev else None
                    loss, correct = dflash_loss(hidden, self.lm_head, dev["labels"], dev["row_weight"], norm,
                                                soft_rows=soft, fused=self.fused_loss)
                    if self.poison:  # fault injection (DFLASH_FAULT_NAN_FROM_STEP)
                        loss = loss * float("nan")
                    loss.backward()
                    valid = (dev["row_weight"] > 0).float()
                    self.metric[0] += loss.detach()
                    self.metric[1:] += (correct * valid).view(-1, bs).sum(0)
            e1.record()
            self.profiler.add_events("drafter fwd+bwd", e0, e1)
            if d.slot.mode != "pinned":
                self.release_waiter.put(e1, lambda s=d.slot: s.owner.release(s))

    def collect_grads(self):
        """Flatten this replica's grads (fp32) and record the event the optimizer waits on."""
        with device_ctx(self.device), stream_ctx(self.stream):
            off = 0
            for p in self.params:
                n = p.numel()
                if p.grad is None:
                    self.flat_grad[off:off + n].zero_()
                else:
                    self.flat_grad[off:off + n].copy_(p.grad.reshape(-1))
                    p.grad = None
                off += n
            self.done_event = new_event(self.device)
            self.done_event.record()


@dataclass
class StepMetrics:
    step: int
    host: torch.Tensor
    event: object
    tokens: int
    lr: float
    pos_counts: np.ndarray
    seq_end: int


class Trainer:
    def __init__(self, cfg: TrainConfig, target_factory=None, dataset=None):
        """target_factory(device) -> model and dataset let the benchmark inject random-init targets and
        synthetic data; production runs load both from --target-model / --data-dir."""
        self.cfg = cfg
        self.target_factory, self.injected_dataset = target_factory, dataset
        # per optimizer step, bounded for long runs: the first and the latest 100 entries (HeadTailLog)
        self.step_log = HeadTailLog()  # (time, step, tokens_seen)
        self.mem_log = HeadTailLog()   # allocator counters (no device sync)
        self.batch_shapes: set[tuple[int, int]] = set()  # distinct [B, S] fed to the target (per-shape caches)
        self.run_id = uuid.uuid4().hex[:8]
        self.out = Path(cfg.output_dir)
        self.stop_requested = threading.Event()
        self.fatal: BaseException | None = None
        self.profiler = Profiler()
        self.notifier = Notifier()
        self.status = StatusWriter(cfg.status_file, self.run_id, min_interval=1.0, notifier=self.notifier)
        self.threads: list[threading.Thread] = []
        self.faults = read_faults()
        self._draining = False
        self.wandb = None

    # ------------------------------------------------------------------------------------- devices
    def _devices(self):
        cfg = self.cfg
        if cfg.on_cpu:
            return ([torch.device("cpu")] * max(1, getattr(cfg, "cpu_target_workers", 1)),
                    [torch.device("cpu")] * max(1, getattr(cfg, "cpu_drafter_replicas", 1)))
        return [torch.device("cuda", i) for i in cfg.target_gpus], [torch.device("cuda", i) for i in cfg.drafter_gpus]

    def setup(self):
        cfg = self.cfg
        cfg.compile = resolve_compile(cfg.compile, cfg.on_cpu)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = setup_logging(cfg.log_dir, self.run_id)
        self.status.update(phase="starting", force=True, log_file=str(self.log_file))
        log.info("dflash trainer %s run %s: %s", __version__, self.run_id, json.dumps(cfg.to_dict(), default=str))
        facts = validate(cfg) if self.target_factory is None else {}
        self.ckpt = CheckpointManager(self.out, cfg.keep_checkpoints)
        self.ckpt.cleanup_stale_tmp()
        if "slow_checkpoint" in self.faults:
            delay = self.faults["slow_checkpoint"]
            self.ckpt.before_publish = lambda tmp: (log.warning("fault injection: checkpoint %s held %.0fs before "
                                                                "its rename", tmp, delay), time.sleep(delay))
        t_dev, d_dev = self._devices()
        self.t_devices, self.d_devices = t_dev, d_dev
        self.dtype = torch.float32 if cfg.on_cpu else torch.bfloat16
        if not cfg.on_cpu:
            torch.backends.cuda.matmul.allow_tf32 = True

        # data
        try:
            self.dataset = self.injected_dataset or load_dataset(cfg.data_dir)
        except DataError as e:
            raise BadInput(f"--data-dir: {e}") from None
        self.planner = BatchPlanner(self.dataset.lengths, cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size,
                                    seed=cfg.seed, drop_long=cfg.drop_long)
        st = self.planner.stats()
        log.info("data: %d sequences, %d tokens; %d batches/epoch; %d truncated, %d dropped (over --max-seq-len %d)",
                 st["num_sequences"], self.dataset.num_tokens, st["num_batches_per_epoch"], st["num_truncated"],
                 st["num_dropped"], cfg.max_seq_len)
        log.info("target batch shapes: at most %d distinct [B, S] over the whole run (--pad-multiple %d)",
                 self.planner.max_batch_shapes(cfg.pad_multiple), cfg.pad_multiple)
        if st["num_batches_per_epoch"] == 0:
            raise TrainingFailed(f"--data-dir: {cfg.data_dir} yields no batches")

        # target replicas
        self.status.update(phase="loading", force=True)
        self.notifier.extend_timeout(900)
        t0 = time.perf_counter()
        load = self.target_factory or (lambda dev: load_target(cfg.target_model, dev, self.dtype))
        first = load(t_dev[0])
        models = [first]
        for dev in t_dev[1:]:
            models.append(copy.deepcopy(first) if dev.type == "cpu" else load(dev))
            self.notifier.extend_timeout(900)
        log.info("loaded %d target replica(s) on %s in %.1fs", len(models), [str(d) for d in t_dev],
                 time.perf_counter() - t0)
        tc = first.config.get_text_config() if hasattr(first.config, "get_text_config") else first.config
        self.mask_token = resolve_mask_token(cfg.target_model, tc.vocab_size, cfg.mask_token_id)
        self.dcfg = DFlashConfig.from_target(tc, num_draft_layers=cfg.num_draft_layers, block_size=cfg.block_size,
                                             mask_token_id=self.mask_token, target_layer_ids=cfg.target_layers)
        log.info("drafter: %d layers, taps %s, block %d, mask token %d", self.dcfg.num_hidden_layers,
                 self.dcfg.target_layer_ids, cfg.block_size, self.mask_token)
        embed = first.get_input_embeddings().weight.detach()
        head = first.get_output_embeddings().weight.detach()
        self.flex = (cfg.attention == "flex") or (cfg.attention == "auto" and not cfg.on_cpu)
        self.rows = cfg.token_budget + (128 * cfg.max_batch_size if self.flex else 0)
        self.workers = [TargetWorker(i, m, dev, self.dcfg.target_layer_ids, cfg.use_soft_labels, self.rows, d_dev,
                                     cfg.slots_per_worker, self.dtype, transport=cfg.transport,
                                     sdpa_backend=cfg.sdpa_backend)
                        for i, (m, dev) in enumerate(zip(models, t_dev))]
        if wants(cfg.compile, "target"):
            n = sum(compile_layers(_decoder(w.model).layers) for w in self.workers)
            log.info("--compile %s: %d target layers compiled (regional; compiles during warmup)", cfg.compile, n)
        log.info("transport: %s", ", ".join(f"worker {w.index} {w.device}->{d_dev[0]} {w.mode}" for w in self.workers))

        # drafter replicas + fp32 master on the first drafter device
        self.release_waiter = EventWaiter("slot-release")
        self.copy_waiter = EventWaiter("copy-done")
        self.release_waiter.start()
        self.copy_waiter.start()
        with torch.device(d_dev[0]):
            base = DFlashDrafter(self.dcfg, split_fc=cfg.split_fc)
        init_drafter_weights(base, seed=cfg.seed)
        self.replicas = []
        for i, dev in enumerate(d_dev):
            m = copy.deepcopy(base).to(device=dev, dtype=self.dtype)
            m.rotary_emb.to(dtype=torch.float32)
            m.train()
            if wants(cfg.compile, "drafter"):
                compile_layers(m.layers, dynamic=True)  # every micro-batch has its own row counts
            self.replicas.append(DrafterReplica(
                i, dev, m, embed.to(dev, self.dtype), head.to(dev, self.dtype), cfg, self.dcfg, self.dtype,
                self.rows, len(self.dcfg.target_layer_ids), self.profiler, self.release_waiter,
                "flex" if self.flex else "sdpa"))
        self.master_dev = d_dev[0]
        self.names = [n for n, _ in base.named_parameters()]
        flat = torch.cat([p.detach().reshape(-1).float() for p in base.parameters()]).to(self.master_dev)
        self.master_flat = flat
        self.master_grad = torch.zeros_like(flat)
        self.master_params = []
        off = 0
        for p in base.parameters():
            mp = torch.nn.Parameter(flat[off:off + p.numel()].view(p.shape))
            mp.grad = self.master_grad[off:off + p.numel()].view(p.shape)
            self.master_params.append(mp)
            off += p.numel()
        decay = [mp for mp, p in zip(self.master_params, base.parameters()) if p.ndim >= 2]
        no_decay = [mp for mp, p in zip(self.master_params, base.parameters()) if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                                     fused=True)
        self.master_stream = torch.cuda.Stream(self.master_dev) if self.master_dev.type == "cuda" else None
        log.info("drafter: %.1fM trainable parameters on %s, fp32 master on %s",
                 flat.numel() / 1e6, [str(d) for d in d_dev], self.master_dev)

        m = len(self.replicas)
        self.batches_per_step = m * cfg.grad_accum
        per_epoch = self.planner.num_batches
        total = (per_epoch * cfg.epochs) // self.batches_per_step
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        if self.total_steps < 1:
            raise TrainingFailed(f"--data-dir: {per_epoch} batches/epoch x {cfg.epochs} epochs is less than one "
                                 f"optimizer step ({self.batches_per_step} batches)")
        warm = max(1, int(cfg.warmup_ratio * self.total_steps)) if cfg.warmup_ratio > 0 else 0
        total_steps = self.total_steps

        def lr_lambda(step):
            if step < warm:
                return (step + 1) / warm
            prog = (step - warm) / max(1, total_steps - warm)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)

        # state
        self.step = 0
        self.seq_start = 0  # global batch number the next step starts at
        self.tokens_seen = 0
        self.nan_skips = 0
        self.nan_streak = 0
        self.last_ckpt = None
        self.resumed_from = None
        latest = self.ckpt.latest()
        if latest is not None:
            if not cfg.resume:
                raise TrainingFailed(f"--no-resume: {self.out} holds {latest.name}; refusing to overwrite")
            self._resume(latest)
        self._broadcast()
        self.metrics_file = open(self.out / "metrics.jsonl", "a")
        self._metrics_error = False
        self.pending: deque[StepMetrics] = deque()
        self.last_loss = None
        self.last_acc = None
        self.wandb = self._wandb()
        return facts

    def _wandb(self):
        if self.cfg.wandb_mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            raise TrainingFailed(f"--wandb-mode {self.cfg.wandb_mode}: the wandb package is not installed")
        return wandb.init(project=self.cfg.wandb_project, mode=self.cfg.wandb_mode, config=self.cfg.to_dict(),
                          id=self.run_id, dir=str(self.out))

    # ------------------------------------------------------------------------------ checkpointing
    def _resume(self, path: Path):
        state, mcfg, tstate, meta = load_checkpoint(path)
        flat = torch.cat([state[n].reshape(-1).float() for n in self.names])
        if flat.numel() != self.master_flat.numel():
            raise TrainingFailed(f"{path}: drafter shape does not match this configuration")
        self.master_flat.copy_(flat.to(self.master_dev))
        self.opt.load_state_dict(tstate["optimizer"])
        self.sched.load_state_dict(tstate["scheduler"])
        self.step = int(tstate["step"])
        self.seq_start = int(tstate["seq_next"])
        self.tokens_seen = int(tstate.get("tokens_seen", 0))
        self.nan_skips = int(tstate.get("nan_skips", 0))
        restore_rng_state(tstate["rng"])
        self.resumed_from = str(path)
        self.last_ckpt = str(path)
        log.info("resumed from %s: step %d, next batch %d (epoch %d, batch %d)", path, self.step, self.seq_start,
                 *self._position(self.seq_start))

    def _position(self, seq: int) -> tuple[int, int]:
        n = self.planner.num_batches
        return seq // n, seq % n

    def save_checkpoint(self, reason: str):
        self.status.update(phase="checkpointing", step=self.step, force=True)
        t0 = time.perf_counter()
        if self.master_dev.type == "cuda":
            torch.cuda.synchronize(self.master_dev)
        state = {n: p.detach().to("cpu", copy=True) for n, p in zip(self.names, self.master_params)}
        ep, bi = self._position(self.seq_start)
        tstate = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
                  "seq_next": self.seq_start, "data_position": DataPosition(ep, bi).to_dict(),
                  "tokens_seen": self.tokens_seen, "nan_skips": self.nan_skips, "rng": capture_rng_state(),
                  "config": self.cfg.to_dict(), "run_id": self.run_id}
        path = self.ckpt.save(self.step, state, self.dcfg.to_dict(), tstate,
                              meta={"step": self.step, "epoch": ep, "trainer_version": __version__, "reason": reason})
        self.last_ckpt = str(path)
        log.info("checkpoint %s (%s) in %.1fs", path, reason, time.perf_counter() - t0)
        self.notifier.watchdog()
        self.status.update(phase="training", last_checkpoint=str(path), force=True)

    # ---------------------------------------------------------------------------------- pipeline
    def _check(self):
        for w in (self.copy_waiter, self.release_waiter):
            if w.error is not None:
                raise TrainingFailed(f"{w.name}: {w.error!r}")
        if self.fatal is not None:
            raise TrainingFailed(f"pipeline thread failed: {self.fatal!r}")

    def _get(self, q: queue.Queue):
        while True:
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                self._check()
                if self._draining:
                    raise Stop()

    def _make_item(self, seq: int):
        cfg = self.cfg
        t0 = time.perf_counter()
        ep, bi = self._position(seq)
        batch = collate(self.dataset, self.planner.epoch_batches(ep)[bi], cfg.max_seq_len, cfg.pad_multiple)
        plan = plan_micro_batch(batch.input_ids.numpy(), batch.loss_mask.numpy(), batch.lengths.numpy(),
                                batch.sample_ids, ep, seed=cfg.seed, block_size=cfg.block_size,
                                max_anchors=cfg.max_anchors, mask_token_id=self.mask_token, gamma=cfg.gamma,
                                soft_labels=cfg.use_soft_labels, chunk_rows=cfg.drafter_chunk_rows, flex=self.flex)
        self.batch_shapes.add(tuple(batch.input_ids.shape))
        item = make_item(seq, ep, bi, batch, plan, pin=not cfg.on_cpu, data_s=0.0)
        item.data_s = time.perf_counter() - t0
        self.profiler.add("data (collate+plan)", item.data_s)
        return item

    def _target_process(self, worker: TargetWorker, item) -> None:
        t0 = time.perf_counter()
        slot = worker.acquire(lambda: self._draining)
        if slot is None:
            return
        self.profiler.add("target slot wait", time.perf_counter() - t0)
        ev, info = worker.forward_pack(item, slot)
        self.profiler.add_events("target fwd+pack", ev["start"], ev["fwd"])
        self.profiler.add_events("copy", ev["fwd"], ev["copy"])
        d = Delivered(item, slot, info["rows"], info["final_rows"], {})
        self.copy_waiter.put(ev["copy"], lambda: self.dispatcher.publish(d))

    def _start_async(self):
        cfg = self.cfg
        self.in_q: queue.Queue = queue.Queue(maxsize=2 * len(self.workers))
        self.dispatcher = Dispatcher(len(self.replicas), cfg.queue_depth)
        self.dispatcher.reset(self.seq_start)
        self._draining = False
        end = self.seq_start + (self.total_steps - self.step) * self.batches_per_step

        def feeder():
            try:
                # keeps producing after SIGTERM so the step in progress completes; stops at shutdown
                for seq in range(self.seq_start, end):
                    if self._draining:
                        break
                    item = self._make_item(seq)
                    while not self._draining:
                        try:
                            self.in_q.put(item, timeout=0.5)
                            break
                        except queue.Full:
                            continue
            except BaseException as e:
                self.fatal = e
                log.exception("feeder failed")
            finally:
                for _ in self.workers:
                    self.in_q.put(None)

        def target_loop(worker):
            try:
                while True:
                    item = self.in_q.get()
                    if item is None or self._draining:
                        return
                    self._target_process(worker, item)
            except BaseException as e:
                self.fatal = e
                log.exception("target worker %d failed", worker.index)

        ts = [threading.Thread(target=feeder, name="feeder", daemon=True)]
        ts += [threading.Thread(target=target_loop, args=(w,), name=f"target-{w.index}", daemon=True)
               for w in self.workers]
        for t in ts:
            t.start()
        self.threads += ts

    def _sync_micro_batches(self, seq0: int):
        """--no-async: the same items, workers and replica assignment, one after another."""
        noise, scale = self._noise(), self.batches_per_step
        for seq in range(seq0, seq0 + self.batches_per_step):
            item = self._make_item(seq)
            worker = self.workers[seq % len(self.workers)]
            slot = worker.acquire()
            ev, info = worker.forward_pack(item, slot)
            ev["copy"].synchronize()
            self.profiler.add_events("target fwd+pack", ev["start"], ev["fwd"])
            self.profiler.add_events("copy", ev["fwd"], ev["copy"])
            rep = self.replicas[seq % len(self.replicas)]
            rep.micro_step(Delivered(item, slot, info["rows"], info["final_rows"], {}), noise, scale)
            if rep.device.type == "cuda":
                torch.cuda.synchronize(rep.device)
        for r in self.replicas:
            r.collect_grads()

    def _replica_run(self, r: DrafterReplica, seq0: int):
        noise, scale = self._noise(), self.batches_per_step
        for _ in range(self.cfg.grad_accum):
            t0 = time.perf_counter()
            d = self._get(self.dispatcher.queues[r.index])
            self.profiler.add(f"drafter {r.index} queue wait", time.perf_counter() - t0)
            r.micro_step(d, noise, scale)
        r.collect_grads()

    def _noise(self) -> float:
        cfg = self.cfg
        prog = min(1.0, self.step / max(1, self.total_steps - 1))
        return cfg.noise_start + (cfg.noise_end - cfg.noise_start) * prog

    # -------------------------------------------------------------------------------- optimizer
    def _broadcast(self):
        with device_ctx(self.master_dev), stream_ctx(self.master_stream):
            for r in self.replicas:
                off = 0
                for p in r.params:
                    n = p.numel()
                    p.data.copy_(self.master_flat[off:off + n].view(p.shape), non_blocking=True)
                    off += n
            ev = new_event(self.master_dev)
            ev.record()
        for r in self.replicas:
            if r.stream is not None:
                r.stream.wait_event(ev)

    def _optimizer_step(self, tokens: int, pos_counts: np.ndarray):
        cfg = self.cfg
        with device_ctx(self.master_dev), stream_ctx(self.master_stream):
            e0, e1 = new_event(self.master_dev, True), new_event(self.master_dev, True)
            e0.record()
            for r in self.replicas:
                if self.master_stream is not None:
                    self.master_stream.wait_event(r.done_event)
            self.master_grad.copy_(self.replicas[0].flat_grad)
            for r in self.replicas[1:]:
                self.master_grad.add_(r.flat_grad.to(self.master_dev, non_blocking=True))
            loss = sum(r.metric[0].to(self.master_dev, non_blocking=True) for r in self.replicas)
            correct = sum(r.metric[1:].to(self.master_dev, non_blocking=True) for r in self.replicas)
            gnorm = self.master_grad.norm()
            bad = (~torch.isfinite(gnorm)) | (~torch.isfinite(loss))
            found_inf = bad.float()
            coef = torch.clamp(cfg.grad_clip / (gnorm + 1e-6), max=1.0)
            self.master_grad.mul_(torch.where(bad, torch.zeros_like(coef), coef))
            self.opt.found_inf = found_inf
            self.opt.step()
            lr = self.sched.get_last_lr()[0]
            self.sched.step()
            vec = torch.cat([loss.reshape(1).float(), found_inf.reshape(1), gnorm.reshape(1), correct.float()])
            host = torch.empty(vec.shape, dtype=torch.float32, pin_memory=self.master_dev.type == "cuda")
            host.copy_(vec, non_blocking=True)
            ev = new_event(self.master_dev)
            ev.record()
            e1.record()
            self.profiler.add_events("optimizer", e0, e1)
            for r in self.replicas:
                r.metric.zero_()
        self._broadcast()
        self.pending.append(StepMetrics(self.step + 1, host, ev, tokens, lr, pos_counts, 0))

    def _drain_metrics(self, block: bool = False):
        lines: list[str] = []
        try:
            self._drain_metrics_into(lines, block)
        finally:
            self._append_metrics(lines)

    def _append_metrics(self, lines: list[str]):
        """metrics.jsonl is a record, not state: when it cannot be written (a full disk) the trainer warns
        once and goes on, and the next checkpoint save is what fails the run, with a message naming the
        checkpoint and the cause (so the outcome does not depend on which write hits the full disk first)."""
        if not lines:
            return
        try:
            self.metrics_file.write("".join(lines))
            self.metrics_file.flush()
            if self._metrics_error:
                log.info("%s is writable again", self.metrics_file.name)
            self._metrics_error = False
        except OSError as e:
            if not self._metrics_error:
                log.warning("could not write %s: %s (training goes on; the next checkpoint save will tell "
                            "whether the disk can hold it)", self.metrics_file.name, e)
            self._metrics_error = True

    def _drain_metrics_into(self, lines: list[str], block: bool):
        while self.pending and (block or self.pending[0].event.query()):
            m = self.pending.popleft()
            if block:
                m.event.synchronize()
            v = m.host.tolist()
            loss, skipped, gnorm, correct = v[0], v[1] > 0, v[2], v[3:]
            acc = [c / n if n else None for c, n in zip(correct, m.pos_counts.tolist())]
            if skipped:
                self.nan_skips += 1
                self.nan_streak += 1
                log.warning("step %d: non-finite loss/gradient (loss %s, grad norm %s): step skipped (%d in a row)",
                            m.step, loss, gnorm, self.nan_streak)
            else:
                self.nan_streak = 0
                self.last_loss = loss
                self.last_acc = acc
            rec = {"step": m.step, "loss": loss if math.isfinite(loss) else None, "skipped": skipped,
                   "grad_norm": gnorm if math.isfinite(gnorm) else None, "lr": m.lr, "tokens": m.tokens,
                   "acc": acc[1:]}
            lines.append(json.dumps(rec) + "\n")
            if self.wandb is not None:
                self.wandb.log({"loss": loss, "grad_norm": gnorm, "lr": m.lr,
                                **{f"acc/pos{k}": a for k, a in enumerate(acc) if k and a is not None}}, step=m.step)
            if self.nan_streak >= self.cfg.max_nan_skips:
                raise TrainingFailed(f"{self.nan_streak} consecutive optimizer steps had a non-finite loss or "
                                     f"gradient (--max-nan-skips {self.cfg.max_nan_skips}); last good checkpoint "
                                     f"{self.last_ckpt or 'none'} left untouched")

    # --------------------------------------------------------------------------------------- run
    def warmup(self):
        cfg = self.cfg
        self.status.update(phase="warmup", force=True)
        t0 = time.perf_counter()
        compiled = cfg.compile != "none"
        if compiled:
            freeze_compiled(False)
        vocab = self.dcfg.vocab_size
        long_b = max(1, cfg.token_budget // cfg.max_seq_len)
        shapes = [(long_b, cfg.max_seq_len), (min(cfg.max_batch_size, cfg.token_budget // 256 or 1), 256)]
        for w in self.workers:
            w.warmup(shapes, vocab)
            self.notifier.extend_timeout(900)
        # one drafter forward/backward per replica at the largest chunk shape (and, with a compiled drafter,
        # a second smaller one so the shape-generic graphs exist before step 1), then throw the grads away
        seq = min(cfg.max_seq_len, cfg.token_budget)
        seqs = [seq] + ([max(cfg.block_size * 2, seq // 2 + 37)] if wants(cfg.compile, "drafter") else [])
        from .data import Batch
        for n in seqs:
            rng = np.random.default_rng(n)
            ids = rng.integers(0, vocab, size=(1, n))
            mask = np.ones((1, n), dtype=bool)
            mask[0, 0] = False
            plan = plan_micro_batch(ids, mask, np.array([n]), [0], 0, seed=0, block_size=cfg.block_size,
                                    max_anchors=min(cfg.max_anchors, cfg.drafter_chunk_rows // cfg.block_size),
                                    mask_token_id=self.mask_token, gamma=cfg.gamma, soft_labels=cfg.use_soft_labels,
                                    chunk_rows=cfg.drafter_chunk_rows, flex=self.flex)
            batch = Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.tensor([n]), [0], n, n - 1)
            for i, r in enumerate(self.replicas):
                t1 = time.perf_counter()
                w = self.workers[i % len(self.workers)]
                item = make_item(-1, 0, 0, batch, plan, pin=not cfg.on_cpu, data_s=0.0)
                slot = w.acquire()
                ev, info = w.forward_pack(item, slot)
                ev["copy"].synchronize()
                r.micro_step(Delivered(item, slot, info["rows"], info["final_rows"], {}), 0.0, 1.0)
                for p in r.params:
                    p.grad = None
                r.metric.zero_()
                r.tokens, r.pos_counts = 0, np.zeros_like(r.pos_counts)
                if r.device.type == "cuda":
                    torch.cuda.synchronize(r.device)
                log.info("warmup: drafter replica %d (%s) %d block rows in %.2fs", i, r.device,
                         sum(len(c.q_seq) for c in plan.chunks), time.perf_counter() - t1)
                self.notifier.extend_timeout(900)
        # slots released by the waiter thread; wait until all are back
        for w in self.workers:
            while w.in_flight:
                time.sleep(0.01)
        self.profiler.reset()
        if compiled:
            freeze_compiled(True)
        log.info("warmup done in %.1fs%s", time.perf_counter() - t0,
                 f" (--compile {cfg.compile}: graphs frozen, shapes they do not cover run eagerly)" if compiled else "")

    def run(self) -> int:
        cfg = self.cfg
        self.warmup()
        if self.step >= self.total_steps:
            log.info("nothing to do: step %d of %d", self.step, self.total_steps)
            self.status.update(phase="done", step=self.step, force=True)
            return 0
        if cfg.async_pipeline:
            self._start_async()
        pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="drafter")
        self.status.update(phase="training", step=self.step, resumed_from=self.resumed_from,
                           last_checkpoint=self.last_ckpt, nan_skips=self.nan_skips, force=True)
        progress = Progress(self.total_steps, desc="train", interval=min(30.0, cfg.profile_interval))
        t_start = t_prof = time.perf_counter()
        tok_window = deque(maxlen=50)
        ready_sent = False
        try:
            while self.step < self.total_steps:
                self._inject_faults()
                seq0 = self.seq_start
                epoch, _ = self._position(seq0)
                if cfg.async_pipeline:
                    futs = [pool.submit(self._replica_run, r, seq0) for r in self.replicas]
                    for f in futs:
                        f.result()
                    # the items trained this step are known exactly: seq0 .. seq0 + batches_per_step
                else:
                    self._sync_micro_batches(seq0)
                tokens = sum(r.tokens for r in self.replicas)
                pos_counts = sum(r.pos_counts for r in self.replicas)
                for r in self.replicas:
                    r.tokens, r.pos_counts = 0, np.zeros_like(r.pos_counts)
                self._optimizer_step(tokens, pos_counts)
                self.step += 1
                self.seq_start = seq0 + self.batches_per_step
                self.tokens_seen += tokens
                tok_window.append((time.perf_counter(), self.tokens_seen))
                self.step_log.append((tok_window[-1][0], self.step, self.tokens_seen))
                self.mem_log.append(self._memory())
                self._drain_metrics()
                self._check()
                now = time.perf_counter()
                rate = ((tok_window[-1][1] - tok_window[0][1]) / (tok_window[-1][0] - tok_window[0][0])
                        if len(tok_window) > 1 else 0.0)
                self.notifier.watchdog()
                if not ready_sent:
                    self.notifier.ready(f"training: step {self.step}")
                    ready_sent = True
                self.status.update(phase="training", step=self.step, epoch=epoch, tokens_seen=self.tokens_seen,
                                   tokens_per_s=rate, loss=self.last_loss, nan_skips=self.nan_skips,
                                   nan_streak=self.nan_streak)
                acc1 = self.last_acc[1] if self.last_acc and len(self.last_acc) > 1 else None
                progress.update(self.step, loss=self.last_loss if self.last_loss is not None else float("nan"),
                                acc1=acc1 if acc1 is not None else float("nan"), tok_s=rate)
                if now - t_prof >= cfg.profile_interval:
                    self._profile_report(now - t_prof, rate)
                    t_prof = now
                if self.step % cfg.save_interval == 0 or (self.step == self.total_steps and cfg.save_final):
                    self._drain_metrics(block=True)
                    if self.nan_streak == 0:  # never checkpoint in the middle of a NaN streak
                        self.save_checkpoint("interval" if self.step < self.total_steps else "final")
                if self.stop_requested.is_set():
                    log.info("stop requested: checkpointing at step %d", self.step)
                    self.notifier.stopping("checkpointing before exit")
                    self._drain_metrics(block=True)
                    if self.last_ckpt is None or not self.last_ckpt.endswith(f"{self.step:08d}"):
                        self.save_checkpoint("SIGTERM")
                    self.status.update(phase="done", step=self.step, error=None, force=True)
                    log.info("stopped cleanly at step %d", self.step)
                    return 0
            self._drain_metrics(block=True)
            log.info("training complete: %d steps, %d tokens in %.1fs", self.step, self.tokens_seen,
                     time.perf_counter() - t_start)
            self.status.update(phase="done", step=self.step, force=True)
            return 0
        finally:
            progress.close()
            self._draining = True
            pool.shutdown(wait=False, cancel_futures=True)

    def _memory(self) -> dict:
        out = {"step": self.step, "rss": _rss(), "batch shapes seen": len(self.batch_shapes)}
        cuda = False
        for d in dict.fromkeys(self.t_devices + self.d_devices):
            if d.type == "cuda":
                cuda = True
                out[str(d)] = torch.cuda.memory_allocated(d)
                out[f"{d} reserved"] = torch.cuda.memory_reserved(d)
        if cuda:
            try:  # pinned host memory held by PyTorch's caching host allocator (batches' pinned inputs)
                out["pinned host (allocator)"] = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
            except Exception:
                pass
        return out

    def _inject_faults(self):
        f = self.faults
        if "step_delay" in f:
            time.sleep(f["step_delay"])
        if "nan_from_step" in f:
            for r in self.replicas:
                r.poison = self.step + 1 >= f["nan_from_step"]
        if "hang_at_step" in f and self.step + 1 >= f["hang_at_step"]:
            log.warning("fault injection: hanging at step %d (DFLASH_FAULT_HANG_AT_STEP)", self.step + 1)
            while True:
                time.sleep(3600)

    def _profile_report(self, wall: float, rate: float):
        extra = [["queue depth/replica", "", "", "", str(self.dispatcher.depths()) if hasattr(self, "dispatcher") else "-"],
                 ["copies in flight", "", "", "", str([w.in_flight for w in self.workers])],
                 ["tok/s", "", "", "", f"{rate:,.0f}"]]
        log.info("profile over %.0fs:\n%s", wall, self.profiler.table(wall, extra))
        self.profiler.reset()

    def shutdown(self):
        self.stop_requested.set()
        self._draining = True
        q = getattr(self, "in_q", None)
        if q is not None:
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            for _ in self.workers:
                q.put(None)
        for t in self.threads:
            t.join(timeout=10)
        for w in (getattr(self, "copy_waiter", None), getattr(self, "release_waiter", None)):
            if w is not None:
                w.close()
        # the copy waiter may sit in Dispatcher.publish on a full replica queue nobody reads any more
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                w is not None and w.is_alive() for w in (getattr(self, "copy_waiter", None),
                                                          getattr(self, "release_waiter", None))):
            for q in getattr(getattr(self, "dispatcher", None), "queues", []):
                while True:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        break
            for w in (self.copy_waiter, self.release_waiter):
                w.join(timeout=0.1)
        if hasattr(self, "metrics_file"):
            try:
                self.metrics_file.close()
            except OSError as e:  # lines still buffered from a full disk
                log.warning("could not close %s: %s", self.metrics_file.name, e)
        if self.wandb is not None:
            self.wandb.finish()


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def read_faults() -> dict:
    """Test hooks for the fault-injection suite (docs/reliability.md); unset in production.
    DFLASH_FAULT_NAN_FROM_STEP=N  losses become NaN from optimizer step N on
    DFLASH_FAULT_HANG_AT_STEP=N   the main loop stops making progress at step N (process stays alive)
    DFLASH_FAULT_SLOW_CHECKPOINT=S  sleep S seconds inside each checkpoint write (before the rename)
    DFLASH_FAULT_STEP_DELAY=S     sleep S seconds before each optimizer step (a slow job, so tests can
                                  act on it mid-run however fast the host is)
    """
    import os
    out = {}
    for env, key, typ in (("DFLASH_FAULT_NAN_FROM_STEP", "nan_from_step", int),
                          ("DFLASH_FAULT_HANG_AT_STEP", "hang_at_step", int),
                          ("DFLASH_FAULT_SLOW_CHECKPOINT", "slow_checkpoint", float),
                          ("DFLASH_FAULT_STEP_DELAY", "step_delay", float)):
        if os.environ.get(env):
            out[key] = typ(os.environ[env])
            log.warning("fault injection active: %s=%s", env, os.environ[env])
    return out


def install_signal_handlers(trainer: Trainer):
    def handler(signum, frame):
        log.info("received %s: finishing the step, then checkpoint and exit", signal.Signals(signum).name)
        trainer.stop_requested.set()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def train(cfg: TrainConfig) -> int:
    trainer = Trainer(cfg)
    install_signal_handlers(trainer)
    try:
        trainer.setup()
        rc = trainer.run()
        if cfg.eval_data_dir and rc == 0 and not trainer.stop_requested.is_set():
            from .evaluate import evaluate_trainer
            evaluate_trainer(trainer, cfg.eval_data_dir)
        return rc
    except BadInput as e:
        log.error("bad input: %s", e)
        trainer.status.update(phase="failed", error=str(e), step=getattr(trainer, "step", 0), force=True)
        print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        return 2
    except (TrainingFailed, CheckpointError) as e:
        log.error("training failed: %s", e)
        trainer.status.update(phase="failed", error=str(e), step=getattr(trainer, "step", 0),
                              nan_skips=getattr(trainer, "nan_skips", 0),
                              nan_streak=getattr(trainer, "nan_streak", 0), force=True)
        return 1
    except Exception as e:
        log.exception("training failed")
        trainer.status.update(phase="failed", error=f"{type(e).__name__}: {e}", force=True)
        return 1
    finally:
        trainer.shutdown()
