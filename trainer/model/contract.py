"""The drafter contract: what the published drafters of one target family share, for one drafter
architecture (MASK token, heads, layer types, window, taps), as a type. Each family's contracts, with their
sources, are its entry in trainer/model/families.py; the config wing resolves a run's choices against them
(trainer/config/drafter_choices.py; docs/contracts.md "Drafter contract").

A drafter trained for a family that has published drafters should keep their contract: the serving stacks
and the users' warm starts (--init-drafter) expect the MASK id, the attention shape and the taps those
drafters use. ``--draft-contract auto`` (the default) makes the family's contract the default of every
choice the user leaves open; ``none`` keeps the generic rules. A run keeps its own block size and anchors
(--block-size's default, or the flag): a contract's block size is recorded, never imposed (a warm start
takes the drafter's).

Standard library only (preflight and the Ansible controller's flag check import it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLIDING, FULL = "sliding_attention", "full_attention"
# --draft-layer-types' short names -> the drafter config's layer_types (Hugging Face names)
DRAFT_LAYER_TYPES = {"full": FULL, "sliding": SLIDING}


def draft_layers(rule: str | None, num_layers: int) -> list[str] | None:
    """A layer-type rule -> the drafter's layer_types: "last-full" ([S..S, F], for more than one layer),
    "all-sliding", or None (all full attention)."""
    if rule == "last-full" and num_layers > 1:
        return [SLIDING] * (num_layers - 1) + [FULL]
    if rule == "all-sliding":
        return [SLIDING] * num_layers
    return None


@dataclass(frozen=True)
class Contract:
    """What the drafters published for one target family share, for one drafter architecture."""
    family: str                        # the target's model_type
    published: str                     # the drafter that defines it (for the log)
    arch: str = "dflash"               # an --arch (trainer/model/architectures.py)
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
    arch_config: dict = field(default_factory=dict)   # the values of the keys its architecture adds

    def draft_layer_types(self, num_layers: int) -> list[str] | None:
        return draft_layers(self.layer_types, num_layers)
