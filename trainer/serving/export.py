"""dflash-export: a checkpoint -> a model directory that serving engines and `AutoModel` load.

    dflash-export CHECKPOINT_OR_OUTPUT_DIR OUT [--target-model DIR] [--force]

CHECKPOINT_OR_OUTPUT_DIR is a `step-XXXXXXXX` directory or a run's output dir (its newest complete
checkpoint is taken). OUT receives only the model (no optimizer or training state):

    model.safetensors   drafter weights in bf16 (names: fc, hidden_norm, layers.N..., norm)
    config.json         one config every loader we target reads (docs/serving.md lists the keys)
    modeling_dflash.py  the model class that config.json's auto_map names

OUT is written beside itself and renamed into place, so a directory named OUT is complete.
With --target-model the export is checked against the target the drafter was trained on (trainer/model/identity.py:
depth, width, vocabulary, tokenizer, config; exit 2 naming what differs, OUT untouched) and the mask
token's text is recorded (SGLang compares it with its tokenizer). export.json records that identity.
Exports are world-readable (files 0644, the directory 0755); checkpoints are not (model.safetensors 0600).
"""

from __future__ import annotations

if __name__ == "__main__":   # run as a program (python -m): torchao only when asked for (trainer/optional.py)
    from trainer.optional import defer
    defer()

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch

from trainer.model import modeling_dflash
from trainer.model.architectures import config_keys, for_config
from trainer.model.checkpoint_format import CONFIG_FILE, MODEL_FILE, STEP_DIR_RE, CheckpointManager
from trainer.model.drafter import DFlashConfig

PROG = "dflash-export"
EXPORT_DTYPE = torch.bfloat16


class ExportError(RuntimeError):
    """The source is not a usable checkpoint, or the export does not fit the target."""


# ------------------------------------------------------------------------------- reading


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step-* dir, an export dir (both hold config.json + model.safetensors), or an output dir
    (-> its newest complete checkpoint)."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file() and (p / MODEL_FILE).is_file():
        return p
    if not p.is_dir():
        raise ExportError(f"{p}: no such directory")
    latest = CheckpointManager(p).latest()
    if latest is None:
        raise ExportError(f"{p}: neither a checkpoint ({CONFIG_FILE} + {MODEL_FILE}) nor an output dir "
                          f"with a complete step-* checkpoint")
    return latest


