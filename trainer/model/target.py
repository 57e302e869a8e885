"""The target rank's stage: a frozen replica of the target on one GPU, its compute stream, its slots.

Forward hooks on the tapped layers (and on the final norm, for soft labels) pack exactly the rows
the drafter needs into a slot, on the forward's own stream, so packing is ordered after the
producer without a sync; `forward_pack` then records the slot's ready event for the sender.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from trainer.distributed import oprecord
from trainer.distributed.transport import (
    Sender,
    Slot,
    device_ctx,
    new_event,
    new_stream,
    packed_numel,
    stream_ctx,
    unpack,
)
from trainer.ops.compiling import sdpa_context

log = logging.getLogger("trainer.target")


def decoder(model):
    """The decoder stack (embeddings, layers, final norm) without the LM head."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def load_target(path: str, device: torch.device, dtype: torch.dtype, allow_slow_linear_attention: bool = False):
    """The target's language model, frozen, on `device`. A vision-language checkpoint (Qwen3.5 / Qwen3.6's
    Qwen3_5ForConditionalGeneration) loads through its text-only causal-LM class, which skips the vision
    tower's weights (transformers maps qwen3_5 -> Qwen3_5ForCausalLM and ignores `model.visual.*`), so the
    tower never reaches the GPU. Where a config's causal-LM class would still carry a tower, the model is
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
        from trainer.config.options import slow_linear_attention_message
        from trainer.errors import BadInput
        raise BadInput(slow_linear_attention_message(path, missing))
    log.warning("target %s: linear-attention layers run the torch fallback (%s missing; "
                "--allow-slow-linear-attention given)", path, ", ".join(missing))


def causal_lm_class(config):
    """The class AutoModelForCausalLM builds for `config` (for qwen3_5, the text-only Qwen3_5ForCausalLM)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class
    return _get_model_class(config, AutoModelForCausalLM._model_mapping)


def vision_tower_class(cls) -> bool:
    """Whether a causal-LM class is a vision-language wrapper (it would build a vision tower)."""
    return cls.__name__.endswith("ForConditionalGeneration")


VISION_PREFIXES = ("visual", "vision_tower", "vision_model")


def vision_params(model) -> list[str]:
    """Names of the parameters of a vision tower in `model` (none for a language model)."""
    return [n for n, _ in model.named_parameters() if any(part in VISION_PREFIXES for part in n.split("."))]


def drop_vision_tower(model) -> int:
    """Remove any vision tower submodule; returns how many parameters it held."""
    n = 0
    for name, module in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if leaf in VISION_PREFIXES:
            n += sum(p.numel() for p in module.parameters())
            setattr(model.get_submodule(parent) if parent else model, leaf, None)
    return n


# Gated DeltaNet's kernels in transformers' Qwen3.5/Qwen3-Next modeling: each function is wrapped so that it
# runs the package's kernel when the package imports and the input's device is one it supports, else the
# reference torch code ("correct but much slower"). package -> (pip name, device types it runs on, required).
MISSING = "not installed or failed to import"
LINEAR_KERNEL_PACKAGES = {
    "fla": ("flash-linear-attention", ("cuda", "xpu", "mlu", "npu"), True),
    "causal_conv1d": ("causal-conv1d", ("cuda",), False),   # F.conv1d is a fair fallback for a 4-tap conv
}


def _kernel_choice(fn, device_type: str) -> tuple[str, str, str] | None:
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

    from trainer.ops.compiling import layer_mixer
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
            choice = _kernel_choice(getattr(mod, attr), device_type)
            if choice is None or choice[1] not in LINEAR_KERNEL_PACKAGES:
                continue
            fname, pkg, how = choice
            pip = LINEAR_KERNEL_PACKAGES[pkg][0]
            found[fname] = {"package": pip, "missing": f"torch ({pip} {MISSING})",
                            "device": f"torch ({pip} does not run on {device_type})"}[how]
        out[name] = found or {"attention": impl}
    return out


def describe_kernels(kernels: dict[str, dict[str, str]]) -> str:
    """One log line's worth: 'Qwen3_5Attention: attention=sdpa; Qwen3_5GatedDeltaNet: ...'."""
    return "; ".join(f"{cls}: " + ", ".join(f"{k}={v}" for k, v in sorted(ks.items()))
                     for cls, ks in kernels.items())


def missing_fast_kernels(kernels: dict[str, dict[str, str]]) -> list[str]:
    """The required packages (flash-linear-attention) that are missing, so that some layer class would run
    their torch fallback."""
    need = {pip for pip, _, required in LINEAR_KERNEL_PACKAGES.values() if required}
    return sorted({pip for ks in kernels.values() for v in ks.values() for pip in need
                   if v == f"torch ({pip} {MISSING})"})


