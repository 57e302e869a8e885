"""A published drafter as the start of a run (--init-drafter): read its directory in any of the peers'
layouts, check its contract against the target and the flags given, and hand its weights over under our
names (docs/contracts.md "Warm start").

Layouts (config.json + *.safetensors; DFlash or DFlash2):
  z-lab        architectures DFlashDraftModel / DFlash2DraftModel, Qwen3 shape keys, block_size,
               num_target_layers, dflash_config {target_layer_ids, mask_token_id, block_size, DFlash2's
               conv_* and selector_*}, layer_types + sliding_window; weights fc, hidden_norm, layers.N.*,
               norm (our exports are this layout)
  SpecForge    the same config (its configs/qwen3.6-27b-dflash*.json); a training checkpoint's weights may
               carry the "draft_model." prefix, and the target's embed_tokens / lm_head beside them
  speculators  speculators_model_type "dflash": transformer_layer_config (the Qwen3 shape),
               aux_hidden_state_layer_ids, mask_token_id, block_size, draft_vocab_size; weights as z-lab's
               plus embed_tokens, lm_head, verifier_lm_head, verifier_norm (the verifier's, refilled) and
               d2t / t2d (a reduced draft vocabulary)

Tap numbering: ours and z-lab's (and NeMo's) target_layer_ids name decoder layers, whose outputs are HF
hidden_states[i + 1]. speculators' aux_hidden_state_layer_ids name hidden_states indices, one higher (its
own converter maps z-lab's i to i + 1), so they are converted here by - 1. A z-lab-layout config whose taps
reach the target's depth counts the other way too, and is refused: nothing says which of its taps is which.

The target's embedding and LM head are never taken from the drafter: the run uses the target's own.
Torch-free except :func:`load_weights`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainer.model.architectures import ARCHITECTURES, architecture, config_keys, for_config

FLAG = "--init-drafter"
# tensors a peer's checkpoint holds that a run takes from the target (or that a full vocabulary needs not)
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                "d2t", "t2d")
PREFIXES = ("draft_model.",)


class PublishedError(ValueError):
    """A drafter that cannot start this run; one line, starting with the flag it is about."""


@dataclass
class Published:
    """A published drafter's contract in our terms, and where its weights are."""
    path: Path
    layout: str                     # z-lab | speculators
    arch: str                       # an --arch (trainer/model/architectures.py)
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    heads: tuple[int, int, int]
    layer_types: list[str]
    sliding_window: int | None
    taps: list[int]                 # our numbering (layer i's output = hidden_states[i + 1])
    num_target_layers: int | None
    mask_token_id: int | None
    block_size: int
    arch_config: dict = field(default_factory=dict)   # the values of the keys its architecture adds
    taps_note: str = ""             # how the taps were read
    files: list[Path] = field(default_factory=list)

    @property
    def source(self) -> str:
        return f"{FLAG} {self.path} ({self.layout} layout)"

    def run_defaults(self) -> dict:
        """The choices a run takes from this drafter where no flag is given (drafter_choices.resolve_run)."""
        out = {"arch": self.arch, "block_size": self.block_size, "num_draft_layers": self.num_layers,
               "heads": self.heads, "layer_types": list(self.layer_types), "taps": list(self.taps)}
        if self.sliding_window is not None and "sliding_attention" in self.layer_types:
            out["sliding_window"] = self.sliding_window
        if self.mask_token_id is not None:
            out["mask_token_id"] = self.mask_token_id
        return out


def read(path: str | Path) -> Published:
    """The drafter in `path`; PublishedError (one line naming the flag) when it is not one we can start from."""
    d = Path(path)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise PublishedError(f"{FLAG}: {d}/config.json: cannot read a drafter config ({e})") from None
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise PublishedError(f"{FLAG}: {d} holds no *.safetensors weights")
    try:
        if cfg.get("speculators_model_type") is not None:
            return _speculators(d, cfg, files)
        return _zlab(d, cfg, files)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, PublishedError):
            raise
        raise PublishedError(f"{FLAG}: {d}/config.json is not a DFlash drafter config ({type(e).__name__}: {e})") \
            from None


