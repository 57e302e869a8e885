"""The drafter architectures: one entry each, keyed by its --arch name, holding every fact that differs
between them. What adding one takes is docs/adding-an-architecture.md.

Every architecture is the DFlash drafter (trainer/model/drafter.py: taps -> fc -> layers with the context
injected as keys and values -> the target's LM head) with parts added. The rest of the trainer asks the
entry (`architecture(name)`, or a drafter config's `DFlashConfig.architecture`) and never tests an --arch
name itself. The published contracts of each target family stay in trainer/model/families.py, keyed by
these names.

What an entry holds:
  hf_class        config.json's `architectures` of its checkpoints and exports: how a saved drafter says
                  what it is (`for_config` reads it back, also from a peer's directory)
  summary         --arch's help for it (None: the plain one, the default)
  config_keys     the drafter-config keys it adds (DFlashConfig fields) -> their defaults, the public
                  checkpoint's; an export writes them under dflash_config, where the serving engines read
                  them, and --init-drafter refuses a published drafter whose values differ
  check           "module.function"(cfg): ValueError naming what in a DFlashConfig does not fit the
                  architecture (the run refuses it in one line); None: nothing to check
  sublayer_conv   a block-local convolution around every attention and MLP sublayer
                  (dflash2.GroupedDynamicConv, reading the conv_* keys)
  loss_terms      the training loss: "lm_head" (the CE / KL of the target's LM head on the block rows), and
                  "selector" (a candidate selector, dflash2.CandidateSelector, reading the selector_* keys:
                  its K-way loss on the same rows, dflash2.selector_loss; the plan then carries each row's
                  predecessor token)
  auto_map        "file.Class": the AutoModel code an export ships beside config.json (a file of this wing);
                  None: none (the serving engines hold the class)
  proposer        dflash-eval's drafter: "module.Class" that wraps the trained (packed) drafter and
                  proposes a block; None: the export's AutoModel class (modeling_dflash.DFlashDraftModel)
  generate        "module.function": dflash-eval's speculative loop for a proposer; None: the AutoModel
                  class's loops
  eval_loops      the --loop values dflash-eval can run it in
The dotted names are resolved (`resolve`) by the wing that uses them, so this table imports nothing.
Variants named after the architectures (the bench's and the recipe's `--variants NAME`) are derived from it.

Standard library only: the config wing and the Ansible controller's flag check import it without torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

LOSS_TERMS = ("lm_head", "selector")
EVAL_LOOPS = ("batched", "single")


@dataclass(frozen=True)
class Architecture:
    """What differs between drafter architectures (the module's docstring says what each field means)."""
    name: str
    hf_class: str
    summary: str | None = None
    config_keys: dict[str, int] = field(default_factory=dict)
    check: str | None = None
    sublayer_conv: bool = False
    loss_terms: tuple[str, ...] = ("lm_head",)
    auto_map: str | None = None
    proposer: str | None = None
    generate: str | None = None
    eval_loops: tuple[str, ...] = EVAL_LOOPS

    @property
    def selector(self) -> bool:
        """It trains (and proposes with) a candidate selector."""
        return "selector" in self.loss_terms


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    # DFlash (z-lab's; arXiv 2602.06036): the drafter alone, the LM head's loss
    Architecture("dflash", "DFlashDraftModel", auto_map="modeling_dflash.DFlashDraftModel"),
    # DFlash2 (z-lab's DFlash2 release; trainer/model/dflash2.py): a grouped dynamic convolution inside each
    # block around every sublayer, and a candidate selector; the reference class, SGLang and vLLM hold the
    # class, so no auto_map. Its eval walks the selector's path per row in the batched loop (the proposer's
    # batched twin, dflash2_eval.DFlash2CachedModel) and verifies against the selector's q in its own single loop.
    Architecture("dflash2", "DFlash2DraftModel",
                 summary="a two-tap grouped dynamic convolution inside each block around every sublayer, and a "
                         "top-16 candidate selector trained beside the LM-head loss; the public checkpoint's sizes",
                 config_keys={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                              "selector_top_k": 16},
                 check="trainer.model.dflash2.check_config", sublayer_conv=True, loss_terms=("lm_head", "selector"),
                 proposer="trainer.serving.dflash2_eval.DFlash2Proposer",
                 generate="trainer.serving.dflash2_eval.dflash2_generate"),
)}
# --arch's default
DEFAULT = "dflash"


def names() -> tuple[str, ...]:
    """The --arch choices, in the table's order."""
    return tuple(ARCHITECTURES)


def architecture(name: str) -> Architecture:
    """The entry of --arch `name` (KeyError naming the choices for another)."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise KeyError(f"unknown drafter architecture {name!r} (one of {', '.join(ARCHITECTURES)})") from None


def config_keys() -> tuple[str, ...]:
    """Every drafter-config key some architecture adds (each once, in the table's order)."""
    return tuple(dict.fromkeys(k for a in ARCHITECTURES.values() for k in a.config_keys))


def for_config(d: dict) -> Architecture:
    """The architecture of a saved drafter config (ours, an export's or a peer's config.json, flat or with
    dflash_config): the entry whose hf_class its `architectures` names; else the one whose added keys are
    all set (the most of them); else the default."""
    named = d.get("architectures") or ()
    for a in ARCHITECTURES.values():
        if a.hf_class in named:
            return a
    sub = d.get("dflash_config") or {}
    have = {k for k in config_keys() if d.get(k) is not None or sub.get(k) is not None}
    fits = [a for a in ARCHITECTURES.values() if a.config_keys and set(a.config_keys) <= have]
    return max(fits, key=lambda a: len(a.config_keys)) if fits else ARCHITECTURES[DEFAULT]


def help_text() -> str:
    """--arch's help: each architecture with its summary."""
    return "drafter architecture: " + ", or ".join(
        a.name + (f" ({a.summary})" if a.summary else "") for a in ARCHITECTURES.values())


def resolve(dotted: str):
    """'package.module.name' -> that object (imported on use: the table itself imports nothing)."""
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)
