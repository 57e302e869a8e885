"""The target families: one entry each, keyed by the target's model_type, holding every fact that differs
between families. What adding one takes is docs/adding-a-target.md.

A family is what transformers calls a model_type: config.json's, or its text config's for a vision-language
wrapper (Qwen3.5's checkpoint says qwen3_5, its language model qwen3_5_text). `family_for` finds the entry
of a model, a config or config.json's dict. A model_type with no entry is a generic target: GENERIC (any
causal LM transformers builds: the generic rules, which every dense family follows unless its entry says
otherwise), or GENERIC_HYBRID where its config declares linear-attention layers (the hybrid rules).

What an entry holds:
  causal_lm          the transformers class the target rank loads (the text-only one of a VL checkpoint;
                     trainer/model/target.py); None: whatever AutoModelForCausalLM builds for the config
  linear_attention   it has linear-attention layers (a hybrid: Gated DeltaNet beside full attention), so
  linear_kernels     the packages whose kernels those layers run on a GPU (trainer/model/target.py checks
                     them at load, preflight looks them up), and
  generation_transformers  the oldest transformers whose generation our caches answer
                     (check_hybrid_transformers stops an older one in one line); None: any release
  vision_prefixes    the submodule names of a vision tower the target rank drops before the GPU
  auto_draft_layers  --draft-layer-types auto: "last-full" (sliding but the last) or None (all full)
  contracts          --arch -> the contract of the family's published drafters (trainer/model/contract.py's
                     Contract: MASK id, heads, layer types, window, taps), the default of every drafter
                     choice a run leaves open (--draft-contract auto); none: the generic rules
The MASK token of a family without a published contract comes from its tokenizer by the one rule
(identity.resolve_mask_token): its mask token, else a spare row past its tokens, else an unused special token.

Sources of the published contracts (the drafters' config.json on their model cards, mirrored in SpecForge
configs/qwen3.6-27b-dflash*.json, configs/qwen3.5-4b-dflash.json and NeMo AutoModel's
qwen3_8_27b_dflash2.yaml):
  qwen3_5  z-lab/Qwen3.6-27B-DFlash: 32 q / 8 kv heads x 128 (for targets of width 2,048 and up), [S, S, S, S, F]
           window 2048, taps by the rule ([1, 16, 31, 46, 61] of 64), MASK 248070, block 16; the Qwen3.8-27B
           DFlash2: the same heads, every layer sliding (2048), taps [5, 19, 33, 47, 61] of 64, block 8.
           Qwen3.5-4B's and 35B-A3B's drafters keep MASK 248070 and 32 heads of 128 too.
  qwen3    z-lab/Qwen3-8B-DFlash-b16: MASK 151669 (the first row past the tokenizer's 151,669 tokens).

A hybrid target (Qwen3.5/3.6: Gated DeltaNet linear-attention layers beside full attention) runs transformers'
own layers inside our loops, and those layers ask the cache for their conv and recurrent states. Our caches
answer the API of transformers >= the floor the family's entry names (HYBRID_TRANSFORMERS), in
trainer/serving/captured/linear_states.py's hybrid state store: get_/update_conv_state, get_/update_recurrent_state,
get_recurrent_states_to_keep; modeling_dflash.target_cache: DynamicCache.activate_past_recording(
recurrent_states_to_keep=). Older releases ask another one (5.17: cache.has_previous_state(...),
layers[i].conv_states[0]) and fail mid-generation with an AttributeError. `check_hybrid_transformers` stops
first, in one line; every hybrid generation path calls it: dflash-eval (both loops) and the in-training eval
(--eval-data-dir, at validation), dflash-regenerate's captured decoder (with or without graphs), the captured
decoders (trainer/serving/captured/) and evaluate.generate_each (so the GPU eval and regenerate benches too).
A dense target passes on any release; transformers' version is read only for a hybrid. Here too the one line
that refuses a hybrid whose fast linear-attention kernels are missing on a GPU
(`slow_linear_attention_message`: preflight's cheap check and target.check_fast_kernels both say it).

Standard library only: preflight and the Ansible controller's flag check import it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainer.model.contract import DRAFT_LAYER_TYPES, SLIDING, Contract, draft_layers

# the layer type (Hugging Face's name, in a config's layer_types) of a linear-attention layer
LINEAR = "linear_attention"
# the oldest transformers whose Qwen3.5 Gated DeltaNet calls the cache API our loops answer (pyproject's floor)
HYBRID_TRANSFORMERS = "5.25"
# Gated DeltaNet's kernels in transformers' Qwen3.5/Qwen3-Next modeling: each function is wrapped so that it
# runs the package's kernel when the package imports and the input's device is one it supports, else the
# reference torch code ("correct but much slower"). import name -> (pip name, device types it runs on, required).
GATED_DELTANET_KERNELS = {
    "fla": ("flash-linear-attention", ("cuda", "xpu", "mlu", "npu"), True),
    "causal_conv1d": ("causal-conv1d", ("cuda",), False),   # F.conv1d is a fair fallback for a 4-tap conv
}
# the submodule names under which a vision-language checkpoint keeps its vision tower
VISION_PREFIXES = ("visual", "vision_tower", "vision_model")


@dataclass(frozen=True)
class Family:
    """What differs between target families (the module's docstring says what each field means)."""
    name: str                                   # the entry's key: the family's model_type
    model_types: tuple[str, ...] = ()           # every model_type it answers to (the wrapper's, the text config's)
    causal_lm: str | None = None
    linear_attention: bool = False
    linear_kernels: dict[str, tuple[str, tuple[str, ...], bool]] = field(default_factory=dict)
    generation_transformers: str | None = None
    vision_prefixes: tuple[str, ...] = VISION_PREFIXES
    auto_draft_layers: str | None = None
    contracts: dict[str, Contract] = field(default_factory=dict)

    def auto_layer_types(self, num_layers: int) -> list[str] | None:
        """--draft-layer-types auto for this family: the drafter's layer_types, or None for all full."""
        return draft_layers(self.auto_draft_layers, num_layers)

    def contract(self, arch: str = "dflash") -> Contract | None:
        """The published contract of this family's drafters of `arch` (None: none published)."""
        return self.contracts.get(arch)


# any causal LM without an entry: the generic rules
GENERIC = Family("generic")
# a config without an entry that declares linear-attention layers: the hybrid rules Qwen3.5 set
GENERIC_HYBRID = Family("generic-hybrid", linear_attention=True, linear_kernels=GATED_DELTANET_KERNELS,
                        generation_transformers=HYBRID_TRANSFORMERS, auto_draft_layers="last-full")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    # Qwen3.5 / Qwen3.6 (the seeds' target): 3 Gated DeltaNet : 1 gated full attention, a VL checkpoint whose
    # language model loads alone
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text"), causal_lm="Qwen3_5ForCausalLM", linear_attention=True,
           linear_kernels=GATED_DELTANET_KERNELS, generation_transformers=HYBRID_TRANSFORMERS,
           auto_draft_layers="last-full", contracts={
               "dflash": Contract(
                   "qwen3_5", "z-lab/Qwen3.6-27B-DFlash", "dflash", mask_token_id=248070, heads=(32, 8, 128),
                   heads_min_hidden=2048, layer_types="last-full", sliding_window=2048, block_size=16),
               "dflash2": Contract(
                   "qwen3_5", "Qwen3.8-27B DFlash2", "dflash2", mask_token_id=248070, heads=(32, 8, 128),
                   heads_min_hidden=2048, layer_types="all-sliding", sliding_window=2048,
                   taps=(5, 19, 33, 47, 61), taps_of=64, block_size=8,
                   arch_config={"conv_group_size": 16, "conv_kernel_size": 2, "selector_rank": 256,
                            "selector_top_k": 16}),
           }),
    # Qwen3 (dense): the tokenizer's 151,669 tokens leave spare rows; the published MASK is the first
    Family("qwen3", ("qwen3",), causal_lm="Qwen3ForCausalLM", contracts={
        "dflash": Contract("qwen3", "z-lab/Qwen3-8B-DFlash-b16", "dflash", mask_token_id=151669, block_size=16),
        "dflash2": Contract("qwen3", "z-lab/Qwen3-8B-DFlash-b16", "dflash2", mask_token_id=151669),
    }),
    # Llama (dense; SmolLM2-135M-Instruct, dflash-real's model): no published drafter, so the generic rules.
    # SmolLM2's tokenizer fills every embedding row and has no mask token: the MASK rule takes its highest
    # unused special token (<empty_output>, id 16). Tied embeddings: the drafter rank's head is the embedding.
    Family("llama", ("llama",), causal_lm="LlamaForCausalLM"),
)}
_BY_MODEL_TYPE = {mt: f for f in FAMILIES.values() for mt in f.model_types}