def _shape(d: Path, t: dict, layers: int) -> dict:
    heads = int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or int(t["hidden_size"]) // heads)
    types = list(t.get("layer_types") or ["full_attention"] * layers)
    if len(types) != layers or any(x not in ("full_attention", "sliding_attention") for x in types):
        raise PublishedError(f"{FLAG}: {d}/config.json: layer_types {types} are not {layers} of "
                             "full_attention|sliding_attention")
    window = t.get("sliding_window") if "sliding_attention" in types else None
    return dict(hidden_size=int(t["hidden_size"]), intermediate_size=int(t["intermediate_size"]),
                vocab_size=int(t["vocab_size"]), num_layers=layers,
                heads=(heads, int(t.get("num_key_value_heads") or heads), head_dim), layer_types=types,
                sliding_window=int(window) if window else None)


def _zlab(d: Path, cfg: dict, files: list[Path]) -> Published:
    sub = cfg.get("dflash_config") or {}
    archs = cfg.get("architectures") or []
    if not any(a.hf_class in archs for a in ARCHITECTURES.values()) and not sub:
        raise PublishedError(f"{FLAG}: {d}/config.json names neither a DFlash drafter (architectures {archs}) "
                             "nor a dflash_config")
    arch_config = {k: int(sub[k]) for k in config_keys() if sub.get(k) is not None}
    arch = for_config({"architectures": archs, **arch_config}).name
    layers = int(cfg["num_hidden_layers"])
    target_layers = cfg.get("num_target_layers", sub.get("num_target_layers"))
    taps = sub.get("target_layer_ids") or cfg.get("target_layer_ids")
    note = "dflash_config.target_layer_ids: layer i's output, HF hidden_states[i + 1] (z-lab's numbering)"
    if taps is None:
        raise PublishedError(f"{FLAG}: {d}/config.json has no dflash_config.target_layer_ids")
    block = cfg.get("block_size", sub.get("block_size"))
    if block is None:
        raise PublishedError(f"{FLAG}: {d}/config.json has no block_size")
    return Published(d, "z-lab", arch, **_shape(d, cfg, layers), taps=[int(t) for t in taps],
                     num_target_layers=int(target_layers) if target_layers is not None else None,
                     mask_token_id=sub.get("mask_token_id", cfg.get("mask_token_id")), block_size=int(block),
                     arch_config=arch_config, taps_note=note, files=files)


def _speculators(d: Path, cfg: dict, files: list[Path]) -> Published:
    if cfg["speculators_model_type"] != "dflash":
        raise PublishedError(f"{FLAG}: {d} is a speculators {cfg['speculators_model_type']!r} drafter, not dflash")
    t = cfg["transformer_layer_config"]
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux:
        raise PublishedError(f"{FLAG}: {d}/config.json has no aux_hidden_state_layer_ids")
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(t["vocab_size"]):
        raise PublishedError(f"{FLAG}: {d} drafts over a reduced vocabulary (draft_vocab_size {draft_vocab} of "
                             f"{t['vocab_size']}, d2t/t2d); this trainer drafts over the target's whole vocabulary")
    taps = [int(a) - 1 for a in aux]
    note = (f"speculators' aux_hidden_state_layer_ids {list(aux)} are HF hidden_states indices: taps {taps} in "
            "z-lab's numbering")
    return Published(d, "speculators", "dflash", **_shape(d, t, int(t["num_hidden_layers"])), taps=taps,
                     num_target_layers=None, mask_token_id=cfg.get("mask_token_id"),
                     block_size=int(cfg["block_size"]), taps_note=note, files=files)


# ------------------------------------------------------------------------------ the contract check


