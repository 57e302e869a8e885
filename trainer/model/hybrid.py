"""The transformers a hybrid target's generation needs, checked in one place.

A hybrid target (Qwen3.5/3.6: Gated DeltaNet linear-attention layers beside full attention) runs
transformers' own layers inside our loops, and those layers ask the cache for their conv and recurrent
states. Our caches answer the API of transformers >= the floor the family's entry names
(generation_transformers in trainer/model/families.py: families.HYBRID_TRANSFORMERS), in
trainer/serving/captured/linear_states.py's hybrid state store: get_/update_conv_state, get_/update_recurrent_state, get_recurrent_states_to_keep;
modeling_dflash.target_cache: DynamicCache.activate_past_recording(recurrent_states_to_keep=).
Older releases ask another one (5.17: cache.has_previous_state(...), layers[i].conv_states[0]) and fail
mid-generation with an AttributeError. `check_hybrid_transformers` stops first, in one line; every hybrid
generation path calls it: dflash-eval (both loops) and the in-training eval (--eval-data-dir, at
validation), dflash-regenerate's captured decoder (with or without graphs), the captured decoders (trainer/serving/captured/) and
evaluate.generate_each (so trainer/tools/gpu/regenerate_bench.py and eval_bench.py too). A dense target passes
on any release. Torch-free and cheap: transformers' version is read only for a hybrid. Here too the one
line that refuses a hybrid whose fast linear-attention kernels are missing on a GPU
(`slow_linear_attention_message`: preflight's cheap check and target.check_fast_kernels both say it).
"""

from __future__ import annotations

from trainer.model.families import GENERIC_HYBRID, family_for


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


def _release(version: str) -> tuple[int, ...]:
    """'5.25.0.dev0' -> (5, 25, 0): the leading release numbers (a dev or rc build of 5.25 counts as 5.25)."""
    import re
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
    if _release(have) < _release(floor):
        raise HybridTransformersTooOld(
            f"{what} is a hybrid (Gated DeltaNet linear-attention layers): its generation here needs "
            f"transformers >= {floor}, installed {have} (pip install 'transformers>={floor}')")


def slow_linear_attention_message(path: str, missing: list[str]) -> str:
    """The one line that refuses a hybrid target whose fast kernels are missing on a GPU."""
    return (f"--target-model: {path} has Gated DeltaNet (linear-attention) layers and {', '.join(missing)} is not "
            f"installed: transformers' torch fallback is slower and runs out of GPU memory where every "
            f"hidden state is kept (pip install {' '.join(missing)}; or --allow-slow-linear-attention to run it "
            f"anyway)")