def drafter_config_from_json(d: dict) -> DFlashConfig:
    """DFlashConfig from either layout: the trainer's checkpoint config.json (DFlashConfig.to_dict())
    or an export's HF config.json (taps, mask id under dflash_config; num_target_layers)."""
    sub = d.get("dflash_config") or {}
    flat = dict(d)
    for key in ("target_layer_ids", "mask_token_id", "block_size", *config_keys()):
        if key not in flat and key in sub:
            flat[key] = sub[key]
    if "target_num_hidden_layers" not in flat:
        flat["target_num_hidden_layers"] = sub.get("num_target_layers", d.get("num_target_layers"))
    rope = d.get("rope_parameters") or {}
    if "rope_theta" not in flat or flat["rope_theta"] is None:
        flat["rope_theta"] = rope.get("rope_theta")
    if "rope_scaling" not in flat and rope.get("rope_type", "default") != "default":
        flat["rope_scaling"] = rope
    required = [f.name for f in dataclasses.fields(DFlashConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if flat.get(k) is None]
    if missing:
        raise ExportError(f"drafter config lacks {', '.join(missing)}")
    flat["architectures"] = [for_config(flat).hf_class]
    flat["model_type"] = "qwen3"
    if "sliding_attention" not in (flat.get("layer_types") or ()):   # an export's all-full list: the default
        flat["layer_types"], flat["sliding_window"] = None, None
    return DFlashConfig.from_dict(flat)


def read_checkpoint(path: str | os.PathLike) -> tuple[DFlashConfig, dict[str, torch.Tensor], Path]:
    """(config, weights as stored, the directory read) of a checkpoint, output dir or export."""
    src = resolve_checkpoint(path)
    try:
        cfg = drafter_config_from_json(json.loads((src / CONFIG_FILE).read_text()))
        state = safetensors.torch.load_file(str(src / MODEL_FILE), device="cpu")
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ExportError(f"{src}: cannot read the drafter: {e}") from e
    return cfg, state, src


# ------------------------------------------------------------------------------- the HF config


def hf_config_dict(cfg: DFlashConfig, dtype: torch.dtype = EXPORT_DTYPE, mask_token: str | None = None) -> dict:
    """The export's config.json. Keys, and who reads them (docs/serving.md has the details):
    - architectures, model_type, Qwen3 shape keys, rms_norm_eps, rope: every loader (vLLM maps the
      architecture DFlashDraftModel to qwen3_dflash; SGLang's DFlashDraftModel is its EntryClass);
    - num_target_layers (top level): the reference class and SpecForge (AttributeError without it);
      also under dflash_config, where SGLang looks first;
    - dflash_config.{target_layer_ids, mask_token_id, block_size}: reference, SGLang, vLLM;
    - block_size (top level): the reference class reads config.block_size;
    - layer_types, one per draft layer, and sliding_window: SGLang and vLLM build a "full_attention" layer
      as non-causal attention over every context and block row, a "sliding_attention" layer as causal
      attention over the last sliding_window positions (SGLang: window_left = sliding_window - 1;
      vLLM: per-layer sliding window, causal; mixed layers need its V2 model runner). That is what
      training ran (trainer/model/drafter.py); use_sliding_window says whether any layer slides;
    - eagle_aux_hidden_state_layer_ids = taps + 1: vLLM's capture points ("before layer i"), the form
      speculators writes for DFlash too; vLLM versions before the dflash_config fallback read only it;
    - architectures: the drafter architecture's class name (trainer/model/architectures.py: DFlashDraftModel,
      DFlash2DraftModel), and the keys it adds under dflash_config (DFlash2's conv_* and selector_*), where
      the reference class, SGLang and vLLM read them;
    - dtype / torch_dtype: `dtype="auto"` loads bf16 weights as bf16;
    - auto_map, where the architecture ships its AutoModel code (DFlash's): AutoModel(trust_remote_code=True)
      builds modeling_dflash.DFlashDraftModel."""
    theta = float(cfg.rope_theta)
    scaling = {k: v for k, v in (cfg.rope_scaling or {}).items() if k != "rope_theta"} or None
    rope_parameters = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    dtype_name = str(dtype).replace("torch.", "")
    layers = cfg.num_hidden_layers
    layer_types = list(cfg.layer_types or ["full_attention"] * layers)
    sliding = "sliding_attention" in layer_types
    dflash = {"block_size": cfg.block_size, "target_layer_ids": list(cfg.target_layer_ids),
              "mask_token_id": cfg.mask_token_id, "num_target_layers": cfg.target_num_hidden_layers}
    if mask_token:
        dflash["mask_token"] = mask_token
    entry = cfg.architecture
    dflash.update({k: int(getattr(cfg, k)) for k in entry.config_keys})
    arch = {"architectures": [entry.hf_class]}
    if entry.auto_map:
        arch["auto_map"] = {"AutoModel": entry.auto_map}
    return {
        **arch,
        "model_type": "qwen3",
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "layer_types": layer_types,
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
        "max_window_layers": layers,
        "tie_word_embeddings": False,
        "use_cache": True,
        "num_target_layers": cfg.target_num_hidden_layers,
        "block_size": cfg.block_size,
        "dflash_config": dflash,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
    }


def check_config(cfg: DFlashConfig, target_config: dict | None = None) -> None:
    """Raise ExportError when the config cannot serve: a tap outside the target, a mask id outside the
    vocabulary, a target whose shape differs from the drafter's."""
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < cfg.target_num_hidden_layers]
    if bad:
        raise ExportError(f"taps {bad} are outside the target's {cfg.target_num_hidden_layers} layers")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ExportError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if cfg.block_size < 2:
        raise ExportError(f"block_size {cfg.block_size} < 2")
    if target_config is not None:
        t = target_config.get("text_config") or target_config
        for ours, theirs in (("target_num_hidden_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                             ("vocab_size", "vocab_size")):
            if t.get(theirs) is not None and int(t[theirs]) != int(getattr(cfg, ours)):
                raise ExportError(f"the target's {theirs} is {t[theirs]}, the drafter's {ours} "
                                  f"{getattr(cfg, ours)}")


def expected_weight_names(cfg: DFlashConfig) -> set[str]:
    from trainer.model.drafter import DFlashDrafter
    with torch.device("meta"):
        return set(DFlashDrafter(cfg).state_dict())


def check_weights(cfg: DFlashConfig, state: dict[str, torch.Tensor]) -> None:
    """Strict: the stored names are exactly the drafter's (a mismatch is an error, never skipped)."""
    want = expected_weight_names(cfg)
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise ExportError(f"weights do not match the drafter: missing {missing[:8]}"
                          f"{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}"
                          f"{'...' if len(extra) > 8 else ''}")


# ------------------------------------------------------------------------------- writing


def _mask_token_text(target_model: str, mask_id: int) -> str | None:
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target_model, local_files_only=True)
    except Exception:  # noqa: BLE001 - a target without a tokenizer still exports
        return None
    text = tok.convert_ids_to_tokens(mask_id) if mask_id < len(tok) else None
    return text or None


def export_drafter(src: str | os.PathLike, out: str | os.PathLike, target_model: str | None = None,
                   force: bool = False, allow_target_change: bool = False) -> Path:
    """Write the servable model directory OUT from a checkpoint, output dir or earlier export. With
    `target_model`, the target must be the one the drafter was trained on (trainer/model/identity.py; ExportError
    naming what differs, before OUT is touched) unless `allow_target_change` and the weights still fit.
    Every file is written 0644 and OUT 0755: a serving engine running as another user reads it."""
    from trainer.model import identity
    cfg, state, ckpt = read_checkpoint(src)
    target_config = None
    mask_token = None
    trained, _ = identity.recorded(ckpt)
    if target_model:
        try:
            target_config = json.loads((Path(target_model) / "config.json").read_text())
            identity.check_drafter_on_target(ckpt, target_model, allow=allow_target_change)
        except identity.TargetMismatch as e:
            raise ExportError(str(e)) from None
        except (OSError, ValueError) as e:
            raise ExportError(f"--target-model: {target_model}/config.json: {e}") from e
        mask_token = _mask_token_text(target_model, cfg.mask_token_id)
    check_config(cfg, target_config)
    check_weights(cfg, state)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ExportError(f"{out} exists and is not empty (use --force to replace it)")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {n: t.detach().to(EXPORT_DTYPE).contiguous() for n, t in sorted(state.items())}
        safetensors.torch.save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config_dict(cfg, EXPORT_DTYPE, mask_token), indent=2) + "\n")
        if cfg.architecture.auto_map:   # the AutoModel class config.json's auto_map names
            code = f"{cfg.architecture.auto_map.split('.')[0]}.py"
            shutil.copyfile(Path(modeling_dflash.__file__).with_name(code), tmp / code)
        step = STEP_DIR_RE.match(ckpt.name)
        (tmp / "export.json").write_text(json.dumps(
            {"source": str(ckpt.resolve()), "step": int(step.group(1)) if step else None,
             "dtype": str(EXPORT_DTYPE).replace("torch.", ""), identity.RECORD_KEY: trained.to_dict()},
            indent=2) + "\n")
        for f in tmp.iterdir():   # safetensors writes 0600; an export is for a serving user
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a step-* checkpoint dir, or an output dir (newest checkpoint)")
    ap.add_argument("out", help="the model directory to write")
    ap.add_argument("--target-model", help="check the export against this target; record the mask token text")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    ap.add_argument("--allow-target-change", action="store_true",
                    help="export for a --target-model other than the one the drafter was trained on (e.g. a "
                         "fine-tuned revision) where its weights still fit")
    a = ap.parse_args(argv)
    try:
        out = export_drafter(a.source, a.out, a.target_model, a.force, a.allow_target_change)
    except ExportError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((out / CONFIG_FILE).read_text())
    print(f"{PROG}: wrote {out} ({cfg['num_hidden_layers']} layers, block {cfg['block_size']}, taps "
          f"{cfg['dflash_config']['target_layer_ids']} of {cfg['num_target_layers']}, {cfg['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