def _config(target):
    """A model's config; a config or config.json's dict as given."""
    return target if isinstance(target, dict) else getattr(target, "config", target)


def _get(cfg, key: str):
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def model_types(target) -> tuple:
    """(the config's model_type, its text config's) of a model, a config or config.json's dict."""
    cfg = _config(target)
    text = _get(cfg, "text_config") or cfg
    return _get(cfg, "model_type"), _get(text, "model_type")


def declares_linear_attention(target) -> bool:
    """Whether a config (or a model's, or config.json's dict) lists linear-attention layers: its own
    layer_types, else its text config's."""
    cfg = _config(target)
    types = _get(cfg, "layer_types")
    if types is None:
        text = _get(cfg, "text_config")
        types = _get(text, "layer_types") if text is not None else None
    return LINEAR in (types or ())


def family_for(target) -> Family:
    """The family of a model, a config or config.json's dict: the entry of its model_type (the wrapper's
    first, then its text config's); else GENERIC_HYBRID where the config declares linear-attention layers,
    else GENERIC."""
    for mt in model_types(target):
        if mt in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[mt]
    return GENERIC_HYBRID if declares_linear_attention(target) else GENERIC


def contract_for(target_config: dict, arch: str = "dflash", mode: str = "auto") -> Contract | None:
    """The published contract this run follows (None: --draft-contract none, or none published for the family)."""
    return None if mode == "none" else family_for(target_config).contract(arch)


