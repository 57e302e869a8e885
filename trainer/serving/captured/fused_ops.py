"""The decode step's small ops compiled (torch.compile, inductor) while `fused_small_ops` is active (the
captured decoders' `fuse`): RMSNorms (each recognised by the formula its forward computes, `norm_kind`),
the rotary embedding, the SiLU-gated MLP, and a hybrid's one-position conv update (linear_states.py holds
that one). The rest of the model runs unchanged.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from trainer.model.target import decoder
from trainer.serving.captured.linear_states import fused_conv_update

_compiled: dict = {}


def _compile(name, fn):
    if name not in _compiled:
        import torch._dynamo.config as dc
        import torch._inductor.config as ic

        for limit in ("recompile_limit", "cache_size_limit"):   # a few shapes per batch size
            if hasattr(dc, limit):
                setattr(dc, limit, max(getattr(dc, limit), 64))

        opts = {"emulate_precision_casts": True} if hasattr(ic, "emulate_precision_casts") else {}
        _compiled[name] = torch.compile(fn, fullgraph=True, dynamic=False, options=opts)
    return _compiled[name]


def _rms(x, w, eps: float):
    """transformers' RMSNorm (Llama/Qwen family), as one fused kernel once compiled."""
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _rms_1p(x, w, eps: float):
    """Qwen3.5's zero-centred RMSNorm: (1 + w) * the normalised x, in fp32, cast back."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.to(torch.float32))).to(x.dtype)


def _rms_gated(x, gate, w, eps: float):
    """Qwen3.5's gated RMSNorm of the linear-attention output (Qwen3_5RMSNormGated): the normalised x times
    the weight in x's dtype, then times silu(gate) in fp32, cast back."""
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((w * xf.to(dt)) * F.silu(gate.to(torch.float32))).to(dt)


# NORMS key -> (formula, its number of tensor inputs besides the weight)
NORMS = {"rms": (_rms, 1), "rms1p": (_rms_1p, 1), "rms_gated": (_rms_gated, 2)}
_norm_kinds: dict[type, tuple[str, str] | None] = {}   # norm_kind per class: probed once, never in a capture


def norm_kind(module) -> tuple[str, str] | None:
    """(NORMS key, name of its epsilon attribute) of the formula that computes this norm's forward, found by
    running it once on small random inputs (one, or two for a gated norm); None for any other module
    (another signature or another formula): left as it is."""
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    w = getattr(module, "weight", None)
    eps_name = next((n for n in ("variance_epsilon", "eps") if isinstance(getattr(module, n, None), float)), None)
    if len(params) not in (1, 2) or not isinstance(w, torch.Tensor) or w.dim() != 1 or eps_name is None:
        return None
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, w.shape[0], generator=gen).to(w.device, w.dtype) for _ in params]
    with torch.no_grad():
        y = module(*xs)
        for kind, (fn, n_in) in NORMS.items():
            if n_in == len(xs) and torch.allclose(fn(*xs, w, getattr(module, eps_name)), y, rtol=1e-2, atol=1e-2):
                return kind, eps_name
    return None


def _silu_mul(g, u):
    return F.silu(g) * u


def _mlp(x, gate_w, up_w, down_w):
    """A SiLU-gated MLP from its weights (bias-free), compiled whole with fuse_mlp."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


@contextmanager
def fused_small_ops(model, whole_mlp: bool = False, linear: bool = True):
    """While active, the target's RMSNorm, rotary embedding and SiLU-gated MLP product run as compiled
    (fused) kernels: about 50 eager kernels per layer of a decode step become about 20. Only the classes
    and functions recognised here are replaced (a norm whose output one of NORMS reproduces, `norm_kind`:
    Qwen3's RMSNorm, Qwen3.5's zero-centred one and its linear layers' gated one; the attention module's
    `apply_rotary_pos_emb`; an MLP with gate/up/down projections and SiLU; a hybrid's one-position conv
    update where transformers runs its torch fallback); others stay as they are (the Gated DeltaNet
    kernels, FLA's on GPUs, and its gates among them).
    whole_mlp: the MLP's projections are compiled with it (one graph per shape for every layer: the
    weights are its arguments), so that work around its GEMMs (e.g. the input quantizations of quantized
    weights, trainer/lab/gpu/regenerate_bench.py's `w8` variants) fuses too.
    linear: a hybrid's gated norm and conv update are compiled too (False: as before they were, for the
    bench's side-by-side `-nolinear` variants)."""
    import sys

    saved = []   # (owner, name, original)
    base = decoder(model)

    def patch(owner, name, new):
        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, new)

    silu_mul = _compile("silu_mul", _silu_mul)
    norms = {}   # class -> (NORMS key, epsilon attribute), probed on its first instance, once per process
    for m in base.modules():
        cls = type(m)
        if cls not in norms and "norm" in cls.__name__.lower():
            if cls not in _norm_kinds:   # a probe syncs the host: never inside a CUDA graph capture
                _norm_kinds[cls] = norm_kind(m)
            norms[cls] = _norm_kinds[cls]
    for cls, found in norms.items():
        if found is None or (NORMS[found[0]][1] == 2 and not linear):
            continue
        fn, eps = _compile(found[0], NORMS[found[0]][0]), found[1]
        if NORMS[found[0]][1] == 2:
            patch(cls, "forward", lambda self, x, gate, fn=fn, eps=eps: fn(x, gate, self.weight, getattr(self, eps)))
        else:
            patch(cls, "forward", lambda self, x, fn=fn, eps=eps: fn(x, self.weight, getattr(self, eps)))
    # a hybrid's linear-attention layers: their conv's one-position update, where it runs transformers' torch
    # fallback (linear_states.fused_conv_update says which)
    conv = fused_conv_update(base, _compile) if linear else None
    if conv is not None:
        patch(*conv)
    layer = base.layers[0]
    attn_mod = sys.modules[type(getattr(layer, "self_attn", layer)).__module__]
    if hasattr(attn_mod, "apply_rotary_pos_emb"):
        patch_mod = attn_mod.__dict__["apply_rotary_pos_emb"]
        key = f"rope:{attn_mod.__name__}"
        patch(attn_mod, "apply_rotary_pos_emb", _compile(key, patch_mod))
    mlp = getattr(layer, "mlp", None)
    if (mlp is not None and all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj"))
            and getattr(base.config, "hidden_act", None) == "silu"):
        if whole_mlp and all(getattr(mlp, a).bias is None for a in ("gate_proj", "up_proj", "down_proj")):
            mlp_c = _compile("mlp", _mlp)
            patch(type(mlp), "forward", lambda self, x: mlp_c(x, self.gate_proj.weight, self.up_proj.weight,
                                                              self.down_proj.weight))
        else:
            patch(type(mlp), "forward",
                  lambda self, x: self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x))))
    try:
        yield
    finally:
        for owner, name, orig in reversed(saved):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
