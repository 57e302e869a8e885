"""The option system: every command-line option written once, as a dataclass field (:func:`opt`).

:class:`TrainConfig` is dflash-train's run configuration. Each field's metadata holds its help text,
flag and simple range; the argparse parser (:func:`build_parser`), the range checks of
:func:`validate_flags` and the Ansible side's flag list (:func:`flag_spec`, checked against
roles/dflash_service/meta/argument_specs.yml by the tests) are all generated from those fields.
The defaults are the recipe we recommend, after the 2026-12-06 table (docs/performance.md, "Real model
(SmolLM2-135M-Instruct)"): block 16, 1024 anchors, noise 0.05 -> 0.01, hard labels (the data tokens) and
CE + D-PACE, its best DFlash row; block 16 is also the seeds' published drafter's (z-lab/Qwen3.6-27B-DFlash)
and CE + D-PACE the peers' loss. gamma 7 is --loss ce's decay (D-PACE does not use it). The architecture
stays dflash, what SGLang and vLLM serve. The seed run's recipe (the defaults until 2026-12-06) is
`--block-size 32 --gamma 10 --use-soft-labels --loss ce`. `dflash-train --help` lists them all.

Only the flags are here, and the rules that need nothing but the flags: no file is read, no model or
checkpoint opened, and torch is never imported at module level (tests/config/test_options.py imports this
module with torch blocked). What reads files before a run starts (the target's config and shard
headers, the data index, checkpoints in --output-dir) is trainer/config/preflight.py; `python -m
trainer.config` (the Ansible role's flag check) is trainer/config/__main__.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.model import architectures

# choices of the speed options (trainer/ops/compiling.py; the transport's in trainer/distributed/groups.py); here, torch-free
COMPILE_CHOICES = ("auto", "none", "target", "drafter", "all")
SDPA_BACKENDS = ("auto", "any", "flash", "cudnn", "efficient")
TRANSPORTS = ("pair", "world")   # groups.Groups: a communicator per (target, drafter) pair, or the world's
ATTENTION_CHOICES = ("auto", "flex", "sdpa")
# --cpu-dtype: a CPU run's compute dtype (trainer/engine/train.py); a GPU run is bfloat16
CPU_DTYPES = ("float32", "bfloat16")
# --fp8: torchao float8 training recipes for the drafter's linear layers (trainer/engine/drafter_stage.py)
FP8_CHOICES = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp")

NOISE_TYPES = ("uniform", "gaussian", "none")
# --loss: the CE weighted per slot by exp(-(k-1)/gamma), or by D-PACE (trainer/ops/loss.py says how)
LOSS_CHOICES = ("ce", "ce+dpace")
# --arch: the drafter architectures' table (trainer/model/architectures.py)
ARCH_CHOICES = architectures.names()
# the bounds of one tau evaluation (trainer/serving/evaluate.py and dflash-eval default to them too)
EVAL_PROMPTS = 16
EVAL_MAX_NEW_TOKENS = 128
WANDB_MODES = ("disabled", "offline", "online")
# --draft-contract: follow a target family's published drafter contract or not (trainer/model/families.py)
CONTRACT_CHOICES = ("auto", "none")


class ConfigError(ValueError):
    """Bad input; the message starts with the flag or file it is about. `leave_output`: the refusal leaves
    the output dir as it is, status.json included (a resume onto another target must not touch the run it
    would resume); other refusals at start say why in an existing status.json (__main__.record_bad_input)."""

    def __init__(self, message: str, *, leave_output: bool = False):
        super().__init__(message)
        self.leave_output = leave_output


def opt(default: Any = dataclasses.MISSING, help: str = "", *, group: str = "operations",
        flag: str | None = None, kind: str | None = None, choices: tuple | None = None,
        ge: float | None = None, gt: float | None = None, lt: float | None = None,
        env: str | None = None, metavar: str | None = None, cli: bool = True,
        default_factory: Any = dataclasses.MISSING) -> Any:
    """A TrainConfig field with its command-line facts.

    flag: the option name (default ``--`` + the field name with dashes); kind: how the text is
    parsed (``gpus``, ``ints``; default from the field's type); ge/gt/lt: simple ranges, checked
    by :func:`validate_flags` and named in the help; env: an environment variable that supplies the
    default; cli=False: not a command-line option (set by code, e.g. the benchmark)."""
    md = dict(help=help, group=group, flag=flag, kind=kind, choices=choices, ge=ge, gt=gt, lt=lt,
              env=env, metavar=metavar, cli=cli)
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=md)
    return field(default=default, metadata=md)


RUN = "original run"   # the flags of the hand-run command line (docs/contracts.md)
DIST = "distributed (one process per GPU; see docs/distributed.md)"
# flags that exist only for A/B measurements (the bench's variants, the stream checker's orders): the parser
# accepts them, but the operator's --help and the role's argument spec (flag_spec) leave them out; the bench
# (--set FIELD=VALUE, --variants) and the checker set them on the config
MEASURE = "measurement"


@dataclass
class TrainConfig:
    # ---- the original run (the defaults are the recipe we recommend) ----
    target_model: str = opt(help="local Hugging Face model directory (bf16 safetensors)", group=RUN)
    data_dir: str = opt(help="shards written by dflash-prepare / dflash-tiny", group=RUN)
    output_dir: str = opt(help="checkpoints, status.json, logs", group=RUN)
    target_gpus: list[int] = opt(help="GPU indices of the frozen target, e.g. 0,1,2,3,4, or cpu", group=RUN,
                                 kind="gpus", default_factory=list)
    drafter_gpus: list[int] = opt(help="GPU indices of the drafter, e.g. 5,6,7, or cpu", group=RUN,
                                  kind="gpus", default_factory=list)
    epochs: int = opt(6, "passes over the data", group=RUN, ge=1)
    lr: float = opt(6e-4, "peak AdamW learning rate (linear warmup, then cosine)", group=RUN, gt=0)
    warmup_ratio: float = opt(0.04, "share of the optimizer steps spent warming up", group=RUN, ge=0, lt=1)
    weight_decay: float = opt(0.01, "AdamW weight decay", group=RUN, ge=0)
    grad_accum: int = opt(4, "micro-batches per optimizer step", group=RUN, ge=1)
    grad_clip: float = opt(1.0, "clip the gradient norm to this", group=RUN, gt=0)
    token_budget: int = opt(49152, "padded tokens per target forward", group=RUN, ge=2)
    max_seq_len: int = opt(8192, "longer sequences are truncated (or dropped with --drop-long)", group=RUN, ge=2)
    max_batch_size: int = opt(64, "sequences per target forward", group=RUN, ge=1)
    block_size: int = opt(16, "tokens per draft block (slot 0 is the anchor's own token)", group=RUN, ge=2)
    max_anchors: int = opt(1024, "anchors (blocks) per sequence", group=RUN, ge=1)
    num_draft_layers: int = opt(5, "decoder layers of the drafter", group=RUN, ge=1)
    gamma: float = opt(7.0, "--loss ce's decay over block slots: w_k = exp(-(k-1)/gamma) (ce+dpace weighs "
                                   "by confidence instead)", group=RUN, gt=0)
    noise_start: float = opt(0.05, "noise on the tapped hidden states at the start (annealed)", group=RUN, ge=0)
    noise_end: float = opt(0.01, "noise at the end of the run (<= --noise-start)", group=RUN, ge=0)
    noise_type: str = opt("uniform", "noise distribution", group=RUN, choices=NOISE_TYPES)
    use_soft_labels: bool = opt(False, "train against the target's distribution (KL) instead of the data tokens "
                                        "(needs --loss ce)", group=RUN)
    loss: str = opt("ce+dpace", "ce: cross-entropy weighted per block slot by --gamma's decay; ce+dpace: weighted by "
                          "D-PACE from the drafter's own confidence (speculators' default since #980; needs "
                          "--no-use-soft-labels)", group=RUN, choices=LOSS_CHOICES)
    dpace_alpha: float = opt(0.5, "D-PACE's confidence smoothing (--loss ce+dpace), in (0, 1]", group=RUN, gt=0)
    arch: str = opt(architectures.DEFAULT, architectures.help_text(), group=RUN, choices=ARCH_CHOICES)
    # ---- operations ----
    max_steps: int = opt(0, "stop after N optimizer steps (0: the epochs decide)", ge=0)
    seed: int = opt(0, "seed of the batch plan, anchors, noise and init")
    save_interval: int = opt(1000, "optimizer steps between checkpoints", ge=1)
    keep_checkpoints: int = opt(3, "checkpoints kept (older ones are pruned after a save)", ge=0)
    resume: bool = opt(True, "resume from the newest checkpoint in --output-dir (--no-resume: refuse to start "
                             "when it holds checkpoints)")
    allow_target_change: bool = opt(False, "resume a checkpoint trained on another target (e.g. a fine-tuned "
                                           "revision of the same model) whose shapes still fit; the run log "
                                           "names what differs (default: such a resume exits 2)")
    status_file: str = opt("", "status.json heartbeat (default <output-dir>/status.json)")
    log_dir: str = opt("", "one log file per run and latest.log (default <output-dir>/logs)")
    tensorboard_dir: str = opt("", "also write the training metrics as TensorBoard events here "
                                   "(needs the tensorboard package; empty: off)")
    profile_interval: float = opt(60.0, "seconds between stage tables", gt=0, env="DFLASH_PROFILE_INTERVAL")
    wandb_mode: str = opt("disabled", "Weights & Biases logging", choices=WANDB_MODES)
    wandb_project: str = opt("dflash", "Weights & Biases project", env="WANDB_PROJECT")
    split_fc: bool = opt(False, "fc as per-tap matmuls (same math)", group=MEASURE)
    async_pipeline: bool = opt(True, "overlap the target, the copies and the drafter (--no-async: the same "
                                     "math synchronously, a baseline)", flag="--async", group=MEASURE)
    target_layers: list[int] | None = opt(None, "override the tapped target layers, e.g. 1,9,17", kind="ints")
    draft_layer_types: str = opt("auto", "attention of each draft layer, comma-separated full|sliding (sliding: "
                                         "causal attention over the last --sliding-window positions, as SGLang and "
                                         "vLLM run a drafter's sliding_attention layers); auto: sliding on every "
                                         "layer but the last for a hybrid Qwen3.5/3.6 target (the layout "
                                         "z-lab/Qwen3.6-27B-DFlash ships), full otherwise", metavar="TYPES")
    sliding_window: int = opt(2048, "window of the sliding draft layers, in positions (the current one included, "
                                    "as in Hugging Face configs)", ge=1)
    draft_heads: int = opt(0, "query heads of each draft layer (0: the target's; z-lab's Qwen3.5-27B drafter "
                              "uses 32 where the target has 24)", ge=0)
    draft_kv_heads: int = opt(0, "key/value heads of each draft layer (0: the target's; z-lab's Qwen3.5-27B "
                                 "drafter: 8, the target 4)", ge=0)
    draft_head_dim: int = opt(0, "head dim of the draft layers (0: the target's; z-lab's Qwen3.5-27B drafter: "
                                 "128, the target 256)", ge=0)
    allow_slow_linear_attention: bool = opt(False, "train a hybrid (Gated DeltaNet) target on GPUs without "
                                                   "flash-linear-attention, on transformers' slow torch fallback "
                                                   "(default: such a run exits 2 naming the package)")
    max_nan_skips: int = opt(10, "consecutive non-finite steps before the run fails", ge=1)
    mask_token_id: int | None = opt(None, "token id of the masked block slots (default: the family's published "
                                          "contract, else the tokenizer's mask token, else a row it never "
                                          "produces, else an unused special token, else the last row; the run "
                                          "log names the source: trainer/model/identity.py)")
    draft_contract: str = opt("auto", "auto: for a target family with published drafters (qwen3_5: 32/8 heads "
                                      "x 128, sliding layers, MASK 248070) their contract is the default of "
                                      "every drafter choice not given (block size and anchors stay this run's); "
                                      "none: the generic rules (trainer/model/families.py)",
                              choices=CONTRACT_CHOICES)
    init_drafter: str = opt("", "warm start: a published drafter directory (config.json + safetensors; DFlash "
                                "or DFlash2, as z-lab, SpecForge or speculators export it) as the first step's "
                                "weights, after a check of its contract against the target and the flags "
                                "given; its block size, taps, MASK, heads and layer types become this run's "
                                "defaults; AdamW starts fresh (a resume from --output-dir wins)",
                            metavar="PATH")
    eval_data_dir: str = opt("", "held-out shards: tau by real speculative generation at the end of the run "
                                 "(eval.json) and every --eval-every steps")
    eval_every: int = opt(0, "optimizer steps between tau evaluations during training, into metrics.jsonl, "
                             "status.json and the plots (needs --eval-data-dir; every rank pauses for it; "
                             "0: only at the end)", ge=0)
    eval_prompts: int = opt(EVAL_PROMPTS, "held-out prompts per tau evaluation", ge=1)
    eval_max_new_tokens: int = opt(EVAL_MAX_NEW_TOKENS, "tokens generated per prompt in a tau evaluation", ge=1)
    drafter_chunk_rows: int = opt(32768, "block rows per drafter forward", ge=1)
    loss_dedup: bool = opt(True, "LM head only on rows with a loss, soft-label targets once per position of a "
                                 "loss chunk (--no-loss-dedup: every block row, per row; the same loss)", group=MEASURE)
    flex_full_blocks: bool = opt(True, "pass FlexAttention the fully visible tiles (they skip mask_mod; the "
                                       "same attention)", group=MEASURE)
    flex_ctx_group: int = opt(0, "FlexAttention: each group of this many 128-row query tiles gets its own copy of "
                                 "the context keys it sees, so no key tile's backward walks every query tile "
                                 "of a long sequence (0, the default: one shared context; the same attention; "
                                 "what it gains and costs: results/INDEX.md, h200-27b-orig-ctxcopy.json)",
                              ge=0, group=MEASURE)
    fp32_logits: bool = opt(True, "LM-head GEMM writes fp32 logits on GPUs (--no-fp32-logits: bf16 output "
                                  "rounded before the softmax, the old behaviour)", group=MEASURE)
    fp8: str = opt("off", "FP8 training of the drafter's linear layers with torchao float8 (needs the torchao "
                          "package and GPUs of compute capability 8.9+; the LM head stays bf16; see "
                          "docs/performance.md for its speed and its loss/tau parity)", choices=FP8_CHOICES)
    flex_kernel_options: str = opt("", "FlexAttention kernel options for the drafter, KEY=INT,... (e.g. "
                                       "BLOCK_M=64,BLOCK_N=64,num_warps=4; empty: PyTorch's defaults)",
                                   metavar="K=V,...")
    slots_per_worker: int = opt(3, "packed slots per target rank (hidden-state sends in flight)", ge=1)
    queue_depth: int = opt(2, "receive buffers per drafter rank (micro-batches received ahead)", ge=1)
    attention: str = opt("auto", "drafter attention kernel", choices=ATTENTION_CHOICES)
    compile: str = opt("auto", "regional torch.compile of the target's and/or the drafter's layers and loss "
                               "(auto: all on GPUs, the drafter only on a hybrid target; none on the CPU)", choices=COMPILE_CHOICES)
    sdpa_backend: str = opt("auto", "attention kernel of the target forward (auto: flash on GPUs, never cuDNN, "
                                    "whose per-shape plan cache grows host memory; any: PyTorch chooses)",
                            choices=SDPA_BACKENDS)
    transport: str = opt("pair", "the communicator hidden states travel on from target to drafter ranks: pair = "
                                 "one per (target, drafter) pair, so a target's sends to different drafters never "
                                 "queue behind each other; world = the world group's one communicator, where NCCL "
                                 "runs a rank's sends in post order (docs/distributed.md)", choices=TRANSPORTS)
    fsdp_prefetch: str = opt("step", "when a drafter rank all-gathers its FSDP shards: step = at the start of each "
                                     "step, before any receive (the order that cannot hang on NCCL); forward = at "
                                     "the first forward, FSDP's own order, which can (kept for the checker's "
                                     "tests; docs/distributed.md)", choices=("step", "forward"), group=MEASURE)
    pad_multiple: int = opt(64, "pad each target batch's length up to a multiple of this (bounds the number "
                                "of distinct batch shapes; 1 = no rounding)", ge=1)
    drop_long: bool = opt(False, "drop sequences over --max-seq-len (default: truncate)")
    cpu_target_workers: int = opt(1, "CPU runs: target ranks (processes)", ge=1)
    cpu_drafter_replicas: int = opt(1, "CPU runs: drafter ranks (processes; the drafter is sharded over them)", ge=1)
    cpu_dtype: str = opt("float32", "CPU runs: the compute dtype (GPUs always run bfloat16). bfloat16 runs the CPU "
                                    "job as a GPU runs it: the target's forward, the hidden states and the "
                                    "drafter's compute in bf16 over fp32 master weights; several times faster "
                                    "where the CPU has AMX or AVX512-BF16", choices=CPU_DTYPES)
    # ---- torch.distributed (trainer/distributed/groups.py, trainer/distributed/launch.py; one process per GPU) ----
    nnodes: int = opt(1, "nodes in the job (each runs `python -m trainer` with its own --target-gpus/--drafter-gpus)",
                      group=DIST, ge=1)
    node_rank: int = opt(0, "this node's rank (0 = the first drafter's node)", group=DIST, ge=0)
    rdzv_endpoint: str = opt("", "HOST:PORT of the c10d rendezvous (the first node); default on one node: a free "
                                 "local port", group=DIST)
    dist_timeout: float = opt(600.0, "seconds a blocked collective or send waits before the job fails", group=DIST,
                              gt=0)
    stop_timeout: float = opt(840.0, "after SIGTERM, seconds the ranks get to reach a step and checkpoint before "
                                     "SIGKILL; dflash.service passes its TimeoutStopSec minus a margin (role dflash_service)", group=DIST, gt=0)
    check_config: bool = opt(False, "validate everything cheap (flags, files, shard headers), load nothing, exit")
    save_final: bool = opt(True, "checkpoint at the end of the run (the benchmark turns it off)", cli=False)
    # the fields whose flag the command line wrote (parse_args; trainer/config/drafter_choices.py fills the others in)
    # (not compared: two configs that say the same are equal however they were written)
    given: list[str] = field(default_factory=list, compare=False, metadata={"cli": False, "help": ""})

    @property
    def on_cpu(self) -> bool:
        return not self.target_gpus

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------ the command line


def cli_fields(cls: type | None = None) -> list[dataclasses.Field]:
    """The command-line fields of an options dataclass (default: TrainConfig, dflash-train's)."""
    return [f for f in dataclasses.fields(cls or TrainConfig) if f.metadata.get("cli", True)]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _kind(f: dataclasses.Field) -> str:
    """gpus | ints | append | bool | int | float | str (the field's type, as text under postponed annotations;
    append: a repeatable option collected into a list of strings)."""
    if f.metadata.get("kind"):
        return f.metadata["kind"]
    t = str(f.type)
    for k in ("bool", "int", "float"):
        if t == k or t.startswith(k + " "):
            return k
    return "str"


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


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


_METAVARS = {"int": "N", "float": "X", "gpus": "IDS|cpu", "ints": "I,J,..."}
_PARSERS = {"int": int, "float": float, "str": str, "ints": _int_list}


def _range_text(f: dataclasses.Field) -> str:
    md = f.metadata
    parts = [f">= {md['ge']:g}" if md.get("ge") is not None else "",
             f"> {md['gt']:g}" if md.get("gt") is not None else "",
             f"< {md['lt']:g}" if md.get("lt") is not None else ""]
    return " and ".join(p for p in parts if p)


def _help(f: dataclasses.Field) -> str:
    md, bits = f.metadata, [f.metadata.get("help", "").replace("%", "%%")]   # argparse formats help with %
    if md.get("ge") is not None or md.get("gt") is not None or md.get("lt") is not None:
        bits.append(f"[{_range_text(f)}]")
    if md.get("env"):
        bits.append(f"(default ${md['env']}, else %(default)s)" if not _required(f) else "")
    elif not _required(f) and _kind(f) != "bool" and _default(f) not in ("", None, []):
        bits.append("(default %(default)s)")
    return " ".join(b for b in bits if b)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # the caller prints one line naming the flag and exits 2
        raise ConfigError(message)


TRAIN_DESCRIPTION = ("Train a DFlash drafter against a frozen target model. The defaults are the recommended "
                     "recipe (block 16, hard labels, CE + D-PACE; the seed run's was --block-size 32 --gamma 10 "
                     "--use-soft-labels --loss ce).")


def build_parser(prog: str = "dflash-train", cls: type | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    """A command line generated from an options dataclass's fields (default: TrainConfig, dflash-train's):
    every switch has a --no- form, ranges are named in the help, and a parse error raises ConfigError
    (the caller prints one line naming the flag and exits 2)."""
    p = _Parser(prog=prog, description=TRAIN_DESCRIPTION if cls is None and description is None else description)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in cli_fields(cls):
        md = f.metadata
        g = groups.setdefault(md["group"], p.add_argument_group(md["group"]))
        flag, kind = flag_of(f), _kind(f)
        kw: dict[str, Any] = dict(dest=f.name, help=_help(f))
        if kind == "bool":
            if f.name == "check_config":
                g.add_argument(flag, action="store_true", **kw)
                continue
            # --x / --no-x: either can be written, whatever the default
            kw["help"] = kw["help"] + (" (default: on)" if f.default else " (default: off)")
            _hide(f, g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **kw))
            continue
        if kind == "append":   # repeatable; None marks "not given", the field's default applies after
            _hide(f, g.add_argument(flag, action="append", metavar=md.get("metavar") or "PATH", **kw))
            continue
        if kind == "gpus":
            kw["type"] = _gpu_list(flag)
        else:
            kw["type"] = _PARSERS[kind]
        if md.get("choices"):
            kw["choices"] = md["choices"]
        kw["metavar"] = md.get("metavar") or ("|".join(map(str, md["choices"])) if md.get("choices") else None) \
            or _METAVARS.get(kind) or ("PATH" if f.name.endswith(("_dir", "_model", "_file")) else "NAME")
        if _required(f):
            kw["required"] = True
        else:
            # None marks "not given" for env-backed options; the dataclass default applies after
            kw["default"] = None if md.get("env") else _default(f)
        _hide(f, g.add_argument(flag, **kw))
    return p


def is_measurement(f: dataclasses.Field) -> bool:
    """A flag that exists only for A/B measurements (group "measurement"): parsed, not offered."""
    return f.metadata.get("group") == MEASURE


def _hide(f: dataclasses.Field, action: argparse.Action) -> None:
    """A measurement flag is left out of --help (set after add_argument: BooleanOptionalAction appends
    to the help text it is given, which would spoil argparse.SUPPRESS)."""
    if is_measurement(f):
        action.help = argparse.SUPPRESS


def parse_options(cls: type, argv=None, prog: str | None = None, description: str | None = None):
    """``argv`` parsed by :func:`build_parser` into a ``cls`` instance; ConfigError names the flag (an
    environment variable that backs a default too). --help prints and exits 0, as argparse does."""
    ns = build_parser(prog, cls, description).parse_args(argv)
    d = vars(ns)
    for f in cli_fields(cls):
        if _kind(f) == "append" and d.get(f.name) is None:
            d[f.name] = _default(f)
        env = f.metadata.get("env")
        if env and d.get(f.name) is None:
            text = os.environ.get(env, "")
            if text:
                try:
                    d[f.name] = _PARSERS[_kind(f)](text)
                except ValueError:
                    raise ConfigError(f"{env}: expected a {_kind(f)} for {flag_of(f)}, got {text!r}") from None
            else:
                d[f.name] = _default(f)
    return cls(**d)


def parse_args(argv=None, prog: str = "dflash-train") -> TrainConfig:
    """dflash-train's command line -> TrainConfig (status file and log dir defaulting under --output-dir)."""
    cfg = parse_options(TrainConfig, argv, prog, TRAIN_DESCRIPTION)
    cfg.given = given_fields(argv)
    if not cfg.status_file:
        cfg.status_file = str(Path(cfg.output_dir) / "status.json")
    if not cfg.log_dir:
        cfg.log_dir = str(Path(cfg.output_dir) / "logs")
    return cfg


def given_fields(argv=None, cls: type | None = None) -> list[str]:
    """The fields whose flag (or its --no- form) `argv` writes, as --flag, --flag=V or a unique prefix
    (argparse's abbreviations)."""
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {}
    for f in cli_fields(cls):
        flags[flag_of(f)] = f.name
        if _kind(f) == "bool":
            flags["--no-" + flag_of(f)[2:]] = f.name
    out = set()
    for a in argv:
        if not a.startswith("--"):
            continue
        word = a.split("=", 1)[0]
        if word in flags:
            out.add(flags[word])
            continue
        hits = {n for fl, n in flags.items() if fl.startswith(word)}
        if len(hits) == 1:
            out |= hits
    return sorted(out)


def flag_spec() -> dict[str, dict]:
    """The trainer flags as the Ansible role takes them (dflash_service_trainer_flags): key = the
    flag without dashes, with underscores; type as argument_specs spells it; choices where fixed.
    The paths, the GPU lists and --status-file/--log-dir/--wandb-mode have role variables of their
    own; --check-config is the deploy's, not the run's. The measurement flags (:func:`is_measurement`) are
    not offered to the role."""
    own = {"target_model", "data_dir", "output_dir", "target_gpus", "drafter_gpus", "status_file", "log_dir",
           "wandb_mode", "check_config"}
    types = {"bool": "bool", "int": "int", "float": "float", "str": "str", "ints": "list", "gpus": "str"}
    spec = {}
    for f in cli_fields():
        if f.name in own or is_measurement(f):
            continue
        key = flag_of(f)[2:].replace("-", "_")
        s: dict[str, Any] = {"type": types[_kind(f)]}
        if _kind(f) == "ints":
            s["elements"] = "int"
        if f.metadata.get("choices"):
            s["choices"] = list(f.metadata["choices"])
        rng, default = _range_text(f), _default(f)
        s["description"] = (f"{flag_of(f)}: {f.metadata.get('help', '')}" + (f" [{rng}]" if rng else "")
                            + (f" (trainer default {default})" if default not in ("", None, []) else ""))
        spec[key] = s
    return spec


# ------------------------------------------------------------------------------ validation


def check_ranges(cfg) -> None:
    """Every command-line field of an options dataclass instance within its range and choices (the ones
    :func:`opt` declares); ConfigError names the flag. Numbers must be finite."""
    for f in cli_fields(type(cfg)):
        md, v = f.metadata, getattr(cfg, f.name)
        if v is None or isinstance(v, (bool, list, str)):
            if md.get("choices") and v not in md["choices"]:
                raise ConfigError(f"{flag_of(f)}: unknown {v!r} (choose {', '.join(md['choices'])})")
            continue
        ok = ((md.get("ge") is None or v >= md["ge"]) and (md.get("gt") is None or v > md["gt"])
              and (md.get("lt") is None or v < md["lt"]) and not (isinstance(v, float) and not math.isfinite(v)))
        if not ok:
            raise ConfigError(f"{flag_of(f)}: must be {_range_text(f) or 'finite'}, got {v}")


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def validate_flags(cfg: TrainConfig, gpu_count: int | None = None) -> None:
    """The flags alone: ranges, choices, flags that must agree. No file is read. GPU indices are
    checked against ``gpu_count`` devices (None: this machine's CUDA devices; -1: not checked, as on
    the Ansible controller)."""
    # a node of a job over several nodes may hold targets only (docs/distributed.md's 13 + 3 over two
    # nodes: node 1 is eight target GPUs); node 0 keeps a drafter, whose first rank writes status.json
    target_only = cfg.nnodes > 1 and cfg.node_rank > 0 and bool(cfg.target_gpus) and not cfg.drafter_gpus
    if bool(cfg.target_gpus) != bool(cfg.drafter_gpus) and not target_only:
        why = (" (a node other than node rank 0 may leave --drafter-gpus empty: a node of targets only)"
               if cfg.nnodes > 1 and cfg.target_gpus else "")
        raise ConfigError(f"--target-gpus/--drafter-gpus: both must list GPUs, or both be 'cpu'{why}")
    overlap = set(cfg.target_gpus) & set(cfg.drafter_gpus)
    shared = len(cfg.target_gpus) == 1 and cfg.target_gpus == cfg.drafter_gpus
    if overlap and not shared:
        raise ConfigError(f"--drafter-gpus: GPU(s) {sorted(overlap)} are also in --target-gpus (one GPU may hold "
                          "both only when it is the node's only GPU: --target-gpus 0 --drafter-gpus 0)")
    if cfg.target_gpus and gpu_count != -1:
        n = _gpu_count() if gpu_count is None else gpu_count
        missing = [f"{flag}: GPU index(es) {bad} do not exist"
                   for flag, ids in (("--target-gpus", cfg.target_gpus), ("--drafter-gpus", cfg.drafter_gpus))
                   if (bad := [i for i in ids if i >= n])]
        if missing:   # every flag's missing indices, in one line
            raise ConfigError("; ".join(missing) + f" (this machine has {n} CUDA device(s))")
    check_ranges(cfg)
    checks = [
        (cfg.token_budget >= cfg.max_seq_len, "--token-budget",
         f"({cfg.token_budget}) is smaller than --max-seq-len ({cfg.max_seq_len})"),
        (cfg.noise_end <= cfg.noise_start, "--noise-end",
         f"({cfg.noise_end}) is larger than --noise-start ({cfg.noise_start})"),
        (cfg.drafter_chunk_rows >= cfg.block_size, "--drafter-chunk-rows",
         f"({cfg.drafter_chunk_rows}) must hold at least one block (--block-size {cfg.block_size})"),
        (cfg.target_layers is None or len(cfg.target_layers) > 0, "--target-layers", "empty list"),
        (cfg.node_rank < cfg.nnodes, "--node-rank", f"must be in [0, --nnodes), got {cfg.node_rank}"),
        (cfg.nnodes == 1 or ":" in cfg.rdzv_endpoint, "--rdzv-endpoint",
         f"HOST:PORT of the first node is needed with --nnodes {cfg.nnodes}"),
        (cfg.dpace_alpha <= 1, "--dpace-alpha", f"must be in (0, 1], got {cfg.dpace_alpha}"),
        (cfg.loss != "ce+dpace" or not cfg.use_soft_labels, "--loss",
         "ce+dpace is defined on hard labels: add --no-use-soft-labels (or --loss ce to train on soft labels)"
         if "loss" in cfg.given else
         "the default ce+dpace is defined on hard labels: --use-soft-labels needs --loss ce too"),
        (cfg.eval_every == 0 or bool(cfg.eval_data_dir), "--eval-every",
         f"({cfg.eval_every}) needs --eval-data-dir (the held-out shards to evaluate on)"),
    ]
    for ok, flag, why in checks:
        if not ok:
            raise ConfigError(f"{flag}: {why}")
    split_blocks(cfg)   # parses --flex-kernel-options too
    draft_layer_types(cfg.draft_layer_types, cfg.num_draft_layers, None)
    if cfg.fp8 != "off":
        _check_fp8(cfg, gpu_count)
    if cfg.tensorboard_dir:
        import importlib.util
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("--tensorboard-dir: needs the tensorboard package "
                              "(pip install 'dflash-trainer[tensorboard]' or pip install tensorboard)")


def draft_layer_types(text: str, num_layers: int, target_config: dict | None) -> list[str] | None:
    """--draft-layer-types checked and resolved by the target family's rule (families.layer_types_for);
    ConfigError names the flag."""
    from trainer.model.families import layer_types_for
    try:
        return layer_types_for(text, num_layers, target_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def draft_attention(cfg, target_config: dict) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of the draft layers: --draft-heads / --draft-kv-heads /
    --draft-head-dim, each 0 meaning the target's (its text config)."""
    t = target_config.get("text_config", target_config)
    heads = t.get("num_attention_heads") or 1
    own = (heads, t.get("num_key_value_heads") or heads,
           t.get("head_dim") or (t.get("hidden_size") or heads) // heads)
    return tuple(x or o for x, o in zip((cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim), own))


def parse_kernel_options(text: str) -> dict:
    """--flex-kernel-options 'BLOCK_M=64,num_warps=4' -> {'BLOCK_M': 64, 'num_warps': 4} (ints; true/false
    for switches such as PRESCALE_QK). ConfigError names the flag on a malformed item."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or not key.replace("_", "").isalnum() or not key[0].isalpha():
            raise ConfigError(f"--flex-kernel-options: expected KEY=VALUE items, got {item!r}")
        if val.lower() in ("true", "false"):
            out[key] = val.lower() == "true"
        else:
            try:
                out[key] = int(val)
            except ValueError:
                raise ConfigError(f"--flex-kernel-options: {key}: expected an integer or true/false, "
                                  f"got {val!r}") from None
    return out


def split_blocks(cfg) -> int:
    """--flex-kernel-options SPLIT_BLOCKS (ours, not FlexAttention's: the in-block part as a small dense
    attention, without FlexAttention's mask work on its tiles): 0 one FlexAttention over the whole mask,
    1 the context part through FlexAttention and the in-block part apart, merged by log-sum-exp, 2 the same
    with the in-block part and the merge as drafter.BlockMerge. ConfigError names the flag for a value or a
    combination that cannot train right. Read by validate_flags and by drafter_stage.build_drafter."""
    split = parse_kernel_options(cfg.flex_kernel_options).get("SPLIT_BLOCKS", 0)
    if split not in (0, 1, 2):   # True == 1, False == 0
        raise ConfigError(f"--flex-kernel-options: SPLIT_BLOCKS must be true, false, 0, 1 or 2, got {split}")
    if split and getattr(cfg, "flex_ctx_group", 0):
        raise ConfigError("--flex-kernel-options: SPLIT_BLOCKS needs --flex-ctx-group 0")
    # 'auto' compiles the drafter's layers on GPUs (compiling.resolve_compile)
    compiled = cfg.compile in ("all", "drafter") or (cfg.compile == "auto"
                                                      and bool(getattr(cfg, "drafter_gpus", ())))
    if split == 2 and compiled:
        raise ConfigError("--flex-kernel-options: SPLIT_BLOCKS=2 needs --compile none or target: inside compiled "
                          "drafter layers its gradients are wrong on the GPU "
                          "(results/h200-split-attention-parity.json)")
    return int(split)


def _check_fp8(cfg: TrainConfig, gpu_count: int | None) -> None:
    """--fp8 needs torchao, and FP8 tensor cores (compute capability 8.9+) on every drafter GPU."""
    if gpu_count == -1:
        return  # the Ansible controller: the trainer's host checks this
    import importlib.util

    from trainer import allow_optional
    allow_optional("torchao")  # asked for: let it be found (the programs defer it: trainer/optional.py)
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"--fp8 {cfg.fp8}: needs the torchao package "
                          "(pip install 'dflash-trainer[fp8]' or pip install torchao)")
    if not cfg.drafter_gpus:
        return
    try:
        import torch
        caps = {i: (torch.cuda.get_device_capability(i), torch.cuda.get_device_name(i)) for i in cfg.drafter_gpus}
    except Exception:
        return  # no CUDA here: validate_flags has already reported the missing GPUs
    for i, (cap, name) in caps.items():
        if tuple(cap) < (8, 9):
            raise ConfigError(f"--fp8 {cfg.fp8}: drafter GPU {i} ({name}) has compute capability "
                              f"{cap[0]}.{cap[1]}; FP8 GEMMs need 8.9 (Ada, Hopper) or newer")


def ansible_spec_yaml(indent: int = 10) -> str:
    """flag_spec() as the YAML block of argument_specs.yml (JSON strings are YAML strings)."""
    pad, lines = " " * indent, []
    for key, s in flag_spec().items():
        lines.append(f"{pad}{key}:")
        for k in ("type", "elements", "choices", "description"):
            if k not in s:
                continue
            v = s[k]
            if k == "description" and len(v) > 100:  # folded: the lines join with single spaces
                lines.append(f"{pad}  {k}: >-")
                lines += [f"{pad}    {part}" for part in textwrap.wrap(v, 100, break_long_words=False,
                                                                    break_on_hyphens=False)]
            else:
                lines.append(f"{pad}  {k}: " + (json.dumps(v) if k in ("choices", "description") else v))
    return "\n".join(lines) + "\n"