class TargetStage:
    """Owns: the model replica, one compute stream, `num_slots` packed slot buffers, the capture hooks."""

    def __init__(self, model, device: torch.device, tap_ids: list[int], soft_labels: bool, rows: int,
                 num_slots: int, dtype: torch.dtype, sdpa_backend: str = "auto", keep_head: bool = False):
        self.model, self.device, self.sdpa_backend = model, device, sdpa_backend
        self.stream = new_stream(device)
        self.tap_ids, self.soft_labels = list(tap_ids), soft_labels
        self.k = len(tap_ids)
        dec = decoder(model)
        self.hidden = dec.config.hidden_size if hasattr(dec, "config") else model.config.hidden_size
        self.capacity = packed_numel(rows, rows if soft_labels else 0, self.k, self.hidden)
        self.slots = [Slot(i, torch.empty(self.capacity, device=device, dtype=dtype)) for i in range(num_slots)]
        self._next = 0
        self._cur: dict | None = None
        layers = dec.layers
        self.all_layers = layers   # the whole stack (full_model); training may run only a prefix of it
        self._hooks = [layers[lid].register_forward_hook(self._tap_hook(col)) for col, lid in enumerate(self.tap_ids)]
        if soft_labels:
            self._hooks.append(dec.norm.register_forward_hook(self._final_hook))
        elif max(self.tap_ids) + 1 < len(layers) and not keep_head:
            # hard labels need nothing after the last tap: run only the layers we read
            dec.layers = layers[: max(self.tap_ids) + 1]

    @contextmanager
    def full_model(self):
        """The whole target for generation (trainer/engine/evaltrain.py): every layer, the final norm and the LM
        head, in eval mode. The layers hard-label training skips are put back for the duration. Call
        it only on the main thread while no forward of this stage is queued (an eval step's boundary);
        the tap hooks stay registered but copy nothing outside forward_pack."""
        dec, model = decoder(self.model), self.model
        trained, was_training = dec.layers, model.training
        dec.layers = self.all_layers
        model.eval()
        try:
            yield model
        finally:
            dec.layers = trained
            model.train(was_training)

    # hooks run on the forward's (this stage's) stream
    def _tap_hook(self, col):
        def hook(module, args, output):
            cur = self._cur
            if cur is None:
                return
            out = output[0] if isinstance(output, tuple) else output
            h = self.hidden
            cur["taps"][:, col * h:(col + 1) * h].copy_(out.reshape(-1, h).index_select(0, cur["gather"]))
        return hook

    def _final_hook(self, module, args, output):
        cur = self._cur
        if cur is None or cur["final"] is None:
            return
        cur["final"].copy_(output.reshape(-1, self.hidden).index_select(0, cur["final_gather"]))

    def next_slot(self) -> Slot:
        """The next slot of the ring, with this stage's stream ordered after its previous send."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        Sender.reclaim(slot, self.stream)
        return slot

    @torch.inference_mode()
    def forward_pack(self, item, slot: Slot) -> dict:
        """Forward + pack into `slot`, on this stage's stream. Returns timing events (start, done)."""
        dev = self.device
        ev = {"start": new_event(dev, True), "done": new_event(dev, True)}
        with device_ctx(dev), stream_ctx(self.stream):
            ev["start"].record()
            ids = item.input_ids.to(dev, non_blocking=True)
            gather = item.ctx_gather.to(dev, non_blocking=True)
            fg = item.final_gather.to(dev, non_blocking=True) if item.final_gather is not None else None
            rows, nf = gather.shape[0], (fg.shape[0] if fg is not None else 0)
            taps, final = unpack(slot.flat, rows, nf, self.k, self.hidden)
            self._cur = {"taps": taps, "gather": gather, "final": final, "final_gather": fg}
            try:
                with sdpa_context(self.sdpa_backend, dev.type):
                    decoder(self.model)(input_ids=ids, use_cache=False)
            finally:
                self._cur = None
            oprecord.compute(self.stream, f"target fwd+pack mb {item.seq_no}")   # no-op unless recording
            ev["done"].record()
            slot.ready = new_event(dev)
            slot.ready.record()
        slot.rows, slot.final_rows = rows, nf
        return ev

    def numel(self, slot: Slot) -> int:
        return packed_numel(slot.rows, slot.final_rows, self.k, self.hidden)

    def warmup(self, shapes: list[tuple[int, int]], vocab: int):
        """Run representative [B, S] shapes so allocation/autotune surprises happen before step 1."""
        for bsz, seqlen in shapes:
            t0 = time.perf_counter()
            ids = torch.randint(0, vocab, (bsz, seqlen))
            with torch.inference_mode(), device_ctx(self.device), stream_ctx(self.stream), \
                    sdpa_context(self.sdpa_backend, self.device.type):
                decoder(self.model)(input_ids=ids.to(self.device), use_cache=False)
            if self.stream is not None:
                self.stream.synchronize()
            log.info("warmup: target %s shape %dx%d in %.2fs", self.device, bsz, seqlen, time.perf_counter() - t0)