def check(pub: Published, cfg, target_config: dict) -> list[str]:
    """The drafter against the target and this run's resolved choices (drafter_choices.resolve_run has filled in
    the drafter's own where no flag was given). Raises PublishedError, one line naming the flag and both
    values, for what its weights cannot survive; returns what a flag given on purpose changed where the
    weights still fit (the caller logs them)."""
    from trainer.model.contract import DRAFT_LAYER_TYPES
    text = target_config.get("text_config") or target_config
    L = text.get("num_hidden_layers")
    where = f"{pub.path}"

    def refuse(flag: str, what: str, run, theirs):
        raise PublishedError(f"{flag}: {what}: this run's {run}, the drafter's {theirs} ({FLAG} {where}; its "
                             "weights do not fit)")

    for what, ours, theirs in (("hidden size", text.get("hidden_size"), pub.hidden_size),
                               ("vocabulary", text.get("vocab_size"), pub.vocab_size),
                               ("MLP width", text.get("intermediate_size"), pub.intermediate_size)):
        if ours is not None and int(ours) != theirs:
            refuse("--target-model", f"the target's {what}", ours, theirs)
    if pub.num_target_layers is not None and L is not None and pub.num_target_layers != L:
        refuse("--target-model", "the target's depth", f"{L} layers", f"{pub.num_target_layers} (num_target_layers)")
    if L is not None and any(not 0 <= t < L for t in pub.taps):
        raise PublishedError(f"{FLAG}: the drafter's taps {pub.taps} reach past the target's {L} layers: they "
                             f"count HF hidden_states indices, not layers ({pub.taps_note}); nothing says which "
                             f"is which: give --target-layers in layer numbering on purpose, or convert its "
                             f"config ({where})")
    if cfg.arch != pub.arch:
        refuse("--arch", "architecture", cfg.arch, pub.arch)
    if cfg.num_draft_layers != pub.num_layers:
        refuse("--num-draft-layers", "draft layer count", cfg.num_draft_layers, pub.num_layers)
    heads = (cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim)
    if heads != pub.heads:
        refuse("--draft-heads", "draft attention (query heads, kv heads, head dim)", heads, pub.heads)
    taps = list(cfg.target_layers or [])
    if len(taps) != len(pub.taps):
        refuse("--target-layers", "taps", taps, pub.taps)
    ours_keys = architecture(pub.arch).config_keys   # the run builds them at its architecture's defaults
    for k, v in pub.arch_config.items():
        if ours_keys.get(k) != v:
            refuse(FLAG, k, ours_keys.get(k), v)
    changed = []
    names = {v: k for k, v in DRAFT_LAYER_TYPES.items()}
    types = [DRAFT_LAYER_TYPES[t] for t in cfg.draft_layer_types.split(",")]
    for flag, ours, theirs in (("--target-layers", taps, pub.taps),
                               ("--mask-token-id", cfg.mask_token_id, pub.mask_token_id),
                               ("--block-size", cfg.block_size, pub.block_size),
                               ("--draft-layer-types", ",".join(names[t] for t in types),
                                ",".join(names[t] for t in pub.layer_types)),
                               ("--sliding-window", cfg.sliding_window if "sliding_attention" in types else None,
                                pub.sliding_window)):
        if theirs is not None and ours != theirs:
            changed.append(f"{flag} {ours} given on purpose: the drafter was trained with {theirs}")
    vocab = text.get("vocab_size")
    if vocab is not None and cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < int(vocab):
        raise PublishedError(f"{FLAG}: the drafter's MASK token {cfg.mask_token_id} is outside the target's "
                             f"vocabulary of {vocab} ({where}; give --mask-token-id)")
    return changed


# ------------------------------------------------------------------------------ the weights


def load_weights(pub: Published, expected: dict) -> dict:
    """The drafter's tensors under our names, fp32 on the CPU, exactly `expected`'s names and shapes
    (name -> shape: the run's drafter). The target's own tensors are dropped. PublishedError names what
    does not fit."""
    import torch
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for f in pub.files:
        for k, t in load_file(str(f), device="cpu").items():
            for p in PREFIXES:
                if k.startswith(p):
                    k = k[len(p):]
            if k in TARGET_OWNED:
                continue
            out[k] = t.float()
    missing = sorted(set(expected) - set(out))
    extra = sorted(set(out) - set(expected))
    wrong = sorted(k for k in set(out) & set(expected) if tuple(out[k].shape) != tuple(expected[k]))
    if missing or extra or wrong:
        bits = [f"missing {missing[:4]}" if missing else "", f"unexpected {extra[:4]}" if extra else "",
                "shapes " + ", ".join(f"{k} {tuple(out[k].shape)} (this run: {tuple(expected[k])})"
                                      for k in wrong[:3]) if wrong else ""]
        raise PublishedError(f"{FLAG}: {pub.path}'s weights do not fit this run's drafter: "
                             + "; ".join(b for b in bits if b))
    return out
