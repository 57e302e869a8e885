"""What we know about a target model: loading it frozen (text-only, no vision tower, no Hub kernels), its
decoder stack, and the kernels its layers run (a hybrid's Gated DeltaNet needs flash-linear-attention on a
GPU). The target rank's stage that runs it in training is trainer/engine/target_stage.py.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("trainer.target")


def decoder(model):
    """The decoder stack (embeddings, layers, final norm) without the LM head."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def load_target(path: str, device: torch.device, dtype: torch.dtype, allow_slow_linear_attention: bool = False):
    """The target's language model, frozen, on `device`. A vision-language checkpoint (Qwen3.5 / Qwen3.6's
    Qwen3_5ForConditionalGeneration) loads through its text-only causal-LM class (its family's causal_lm:
    Qwen3_5ForCausalLM, which ignores `model.visual.*`), so the tower never reaches the GPU. Where a config's causal-LM class would still carry a tower, the model is
    loaded on the CPU, the tower dropped, and only then moved.
    Hub kernels stay off (use_kernels=False): transformers >= 5.25 kernelizes by default when the `kernels`
    package is installed, which on a GPU fetches layer code from the Hub at load time (offline it fails:
    "Kernel repository 'kernels-community/rotary' could not verify publisher trust status", as on the H200)
    and swaps in code our taps, compile and captured decoder were not verified against.
    Logs the kernels each layer class runs; a hybrid target whose linear-attention layers would run
    transformers' torch fallback on a GPU raises errors.BadInput naming the missing package, unless
    `allow_slow_linear_attention`."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    cls = causal_lm_class(config)
    on_cpu_first = vision_tower_class(cls)
    model = cls.from_pretrained(
        path, dtype=dtype, local_files_only=True, use_safetensors=True, attn_implementation="sdpa",
        use_kernels=False, device_map={"": str(device)} if device.type == "cuda" and not on_cpu_first else None)
    dropped = drop_vision_tower(model)
    if dropped:
        log.info("target %s: dropped its vision tower (%d parameters) before moving it to %s", path, dropped, device)
    if on_cpu_first or device.type != "cuda":
        model.to(device)
    model.eval().requires_grad_(False)
    log.info("target kernels on %s: %s", device, describe_kernels(layer_kernels(model, device.type)))
    check_fast_kernels(model, path, device.type, allow_slow_linear_attention)
    return model


def check_fast_kernels(model, path: str, device_type: str, allow: bool) -> None:
    """On a GPU, a hybrid whose linear-attention layers would run transformers' torch fallback (the package
    did not import) raises errors.BadInput naming the package (exit 2); `allow`: a warning instead."""
    missing = missing_fast_kernels(layer_kernels(model, device_type)) if device_type == "cuda" else []
    if not missing:
        return
    if not allow:
        from trainer.errors import BadInput
        from trainer.model.families import slow_linear_attention_message
        raise BadInput(slow_linear_attention_message(path, missing))
    log.warning("target %s: linear-attention layers run the torch fallback (%s missing; "
                "--allow-slow-linear-attention given)", path, ", ".join(missing))


def causal_lm_class(config):
    """The class the target rank loads for `config`: its family's causal_lm (for qwen3_5, the text-only
    Qwen3_5ForCausalLM; trainer/model/families.py), else the one AutoModelForCausalLM builds."""
    import transformers

    from trainer.model.families import family_for
    name = family_for(config).causal_lm
    if name is not None:
        return getattr(transformers, name)
    from transformers.models.auto.auto_factory import _get_model_class
    return _get_model_class(config, transformers.AutoModelForCausalLM._model_mapping)


def vision_tower_class(cls) -> bool:
    """Whether a causal-LM class is a vision-language wrapper (it would build a vision tower)."""
    return cls.__name__.endswith("ForConditionalGeneration")


def vision_params(model) -> list[str]:
    """Names of the parameters of a vision tower in `model` (none for a language model): under its family's
    vision_prefixes."""
    from trainer.model.families import family_for
    prefixes = family_for(model).vision_prefixes
    return [n for n, _ in model.named_parameters() if any(part in prefixes for part in n.split("."))]


def drop_vision_tower(model) -> int:
    """Remove any vision tower submodule (its family's vision_prefixes); returns how many parameters it held."""
    from trainer.model.families import family_for
    prefixes = family_for(model).vision_prefixes
    n = 0
    for name, module in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if leaf in prefixes:
            n += sum(p.numel() for p in module.parameters())
            setattr(model.get_submodule(parent) if parent else model, leaf, None)
    return n


# what layer_kernels says of a kernel whose package did not import
MISSING = "not installed or failed to import"


def kernel_choice(fn, device_type: str) -> tuple[str, str, str] | None:
    """(kernel name, package, 'package' | 'missing' | 'device') for one of transformers' kernel-with-fallback
    functions, read from the wrapper transformers built at import: whether it will run the package's kernel
    on `device_type`, or the torch fallback because the package did not import or does not run on that
    device. None when `fn` is not such a wrapper."""
    import inspect
    for cand in (getattr(fn, "forward", None), fn):   # with the `kernels` package, a Func module wraps it
        if cand is None or not callable(cand):
            continue
        try:
            nl = inspect.getclosurevars(cand).nonlocals
        except TypeError:
            continue
        inner = nl.get("func")
        if inner is not None and "package" not in nl:
            try:
                nl = inspect.getclosurevars(inner).nonlocals
            except TypeError:
                continue
        if "package" in nl and "is_new_implementation" in nl:
            devs = nl.get("supported_devices")
            how = ("missing" if not nl["is_new_implementation"]
                   else "package" if devs is None or device_type in devs else "device")
            return nl.get("func_name", getattr(fn, "__name__", "?")), nl["package"], how
    return None


def layer_kernels(model, device_type: str) -> dict[str, dict[str, str]]:
    """Per token-mixer class of the decoder stack, the kernels it runs on `device_type`:
    {"Qwen3_5Attention": {"attention": "sdpa"}, "Qwen3_5GatedDeltaNet": {"chunk_gated_delta_rule": "fla"
    | "torch (flash-linear-attention ...)", ...}}. Read from what transformers resolved at import."""
    import sys

    from trainer.model.families import family_for
    from trainer.ops.compiling import layer_mixer
    packages = family_for(model).linear_kernels
    out: dict[str, dict[str, str]] = {}
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    for layer in decoder(model).layers:
        mixer = layer_mixer(layer)
        name = type(mixer).__name__
        if name in out:
            continue
        # the kernel functions of the modeling module belong to its linear-attention mixer
        linear = getattr(layer, "linear_attn", None) is mixer
        mod = sys.modules.get(type(mixer).__module__) if linear else None
        found = {}
        for attr in dir(mod) if mod is not None else ():
            choice = kernel_choice(getattr(mod, attr), device_type)
            if choice is None or choice[1] not in packages:
                continue
            fname, pkg, how = choice
            pip = packages[pkg][0]
            found[fname] = {"package": pip, "missing": f"torch ({pip} {MISSING})",
                            "device": f"torch ({pip} does not run on {device_type})"}[how]
        out[name] = found or {"attention": impl}
    return out


def describe_kernels(kernels: dict[str, dict[str, str]]) -> str:
    """One log line's worth: 'Qwen3_5Attention: attention=sdpa; Qwen3_5GatedDeltaNet: ...'."""
    return "; ".join(f"{cls}: " + ", ".join(f"{k}={v}" for k, v in sorted(ks.items()))
                     for cls, ks in kernels.items())


def missing_fast_kernels(kernels: dict[str, dict[str, str]]) -> list[str]:
    """The required packages of any family's linear-attention kernels (flash-linear-attention) that are
    missing, so that some layer class of `kernels` (layer_kernels') would run their torch fallback."""
    from trainer.model.families import FAMILIES, GENERIC_HYBRID
    need = {pip for fam in (*FAMILIES.values(), GENERIC_HYBRID) for pip, _, required in fam.linear_kernels.values()
            if required}
    return sorted({pip for ks in kernels.values() for v in ks.values() for pip in need
                   if v == f"torch ({pip} {MISSING})"})
