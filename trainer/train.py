"""The training loop of one rank, top to bottom. Moving parts live beside it: dist.py (ranks, groups,
launcher, dispatch plan, stop vote), target.py and drafter.py (the two stages), transport.py (slots,
sends, receives), optim.py, metrics.py, checkpoint.py, status.py, runlog.py.

Owners on a rank (one each):
  main thread      the step loop: target forwards and sends, drafter receives and micro-steps,
                   optimizer step, stop vote, metrics/status/checkpoints (rank 0), the tau eval at
                   eval steps with the pipeline quiescent (evaltrain.py; the lowest target rank runs it)
  prefetch thread  collate + plan of this rank's micro-batches, in order, into a bounded queue
  streams          TargetStage.stream (forward + pack), Sender.stream (sends), DrafterStage.stream
                   (receives are ordered onto it; forward/backward/optimizer)
  buffers          TargetStage.slots, Receiver.bufs, DrafterStage.metric
No host sync on a compute stream in the steady state: metrics reach the host through pinned buffers,
read when their event has fired.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import queue
import signal
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .checkpoint import CheckpointError, CheckpointManager, capture_rng_state, restore_rng_state, step_dir_name
from .config import TrainConfig, validate
from .data import BatchPlanner, DataError, DataPosition, collate, load_dataset
from .dist import DispatchPlan, Groups, StopVote, Topology, init_rank
from .drafter import DrafterStage, build_drafter
from .evaltrain import InTrainingEval, eval_record, eval_scalars, eval_status, eval_wandb
from .fast import compile_layers, freeze_compiled, resolve_compile, wants
from .fsutil import atomic_write_text
from .metrics import HeadTailLog, MetricsFile, Profiler, StepMetrics, step_record
from .model import DFlashConfig
from .optim import build_optimizer, guarded_step, lr_at, warmup_steps
from .items import WorkItem, make_item
from .plan import plan_micro_batch
from .runlog import Progress, format_table, setup_logging
from .status import Notifier, StatusWriter
from .target import TargetStage, decoder, load_target
from .transport import Receiver, Sender, device_ctx, new_event, stream_ctx, unpack

log = logging.getLogger("trainer")


class TrainingFailed(RuntimeError):
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


def load_embed_head(path: str, device: torch.device, dtype: torch.dtype):
    """A drafter rank needs only the target's embedding and LM head: read those two tensors from the
    safetensors files (tied embeddings: the head is the embedding) instead of loading 27B weights."""
    from safetensors import safe_open
    d = Path(path)
    index = d / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    embed = head = None
    for fn in files:
        with safe_open(str(d / fn), framework="pt") as f:
            for k in f.keys():
                if embed is None and k.endswith("embed_tokens.weight") and "mtp" not in k and "visual" not in k:
                    embed = f.get_tensor(k)
                elif head is None and k.endswith("lm_head.weight"):
                    head = f.get_tensor(k)
    if embed is None:
        raise TrainingFailed(f"--target-model: no embed_tokens weight in {d}")
    head = embed if head is None else head
    return embed.to(device, dtype), head.to(device, dtype)


class _NoStatus:
    """Ranks other than 0 keep no status file."""

    def update(self, *a, **k):
        return False


class Trainer:
    """One rank of the job. target_factory(device) -> model and dataset let the benchmark and tests
    inject random-init targets and synthetic data (world size 1 only)."""

    def __init__(self, cfg: TrainConfig, topo: Topology, groups: Groups, target_factory=None, dataset=None):
        self.cfg, self.topo, self.groups = cfg, topo, groups
        self.target_factory, self.injected_dataset = target_factory, dataset
        self.run_id: str = os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex[:8]
        self.out = Path(cfg.output_dir)
        self.device = torch.device(topo.role.device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.stop_requested = threading.Event()
        self.profiler = Profiler()
        self.step_log = HeadTailLog()   # (time, step, tokens_seen), bounded
        self.mem_log = HeadTailLog()
        self.step_events = HeadTailLog(keep=20)   # (step, timing event at the end of its optimizer step)
        self.batch_shapes: set[tuple[int, int]] = set()
        self.notifier = Notifier() if topo.leader else None
        # pid: the supervisor's (what systemd watches and dflash-status checks), this rank's when it runs alone
        job_pid = int(os.environ.get("DFLASH_SUPERVISOR_PID") or os.getpid())
        self.status = (StatusWriter(cfg.status_file, self.run_id, min_interval=1.0, notifier=self.notifier,
                                    pid=job_pid) if topo.leader else _NoStatus())
        self.faults = read_faults()
        self.prefetch_thread: threading.Thread | None = None
        self.prefetch_q: queue.Queue = queue.Queue(maxsize=8)
        self.lookahead: deque = deque()
        self.fatal: BaseException | None = None
        self._draining = False
        # built in setup()
        self.target: TargetStage | None = None
        self.sender: Sender | None = None
        self.drafter: DrafterStage | None = None
        self.receiver: Receiver | None = None
        self.opt = None
        self.metrics_file: MetricsFile | None = None
        self.wandb = None
        self.tensorboard = None
        self.rate = 0.0
        self.pending: deque[StepMetrics] = deque()
        self.step = 0
        self.tokens_seen = 0
        self.nan_skips = 0
        self.nan_streak = 0
        self.warmup_steps = 0
        self.last_ckpt: str | None = None
        self.resumed_from: str | None = None
        self.last_loss: float | None = None
        self.last_acc: list | None = None
        self.evaluator: InTrainingEval | None = None     # with --eval-data-dir (evaltrain.py)
        self.final_eval: dict | None = None               # the end-of-run eval's record (leader), for eval.json
        self.paused_s = 0.0    # seconds training stood still for evals: kept out of tokens/s and the profile
        self.wait_s = 0.0
        self.items_done = 0    # micro-batches this rank worked on (as target, drafter or both)

    # ------------------------------------------------------------------------------------- setup
    def setup(self) -> dict:
        cfg, topo = self.cfg, self.topo
        cfg.compile = resolve_compile(cfg.compile, self.device.type == "cpu")
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = setup_logging(cfg.log_dir, self.run_id if topo.leader else f"{self.run_id}-rank{topo.rank}",
                                      link_latest=topo.leader)
        self.status.update(phase="starting", force=True, log_file=str(self.log_file), world_size=topo.world)
        log.info("dflash trainer %s run %s rank %d of %d: %s", __version__, self.run_id, topo.rank, topo.world,
                 json.dumps(cfg.to_dict(), default=str))
        log.info("ranks: %s", topo.describe())
        facts = validate(cfg) if self.target_factory is None else {}
        self.ckpt = CheckpointManager(self.out, cfg.keep_checkpoints)
        if topo.leader:
            self.ckpt.cleanup_stale_tmp()
            if "slow_checkpoint" in self.faults:
                delay = self.faults["slow_checkpoint"]
                self.ckpt.before_publish = lambda tmp: (log.warning("fault injection: checkpoint %s held %.0fs "
                                                                    "before its rename", tmp, delay), time.sleep(delay))
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        self._build_data()
        self._build_stages()
        self._build_schedule()
        self._resume()
        if cfg.eval_data_dir:
            try:
                self.evaluator = InTrainingEval(cfg, topo, self.groups, self.device, self.dtype)
            except (DataError, ValueError) as e:
                raise BadInput(f"--eval-data-dir: {e}") from None
        self.vote = StopVote(topo, self.groups.control)
        if topo.leader:
            self.metrics_file = MetricsFile(self.out / "metrics.jsonl", self.step if self.resumed_from else None)
            if "eval" in self.metrics_file.last:   # a resumed run's status shows its last eval from the start
                self.status.update(eval=eval_status(self.metrics_file.last["eval"]))
            self.wandb = self._wandb()
            from .metrics_sinks import open_tensorboard
            self.tensorboard = open_tensorboard(cfg.tensorboard_dir, self.run_id)
        return facts

    def _build_data(self):
        cfg = self.cfg
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
        if st["num_batches_per_epoch"] == 0:
            raise TrainingFailed(f"--data-dir: {cfg.data_dir} yields no batches")
        self.dispatch = DispatchPlan(self.planner, self.dataset, cfg, len(self.topo.target_ranks),
                                     len(self.topo.drafter_ranks))

    def _build_stages(self):
        cfg, topo, dev = self.cfg, self.topo, self.device
        self.status.update(phase="loading", force=True)
        self._extend(900)
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
                    model = load_target(cfg.target_model, dev, self.dtype)
                except Exception as e:  # noqa: BLE001  a truncated or corrupt shard: name it, exit 2
                    from .config import ConfigError, check_target_shards
                    try:
                        check_target_shards(cfg.target_model)
                    except ConfigError as bad:
                        raise BadInput(str(bad)) from None
                    raise TrainingFailed(f"--target-model: {cfg.target_model} failed to load: {e}") from e
                log.info("loaded the target on %s in %.1fs", dev, time.perf_counter() - t0)
        tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        self.mask_token = resolve_mask_token(cfg.target_model, tc.vocab_size, cfg.mask_token_id)
        self.dcfg = DFlashConfig.from_target(tc, num_draft_layers=cfg.num_draft_layers, block_size=cfg.block_size,
                                             mask_token_id=self.mask_token, target_layer_ids=cfg.target_layers)
        log.info("drafter: %d layers, taps %s, block %d, mask token %d", self.dcfg.num_hidden_layers,
                 self.dcfg.target_layer_ids, cfg.block_size, self.mask_token)
        self.flex = (cfg.attention == "flex") or (cfg.attention == "auto" and dev.type == "cuda")
        self.rows = cfg.token_budget + (128 * cfg.max_batch_size if self.flex else 0)
        k, hidden = len(self.dcfg.target_layer_ids), self.dcfg.hidden_size
        if topo.is_drafter:
            if model is not None:
                embed = model.get_input_embeddings().weight.detach().to(dev, self.dtype)
                head = model.get_output_embeddings().weight.detach().to(dev, self.dtype)
            else:
                embed, head = load_embed_head(cfg.target_model, dev, self.dtype)
        if topo.is_target:
            self.target = TargetStage(model, dev, self.dcfg.target_layer_ids, cfg.use_soft_labels, self.rows,
                                      cfg.slots_per_worker, self.dtype, sdpa_backend=cfg.sdpa_backend)
            self.sender = Sender(dev, self.groups.world)
            if wants(cfg.compile, "target"):
                n = compile_layers(decoder(self.target.model).layers)
                log.info("--compile %s: %d target layers compiled (regional; compiles during warmup)", cfg.compile, n)
        if topo.is_drafter:
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh.from_group(self.groups.drafters, dev.type)
            module = build_drafter(self.dcfg, cfg, dev, self.dtype, mesh)
            self.drafter = DrafterStage(module, dev, embed, head, cfg, self.dcfg, "flex" if self.flex else "sdpa")
            self.opt = build_optimizer(module, cfg.lr, cfg.weight_decay)
            if not topo.is_target:   # receive buffers; a rank holding both roles reads its own slots
                cap = (self.rows * k * hidden) + (self.rows * hidden if cfg.use_soft_labels else 0)
                self.receiver = Receiver(dev, cap, self.dtype, cfg.queue_depth, k, hidden, self.groups.world)
            nparams = sum(p.numel() for p in module.parameters())
            log.info("drafter: %.1fM parameters, FSDP2 over %d drafter rank(s); this rank holds its shard on %s",
                     nparams / 1e6, len(topo.drafter_ranks), dev)
        del model

    def _build_schedule(self):
        cfg = self.cfg
        per_epoch = self.planner.num_batches
        self.batches_per_step = self.dispatch.per_step
        total = (per_epoch * cfg.epochs) // self.batches_per_step
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        if self.total_steps < 1:
            raise TrainingFailed(f"--data-dir: {per_epoch} batches/epoch x {cfg.epochs} epochs is less than one "
                                 f"optimizer step ({self.batches_per_step} batches)")
        self.warmup_steps = warmup_steps(cfg.warmup_ratio, self.total_steps)

    def _extend(self, seconds: float):
        if self.notifier is not None:
            self.notifier.extend_timeout(seconds)

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
    def _resume(self):
        """Rank 0 finds the newest checkpoint and tells every rank where the run stands; drafter ranks
        load the sharded model and optimizer state with DCP (any number of drafter ranks)."""
        import torch.distributed as dist
        info = [None]
        if self.topo.leader:
            latest = self.ckpt.latest()
            if latest is not None and not self.cfg.resume:
                info[0] = {"error": f"--no-resume: {self.out} holds {latest.name}; refusing to overwrite"}
            elif latest is not None:
                tstate = torch.load(latest / "training_state.pt", map_location="cpu", weights_only=False)
                info[0] = {"path": str(latest), "step": int(tstate["step"]), "tokens_seen": tstate.get("tokens_seen", 0),
                           "nan_skips": tstate.get("nan_skips", 0), "warmup_steps": tstate.get("warmup_steps"),
                           "rng": tstate.get("rng_by_rank") or [tstate.get("rng")],
                           "batches_per_step": tstate.get("batches_per_step"), "seq_next": tstate.get("seq_next")}
        dist.broadcast_object_list(info, src=0, group=self.groups.control)
        r = info[0]
        if r is None:
            return
        if "error" in r:
            raise TrainingFailed(r["error"])
        path = Path(r["path"])
        self.step, self.tokens_seen, self.nan_skips = r["step"], r["tokens_seen"], r["nan_skips"]
        if r["warmup_steps"] is not None:
            self.warmup_steps = int(r["warmup_steps"])
        if r["seq_next"] is not None and r["seq_next"] != self.step * self.batches_per_step:
            log.warning("resuming from %s with %d micro-batches per step (it was trained with %d): the data "
                        "position is step x the new size, so some batches are skipped or repeated",
                        path, self.batches_per_step, r.get("batches_per_step"))
        if self.topo.is_drafter:
            self._load_drafter_state(path)
            rngs = r["rng"] or []
            mine = self.topo.drafter_index
            if mine < len(rngs) and rngs[mine] is not None:
                restore_rng_state(rngs[mine])
        self.resumed_from = self.last_ckpt = str(path)
        log.info("resumed from %s: step %d of %d (warmup %d steps)", path, self.step, self.total_steps,
                 self.warmup_steps)

    def _load_drafter_state(self, path: Path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                             set_state_dict)
        model = self.drafter.model
        if (path / "dcp").is_dir():
            msd, osd = get_state_dict(model, self.opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(path / "dcp"), process_group=self.groups.dctl)
            set_state_dict(model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:   # a checkpoint of the single-process trainer: weights only, fresh optimizer moments
            import safetensors.torch
            full = safetensors.torch.load_file(str(path / "model.safetensors"))
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
            log.warning("%s has no sharded optimizer state (dcp/): weights resumed, AdamW moments start fresh", path)

    def save_checkpoint(self, reason: str):
        """Drafter ranks, together: DCP writes every rank's shard of model and optimizer into the temp dir;
        rank 0 adds the consolidated fp32 model.safetensors, config.json, training_state.pt and meta.json
        and publishes the directory atomically (checkpoint.py)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        topo, g = self.topo, self.groups.dctl
        self.status.update(phase="checkpointing", step=self.step, force=True)
        t0 = time.perf_counter()
        full = self.consolidated_state()
        rngs = [None] * len(topo.drafter_ranks) if topo.leader else None
        dist.gather_object(capture_rng_state(), rngs, dst=0, group=g)
        box = [None]
        if topo.leader:
            try:
                box[0] = {"tmp": str(self.ckpt.begin(self.step))}
            except CheckpointError as e:
                box[0] = {"error": str(e)}
        dist.broadcast_object_list(box, src=0, group=g)
        if "error" in box[0]:
            raise CheckpointError(box[0]["error"])
        tmp = Path(box[0]["tmp"])
        try:
            msd, osd = get_state_dict(self.drafter.model, self.opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"), process_group=g)
        except (Exception, dcp.api.CheckpointException) as e:  # DCP raises on every rank when one fails
            if topo.leader:
                self.ckpt.abort(tmp)
            why = _root_cause(e)
            free = shutil.disk_usage(self.out).free
            if "Errno" not in why and free < 2 * sum(t.numel() * 4 for t in full.values()) + (1 << 20):
                # torch.save's zip writer reports a full disk as "unexpected pos ...": say what it is
                why = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({free} bytes free; {why})"
            raise CheckpointError(f"checkpoint step {self.step} not saved to {self.out / step_dir_name(self.step)}: "
                                  f"{why} (earlier checkpoints left intact)") from e
        box = [None]
        if topo.leader:
            ep, bi = self._position(self.step * self.batches_per_step)
            tstate = {"step": self.step, "seq_next": self.step * self.batches_per_step,
                      "batches_per_step": self.batches_per_step, "warmup_steps": self.warmup_steps,
                      "data_position": DataPosition(ep, bi).to_dict(), "tokens_seen": self.tokens_seen,
                      "nan_skips": self.nan_skips, "rng_by_rank": rngs, "drafter_ranks": len(topo.drafter_ranks),
                      "config": self.cfg.to_dict(), "run_id": self.run_id}
            try:
                path = self.ckpt.commit(tmp, self.step, full, self.dcfg.to_dict(), tstate,
                                        meta={"step": self.step, "epoch": ep, "trainer_version": __version__,
                                              "reason": reason})
                box[0] = {"path": str(path)}
            except CheckpointError as e:
                box[0] = {"error": str(e)}
        dist.broadcast_object_list(box, src=0, group=g)
        if "error" in box[0]:
            raise CheckpointError(box[0]["error"])
        self.last_ckpt = box[0]["path"]
        log.info("checkpoint %s (%s) in %.1fs", self.last_ckpt, reason, time.perf_counter() - t0)
        self.status.update(phase="training", last_checkpoint=self.last_ckpt, force=True)

    def consolidated_state(self) -> dict[str, torch.Tensor]:
        """The whole fp32 drafter, on the leader's CPU (empty elsewhere): every drafter rank together
        (FSDP all-gathers each parameter). What model.safetensors holds and what the tau eval loads."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        full = {}
        for n, p in self.drafter.model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if self.topo.leader:
                full[n] = t.detach().float().cpu()
            del t
        return full

    # ------------------------------------------------------------------------------ tau eval
    def _quiesce(self):
        """Nothing of this rank's pipeline in flight: the step's sends complete, the device idle. (No
        receive is posted across a step boundary: _post_receives.)"""
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
        self._quiesce()
        state = self.consolidated_state() if self.topo.is_drafter else None
        res = self.evaluator.run(self.step, state, self.target, self.dcfg, final)
        del state
        secs = time.perf_counter() - t0
        if self.topo.leader:
            if "error" in res:
                log.warning("eval at step %d failed on rank %d: %s (training goes on)", self.step,
                            self.evaluator.owner, res["error"])
            else:
                self._record_eval(eval_record(self.step, res, final), secs)
        return secs

    def _record_eval(self, rec: dict, secs: float):
        log.info("eval at step %d: tau %.3f over %d verify steps (%d prompts); per-position acceptance %s; "
                 "training paused %.1fs (not counted in tokens/s)", rec["step"], rec["tau"], rec["verify_steps"],
                 rec["prompts"], [round(x, 3) for x in rec["per_position_acceptance"]], secs)
        if self.metrics_file is not None:
            self.metrics_file.write([json.dumps(rec) + "\n"])
        self.status.update(eval=eval_status(rec), force=True)
        if self.wandb is not None:
            self.wandb.log(eval_wandb(rec), step=rec["step"])
        if self.tensorboard is not None:
            self.tensorboard.write(rec["step"], eval_scalars(rec))
        if rec["final"]:
            self.final_eval = rec

    def _write_eval_json(self):
        """The end-of-run eval as eval.json (as dflash-eval writes it), with the checkpoint of its weights."""
        rec = {k: v for k, v in self.final_eval.items() if k not in ("kind", "final")}
        ckpt = self.last_ckpt if (self.last_ckpt or "").endswith(step_dir_name(rec["step"])) else None
        atomic_write_text(self.out / "eval.json", json.dumps(dict(rec, checkpoint=ckpt), indent=2) + "\n")

    def train_clock(self) -> float:
        """Seconds of training: the wall clock less the eval pauses (tokens/s, the profile, progress)."""
        return time.perf_counter() - self.paused_s

    def _position(self, seq: int) -> tuple[int, int]:
        n = self.planner.num_batches
        return seq // n, seq % n

    # ---------------------------------------------------------------------------------- data
    def plan(self, input_ids, loss_mask, lengths, sample_ids, epoch: int, *, seed: int, max_anchors: int):
        """plan_micro_batch with this run's drafter options: the one place the training batches and the
        warmup's batches take them from, so the warmup compiles for the layouts training will bring."""
        cfg = self.cfg
        return plan_micro_batch(input_ids, loss_mask, lengths, sample_ids, epoch, seed=seed,
                                block_size=cfg.block_size, max_anchors=max_anchors, mask_token_id=self.mask_token,
                                gamma=cfg.gamma, soft_labels=cfg.use_soft_labels, chunk_rows=cfg.drafter_chunk_rows,
                                flex=self.flex, dedup=cfg.loss_dedup, full_blocks=cfg.flex_full_blocks,
                                ctx_group=cfg.flex_ctx_group)

    def make_item(self, seq: int) -> WorkItem:
        cfg = self.cfg
        t0 = time.perf_counter()
        ep, bi = self._position(seq)
        batch = collate(self.dataset, self.planner.epoch_batches(ep)[bi], cfg.max_seq_len, cfg.pad_multiple)
        plan = self.plan(batch.input_ids.numpy(), batch.loss_mask.numpy(), batch.lengths.numpy(), batch.sample_ids,
                         ep, seed=cfg.seed, max_anchors=cfg.max_anchors)
        self.batch_shapes.add(tuple(batch.input_ids.shape))
        item = make_item(seq, ep, bi, batch, plan, pin=self.device.type == "cuda", data_s=0.0)
        item.data_s = time.perf_counter() - t0
        self.profiler.add("data (collate+plan)", item.data_s)
        return item

    def mine(self, step: int) -> list:
        """This rank's micro-batches of `step`, in sequence order (as target, drafter or both)."""
        topo = self.topo
        ti = topo.target_index if topo.is_target else -1
        di = topo.drafter_index if topo.is_drafter else -1
        return [a for a in self.dispatch.step(step) if a.target == ti or a.drafter == di]

    def _start_prefetch(self):
        def run():
            try:
                for step in range(self.step, self.total_steps):
                    for a in self.mine(step):
                        item = self.make_item(a.seq)
                        while not self._draining:
                            try:
                                self.prefetch_q.put((a, item), timeout=0.5)
                                break
                            except queue.Full:
                                continue
                        if self._draining:
                            return
            except BaseException as e:  # surfaced by the main thread
                self.fatal = e
                log.exception("prefetch failed")
        self.prefetch_thread = threading.Thread(target=run, name="prefetch", daemon=True)
        self.prefetch_thread.start()

    def _pull(self, block: bool) -> bool:
        try:
            self.lookahead.append(self.prefetch_q.get(timeout=0.5) if block else self.prefetch_q.get_nowait())
            return True
        except queue.Empty:
            if self.fatal is not None:
                raise TrainingFailed(f"prefetch thread failed: {self.fatal!r}")
            return False

    def _next(self, seq: int):
        while not self.lookahead:
            self._pull(block=True)
        a, item = self.lookahead.popleft()
        if a.seq != seq:
            raise RuntimeError(f"prefetch order broken: expected micro-batch {seq}, got {a.seq}")
        return item

    def _post_receives(self, until: int | None = None):
        """Post irecvs for this step's upcoming drafter micro-batches, in order, as far as free buffers
        allow; with `until`, block on the prefetcher until that micro-batch is posted."""
        r, di = self.receiver, self.topo.drafter_index
        while r.can_post():
            posted = {p.seq for p in r.posted}
            # only this step's: a stop agreed after this step must leave no receive posted
            todo = [(a, it) for a, it in self.lookahead
                    if a.drafter == di and a.step == self.step and a.seq not in posted]
            if not todo:
                need = until is not None and until not in posted
                if not self._pull(block=need) and not need:
                    return
                continue
            a, item = todo[0]
            rows = int(item.plan.num_ctx_rows)
            nf = int(item.final_gather.shape[0]) if item.final_gather is not None else 0
            r.post(a.seq, self.topo.target_ranks[a.target], rows, nf, self.drafter.stream)

    # ----------------------------------------------------------------------------------- the step
    def _noise(self) -> float:
        cfg = self.cfg
        prog = min(1.0, self.step / max(1, self.total_steps - 1))
        return cfg.noise_start + (cfg.noise_end - cfg.noise_start) * prog

    def train_step(self):
        """This rank's share of one optimizer step."""
        topo = self.topo
        work = self.mine(self.step)
        di = topo.drafter_index if topo.is_drafter else -1
        ti = topo.target_index if topo.is_target else -1
        mine_d = [a.seq for a in work if a.drafter == di]
        noise, scale = self._noise(), len(topo.drafter_ranks) / self.batches_per_step
        if topo.is_drafter:
            self.drafter.begin_step()
        for a in work:
            if a.drafter == di and a.target != ti:
                self._post_receives(until=a.seq)
            item = self._next(a.seq)
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
                    self._post_receives()
            self.items_done += 1
        if topo.is_drafter:
            self.optimizer_step()

    def optimizer_step(self):
        import torch.distributed as dist
        cfg, d = self.cfg, self.drafter
        with device_ctx(self.device), stream_ctx(d.stream):
            e0, e1 = new_event(self.device, True), new_event(self.device, True)
            e0.record()
            bs = self.dcfg.block_size
            counts = torch.tensor([float(d.tokens), *d.pos_counts.tolist()], dtype=torch.float32,
                                  pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
            vec = torch.cat([d.metric[:1], counts[:1], d.metric[1:], counts[1:]])
            dist.all_reduce(vec, group=self.groups.drafters)
            loss = vec[0]
            lr = lr_at(self.step, cfg.lr, self.warmup_steps, self.total_steps)
            gnorm, bad = guarded_step(d.model, self.opt, lr, cfg.grad_clip, loss)
            out = torch.cat([loss.reshape(1), bad.float().reshape(1), gnorm.float().reshape(1).to(self.device),
                             vec[1:2], vec[2:2 + bs], vec[2 + bs:2 + 2 * bs]])
            host = torch.empty(out.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(out, non_blocking=True)
            ev = new_event(self.device)
            ev.record()
            e1.record()
            self.profiler.add_events("optimizer", e0, e1)
        self.step_events.append((self.step + 1, e1))   # GPU timestamps of step ends (rates over many steps)
        d.reset_counters()
        self.pending.append(StepMetrics(self.step + 1, host, ev, lr))

    def _drain_metrics(self, block: bool = False):
        lines = []
        bs = self.dcfg.block_size
        while self.pending and (block or self.pending[0].event.query()):
            m = self.pending.popleft()
            if block:
                m.event.synchronize()
            rec = step_record(m, m.host.tolist(), bs)
            if rec["skipped"]:
                self.nan_skips += 1
                self.nan_streak += 1
                log.warning("step %d: non-finite loss/gradient (loss %s, grad norm %s): step skipped (%d in a row)",
                            m.step, rec["loss"], rec["grad_norm"], self.nan_streak)
            else:
                self.nan_streak = 0
                self.last_loss, self.last_acc = rec["loss"], [None] + rec["acc"]
            lines.append(json.dumps(rec) + "\n")
            if self.wandb is not None:
                self.wandb.log({"loss": rec["loss"], "grad_norm": rec["grad_norm"], "lr": m.lr,
                                **{f"acc/pos{k + 1}": a for k, a in enumerate(rec["acc"]) if a is not None}},
                               step=m.step)
            if self.tensorboard is not None:
                self.tensorboard.write(m.step, {"loss": rec["loss"], "grad_norm": rec["grad_norm"], "lr": m.lr,
                                                "tokens_per_s": self.rate, "acc": rec["acc"]})
            if self.nan_streak >= self.cfg.max_nan_skips:
                if self.metrics_file is not None:
                    self.metrics_file.write(lines)
                raise TrainingFailed(f"{self.nan_streak} consecutive optimizer steps had a non-finite loss or "
                                     f"gradient (--max-nan-skips {self.cfg.max_nan_skips}); last good checkpoint "
                                     f"{self.last_ckpt or 'none'} left untouched")
        if self.metrics_file is not None:
            self.metrics_file.write(lines)

    # --------------------------------------------------------------------------------------- run
    def warmup(self):
        """Compile/autotune surprises before step 1: target shapes on target ranks; on drafter ranks
        one forward/backward at the largest chunk shape on random taps (all drafter ranks together:
        it runs the FSDP collectives), gradients thrown away."""
        cfg = self.cfg
        self.status.update(phase="warmup", force=True)
        t0 = time.perf_counter()
        compiled = cfg.compile != "none"
        if compiled:
            freeze_compiled(False)
        vocab = self.dcfg.vocab_size
        if self.target is not None:
            long_b = max(1, cfg.token_budget // cfg.max_seq_len)
            self.target.warmup([(long_b, cfg.max_seq_len), (min(cfg.max_batch_size, cfg.token_budget // 256 or 1), 256)],
                               vocab)
            self._extend(900)
        if self.drafter is not None:
            from .data import Batch
            k, hidden = len(self.dcfg.target_layer_ids), self.dcfg.hidden_size
            for lens in warmup_batches(cfg):
                t1 = time.perf_counter()
                rng = np.random.default_rng(sum(lens))
                n, s = len(lens), max(lens)
                ids = rng.integers(0, vocab, size=(n, s))
                lengths = np.array(lens)
                mask = np.arange(s)[None, :] < lengths[:, None]
                mask[:, 0] = False
                plan = self.plan(ids, mask, lengths, list(range(n)), 0, seed=0,
                                 max_anchors=min(cfg.max_anchors, cfg.drafter_chunk_rows // cfg.block_size))
                batch = Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(lengths),
                              list(range(n)), int(lengths.sum()), int(mask.sum()))
                item = make_item(-1, 0, 0, batch, plan, pin=self.device.type == "cuda", data_s=0.0)
                gen = torch.Generator(device=self.device).manual_seed(n)
                taps = torch.randn(plan.num_ctx_rows, k * hidden, generator=gen, device=self.device).to(self.dtype)
                nf = item.final_gather.shape[0] if item.final_gather is not None else 0
                final = (torch.randn(nf, hidden, generator=gen, device=self.device).to(self.dtype) if nf else None)
                self.drafter.begin_step()
                self.drafter.micro_step(item, taps, final, 0.0, 1.0, last=True)
                self.opt.zero_grad(set_to_none=True)
                self.drafter.reset_counters()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                log.info("warmup: drafter %s %d sequences, %d block rows in %d chunks in %.2fs", self.device, n,
                         sum(len(c.q_seq) for c in plan.chunks), len(plan.chunks), time.perf_counter() - t1)
                self._extend(900)
        self.profiler.reset()
        if compiled:
            freeze_compiled(True)
        log.info("warmup done in %.1fs%s", time.perf_counter() - t0,
                 f" (--compile {cfg.compile}: graphs frozen, shapes they do not cover run eagerly)" if compiled else "")

    def run(self) -> int:
        cfg, topo = self.cfg, self.topo
        self.warmup()
        if self.step >= self.total_steps:
            log.info("nothing to do: step %d of %d", self.step, self.total_steps)
            self.status.update(phase="done", step=self.step, force=True)
            return 0
        self._start_prefetch()
        self.status.update(phase="training", step=self.step, resumed_from=self.resumed_from,
                           last_checkpoint=self.last_ckpt, nan_skips=self.nan_skips, force=True)
        progress = Progress(self.total_steps, desc="train", interval=min(30.0, cfg.profile_interval),
                            clock=self.train_clock) if topo.leader else None
        t_start = t_prof = self.train_clock()
        tok_window: deque = deque(maxlen=50)
        ready_sent = False
        try:
            while self.step < self.total_steps:
                self._inject_faults()
                epoch, _ = self._position(self.step * self.batches_per_step)
                self.train_step()
                self.tokens_seen += sum(a.real_tokens for a in self.dispatch.step(self.step))  # known on every rank
                self.step += 1
                counters = {"items": self.items_done,
                            "busy_s": self.profiler.busy(("target fwd+pack", "drafter fwd+bwd", "optimizer")),
                            "wait_s": self.wait_s}
                self.vote.post(self.step, self.stop_requested.is_set(), counters)
                stop = self.vote.verdict(self.step)
                if topo.is_drafter:
                    self._drain_metrics()
                now = self.train_clock()
                if topo.leader:
                    tok_window.append((now, self.tokens_seen))
                    self.step_log.append((now, self.step, self.tokens_seen))
                    self.mem_log.append(self._memory())
                    rate = ((tok_window[-1][1] - tok_window[0][1]) / (tok_window[-1][0] - tok_window[0][0])
                            if len(tok_window) > 1 else 0.0)
                    self.rate = rate
                    self.notifier.watchdog()
                    if not ready_sent:
                        self.notifier.ready(f"training: step {self.step}")
                        ready_sent = True
                    self.status.update(phase="training", step=self.step, epoch=epoch, tokens_seen=self.tokens_seen,
                                       tokens_per_s=rate, loss=self.last_loss, nan_skips=self.nan_skips,
                                       nan_streak=self.nan_streak, ranks=self.rank_rates(now - t_start))
                    acc1 = self.last_acc[1] if self.last_acc and len(self.last_acc) > 1 else None
                    progress.update(self.step, loss=self.last_loss if self.last_loss is not None else float("nan"),
                                    acc1=acc1 if acc1 is not None else float("nan"), tok_s=rate)
                    if now - t_prof >= cfg.profile_interval:
                        self._profile_report(now - t_prof, rate, now - t_start)
                        t_prof = now
                last = self.step == self.total_steps
                if self.evaluator is not None and not stop and self.evaluator.due(self.step, last):
                    # before the step's checkpoint: a run killed between the two re-evaluates this step
                    # after the resume (metrics.jsonl is cut back to the checkpoint), so each eval is once
                    self.paused_s += self.evaluate_now(final=last)
                final = last and cfg.save_final
                if topo.is_drafter and (self.step % cfg.save_interval == 0 or final or stop):
                    self._drain_metrics(block=True)
                    if self.nan_streak == 0 and not (self.last_ckpt or "").endswith(f"{self.step:08d}"):
                        self.save_checkpoint("SIGTERM" if stop else ("interval" if not final else "final"))
                if stop:
                    log.info("stop requested: stopped cleanly at step %d", self.step)
                    self.status.update(phase="done", step=self.step, error=None, force=True)
                    return 0
            if topo.is_drafter:
                self._drain_metrics(block=True)
            log.info("training complete: %d steps, %d tokens in %.1fs%s", self.step, self.tokens_seen,
                     self.train_clock() - t_start, f" (+ {self.paused_s:.1f}s of tau evals)" if self.paused_s else "")
            if self.final_eval is not None:
                self._write_eval_json()
            self.status.update(phase="done", step=self.step, force=True)
            return 0
        finally:
            if progress is not None:
                progress.close()
            self._draining = True

    def rank_rates(self, wall: float) -> list[dict] | None:
        """Per rank, from the newest stop vote: micro-batches per second, busy and waiting fractions."""
        v = self.vote.last
        if v is None or wall <= 0:
            return None
        out = []
        for r, role in enumerate(self.topo.roles):
            kind = "target+drafter" if role.target and role.drafter else ("target" if role.target else "drafter")
            out.append({"rank": r, "role": kind, "items": int(v[r, 1]), "busy_s": round(float(v[r, 3]), 3),
                        "wait_s": round(float(v[r, 4]), 3)})
        return out

    def split_table(self, wall: float) -> str:
        """Measured work per rank and the recommended target/drafter split for this data."""
        rows, t_rate, d_rate = [], [], []
        rates = self.rank_rates(wall) or []
        per_item_rows = np.mean([a.rows for a in self.dispatch.step(max(0, self.step - 1))]) or 1.0
        per_item_tok = np.mean([a.tokens for a in self.dispatch.step(max(0, self.step - 1))]) or 1.0
        for x in rates:
            rate = x["items"] / max(x["busy_s"], 1e-9)     # per second of its own stage's (GPU) time
            rows.append([x["rank"], x["role"], x["items"], f"{x['busy_s']:.1f}", f"{rate:.2f}", f"{x['wait_s']:.1f}"])
            (t_rate if x["role"] == "target" else d_rate).append(rate)
        table = format_table(["rank", "role", "micro-batches", "stage s", "per stage s", "waiting s"], rows)
        rec = recommend_split(t_rate, d_rate)
        table += (f"\nblock rows per token: {per_item_rows / per_item_tok:.2f}" +
                  (f"\n{rec}" if rec else ""))
        return table

    def _memory(self) -> dict:
        out = {"step": self.step, "rss": _rss(), "batch shapes seen": len(self.batch_shapes)}
        if self.device.type == "cuda":
            out[str(self.device)] = torch.cuda.memory_allocated(self.device)
            out[f"{self.device} reserved"] = torch.cuda.memory_reserved(self.device)
            try:
                out["pinned host (allocator)"] = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
            except Exception:  # noqa: BLE001
                pass
        return out

    def _inject_faults(self):
        f = self.faults
        if "step_delay" in f:
            time.sleep(f["step_delay"])
        if "nan_from_step" in f and self.drafter is not None:
            self.drafter.poison = self.step + 1 >= f["nan_from_step"]
        if "hang_at_step" in f and self.step + 1 >= f["hang_at_step"]:
            log.warning("fault injection: hanging at step %d (DFLASH_FAULT_HANG_AT_STEP)", self.step + 1)
            while True:
                time.sleep(3600)
        if "die_at_step" in f and self.step + 1 >= f["die_at_step"] and self.topo.rank == f.get("die_rank", -1):
            log.error("fault injection: rank %d killing itself at step %d (DFLASH_FAULT_DIE_AT_STEP)",
                      self.topo.rank, self.step + 1)
            os.kill(os.getpid(), signal.SIGKILL)

    def _profile_report(self, wall: float, rate: float, since_start: float):
        extra = [["tok/s", "", "", "", f"{rate:,.0f}"]]
        if self.tensorboard is not None:
            self.tensorboard.write(self.step, {"stage_s": {k: v["total_s"] for k, v in self.profiler.snapshot().items()}})
        log.info("profile over %.0fs:\n%s\n%s", wall, self.profiler.table(wall, extra), self.split_table(since_start))
        self.profiler.reset()

    def shutdown(self):
        self.stop_requested.set()
        self._draining = True
        while True:
            try:
                self.prefetch_q.get_nowait()
            except queue.Empty:
                break
        if self.prefetch_thread is not None:
            self.prefetch_thread.join(timeout=10)
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


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


def read_faults() -> dict:
    """Test hooks for the fault-injection suite (docs/reliability.md); unset in production.
    DFLASH_FAULT_NAN_FROM_STEP=N  losses become NaN from optimizer step N on
    DFLASH_FAULT_HANG_AT_STEP=N   the main loop stops making progress at step N (process stays alive)
    DFLASH_FAULT_SLOW_CHECKPOINT=S  sleep S seconds inside each checkpoint write (before the rename)
    DFLASH_FAULT_STEP_DELAY=S     sleep S seconds before each optimizer step
    DFLASH_FAULT_DIE_AT_STEP=N and DFLASH_FAULT_DIE_RANK=R   rank R kills itself (SIGKILL) at step N
    """
    out = {}
    for env, key, typ in (("DFLASH_FAULT_NAN_FROM_STEP", "nan_from_step", int),
                          ("DFLASH_FAULT_HANG_AT_STEP", "hang_at_step", int),
                          ("DFLASH_FAULT_SLOW_CHECKPOINT", "slow_checkpoint", float),
                          ("DFLASH_FAULT_STEP_DELAY", "step_delay", float),
                          ("DFLASH_FAULT_DIE_AT_STEP", "die_at_step", int),
                          ("DFLASH_FAULT_DIE_RANK", "die_rank", int)):
        if os.environ.get(env):
            out[key] = typ(os.environ[env])
            log.warning("fault injection active: %s=%s", env, os.environ[env])
    return out


def warmup_batches(cfg: TrainConfig) -> list[list[int]]:
    """Sequence lengths of the drafter's warmup micro-batches. Uncompiled: one sequence (autotuning only).
    Compiled (--compile all|drafter): the compiled layers must cover every shape a step can bring, because
    after the warmup a shape they do not cover runs eagerly, and eager FlexAttention materializes the whole
    [heads, rows, ctx] score matrix (tens of GiB at 27B width: the OOM in results/log-issue15-27b-b16-oom).
    Dynamo specializes sizes 0 and 1 even when compiled dynamic, so the warmup brings a chunk holding one
    sequence, full chunks holding several equal sequences, and mixed lengths with a partial tail chunk."""
    seq = min(cfg.max_seq_len, cfg.token_budget)
    shapes = [[seq]]
    if not wants(cfg.compile, "drafter"):
        return shapes
    per = max(2, min(cfg.max_batch_size, cfg.token_budget // cfg.max_seq_len))
    full = max(cfg.block_size * 2, min(cfg.max_seq_len, cfg.token_budget // per))
    shapes.append([full] * per)
    # mixed: two medium sequences (a partial chunk) and short ones that share a chunk
    short = max(cfg.block_size * 2, cfg.drafter_chunk_rows // (4 * cfg.block_size))
    mixed = [n for n in (seq // 2 + 37, seq // 3 + 74) if n > short] + [min(short, seq)] * 3
    while sum(mixed) > cfg.token_budget and len(mixed) > 2:
        mixed.pop(0)
    shapes.append(mixed)
    return shapes


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
    _die_with_supervisor()
    try:
        topo, groups = init_rank(cfg)
    except ValueError as e:
        _record(e)
        if not os.environ.get("DFLASH_SUPERVISED"):
            print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        return 2
    trainer = Trainer(cfg, topo, groups, target_factory, dataset)
    install_signal_handlers(trainer)
    rc = 1
    try:
        trainer.setup()
        rc = trainer.run()
        if on_done is not None and rc == 0:
            on_done(trainer)
        return rc
    except BadInput as e:
        _record(e)
        log.error("bad input: %s", e, extra={"console": False})
        trainer.status.update(phase="failed", error=str(e), step=trainer.step, force=True)
        if not os.environ.get("DFLASH_SUPERVISED"):
            print(f"dflash-train: error: {e}", file=sys.stderr, flush=True)
        rc = 2
        return rc
    except (TrainingFailed, CheckpointError) as e:
        _record(e)
        log.error("training failed: rank %d: %s", topo.rank, e)
        trainer.status.update(phase="failed", error=f"rank {topo.rank}: {e}", step=trainer.step,
                              nan_skips=trainer.nan_skips, nan_streak=trainer.nan_streak, force=True)
        return 1
    except (Exception, CheckpointErrorBase) as e:
        _record(e)
        log.exception("training failed on rank %d", topo.rank)
        trainer.status.update(phase="failed", error=f"rank {topo.rank}: {type(e).__name__}: {e}", force=True)
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


def _die_with_supervisor() -> None:
    """A rank started by our supervisor goes when the supervisor goes, whatever killed it (kill -9
    included): the kernel sends this rank SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG)."""
    sup = os.environ.get("DFLASH_SUPERVISOR_PID")
    if not sup:
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(sup) and not os.path.exists(f"/proc/{sup}"):
        os._exit(1)   # the supervisor died before prctl took effect


try:   # torch.distributed.checkpoint's exception derives from BaseException
    from torch.distributed.checkpoint.api import CheckpointException as CheckpointErrorBase
except ImportError:  # pragma: no cover
    CheckpointErrorBase = Exception


def _root_cause(e: BaseException) -> str:
    """The OSError under a DCP failure (its CheckpointException wraps every rank's exception), else e."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return f"[Errno {x.errno}] {x.strerror}" + (f": {x.filename!r}" if x.filename else "")
        todo += [x.__cause__, x.__context__]
        for w in (getattr(x, "failures", None) or {}).values():
            todo.append(w[0] if isinstance(w, tuple) else w)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"   # DCP's text ends with the cause


def _record(e: BaseException) -> None:
    """The launcher's error file: the supervisor names this rank's error in status.json and on stderr."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(e)
    except Exception:  # noqa: BLE001
        pass


def train(cfg: TrainConfig) -> int:
    return train_rank(cfg)
