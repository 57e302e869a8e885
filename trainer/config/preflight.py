"""Preflight: the cheap checks of a run's files before anything loads (`--check-config`, and every start).

Validation reads only small files (config.json, safetensors headers, the tokenizer, the data index)
and hashes the data shards (a shard corrupted in place); it never imports a model, so a bad flag or a
broken shard fails with exit code 2 before anything loads. With checkpoints in --output-dir it also
checks that the target is the one they were trained on (trainer/model/identity.py). A bad shard found by
the supervisor before any rank starts goes into status.json (:func:`_record_start_failure`).

The flags alone are trainer/config/options.py's (:func:`~trainer.config.options.validate_flags`); :func:`validate`
runs those first.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from trainer.config.options import (
    ConfigError,
    TrainConfig,
    draft_attention,
    draft_layer_types,
    validate_flags,
)
from trainer.model.contract import DRAFT_LAYER_TYPES
from trainer.model.families import family_for, slow_linear_attention_message


def check_linear_attention_kernels(cfg, target_config: dict) -> None:
    """A hybrid target (Gated DeltaNet layers) on GPUs needs its family's required kernel packages
    (flash-linear-attention: trainer/model/families.py): without them transformers runs its torch fallback,
    slower, and out of GPU memory where every hidden state is kept. Cheap: the package is looked
    up, not imported (the target rank checks what transformers
    really resolved when it loads the model: trainer/model/target.py)."""
    family = family_for(target_config)
    if not cfg.target_gpus or cfg.allow_slow_linear_attention or not family.linear_attention:
        return
    import importlib.util
    missing = [pip for module, (pip, _, required) in family.linear_kernels.items()
               if required and importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(slow_linear_attention_message(cfg.target_model, missing))


def validate(cfg: TrainConfig, gpu_count: int | None = None, read_shards: bool | None = None) -> dict:
    """Cheap checks of every flag and file. Returns facts learnt (target config, data index, the target's
    identity). read_shards: hash every data shard against the index (None: unless this process is a
    launched rank, which verifies each shard as it loads it; so --check-config and the supervisor catch a
    corrupt shard before any rank starts). With checkpoints in --output-dir, the target must be the one
    the newest was trained on (:func:`check_resume_target`)."""
    validate_flags(cfg, gpu_count)

    facts = {"target_config": check_model_dir(cfg.target_model)}
    tcfg = facts["target_config"]
    if gpu_count != -1:   # the Ansible controller (-1) has not the trainer's packages: the host checks this
        check_linear_attention_kernels(cfg, tcfg)
        if cfg.eval_data_dir:   # the in-training and final tau generate with the target (families.check_hybrid_transformers)
            from trainer.model.families import HybridTransformersTooOld, check_hybrid_transformers
            try:
                check_hybrid_transformers(tcfg, f"--target-model {cfg.target_model}")
            except HybridTransformersTooOld as e:
                raise ConfigError(f"--eval-data-dir: {e}") from None
    text = tcfg.get("text_config", tcfg)
    layers = text.get("num_hidden_layers")
    if cfg.target_layers is not None:
        bad = [i for i in cfg.target_layers if layers is not None and not 0 <= i < layers]
        if bad:
            raise ConfigError(f"--target-layers: {bad} outside the target's {layers} layers")
    elif layers is not None and layers < 2:
        raise ConfigError(f"--target-model: {cfg.target_model}/config.json has {layers} layer(s); need >= 2")

    from trainer.config import drafter_choices
    from trainer.model import published
    try:   # the choices the flags leave open, filled in once (a warm start's drafter, else the family's
        # contract; the run log names each source), then a warm start's drafter checked against them
        pub = published.read(cfg.init_drafter) if cfg.init_drafter else None
        drafter_choices.log_choices(drafter_choices.resolve_run(cfg, tcfg, pub.run_defaults() if pub else None,
                                                                pub.source if pub else ""))
        if pub is not None:
            import logging
            wlog = logging.getLogger("trainer.contract")
            wlog.info("%s: %s", pub.source, pub.taps_note)
            for line in published.check(pub, cfg, tcfg):
                wlog.warning("%s: %s", published.FLAG, line)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    heads, kv_heads, head_dim = draft_attention(cfg, tcfg)
    if heads % kv_heads or head_dim % 2:
        raise ConfigError(f"--draft-kv-heads: {kv_heads} must divide the draft layers' {heads} query heads, and "
                          f"their head dim ({head_dim}) be even (--draft-heads, --draft-head-dim)")
    if draft_layer_types(cfg.draft_layer_types, cfg.num_draft_layers, tcfg) and cfg.sliding_window < cfg.block_size:
        raise ConfigError(f"--sliding-window: ({cfg.sliding_window}) must hold a block (--block-size "
                          f"{cfg.block_size}) for the sliding draft layers")

    from trainer.model import identity
    try:
        facts["target"] = target = identity.for_run(cfg.target_model, cfg.num_draft_layers, cfg.target_layers,
                                                     cfg.mask_token_id)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--target-model: {cfg.target_model}: cannot read its identity ({e})") from None

    if read_shards is None:
        from trainer.distributed.topology import in_launched_rank
        read_shards = not in_launched_rank()
    for flag, d in (("--data-dir", cfg.data_dir), ("--eval-data-dir", cfg.eval_data_dir)):
        if not d:
            continue
        try:
            index = check_data(flag, d, read_shards)
        except ConfigError as e:
            if read_shards and not cfg.check_config:   # the supervisor, before any rank: say why in status.json
                _record_start_failure(cfg, str(e))
            raise
        if flag == "--data-dir":
            facts["data_index"] = index
        try:
            identity.check_data_tokenizer(index, target, flag, d)
        except identity.TargetMismatch as e:
            raise ConfigError(str(e)) from None

    for flag, value in (("--output-dir", cfg.output_dir), ("--log-dir", cfg.log_dir),
                        ("--status-file", str(Path(cfg.status_file).parent) if cfg.status_file else ""),
                        ("--tensorboard-dir", cfg.tensorboard_dir)):
        if value:
            check_writable_dir(flag, Path(value))
    out = Path(cfg.output_dir)
    if not cfg.resume and out.is_dir() and any(out.glob("step-*")):
        raise ConfigError(f"--no-resume: {out} already holds checkpoints; refusing to overwrite them "
                          "(choose another --output-dir or drop --no-resume)")
    if cfg.resume and out.is_dir() and any(out.glob("step-*")):
        facts["target_changes"] = check_resume_target(cfg, target)
        check_resume_layers(cfg, tcfg)
        check_resume_keeps(cfg)
    return facts


def check_resume_layers(cfg: TrainConfig, target_config: dict) -> None:
    """The drafter a run resumes keeps its attention: the draft layers' types and window this run resolves
    (--draft-layer-types, --sliding-window) must be the newest checkpoint's. ConfigError names the flag."""
    from trainer.model.checkpoint_format import CheckpointManager
    latest = CheckpointManager(cfg.output_dir).latest()
    if latest is None:
        return
    try:
        old = json.loads((latest / "config.json").read_text())
    except (OSError, ValueError):
        return   # an unreadable checkpoint config is the resume's own error to report
    if old.get("num_hidden_layers") != cfg.num_draft_layers:
        return   # a changed depth is check_resume_target's (and the load's) to report
    want_attn = draft_attention(cfg, target_config)
    have_attn = tuple(old.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    if None not in have_attn and want_attn != have_attn:
        raise ConfigError(f"--draft-heads: this run's draft layers have {want_attn[0]} query heads, {want_attn[1]} "
                          f"kv heads of dim {want_attn[2]}, the checkpoint's {have_attn[0]}, {have_attn[1]} of dim "
                          f"{have_attn[2]} (resuming {latest}; give --draft-heads {have_attn[0]} --draft-kv-heads "
                          f"{have_attn[1]} --draft-head-dim {have_attn[2]})", leave_output=True)
    names = {v: k for k, v in DRAFT_LAYER_TYPES.items()}
    want = draft_layer_types(cfg.draft_layer_types, cfg.num_draft_layers, target_config)
    have = old.get("layer_types") if "sliding_attention" in (old.get("layer_types") or ()) else None
    show = lambda t: ",".join(names[x] for x in t) if t else ",".join(["full"] * cfg.num_draft_layers)  # noqa: E731
    if want != have:
        raise ConfigError(f"--draft-layer-types: this run's draft layers are {show(want)}, the checkpoint's "
                          f"{show(have)} (resuming {latest}; give --draft-layer-types {show(have)})",
                          leave_output=True)
    if have and old.get("sliding_window") != cfg.sliding_window:
        raise ConfigError(f"--sliding-window: {cfg.sliding_window}, the checkpoint's sliding layers were trained "
                          f"with {old.get('sliding_window')} (resuming {latest})", leave_output=True)


def check_resume_keeps(cfg: TrainConfig) -> None:
    """Block size, --arch and --loss are the newest checkpoint's (trainer/model/checkpoint_format.py's
    check_resume_keeps); ConfigError names the flag, leaving the output dir as it is."""
    from trainer.model.checkpoint_format import CheckpointManager, ResumeChanged
    from trainer.model.checkpoint_format import check_resume_keeps as keeps
    latest = CheckpointManager(cfg.output_dir).latest()
    if latest is not None:
        try:
            keeps(cfg, latest)
        except ResumeChanged as e:
            raise ConfigError(str(e), leave_output=True) from None


def check_data(flag: str, data_dir: str, read_shards: bool) -> dict:
    """The data index and its shards (present, non-empty; with read_shards, each one's sha256 is the
    index's: a shard corrupted in place, of the right size, is found before a run starts)."""
    from trainer.data.dataset import DataError, check_data_dir, sha256_file
    try:
        index = check_data_dir(data_dir)
        for s in index["shards"] if read_shards else ():
            p = Path(data_dir) / s["file"]
            digest = sha256_file(p)
            if digest != s["sha256"]:
                raise DataError(f"{p}: sha256 mismatch (index says {s['sha256'][:12]}..., file is {digest[:12]}...; "
                                "the shard is corrupt: re-copy or re-prepare it)")
    except DataError as e:
        raise ConfigError(f"{flag}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{flag}: {data_dir}: cannot read a shard: {e}") from None
    return index


def _record_start_failure(cfg: TrainConfig, error: str) -> None:
    """A bad shard found before any rank starts goes into status.json as a rank would put it (phase
    failed, the error), so dflash-status and the deploy's health handler say why the unit failed.
    Best effort: the stderr line is the report."""
    from trainer.status import record_failure
    record_failure(cfg.status_file or str(Path(cfg.output_dir) / "status.json"), error)


def check_resume_target(cfg: TrainConfig, target) -> list[str]:
    """A run that resumes continues the drafter of the newest checkpoint in --output-dir: the target (its
    shape, tokenizer and config) and the taps and mask token this run resolves must be the ones that
    checkpoint was trained with. Raises ConfigError naming what differs; with --allow-target-change the
    differences a drafter's weights survive are logged (the run log says the run continues on a new
    target) and returned. Imports torch only here, where checkpoints exist (trainer/engine/checkpoint.py owns
    what a complete checkpoint is)."""
    import logging

    from trainer.model import identity
    from trainer.model.checkpoint_format import CheckpointManager
    latest = CheckpointManager(cfg.output_dir).latest()
    if latest is None:
        return []
    trained, _ = identity.recorded(latest)
    try:
        allowed = identity.check(trained, target, flag="--target-model", what="the checkpoint",
                                 allow=cfg.allow_target_change, where=f"resuming {latest}")
    except identity.TargetMismatch as e:
        raise ConfigError(str(e), leave_output=True) from None
    if allowed:
        logging.getLogger("trainer.identity").warning(
            "%s: resuming %s on a different target (%s); from now on its checkpoints record the new target: %s",
            identity.ALLOW_FLAG, latest, target.describe(), "; ".join(allowed))
    return allowed


def check_writable_dir(flag: str, d: Path) -> None:
    """``d`` is a directory we can write, or can be created: its nearest existing ancestor is a
    writable directory (a regular file on the way would fail the mkdir with NotADirectoryError)."""
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{flag}: {d} exists and is not a directory")
    p = d.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"{flag}: cannot create {d}: {p} is a file, not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: {p} is not writable")


