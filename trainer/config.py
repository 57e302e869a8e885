"""The one run configuration, the command line that fills it, and cheap validation (`--check-config`).

Validation reads only small files (config.json, the safetensors index, the data index) and never
imports a model, so a bad flag fails in well under a second with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

# choices of the speed options (trainer/fast.py, trainer/pipeline.py); kept here so config stays torch-free
COMPILE_CHOICES = ("auto", "none", "target", "drafter", "all")
SDPA_BACKENDS = ("auto", "any", "flash", "cudnn", "efficient")
TRANSPORTS = ("auto", "peer", "pinned")

NOISE_TYPES = ("uniform", "gaussian", "none")
WANDB_MODES = ("disabled", "offline", "online")


class ConfigError(ValueError):
    """Bad input; the message starts with the flag or file it is about."""


@dataclass
class TrainConfig:
    target_model: str
    data_dir: str
    output_dir: str
    target_gpus: list[int] = field(default_factory=list)   # [] = CPU
    drafter_gpus: list[int] = field(default_factory=list)
    epochs: int = 6
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_accum: int = 4
    grad_clip: float = 1.0
    token_budget: int = 49152
    max_seq_len: int = 8192
    max_batch_size: int = 64
    block_size: int = 16
    max_anchors: int = 512
    num_draft_layers: int = 5
    gamma: float = 7.0
    noise_start: float = 0.0
    noise_end: float = 0.0
    noise_type: str = "uniform"
    use_soft_labels: bool = False
    # operations
    max_steps: int = 0
    seed: int = 0
    save_interval: int = 1000
    keep_checkpoints: int = 3
    resume: bool = True
    status_file: str = ""
    log_dir: str = ""
    profile_interval: float = 60.0
    wandb_mode: str = "disabled"
    wandb_project: str = "dflash"
    split_fc: bool = False
    async_pipeline: bool = True
    target_layers: list[int] | None = None
    max_nan_skips: int = 10
    mask_token_id: int | None = None
    eval_data_dir: str = ""
    drafter_chunk_rows: int = 32768
    slots_per_worker: int = 3
    queue_depth: int = 2
    attention: str = "auto"   # auto | flex | sdpa
    compile: str = "auto"     # auto | none | target | drafter | all (regional torch.compile, trainer/fast.py)
    sdpa_backend: str = "auto"  # auto | any | flash | cudnn | efficient (the target's attention kernel)
    transport: str = "auto"   # auto | peer | pinned (how hidden states reach the drafter GPU)
    pad_multiple: int = 64    # target batches padded to a multiple of this length (bounded set of shapes)
    check_config: bool = False
    drop_long: bool = False
    cpu_target_workers: int = 1
    cpu_drafter_replicas: int = 1
    save_final: bool = True   # the benchmark turns the end-of-run checkpoint off
    # torch.distributed (trainer/dist.py)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    dist_timeout: float = 600.0   # seconds a collective / point-to-point op may block before the job fails
    stop_timeout: float = 840.0   # SIGTERM -> ranks get this long to checkpoint before SIGKILL

    @property
    def on_cpu(self) -> bool:
        return not self.target_gpus

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu_list(flag: str):
    def parse(text: str) -> list[int]:
        t = text.strip().lower()
        if t in ("", "cpu", "none"):
            return []
        try:
            ids = [int(x) for x in t.split(",") if x.strip() != ""]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected GPU indices like 0,1,2 or 'cpu', got {text!r}")
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise argparse.ArgumentTypeError(f"{flag}: GPU indices must be distinct and >= 0, got {text!r}")
        return ids
    return parse


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with one line naming the flag
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "dflash-train") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Train a DFlash drafter against a frozen target model.")
    g = p.add_argument_group("original run")
    g.add_argument("--target-model", required=True, help="local Hugging Face model directory (bf16 safetensors)")
    g.add_argument("--data-dir", required=True, help="shards written by dflash-prepare / dflash-tiny")
    g.add_argument("--output-dir", required=True, help="checkpoints, status.json, logs")
    g.add_argument("--target-gpus", type=_gpu_list("--target-gpus"), default=[], help="e.g. 0,1,2,3,4 or cpu")
    g.add_argument("--drafter-gpus", type=_gpu_list("--drafter-gpus"), default=[], help="e.g. 5,6,7 or cpu")
    g.add_argument("--epochs", type=int, default=6)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup-ratio", type=float, default=0.04)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--grad-accum", type=int, default=4)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--token-budget", type=int, default=49152, help="padded tokens per target forward")
    g.add_argument("--max-seq-len", type=int, default=8192)
    g.add_argument("--max-batch-size", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-anchors", type=int, default=512, help="anchors per sequence")
    g.add_argument("--num-draft-layers", type=int, default=5)
    g.add_argument("--gamma", type=float, default=7.0, help="loss decay: w_k = exp(-(k-1)/gamma)")
    g.add_argument("--noise-start", type=float, default=0.0)
    g.add_argument("--noise-end", type=float, default=0.0)
    g.add_argument("--noise-type", default="uniform", help="|".join(NOISE_TYPES))
    g.add_argument("--use-soft-labels", action="store_true", help="KL to the target's distribution")
    o = p.add_argument_group("operations")
    o.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (0: epochs decide)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--save-interval", type=int, default=1000, help="optimizer steps between checkpoints")
    o.add_argument("--keep-checkpoints", type=int, default=3)
    o.add_argument("--no-resume", dest="resume", action="store_false",
                   help="refuse to start when the output dir holds checkpoints (default: resume the newest)")
    o.add_argument("--status-file", default="", help="default <output-dir>/status.json")
    o.add_argument("--log-dir", default="", help="default <output-dir>/logs")
    o.add_argument("--profile-interval", type=float,
                   default=None, help="seconds between stage tables (default $DFLASH_PROFILE_INTERVAL or 60)")
    o.add_argument("--wandb-mode", default="disabled", help="|".join(WANDB_MODES))
    o.add_argument("--wandb-project", default=os.environ.get("WANDB_PROJECT", "dflash"))
    o.add_argument("--split-fc", action="store_true", help="fc as per-tap matmuls (same math)")
    o.add_argument("--no-async", dest="async_pipeline", action="store_false",
                   help="run the same math synchronously (baseline)")
    o.add_argument("--target-layers", type=_int_list, default=None, help="override the tapped layers, e.g. 1,9,17")
    o.add_argument("--max-nan-skips", type=int, default=10, help="consecutive non-finite steps before failing")
    o.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's <|mask|>, else 151669")
    o.add_argument("--eval-data-dir", default="", help="held-out shards for the acceptance evaluation at the end")
    o.add_argument("--drafter-chunk-rows", type=int, default=32768, help="block rows per drafter forward")
    o.add_argument("--slots-per-worker", type=int, default=3, help="copies in flight per target worker")
    o.add_argument("--queue-depth", type=int, default=2, help="delivered batches waiting per drafter replica")
    o.add_argument("--attention", default="auto", choices=("auto", "flex", "sdpa"))
    o.add_argument("--compile", default="auto", choices=COMPILE_CHOICES,
                   help="regional torch.compile of the target's and/or the drafter's layers and loss "
                        "(auto: all on GPUs, none on the CPU)")
    o.add_argument("--sdpa-backend", default="auto", choices=SDPA_BACKENDS,
                   help="attention kernel of the target forward (auto: flash on GPUs, never cuDNN, whose "
                        "per-shape plan cache grows host memory without limit; any: PyTorch chooses)")
    o.add_argument("--pad-multiple", type=int, default=64,
                   help="pad each target batch's length up to a multiple of this (bounds the number of distinct "
                        "batch shapes, and with it per-shape kernel-plan caches; 1 = no rounding)")
    o.add_argument("--transport", default="auto", choices=TRANSPORTS,
                   help="target->drafter copies: GPU peer-to-peer or through pinned host memory "
                        "(auto: peer where the GPUs allow it)")
    o.add_argument("--drop-long", action="store_true", help="drop sequences over --max-seq-len (default: truncate)")
    o.add_argument("--cpu-target-workers", type=int, default=1, help="CPU runs: target worker threads")
    o.add_argument("--cpu-drafter-replicas", type=int, default=1, help="CPU runs: drafter replicas")
    n = p.add_argument_group("distributed (one process per GPU; see docs/distributed.md)")
    n.add_argument("--nnodes", type=int, default=1, help="nodes in the job (each runs `python -m trainer` "
                   "with its own --target-gpus/--drafter-gpus)")
    n.add_argument("--node-rank", type=int, default=0, help="this node's rank (0 = the first drafter's node)")
    n.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (the first node); "
                   "default on one node: a free local port")
    n.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a blocked collective or send waits before the job fails")
    n.add_argument("--stop-timeout", type=float, default=840.0,
                   help="after SIGTERM, seconds the ranks get to reach a step and checkpoint before SIGKILL "
                        "(keep below the unit's TimeoutStopSec)")
    o.add_argument("--check-config", action="store_true", help="validate everything cheap, load nothing, exit")
    return p


def parse_args(argv=None, prog: str = "dflash-train") -> TrainConfig:
    ns = build_parser(prog).parse_args(argv)
    d = vars(ns)
    if d["profile_interval"] is None:
        env = os.environ.get("DFLASH_PROFILE_INTERVAL", "")
        try:
            d["profile_interval"] = float(env) if env else 60.0
        except ValueError:
            raise ConfigError(f"DFLASH_PROFILE_INTERVAL: expected seconds, got {env!r}")
    cfg = TrainConfig(**d)
    if not cfg.status_file:
        cfg.status_file = str(Path(cfg.output_dir) / "status.json")
    if not cfg.log_dir:
        cfg.log_dir = str(Path(cfg.output_dir) / "logs")
    return cfg


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def validate(cfg: TrainConfig, gpu_count: int | None = None) -> dict:
    """Cheap checks of every flag and file. Returns facts learnt (target config, data index)."""
    if bool(cfg.target_gpus) != bool(cfg.drafter_gpus):
        raise ConfigError("--target-gpus/--drafter-gpus: both must list GPUs, or both be 'cpu'")
    overlap = set(cfg.target_gpus) & set(cfg.drafter_gpus)
    shared = len(cfg.target_gpus) == 1 and cfg.target_gpus == cfg.drafter_gpus
    if overlap and not shared:
        raise ConfigError(f"--drafter-gpus: GPU(s) {sorted(overlap)} are also in --target-gpus (one GPU may hold "
                          "both only when it is the node's only GPU: --target-gpus 0 --drafter-gpus 0)")
    if cfg.target_gpus:
        n = _gpu_count() if gpu_count is None else gpu_count
        missing = [i for i in cfg.target_gpus + cfg.drafter_gpus if i >= n]
        if missing:
            flag = "--target-gpus" if any(i in cfg.target_gpus for i in missing) else "--drafter-gpus"
            raise ConfigError(f"{flag}: GPU index(es) {missing} do not exist (this machine has {n} CUDA device(s))")
    checks = [
        (cfg.block_size >= 2, "--block-size", f"must be >= 2, got {cfg.block_size}"),
        (cfg.gamma > 0, "--gamma", f"must be > 0, got {cfg.gamma}"),
        (cfg.token_budget >= cfg.max_seq_len, "--token-budget",
         f"({cfg.token_budget}) is smaller than --max-seq-len ({cfg.max_seq_len})"),
        (cfg.max_seq_len >= 2, "--max-seq-len", f"must be >= 2, got {cfg.max_seq_len}"),
        (cfg.noise_end <= cfg.noise_start, "--noise-end",
         f"({cfg.noise_end}) is larger than --noise-start ({cfg.noise_start})"),
        (cfg.noise_start >= 0 and cfg.noise_end >= 0, "--noise-start", "noise must be >= 0"),
        (cfg.noise_type in NOISE_TYPES, "--noise-type", f"unknown {cfg.noise_type!r} (choose {', '.join(NOISE_TYPES)})"),
        (cfg.wandb_mode in WANDB_MODES, "--wandb-mode", f"unknown {cfg.wandb_mode!r} (choose {', '.join(WANDB_MODES)})"),
        (cfg.epochs >= 1, "--epochs", f"must be >= 1, got {cfg.epochs}"),
        (cfg.lr > 0, "--lr", f"must be > 0, got {cfg.lr}"),
        (0 <= cfg.warmup_ratio < 1, "--warmup-ratio", f"must be in [0, 1), got {cfg.warmup_ratio}"),
        (cfg.weight_decay >= 0, "--weight-decay", f"must be >= 0, got {cfg.weight_decay}"),
        (cfg.grad_accum >= 1, "--grad-accum", f"must be >= 1, got {cfg.grad_accum}"),
        (cfg.grad_clip > 0, "--grad-clip", f"must be > 0, got {cfg.grad_clip}"),
        (cfg.max_batch_size >= 1, "--max-batch-size", f"must be >= 1, got {cfg.max_batch_size}"),
        (cfg.max_anchors >= 1, "--max-anchors", f"must be >= 1, got {cfg.max_anchors}"),
        (cfg.num_draft_layers >= 1, "--num-draft-layers", f"must be >= 1, got {cfg.num_draft_layers}"),
        (cfg.max_steps >= 0, "--max-steps", f"must be >= 0, got {cfg.max_steps}"),
        (cfg.save_interval >= 1, "--save-interval", f"must be >= 1, got {cfg.save_interval}"),
        (cfg.keep_checkpoints >= 0, "--keep-checkpoints", f"must be >= 0, got {cfg.keep_checkpoints}"),
        (cfg.profile_interval > 0, "--profile-interval", f"must be > 0, got {cfg.profile_interval}"),
        (cfg.max_nan_skips >= 1, "--max-nan-skips", f"must be >= 1, got {cfg.max_nan_skips}"),
        (cfg.slots_per_worker >= 1, "--slots-per-worker", f"must be >= 1, got {cfg.slots_per_worker}"),
        (cfg.queue_depth >= 1, "--queue-depth", f"must be >= 1, got {cfg.queue_depth}"),
        (cfg.pad_multiple >= 1, "--pad-multiple", f"must be >= 1, got {cfg.pad_multiple}"),
        (cfg.cpu_target_workers >= 1, "--cpu-target-workers", "must be >= 1"),
        (cfg.cpu_drafter_replicas >= 1, "--cpu-drafter-replicas", "must be >= 1"),
        (cfg.drafter_chunk_rows >= cfg.block_size, "--drafter-chunk-rows", "must hold at least one block"),
        (cfg.nnodes >= 1, "--nnodes", f"must be >= 1, got {cfg.nnodes}"),
        (0 <= cfg.node_rank < cfg.nnodes, "--node-rank", f"must be in [0, --nnodes), got {cfg.node_rank}"),
        (cfg.nnodes == 1 or ":" in cfg.rdzv_endpoint, "--rdzv-endpoint",
         f"HOST:PORT of the first node is needed with --nnodes {cfg.nnodes}"),
        (cfg.dist_timeout > 0, "--dist-timeout", f"must be > 0, got {cfg.dist_timeout}"),
        (cfg.stop_timeout > 0, "--stop-timeout", f"must be > 0, got {cfg.stop_timeout}"),
    ]
    for ok, flag, why in checks:
        if not ok:
            raise ConfigError(f"{flag}: {why}")

    facts = {"target_config": check_model_dir(cfg.target_model)}
    tcfg = facts["target_config"]
    text = tcfg.get("text_config", tcfg)
    layers = text.get("num_hidden_layers")
    if cfg.target_layers is not None:
        if len(cfg.target_layers) == 0:
            raise ConfigError("--target-layers: empty list")
        bad = [i for i in cfg.target_layers if layers is not None and not 0 <= i < layers]
        if bad:
            raise ConfigError(f"--target-layers: {bad} outside the target's {layers} layers")
    elif layers is not None and layers < 2:
        raise ConfigError(f"--target-model: {cfg.target_model}/config.json has {layers} layer(s); need >= 2")

    from .data import DataError, check_data_dir
    try:
        facts["data_index"] = check_data_dir(cfg.data_dir)
    except DataError as e:
        raise ConfigError(f"--data-dir: {e}") from None
    if cfg.eval_data_dir:
        try:
            check_data_dir(cfg.eval_data_dir)
        except DataError as e:
            raise ConfigError(f"--eval-data-dir: {e}") from None

    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir: {out} exists and is not a directory")
    parent = out if out.exists() else _existing_parent(out)
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--output-dir: {parent} is not writable")
    if not cfg.resume and out.is_dir() and any(out.glob("step-*")):
        raise ConfigError(f"--no-resume: {out} already holds checkpoints; refusing to overwrite them "
                          "(choose another --output-dir or drop --no-resume)")
    return facts


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def check_model_dir(path: str) -> dict:
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"--target-model: {d} is not a directory")
    cj = d / "config.json"
    if not cj.is_file():
        raise ConfigError(f"--target-model: {cj} is missing")
    try:
        config = json.loads(cj.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--target-model: {cj} is not valid JSON ({e})")
    if not isinstance(config, dict):
        raise ConfigError(f"--target-model: {cj} is not a JSON object")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--target-model: {index} is unreadable ({e})")
        for shard in sorted(set(weight_map.values())):
            if not (d / shard).is_file():
                raise ConfigError(f"--target-model: shard {d / shard} listed in {index.name} is missing")
    elif not (d / "model.safetensors").is_file():
        raise ConfigError(f"--target-model: {d} has neither model.safetensors nor model.safetensors.index.json")
    return config


def main_check(cfg: TrainConfig) -> int:
    facts = validate(cfg)
    idx = facts.get("data_index") or {}
    print(f"config ok: target {cfg.target_model}, data {cfg.data_dir} "
          f"({idx.get('num_sequences', '?')} sequences), output {cfg.output_dir}")
    return 0


def fail(prog: str, message: str) -> "None":
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
