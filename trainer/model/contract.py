"""The published drafter contract of a target family: one table, keyed by the target's model_type. A run's
drafter choices (MASK token, heads, layer types, window, taps) are resolved against it, with the source of
each, in the config wing (trainer/config/drafter_choices.py; docs/contracts.md "Drafter contract").

A drafter trained for a family that has published drafters should keep their contract: the serving stacks
and the users' warm starts (--init-drafter) expect the MASK id, the attention shape and the taps those
drafters use. ``--draft-contract auto`` (the default) makes the family's contract the default of every
choice the user leaves open; ``none`` keeps the generic rules. The seeds' recipe keeps its own block size
and anchors: a contract's block size is recorded, never imposed (a warm start takes the drafter's).

Sources (the drafters' config.json on their model cards, mirrored in SpecForge
configs/qwen3.6-27b-dflash*.json, configs/qwen3.5-4b-dflash.json and NeMo AutoModel's
qwen3_8_27b_dflash2.yaml):
  qwen3_5  z-lab/Qwen3.6-27B-DFlash: 32 q / 8 kv heads x 128 (for targets of width 2,048 and up), [S, S, S, S, F] window 2048, taps by the
           rule ([1, 16, 31, 46, 61] of 64), MASK 248070, block 16; the Qwen3.8-27B DFlash2: the same
           heads, every layer sliding (2048), taps [5, 19, 33, 47, 61] of 64, block 8. Qwen3.5-4B's and
           35B-A3B's drafters keep MASK 248070 and 32 heads of 128 too.
  qwen3    z-lab/Qwen3-8B-DFlash-b16: MASK 151669 (the first row past the tokenizer's 151,669 tokens).

Standard library only (preflight and the Ansible controller's flag check import it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.model.hybrid import is_hybrid

SLIDING, FULL = "sliding_attention", "full_attention"
# --draft-layer-types' short names -> the drafter config's layer_types (Hugging Face names)
DRAFT_LAYER_TYPES = {"full": FULL, "sliding": SLIDING}


def layer_types_for(text: str, num_layers: int, target_config: dict | None) -> list[str] | None:
    """--draft-layer-types' text -> the drafter's layer_types (Hugging Face names: full_attention,
    sliding_attention), or None for all full attention. 'auto': sliding on every layer but the last
    for a hybrid target (text config layer_types with linear_attention: Qwen3.5/3.6), as
    z-lab/Qwen3.6-27B-DFlash ships ([S, S, S, S, F], window 2048); full otherwise (z-lab's dense-target
    drafters). target_config None: check the syntax only. ValueError names the flag (the config wing's
    options.draft_layer_types turns it into a ConfigError)."""
    if text == "auto":
        if target_config is None:
            return None
        return [SLIDING] * (num_layers - 1) + [FULL] if is_hybrid(target_config) and num_layers > 1 else None
    kinds = [t.strip() for t in text.split(",")]
    bad = [t for t in kinds if t not in DRAFT_LAYER_TYPES]
    if bad or len(kinds) != num_layers:
        raise ValueError(f"--draft-layer-types: expected auto or {num_layers} comma-separated "
                         f"{'|'.join(DRAFT_LAYER_TYPES)} (one per --num-draft-layers), got {text!r}")
    types = [DRAFT_LAYER_TYPES[t] for t in kinds]
    return types if SLIDING in types else None


@dataclass(frozen=True)
class Contract:
    """What the drafters published for one target family share, for one drafter architecture."""
    family: str                        # the target's model_type
    published: str                     # the drafter that defines it (for the log)
    arch: str = "dflash"               # dflash | dflash2
    mask_token_id: int | None = None   # used where the target's vocabulary has that row
    heads: tuple[int, int, int] | None = None   # (query heads, kv heads, head dim); None: the target's
    # the narrowest target the family's drafters are published for: below it (a tiny stand-in) nothing says
    # the heads hold, and a 4096-wide attention on a narrow target would be a guess
    heads_min_hidden: int = 0
    layer_types: str | None = None     # "last-full" ([S..S, F]) | "all-sliding" | None (all full)
    sliding_window: int | None = None
    taps: tuple[int, ...] | None = None   # for a target of `taps_of` layers (else the rule)
    taps_of: int | None = None
    block_size: int | None = None      # recorded; a fresh run keeps its --block-size
    dflash2: dict = field(default_factory=dict)

    def draft_layer_types(self, num_layers: int) -> list[str] | None:
        if self.layer_types == "last-full" and num_layers > 1:
            return [SLIDING] * (num_layers - 1) + [FULL]
        if self.layer_types == "all-sliding":
            return [SLIDING] * num_layers
        return None


# model_type (the wrapper's or its text config's) -> the family whose contract applies
FAMILY_OF = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3": "qwen3"}

CONTRACTS: dict[tuple[str, str], Contract] = {
    ("qwen3_5", "dflash"): Contract(
        "qwen3_5", "z-lab/Qwen3.6-27B-DFlash", "dflash", mask_token_id=248070, heads=(32, 8, 128),
        heads_min_hidden=2048, layer_types="last-full", sliding_window=2048, block_size=16),
    ("qwen3_5", "dflash2"): Contract(
        "qwen3_5", "Qwen3.8-27B DFlash2", "dflash2", mask_token_id=248070, heads=(32, 8, 128),
        heads_min_hidden=2048, layer_types="all-sliding", sliding_window=2048, taps=(5, 19, 33, 47, 61), taps_of=64, block_size=8,
        dflash2={"conv_group_size": 16, "conv_kernel_size": 2, "selector_rank": 256, "selector_top_k": 16}),
    ("qwen3", "dflash"): Contract("qwen3", "z-lab/Qwen3-8B-DFlash-b16", "dflash", mask_token_id=151669,
                                  block_size=16),
    ("qwen3", "dflash2"): Contract("qwen3", "z-lab/Qwen3-8B-DFlash-b16", "dflash2", mask_token_id=151669),
}


def family_of(target_config: dict) -> str | None:
    """The family of a target's config.json (the wrapper's model_type first, then its text config's)."""
    text = target_config.get("text_config") or target_config
    for mt in (target_config.get("model_type"), text.get("model_type")):
        if mt in FAMILY_OF:
            return FAMILY_OF[mt]
    return None


def contract_for(target_config: dict, arch: str = "dflash", mode: str = "auto") -> Contract | None:
    """The published contract this run follows (None: --draft-contract none, or no published family)."""
    if mode == "none":
        return None
    fam = family_of(target_config)
    return CONTRACTS.get((fam, arch)) if fam else None