# ------------------------------------------------------------------------------ the target's files

# bytes per element of the dtypes safetensors writes
_ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                   "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
                   "C64": 8}
_ST_MAX_HEADER = 100 * 1024 * 1024   # safetensors' own limit


def check_safetensors_header(path: str | os.PathLike, expect_tensors=()) -> dict:
    """Read one safetensors file's header (8 bytes + JSON; cheap however large the file) and check
    that the file holds every byte it promises: a truncated or corrupt shard is found here, before a
    load. Raises ConfigError naming the file; returns the header."""
    path = Path(path)
    name = f"--target-model: {path}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ConfigError(f"{name}: {size} bytes, too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(_ST_MAX_HEADER, size - 8):
                raise ConfigError(f"{name}: not a safetensors file or truncated (header of {n} bytes, "
                                  f"file of {size})")
            raw = fh.read(n)
    except OSError as e:
        raise ConfigError(f"{name}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{name}: corrupt safetensors header ({e})") from None
    data_len, end = size - 8 - n, 0
    for tname, t in header.items():
        if tname == "__metadata__":
            continue
        try:
            b, e = (int(x) for x in t["data_offsets"])
            numel = math.prod(int(d) for d in t["shape"])
            nbytes = numel * _ST_DTYPE_BYTES.get(t["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{name}: corrupt safetensors header (entry {tname!r})") from None
        if not 0 <= b <= e or (t["dtype"] in _ST_DTYPE_BYTES and e - b != nbytes):
            raise ConfigError(f"{name}: corrupt safetensors header (tensor {tname!r} spans {b}..{e})")
        end = max(end, e)
    if end > data_len:
        raise ConfigError(f"{name}: truncated: its tensors need {end} bytes of data, the file holds {data_len} "
                          f"(re-copy the weights)")
    if end < data_len:
        raise ConfigError(f"{name}: corrupt: {data_len - end} bytes after the last tensor")
    missing = [t for t in expect_tensors if t not in header]
    if missing:
        raise ConfigError(f"{name}: lacks {len(missing)} tensor(s) the index puts there, e.g. {missing[0]!r}")
    return header


def check_target_shards(model_dir: str | os.PathLike) -> None:
    """Every weight file of the target (model.safetensors, or each shard the index lists) is present
    and its header is whole. Raises ConfigError naming the file. The trainer calls it when loading
    the target fails, so that failure names the shard too (exit 2: a restart will not fix it)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--target-model: {index} is unreadable ({e})") from None
        by_shard: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(tensor)
        for shard in sorted(by_shard):
            if not (d / shard).is_file():
                raise ConfigError(f"--target-model: shard {d / shard} listed in {index.name} is missing")
        for shard in sorted(by_shard):
            check_safetensors_header(d / shard, by_shard[shard])
    elif (d / "model.safetensors").is_file():
        check_safetensors_header(d / "model.safetensors")
    else:
        raise ConfigError(f"--target-model: {d} has neither model.safetensors nor model.safetensors.index.json")


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
    check_target_shards(d)
    return config


def main_check(cfg: TrainConfig) -> int:
    facts = validate(cfg)
    idx = facts.get("data_index") or {}
    print(f"config ok: target {cfg.target_model}, data {cfg.data_dir} "
          f"({idx.get('num_sequences', '?')} sequences), output {cfg.output_dir}")
    return 0