def layer_types_for(text: str, num_layers: int, target_config: dict | None) -> list[str] | None:
    """--draft-layer-types' text -> the drafter's layer_types (Hugging Face names: full_attention,
    sliding_attention), or None for all full attention. 'auto': the family's rule (auto_draft_layers:
    sliding on every layer but the last for a hybrid, as z-lab/Qwen3.6-27B-DFlash ships [S, S, S, S, F],
    window 2048; full otherwise, as z-lab's dense-target drafters). target_config None: check the syntax
    only. ValueError names the flag (the config wing's options.draft_layer_types turns it into a ConfigError)."""
    if text == "auto":
        return None if target_config is None else family_for(target_config).auto_layer_types(num_layers)
    kinds = [t.strip() for t in text.split(",")]
    bad = [t for t in kinds if t not in DRAFT_LAYER_TYPES]
    if bad or len(kinds) != num_layers:
        raise ValueError(f"--draft-layer-types: expected auto or {num_layers} comma-separated "
                         f"{'|'.join(DRAFT_LAYER_TYPES)} (one per --num-draft-layers), got {text!r}")
    types = [DRAFT_LAYER_TYPES[t] for t in kinds]
    return types if SLIDING in types else None


# ------------------------------------------------------------------ the transformers a hybrid generates with


class HybridTransformersTooOld(ValueError):
    """A hybrid target met a transformers older than its family's floor (families.HYBRID_TRANSFORMERS; the
    CLIs print it as their one line and exit 2)."""


def installed_transformers() -> str:
    """The transformers this process imports (its __version__)."""
    import transformers
    return transformers.__version__


def is_hybrid(target) -> bool:
    """True for a target with linear-attention layers (its family says so: families.family_for): `target` a
    model, its config, config.json's dict (text_config or flat), or a bool said by the caller."""
    if isinstance(target, bool):
        return target
    return family_for(target).linear_attention


def generation_floor(target) -> str | None:
    """The oldest transformers `target`'s generation works with here (see is_hybrid for `target`); None:
    any release."""
    if isinstance(target, bool):
        return GENERIC_HYBRID.generation_transformers if target else None
    return family_for(target).generation_transformers


def release(version: str) -> tuple[int, ...]:
    """'5.25.0.dev0' -> (5, 25, 0): the leading release numbers (a dev or rc build of 5.25 counts as 5.25)."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group().split(".")) if m else ()


def check_hybrid_transformers(target, what: str = "the target") -> None:
    """Raise HybridTransformersTooOld (one line: the installed release and the needed one) when `target`
    (see is_hybrid) is a hybrid and the installed transformers is older than its family's floor
    (generation_floor); else nothing. `what` names the target in the message (e.g. "--target-model DIR")."""
    floor = generation_floor(target)
    if floor is None:
        return
    have = installed_transformers()
    if release(have) < release(floor):
        raise HybridTransformersTooOld(
            f"{what} is a hybrid (Gated DeltaNet linear-attention layers): its generation here needs "
            f"transformers >= {floor}, installed {have} (pip install 'transformers>={floor}')")


def slow_linear_attention_message(path: str, missing: list[str]) -> str:
    """The one line that refuses a hybrid target whose fast kernels are missing on a GPU."""
    return (f"--target-model: {path} has Gated DeltaNet (linear-attention) layers and {', '.join(missing)} is not "
            f"installed: transformers' torch fallback is slower and runs out of GPU memory where every "
            f"hidden state is kept (pip install {' '.join(missing)}; or --allow-slow-linear-attention to run it "
            f"anyway)")
