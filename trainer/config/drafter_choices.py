"""A run's drafter choices (MASK token, heads, layer types, window, taps, and the shape a warm start may
set), resolved once with the source of each: the flag the user gave; else a warm start's drafter
(--init-drafter); else the target family's published contract (--draft-contract auto:
trainer/model/families.py); else the generic rule (docs/contracts.md "Drafter contract"). Preflight calls
it before the supervisor launches a rank, so the resume checks and every rank read one answer, and the run
log has one line naming each choice and its source.

Standard library only at import (the model wing's facts it reads are too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainer.model import identity
from trainer.model.contract import DRAFT_LAYER_TYPES, FULL, SLIDING
from trainer.model.families import contract_for, layer_types_for

log = logging.getLogger("trainer.contract")


@dataclass
class Choice:
    """One resolved drafter choice: the value and where it came from (the run log's words)."""
    name: str
    value: object
    source: str

    def line(self) -> str:
        return f"{self.name} {self.value}: {self.source}"


def _flag_given(cfg, name: str) -> bool:
    """Whether the user wrote the flag of field `name` (TrainConfig.given, filled by options.parse_args); a
    value alone cannot say it, since this function fills the open ones in."""
    return name in (getattr(cfg, "given", None) or ())


def resolve_run(cfg, target_config: dict, defaults: dict | None = None,
                defaults_source: str = "") -> list[Choice]:
    """Fill in the drafter choices of `cfg` (a TrainConfig) that the user left open, in place, and say where
    each came from: the flag; else `defaults` (a warm start's drafter: --init-drafter); else the family's
    published contract (--draft-contract auto); else the generic rule. So preflight, the resume checks and
    the trainer read one answer. Idempotent. Raises ValueError naming the flag for a MASK id outside the
    vocabulary."""
    text = target_config.get("text_config") or target_config
    defaults = defaults or {}
    contract = contract_for(target_config, cfg.arch, getattr(cfg, "draft_contract", "auto"))
    by = f"the {contract.family} family's published contract ({contract.published})" if contract else ""
    out: list[Choice] = []

    def pick(name: str, flag: str, given: bool, value, fallback, rule: str):
        if given:
            out.append(Choice(name, value, flag))
            return value
        if name in defaults:
            out.append(Choice(name, defaults[name], defaults_source))
            return defaults[name]
        if fallback is not None:
            out.append(Choice(name, fallback, by))
            return fallback
        out.append(Choice(name, value, rule))
        return value

    # the shape choices first: a warm start's drafter may set them
    for name, flag in (("arch", "--arch"), ("block_size", "--block-size"), ("num_draft_layers", "--num-draft-layers")):
        v = pick(name, flag, _flag_given(cfg, name), getattr(cfg, name), None, f"{flag} default")
        setattr(cfg, name, v)
    if cfg.arch != (contract.arch if contract else cfg.arch):   # a warm start changed the arch
        contract = contract_for(target_config, cfg.arch, getattr(cfg, "draft_contract", "auto"))
        by = f"the {contract.family} family's published contract ({contract.published})" if contract else ""

    heads_given = any(_flag_given(cfg, n) for n in ("draft_heads", "draft_kv_heads", "draft_head_dim"))
    own = (text.get("num_attention_heads"), text.get("num_key_value_heads") or text.get("num_attention_heads"),
           text.get("head_dim") or (text.get("hidden_size") or 1) // (text.get("num_attention_heads") or 1))
    given_heads = tuple(getattr(cfg, n) or o for n, o in zip(("draft_heads", "draft_kv_heads", "draft_head_dim"), own))
    hidden = text.get("hidden_size") or 0
    c_heads = contract.heads if contract and hidden >= contract.heads_min_hidden else None
    own_why = "the target's own attention heads"
    if contract and contract.heads and c_heads is None:
        own_why += (f" (the {contract.family} contract's {contract.heads} is published for targets of width >= "
                    f"{contract.heads_min_hidden}; this one is {hidden})")
    heads = pick("heads", "--draft-heads/--draft-kv-heads/--draft-head-dim", heads_given, given_heads, c_heads,
                 own_why)
    cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim = (int(x) for x in heads)

    n = cfg.num_draft_layers
    names = {v: k for k, v in DRAFT_LAYER_TYPES.items()}
    types_given = _flag_given(cfg, "draft_layer_types") and cfg.draft_layer_types != "auto"
    own_types = layer_types_for(cfg.draft_layer_types, n, target_config)
    want = contract.draft_layer_types(n) if contract and contract.layer_types else None
    if contract and not contract.layer_types:
        want = [FULL] * n   # the contract says: all full
    types = pick("layer_types", "--draft-layer-types", types_given, own_types or [FULL] * n, want,
                 "--draft-layer-types auto (sliding but the last for a hybrid target, full otherwise)")
    types = list(types or [FULL] * n)
    cfg.draft_layer_types = ",".join(names[t] for t in types)
    sliding = SLIDING in types
    win = pick("sliding_window", "--sliding-window", _flag_given(cfg, "sliding_window"), cfg.sliding_window,
               contract.sliding_window if contract and sliding else None, "--sliding-window default")
    cfg.sliding_window = int(win)
    if not sliding:
        out.pop()   # no sliding layer: the window means nothing
    layers = text.get("num_hidden_layers")
    rule_taps = identity.tap_layers(layers, n) if layers else None
    c_taps = (list(contract.taps) if contract and contract.taps and contract.taps_of == layers
              and len(contract.taps) == n else None)
    taps = pick("taps", "--target-layers", _flag_given(cfg, "target_layers"), cfg.target_layers or rule_taps, c_taps,
                "evenly spread, round(1 + i (L - 4) / (K - 1)); layer i's output is HF hidden_states[i + 1]")
    cfg.target_layers = list(taps) if taps is not None else None

    vocab = text.get("vocab_size")
    mask_given = _flag_given(cfg, "mask_token_id")
    if "mask_token_id" in defaults and not mask_given:
        mask = identity.MaskChoice(int(defaults["mask_token_id"]), defaults_source)
    else:
        mask = identity.resolve_mask_token(cfg.target_model, vocab, cfg.mask_token_id if mask_given else None,
                                           contract=contract)
    out.append(Choice("mask_token_id", mask.token_id, mask.source))
    cfg.mask_token_id = mask.token_id
    return out


def log_choices(choices: list[Choice], logger: logging.Logger | None = None) -> None:
    (logger or log).info("drafter contract: %s", "; ".join(c.line() for c in choices))
