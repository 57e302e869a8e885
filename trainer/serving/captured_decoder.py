"""dflash-regenerate's own decode loop: a preallocated KV cache, the decode step captured as CUDA graphs.

`generate` (transformers) spends most of a decode step in Python and launches, and its static-cache
attention copies every key/value head once per query head (`repeat_kv`: 4-5x the KV bytes of the step).
This loop keeps the target's own modules (transformers' decoder layers, rotary embedding, norms, LM head)
and changes only what is around them:

* one KV buffer per layer, ``[batch, kv_heads, capacity, head_dim]``, allocated once and reused by every
  batch (no allocation, no copy per step); a step's attention reads only the prefix its position needs
  (capacity in steps of `view_step` positions), not the whole buffer;
* the attention of a decode step folds the query heads of one KV head into rows of one query
  (``[B, kv_heads, group, D]`` against ``[B, kv_heads, L, D]``): keys and values are read once, never
  repeated; the prefill attends with the keys repeated, through SDPA, as transformers' sdpa does;
* on a GPU the decode step (the forward, greedy argmax or Gumbel-max sampling, the stop test, the output
  write, the position and slot increments) is one CUDA graph per KV view length, captured once per
  generator and replayed; the host looks at the stop flags every `check_every` steps only;
* the prefill runs eagerly in row chunks and computes logits for the last prompt position only; with
  `prefill_trim` (default) each chunk runs at its own width (its longest prompt), not the batch's;
* `decode_kernel="triton"`: the decode attention is trainer/ops/decode_attn.py's split-KV kernel (faster
  than SDPA per layer on GPUs: results/INDEX.md, h200-8b-regenerate-triton.json; its plain-torch reference
  on the CPU); `kv_fp8`: the cache in fp8 e4m3, read by that kernel only (half the memory and, with the fp8
  tile of decode_attn.CONFIG, a faster decode: h200-8b-regenerate-fp8-dot.json; changes the numerics, off
  by default).

* a hybrid target (Qwen3.5/3.6: Gated DeltaNet layers beside gated full attention): its linear layers' conv
  and recurrent states live in buffers allocated once (`_LinearStates`, answering transformers' cache API),
  KV buffers only for the attention layers; the speculative loop rolls the states back to each row's
  accepted prefix after a verify step (docs/serving.md, "Hybrid targets").

Same tokens as `generate` (greedy): left padding, position ids counted from each row's first real token,
the EOS ids stop a row; tests/test_regenerate.py compares the two on the CPU, where the same loop runs
without graphs. Sampling (temperature > 0) is Gumbel-max over softmax(logits / T) with noise hashed from
(seed, prompt index, step): a prompt's sample does not depend on its batch, device or the capture.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from trainer.model.hybrid import check_hybrid_transformers

ATTN_NAME = "dflash_decode"   # registered in transformers' AttentionInterface while this loop runs
PAD_TO = 64                   # prompt widths rounded up to this (the KV capacity is width + new tokens)


DECODE_KERNELS = ("sdpa", "matmul", "triton")
_decode_kernel = ["sdpa"]     # set by GraphDecoder around its forwards (a switch to measure both)
# "triton" (trainer/ops/decode_attn.py): each row's first cached position and the newest one (device tensors,
# so a captured graph follows them); tiles outside [row_start, last] are not read
_decode_ctx: dict = {"row_start": None, "last": None}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with a [B, 1, Q, L] mask (bool, True = attend, or additive); a one-token query groups
    its heads per KV head. Decode kernel "sdpa": PyTorch's SDPA; "matmul": two batched matmuls and an
    fp32 softmax (K and V read once each either way); "triton": the split-KV kernel of
    trainer/ops/decode_attn.py (its plain-torch reference where Triton cannot run)."""
    b, h, q, d = query.shape
    hk = key.shape[1]
    g = h // hk
    if q == 1 and _decode_kernel[0] == "triton":
        from trainer.ops.decode_attn import split_kv_attention

        out = split_kv_attention(query[:, :, 0], key, value, attention_mask, scaling,
                                 _decode_ctx["row_start"], _decode_ctx["last"])
        return out[:, None], None    # [B, 1, H, D], as the transpose below gives it
    if q == 1 and g > 1:   # decode: the g query heads of one KV head are g rows of one attention
        qg = query.reshape(b, hk, g, d)
        if _decode_kernel[0] == "matmul":
            s = torch.matmul(qg, key.transpose(-1, -2)).float() * (scaling or d ** -0.5)
            if attention_mask.dtype == torch.bool:
                s = s.masked_fill(~attention_mask, float("-inf"))
            else:
                s = s + attention_mask
            out = torch.matmul(torch.softmax(s, dim=-1).to(value.dtype), value)
        else:
            out = F.scaled_dot_product_attention(qg, key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(b, h, 1, d)
    else:
        if g > 1:           # transformers' repeat_kv: query head i reads KV head i // g
            key = key.repeat_interleave(g, dim=1)
            value = value.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


VERIFY_ATTN_NAME = "dflash_verify"   # the batched speculative loop's target attention


def _verify_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of several query positions with a bool [B, 1, Q, L] mask, the g query heads of one KV head
    folded into g*Q rows of one attention: keys and values are read once, never repeated (a verify step's
    KV is the largest tensor it reads)."""
    b, h, q, d = query.shape
    hk = key.shape[1]
    g = h // hk
    if g > 1:
        query = query.reshape(b, hk, g * q, d)                   # row gi*Q + j: head gi of the group, position j
        attention_mask = attention_mask.repeat(1, 1, g, 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionInterface.register(VERIFY_ATTN_NAME, _verify_attention)


# --------------------------------------------------------------------------------------------
# fuse=True: the decode step's small ops compiled (torch.compile, inductor), the rest unchanged


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


def _conv_step(x, state, w):
    """One new position of a depthwise causal conv (transformers' `causal_conv1d_update` torch fallback for
    seq_len 1, bias-free): x [B, C, 1] enters the window `state` [B, C, K] in place (its oldest input
    leaves), and the output [B, C, 1] is the window times the taps w [C, K], summed in fp32 as the conv
    does, in w's dtype. With the SiLU after it, one fused kernel once compiled, where the fallback runs a
    cat, a copy, a convolution and the activation."""
    win = torch.cat([state[..., 1:], x.to(state.dtype)], dim=-1)
    state.copy_(win)
    return (win.to(torch.float32) * w.to(torch.float32)[None]).sum(-1, keepdim=True).to(w.dtype)


def _conv_step_none(x, state, w):
    return _conv_step(x, state, w).to(x.dtype)


def _conv_step_silu(x, state, w):
    return F.silu(_conv_step(x, state, w)).to(x.dtype)


def _fused_conv_update(orig, compiled):
    """transformers' `causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None)`:
    one position, bias-free, SiLU or none -> the compiled step; anything else -> the original."""
    def conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
        if (hidden_states.shape[-1] == 1 and bias is None and activation in (None, "silu")
                and conv_state.shape[-1] == weight.shape[-1]):
            return compiled[activation](hidden_states, conv_state, weight)
        return orig(hidden_states, conv_state, weight, bias, activation=activation)
    return conv_update


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
    weights, tests/gpu/regenerate_bench.py's `w8` variants) fuses too.
    linear: a hybrid's gated norm and conv update are compiled too (False: as before they were, for the
    bench's side-by-side `-nolinear` variants)."""
    import sys

    from trainer.model.target import decoder

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
    # fallback (causal-conv1d's kernel, where installed and on its device, stays)
    lin = next((lyr.linear_attn for lyr in base.layers if getattr(lyr, "linear_attn", None) is not None), None)
    if lin is not None and linear:
        from trainer.model.target import _kernel_choice

        lin_mod = sys.modules[type(lin).__module__]
        orig = lin_mod.__dict__.get("causal_conv1d_update")
        choice = _kernel_choice(orig, lin.conv1d.weight.device.type) if orig is not None else None
        if choice is not None and choice[2] != "package":
            compiled = {None: _compile("conv_step", _conv_step_none), "silu": _compile("conv_step_silu", _conv_step_silu)}
            patch(lin_mod, "causal_conv1d_update", _fused_conv_update(orig, compiled))
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


def _fp8(x):
    from trainer.ops.decode_attn import to_fp8
    return to_fp8(x)


# --------------------------------------------------------------------------------------------
# Hybrid targets (Qwen3.5/3.6: Gated DeltaNet linear-attention layers beside gated full attention).
# transformers' own layers run unchanged; they ask the cache for their conv and recurrent states
# (get_/update_conv_state, get_/update_recurrent_state), and _LinearStates answers from preallocated
# buffers, so the decode step stays capturable as a CUDA graph.

LINEAR = "linear_attention"
CHUNK_FN = "torch_chunk_gated_delta_rule"   # transformers' module-level chunked kernel (FLA's on GPUs)


def linear_layer_ids(cfg) -> list[int]:
    """The decoder layers that hold a recurrent state instead of a KV cache ([] for a dense target)."""
    types = list(getattr(cfg, "layer_types", None) or [])[:cfg.num_hidden_layers]
    return [i for i, t in enumerate(types) if t == LINEAR]


def hybrid_unsupported(base, speculative: bool = False) -> str | None:
    """None when these loops can run the decoder stack `base`; else why not, in a few words (the caller
    says it in one line and falls back). `speculative`: the verify step's rollback also needs the layer's
    module-level chunked kernel (CHUNK_FN), which the rollback re-runs on the accepted prefix."""
    import sys

    cfg = base.config
    known = {LINEAR, "full_attention", "sliding_attention"}
    types = list(getattr(cfg, "layer_types", None) or [])
    odd = sorted(set(types) - known)
    if odd:
        return f"layer types {', '.join(odd)} are not supported"
    for i in linear_layer_ids(cfg):
        la = getattr(base.layers[i], "linear_attn", None)
        need = ("conv_dim", "conv_kernel_size", "num_v_heads", "head_k_dim", "head_v_dim")
        if la is None or not all(hasattr(la, a) for a in need):
            return f"linear-attention layer {i} ({type(la).__name__}) is not a Gated DeltaNet this loop knows"
        if speculative and not callable(getattr(sys.modules[type(la).__module__], CHUNK_FN, None)):
            return f"{type(la).__module__} has no {CHUNK_FN} to roll the recurrent state back with"
    return None


class _LinearStates:
    """The conv and recurrent states of a hybrid's linear-attention layers, one buffer each, allocated once:
    conv [batch, conv_dim, kernel] (the layer's last `kernel` conv inputs, in the model's dtype) and
    recurrent [batch, v_heads, k_dim, v_dim] (fp32, as the kernels return it).

    A forward covers the rows `rows` and keeps, per row, its first `keep` new positions (None: all):
    * `fresh` (a prefill): the rows start from zero states;
    * `keep` known before the forward (a right-padded prefill): the positions past it are neutralised in
      the chunked kernel (gate g = 0 and beta = 0 leave a gated-delta state unchanged), so its final state
      is the state after `keep`; the conv state is the inputs before `keep`;
    * `defer` (a verify step, whose accepted length is known only after it): the conv window and the
      kernel's inputs are recorded and `commit(n)` sets each row's states to those after its first n
      positions, re-running the chunked kernel from the pre-step state with the rest neutralised (the
      accepted prefix recomputed: O(block) activations kept, not a state per position).
    Decode steps of one token use transformers' in-place conv update and its recurrent kernel."""

    def __init__(self, base, batch: int, dtype, device, state_dtype=torch.float32):
        self.ids = linear_layer_ids(base.config)
        self.conv, self.rec = {}, {}
        for i in self.ids:
            la = base.layers[i].linear_attn
            self.conv[i] = torch.zeros(batch, la.conv_dim, la.conv_kernel_size, dtype=dtype, device=device)
            self.rec[i] = torch.zeros(batch, la.num_v_heads, la.head_k_dim, la.head_v_dim, dtype=state_dtype,
                                      device=device)
        self.state_dtype = state_dtype
        self.rows = slice(None)
        self.fresh = False
        self.keep: torch.Tensor | None = None
        self.defer = False
        self.chunk_fn = None                  # the original CHUNK_FN while `rollback_kernels` is active
        self._cur: int | None = None          # the layer whose kernel runs next
        self._pending: dict[int, dict] = {}

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows == slice(None) else t[self.rows]

    # transformers' cache API for linear-attention layers
    def get_conv_state(self, layer_idx, state_idx=0):
        return None if self.fresh else self._view(self.conv[layer_idx])

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        """conv_states [rows, C, T] new inputs -> [rows, C, K + T] with the K inputs before them (zeros for a
        fresh row: the same outputs as the kernel's own zero padding)."""
        prev = self.conv[layer_idx]
        prev = torch.zeros_like(self._view(prev)) if self.fresh else self._view(prev)
        window = torch.cat([prev, conv_states.to(prev.dtype)], dim=-1)
        if self.defer:
            self._pending.setdefault(layer_idx, {})["window"] = window
        else:
            self._set_conv(layer_idx, window, self.keep)
        return window

    def get_recurrent_state(self, layer_idx, state_idx=0):
        self._cur = layer_idx
        return None if self.fresh else self._view(self.rec[layer_idx])

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        state = self._view(self.rec[layer_idx])
        # deferred: commit() writes it once the accepted length is known; the buffer itself: the kernel wrote
        # it in place (`inplace_recurrent_state`)
        if not self.defer and recurrent_states.data_ptr() != state.data_ptr():
            state.copy_(recurrent_states)
        return recurrent_states

    # the rollback
    def _set_conv(self, layer_idx: int, window: torch.Tensor, n: torch.Tensor | None) -> None:
        conv = self._view(self.conv[layer_idx])
        k = conv.shape[-1]
        if n is None:
            conv.copy_(window[..., -k:])
            return
        idx = (n[:, None] + torch.arange(k, device=n.device)[None])[:, None, :].expand(-1, window.shape[1], -1)
        conv.copy_(window.gather(2, idx))

    def _neutral(self, g, beta, n):
        """g and beta ([rows, T, heads]) with the positions at or past each row's n set to 0."""
        keep = (torch.arange(g.shape[1], device=g.device)[None] < n[:, None])[..., None]
        return g * keep, beta * keep

    def on_chunk(self, query, key, value, g, beta, kwargs):
        """Called by the chunked kernel's wrapper (`rollback_kernels`) before it runs; returns g and beta."""
        if self.defer and self._cur is not None:
            self._pending.setdefault(self._cur, {}).update(q=query, k=key, v=value, g=g, beta=beta, kw=kwargs)
        elif self.keep is not None:
            g, beta = self._neutral(g, beta, self.keep)
        return g, beta

    def commit(self, n: torch.Tensor) -> None:
        """After a deferred forward: every row's states become those after its first n [rows] new positions."""
        for i, rec in self._pending.items():
            self._set_conv(i, rec["window"], n)
            g, beta = self._neutral(rec["g"], rec["beta"], n)
            kw = dict(rec["kw"], output_final_state=True)
            kw.pop("initial_state", None)
            state = self._view(self.rec[i])
            _, final = self.chunk_fn(rec["q"], rec["k"], rec["v"], g=g, beta=beta, initial_state=state, **kw)
            state.copy_(final)
        self._pending.clear()


@contextmanager
def rollback_kernels(base, states: _LinearStates):
    """While active, the linear-attention layers' chunked kernel (CHUNK_FN of their module) reports its inputs
    to `states` before running (the verify step's rollback and the right-padded prefill need them)."""
    import sys

    mods = {sys.modules[type(base.layers[i].linear_attn).__module__] for i in states.ids}
    saved = []
    for mod in mods:
        orig = mod.__dict__[CHUNK_FN]
        if getattr(orig, "reports_to", None) is states:   # already active (re-entered): as it is
            continue

        def chunk(query, key, value, g, beta, _orig=orig, **kwargs):
            g, beta = states.on_chunk(query, key, value, g, beta, kwargs)
            return _orig(query, key, value, g=g, beta=beta, **kwargs)

        chunk.reports_to = states
        saved.append((mod, orig))
        setattr(mod, CHUNK_FN, chunk)
        states.chunk_fn = orig
    try:
        yield
    finally:
        for mod, orig in saved:
            setattr(mod, CHUNK_FN, orig)
        if saved:
            states.chunk_fn = None


RECURRENT_FN = "torch_recurrent_gated_delta_rule"   # transformers' one-token kernel (FLA's fused one on GPUs)
FLA_RECURRENT = "fla.ops.gated_delta_rule.fused_recurrent"


class _AliasFinalState:
    """FLA's fused recurrent kernel with its final state `ht` written over its initial state `h0` (same shape;
    the kernel computes in fp32 and casts to the dtype it stores to): safe in flash-linear-attention 0.6, where
    each program loads its tile of h0 first and stores the same tile of ht last. `hits` collects the h0
    pointers launched that way.

    `tile` = (BV, num_warps), or None for FLA's own launch: each program's state tile is K x BV. FLA 0.6
    launches BV = 8 with one warp: a [128, 8] tile whose rows are 32 bytes apart in fp32 and 16 in bf16, so a
    bf16 state still moves whole 32-byte sectors (bf16 states did not halve the kernel's time:
    results/h200-qwen3.6-27b-regenerate-step-variants.json, its results/INDEX.md row). A wider tile
    reads whole lines. The kernel derives its programs' tiles from BV (`NV = cdiv(V, BV)`), so the grid is
    rescaled with it: (N * HV) programs per tile column, as FLA's own wrapper computes it."""

    def __init__(self, kernel, tile: tuple[int, int] | None = None):
        self.kernel, self.hits, self.tile = kernel, [], tile

    def _retile(self, grid, kwargs):
        """FLA's grid and launch arguments with BV and num_warps from `tile` (unchanged without one, or when
        the launch is not the one-dimensional (NV * N * HV,) grid of FLA 0.6's wrapper)."""
        if self.tile is None or "BV" not in kwargs or "V" not in kwargs:
            return grid, kwargs
        bv, warps = self.tile
        V, old_bv = int(kwargs["V"]), int(kwargs["BV"])
        old_nv, new_nv = -(-V // old_bv), -(-V // bv)
        if len(grid) != 1 or grid[0] % old_nv:
            return grid, kwargs
        return (grid[0] // old_nv * new_nv,), {**kwargs, "BV": bv, "num_warps": warps}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            h0, ht = kwargs.get("h0"), kwargs.get("ht")
            if h0 is not None and ht is not None and h0.shape == ht.shape:   # the kernel casts to ht's dtype
                kwargs["ht"] = h0
                self.hits.append(h0.data_ptr())
            g, kw = self._retile(tuple(grid), kwargs)
            return self.kernel[g](*args, **kw)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


@contextmanager
def inplace_recurrent_state(base, states: _LinearStates, fla_module=None, tile: tuple[int, int] | None = None):
    """While active, a one-token step's recurrent kernel writes the new state over the old one in the cache's
    buffer: per step the state is read once and written once, where transformers' call writes a new tensor
    that the cache then copies (read, write, read, write). Only where transformers' call reaches FLA's fused
    kernel (`fla_module`, default FLA_RECURRENT, with the buffer itself as h0); elsewhere (the CPU's torch
    fallback, another FLA) the kernel's own final state is returned and copied as before. `tile`: the
    kernel's state tile (BV, num_warps) in place of FLA's (_AliasFinalState)."""
    import importlib
    import sys

    if fla_module is None:
        try:
            fla_module = importlib.import_module(FLA_RECURRENT)
        except Exception:  # noqa: BLE001  no FLA (or one that does not import): nothing to alias
            yield
            return
    kernel_name = "fused_recurrent_gated_delta_rule_fwd_kernel"
    kernel = getattr(fla_module, kernel_name, None)
    if kernel is None:
        yield
        return
    alias = _AliasFinalState(kernel, tile)
    mods = {sys.modules[type(base.layers[i].linear_attn).__module__] for i in states.ids}
    saved = [(mod, mod.__dict__[RECURRENT_FN]) for mod in mods if RECURRENT_FN in mod.__dict__]
    for mod, orig in saved:
        def recurrent(*args, _orig=orig, **kwargs):
            h0 = kwargs.get("initial_state")
            alias.hits.clear()
            o, ht = _orig(*args, **kwargs)
            if h0 is not None and alias.hits and alias.hits[-1] == h0.data_ptr():
                return o, h0     # FLA wrote the new state into h0, the cache's buffer
            return o, ht
        setattr(mod, RECURRENT_FN, recurrent)
    setattr(fla_module, kernel_name, alias)
    try:
        yield
    finally:
        setattr(fla_module, kernel_name, kernel)
        for mod, orig in saved:
            setattr(mod, RECURRENT_FN, orig)


class _LinearCacheAPI:
    """The linear-attention part of transformers' cache API, delegated to `self.linear` (_LinearStates)."""

    linear: _LinearStates | None = None

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.linear.get_conv_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        return self.linear.update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.linear.get_recurrent_state(layer_idx, state_idx)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        return self.linear.update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        return 0          # no per-position states: the rollback re-runs the accepted prefix (_LinearStates)

    def is_recording_past(self, layer_idx) -> bool:
        return False      # one-token steps: transformers' in-place conv update on the buffer

    def increase_count(self, layer_idx, state_idx=0) -> None:
        pass              # positions are the loop's, not the cache's


class _KVCache(_LinearCacheAPI):
    """Duck-typed transformers cache: `update(k, v, layer_idx)` writes into the preallocated buffers.

    Prefill (`rows` a slice, `prefill` True) writes positions [0, W) of those rows and attends the new
    keys themselves; a decode step writes position `slot` (a device tensor, so a captured graph advances
    it) of every row and attends the first `view` positions. A hybrid target's linear-attention layers
    (`linear`, _LinearStates) get no KV buffer (None in `k`, `v`)."""

    is_compileable = False

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 fp8: bool = False, linear: _LinearStates | None = None):
        shape = (batch, kv_heads, capacity, head_dim)
        # fp8: the buffers hold e4m3 (trainer/ops/decode_attn.py to_fp8); only the split-KV kernel reads them
        self.fp8 = fp8
        if fp8:
            from trainer.ops.decode_attn import FP8
            dtype = FP8
        # zeros, not empty: a masked position still enters attention with probability 0, and 0 * NaN is NaN
        self.linear = linear
        skip = set(linear.ids) if linear is not None else set()
        self.k = [None if i in skip else torch.zeros(shape, dtype=dtype, device=device) for i in range(layers)]
        self.v = [None if i in skip else torch.zeros(shape, dtype=dtype, device=device) for i in range(layers)]
        self.batch, self.capacity = batch, capacity
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.view = capacity
        self.rows = slice(None)
        self.prefill = False
        self.offset = 0          # prefill: the first position written (a row chunk's own width trimmed)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.prefill:
            o, w = self.offset, key_states.shape[2]
            ks, vs = (_fp8(key_states), _fp8(value_states)) if self.fp8 else (key_states, value_states)
            k[self.rows, :, o:o + w] = ks
            v[self.rows, :, o:o + w] = vs
            return key_states, value_states     # the prefill attends its own keys, unrounded
        if self.fp8:   # as bytes: index_copy_ has no fp8 kernel on the CPU
            k.view(torch.uint8).index_copy_(2, self.slot, _fp8(key_states).view(torch.uint8))
            v.view(torch.uint8).index_copy_(2, self.slot, _fp8(value_states).view(torch.uint8))
        else:
            k.index_copy_(2, self.slot, key_states)
            v.index_copy_(2, self.slot, value_states)
        return k[:, :, :self.view], v[:, :, :self.view]

    # what transformers may ask of a cache it did not build
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.k)


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLD, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _hash_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] int64 keys -> [B, vocab] uniforms in (0, 1), a function of (key, column) only (splitmix64;
    int64 products wrap)."""
    x = (keys[:, None] * vocab + torch.arange(vocab, device=keys.device) + 1) * _GOLD
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return (_shr(x, 41).float() + 0.5) * (1.0 / (1 << 23))   # 23 bits: k + 0.5 exact in float32


class GraphDecoder:
    """Batched greedy (or sampled) decoding of left-padded prompts with `model` (a transformers causal LM).

    `generate(prompts, keys)` returns each prompt's generated tokens, the stop token kept; `keys` (one
    int per prompt) seed its sampling noise. Graphs are captured on CUDA devices when `graphs` is true."""

    def __init__(self, model, device, batch_size: int, max_new_tokens: int, temperature: float,
                 stop_ids, pad_id: int, graphs: bool | None = None, view_step: int = 128,
                 check_every: int = 16, prefill_tokens: int = 16384, decode_kernel: str = "sdpa",
                 float_mask: bool = True, fuse: bool = False, prefill_trim: bool = True, kv_fp8: bool = False,
                 fuse_mlp: bool = False, state_inplace: bool = False, state_dtype=torch.float32,
                 fuse_linear: bool = True, recurrent_tile: tuple[int, int] | None = None):
        from trainer.model.target import decoder

        self.model, self.device = model, torch.device(device)
        self.base = decoder(model)
        self.head = model.get_output_embeddings()
        self.cfg = self.base.config
        self.batch, self.max_new, self.temperature = batch_size, max_new_tokens, float(temperature)
        self.stop_ids, self.pad_id = list(stop_ids), int(pad_id)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs and self.device.type == "cuda")
        self.view_step, self.check_every, self.prefill_tokens = view_step, check_every, prefill_tokens
        # decode_kernel: the decode attention (DECODE_KERNELS; "triton": trainer/ops/decode_attn.py's split-KV
        # kernel); float_mask: the step's boolean mask turned into one additive mask per step, not one
        # conversion per layer inside SDPA
        assert decode_kernel in DECODE_KERNELS, decode_kernel
        self.decode_kernel, self.float_mask = decode_kernel, float_mask
        # fuse: the decode step's norms, rotary and SiLU gate compiled (fused_small_ops); the prefill stays eager.
        # fuse_mlp: with fuse, each MLP compiled whole, its GEMMs included (no gain with bf16 weights: a switch
        # for the benchmark's fp8-weight variants, docs/performance-archive.md "Sixth call")
        self.fuse = fuse
        self.fuse_mlp = fuse_mlp
        self.fuse_linear = fuse_linear   # with fuse, a hybrid's gated norm and one-position conv update compiled
        # prefill_trim: each prefill row chunk runs at its own width (its longest prompt, rounded up to
        # PAD_TO), not the batch's: the left padding of a chunk of short prompts is not computed
        self.prefill_trim = prefill_trim
        # kv_fp8: the KV cache in fp8 e4m3 (half the bytes a decode step reads; changes numerics), read by the
        # split-KV kernel only
        if kv_fp8 and decode_kernel != "triton":
            raise ValueError("kv_fp8 needs decode_kernel='triton' (SDPA does not read an fp8 cache)")
        self.kv_fp8 = kv_fp8
        params = inspect.signature(self.base.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.dtype = next(model.parameters()).dtype
        # a hybrid target (Qwen3.5): its linear-attention layers' states live in the cache too (_LinearStates),
        # which answers the cache API of transformers >= trainer/model/hybrid.py's floor (else one line, here)
        check_hybrid_transformers(self.cfg)
        why = hybrid_unsupported(self.base)
        if why:
            raise ValueError(f"the captured decoder cannot run this target: {why}")
        self.linear_ids = linear_layer_ids(self.cfg)
        # state_inplace: a hybrid's decode step writes each recurrent state in place (inplace_recurrent_state;
        # FLA on GPUs only; off until measured: tests/gpu/regenerate_bench.py's `-inplace` variants)
        self.state_inplace = state_inplace
        # state_dtype: the recurrent states' storage (fp32 as transformers keeps them; bf16 halves the bytes a
        # step moves, as serving engines store them by default, and changes the numerics; off until measured)
        self.state_dtype = state_dtype
        # recurrent_tile: with state_inplace, FLA's recurrent kernel launched with this (BV, num_warps) state
        # tile (_AliasFinalState); None: FLA's own (8, 1). Off until measured (regenerate_bench's `-bv32`)
        self.recurrent_tile = recurrent_tile
        self.cache: _KVCache | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0
        # timed=True: the device is synchronised around the prefill and the decode loop of each batch and
        # their seconds summed here (the benchmark's breakdown; off in dflash-regenerate)
        self.timed = False
        self.times = {"prefill_s": 0.0, "decode_s": 0.0, "capture_s": 0.0, "decode_steps": 0, "batches": 0}
        # timed: each prefill row chunk's [rows, width, seconds] too (a first call of a shape in FLA's
        # shape-keyed kernels costs seconds on a hybrid: docs/serving.md, "Hybrid targets")
        self.prefill_chunks: list[list] = []
        _register_attention()

    # ---------------------------------------------------------------- state
    def _alloc(self, capacity: int) -> None:
        if (self.cache is not None and self.cache.capacity >= capacity and self.cache.fp8 == self.kv_fp8
                and (self.cache.linear is None or self.cache.linear.state_dtype == self.state_dtype)):
            return
        capacity = -(-capacity // self.view_step) * self.view_step
        self._graphs.clear()          # captured against the old buffers
        self._pool = None
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        c, dev, b = self.cfg, self.device, self.batch
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        linear = _LinearStates(self.base, b, self.dtype, dev, self.state_dtype) if self.linear_ids else None
        self.cache = _KVCache(c.num_hidden_layers, b, kv_heads, capacity, head_dim, self.dtype, dev, fp8=self.kv_fp8,
                              linear=linear)
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)
        self.tok, self.pos, self.step, self.keys = z(b), z(b), z(1), z(b)
        self.first = z(b)            # each row's first real position (its left padding ends there)
        self.done = z(b, dt=torch.bool)
        self.mask = z(b, capacity, dt=torch.bool)
        self.out = z(b, self.max_new)
        self.stop = torch.tensor(self.stop_ids or [-1], dtype=torch.long, device=dev)

    @contextmanager
    def _attn(self):
        prev, prev_kernel, prev_ctx = self.cfg._attn_implementation, _decode_kernel[0], dict(_decode_ctx)
        self.cfg._attn_implementation = ATTN_NAME
        _decode_kernel[0] = self.decode_kernel
        _decode_ctx.update(row_start=self.first, last=self.cache.slot)
        try:
            yield
        finally:
            self.cfg._attn_implementation = prev
            _decode_kernel[0] = prev_kernel
            _decode_ctx.update(prev_ctx)

    def _next(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] fp32 logits -> [B] next tokens (greedy, or Gumbel-max at the temperature)."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        u = _hash_uniform(self.keys * (self.max_new + 1) + self.step, logits.shape[-1])
        return (logits / self.temperature - torch.log(-torch.log(u))).argmax(-1)

    def _emit(self, nxt: torch.Tensor) -> None:
        """Record the step's tokens (pad once a row has stopped) and advance the in-graph counters."""
        nxt = torch.where(self.done, torch.full_like(nxt, self.pad_id), nxt)
        self.out.index_copy_(1, self.step, nxt[:, None])
        if self.stop_ids:
            self.done |= (nxt[:, None] == self.stop[None]).any(-1)
        self.tok.copy_(nxt)
        self.step.add_(1)

    def _decode_step(self, view: int) -> None:
        with fused_small_ops(self.model, whole_mlp=self.fuse_mlp, linear=self.fuse_linear) if self.fuse \
                else nullcontext(), \
                inplace_recurrent_state(self.base, self.cache.linear, tile=self.recurrent_tile) \
                if self.state_inplace and self.cache.linear \
                else nullcontext():
            return self._decode_step_inner(view)

    def _decode_step_inner(self, view: int) -> None:
        cache = self.cache
        cache.view, cache.prefill, cache.rows = view, False, slice(None)
        self.mask.index_fill_(1, cache.slot, True)
        mask = self.mask[:, None, None, :view]
        if self.float_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        if self.linear_ids:   # a hybrid: the mask of its attention layers; a decode step has no padding
            mask = {"full_attention": mask, LINEAR: None}
        h = self.base(input_ids=self.tok[:, None], position_ids=self.pos[:, None],
                      attention_mask=mask, use_cache=True,
                      **{self.cache_kw: cache}).last_hidden_state
        self._emit(self._next(self.head(h[:, -1]).float()))
        self.pos.add_(1)
        cache.slot.add_(1)

    def _capture(self, view: int) -> torch.cuda.CUDAGraph:
        """This step, run eagerly (the warm-up: lazy initialisations happen outside the capture), then the
        graph of the next ones captured (capturing runs nothing). The warm-up is kept, not undone: a
        hybrid's recurrent states advance in place, and a copy to undo them would double their memory."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._decode_step(view)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._decode_step(view)
        self.captures += 1
        return g

    def _clock(self):
        """clock(key): the seconds since the last call added to times[key] (None: only restart)."""
        import time

        last = [time.perf_counter()]

        def clock(key) -> float:
            """The seconds added (0.0 when not timed)."""
            if not self.timed:
                return 0.0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            dt, last[0] = now - last[0], now
            if key is not None:
                self.times[key] += dt
            return dt
        clock(None)
        return clock

    # ---------------------------------------------------------------- one batch
    @torch.no_grad()
    def generate(self, prompts: list[np.ndarray], keys) -> list[np.ndarray]:
        if self.device.type == "cuda":   # graphs are captured on the current device's streams: make it ours
            with torch.cuda.device(self.device):
                return self._generate(prompts, keys)
        return self._generate(prompts, keys)

    def _generate(self, prompts: list[np.ndarray], keys) -> list[np.ndarray]:
        n, b = len(prompts), self.batch
        assert 1 <= n <= b, (n, b)
        rows = list(prompts) + [prompts[-1]] * (b - n)       # a short last batch: repeated rows, dropped
        lens = [len(p) for p in rows]
        width = -(-max(lens) // PAD_TO) * PAD_TO
        self._alloc(width + self.max_new)
        dev, cache = self.device, self.cache
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        valid = torch.zeros((b, cache.capacity), dtype=torch.bool)
        for r, p in enumerate(rows):
            ids[r, width - len(p):] = torch.as_tensor(np.asarray(p), dtype=torch.long)
            valid[r, width - len(p):width] = True
        pos = (valid[:, :width].long().cumsum(-1) - 1).clamp_(min=0)   # generate's position ids
        ids, pos = ids.to(dev), pos.to(dev)
        self.mask.copy_(valid.to(dev))
        self.first.copy_(torch.as_tensor([width - len(p) for p in rows], dtype=torch.long))
        self.keys.copy_(torch.as_tensor(list(keys) + [0] * (b - n), dtype=torch.long))
        self.done.zero_()
        self.step.zero_()
        self.out.fill_(self.pad_id)

        clock = self._clock()
        with self._attn():
            # prefill, in row chunks of about prefill_tokens positions; logits of the last position only
            chunk = max(1, self.prefill_tokens // width)
            causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()
            eye = torch.eye(width, dtype=torch.bool, device=dev)
            last = torch.empty((b, self.head.weight.shape[0]), dtype=torch.float32, device=dev)
            cache.prefill = True
            for r0 in range(0, b, chunk):
                r1 = min(b, r0 + chunk)
                c0 = width - -(-max(lens[r0:r1]) // PAD_TO) * PAD_TO if self.prefill_trim else 0
                m = (causal[None, c0:, c0:] & self.mask[r0:r1, None, c0:width]) | eye[c0:, c0:]   # a padding row sees itself
                cache.rows, cache.offset = slice(r0, r1), c0
                mask = m[:, None]
                if cache.linear is not None:   # a hybrid: its linear layers zero the left padding's inputs
                    cache.linear.rows, cache.linear.fresh = slice(r0, r1), True
                    mask = {"full_attention": mask, LINEAR: self.mask[r0:r1, c0:width]}
                h = self.base(input_ids=ids[r0:r1, c0:], position_ids=pos[r0:r1, c0:], attention_mask=mask,
                              use_cache=True, **{self.cache_kw: cache}).last_hidden_state
                last[r0:r1] = self.head(h[:, -1]).float()
                if self.timed:
                    self.prefill_chunks.append([r1 - r0, width - c0, round(clock("prefill_s"), 4)])
            cache.prefill, cache.offset = False, 0
            if cache.linear is not None:
                cache.linear.rows, cache.linear.fresh = slice(None), False
            self._emit(self._next(last))
            self.pos.copy_(pos[:, -1] + 1)
            cache.slot.fill_(width)
            clock("prefill_s")
            steps = 0
            # decode: one captured graph (or eager step) per token
            for t in range(1, self.max_new):
                slot = width + t - 1
                view = -(-(slot + 1) // self.view_step) * self.view_step
                if self.graphs:
                    g = self._graphs.get(view)
                    if g is None:       # the capture runs this step eagerly
                        clock("decode_s")
                        self._graphs[view] = self._capture(view)
                        clock("capture_s")
                    else:
                        g.replay()
                else:
                    self._decode_step(view)
                steps += 1
                if self.stop_ids and t % self.check_every == 0 and bool(self.done[:n].all()):
                    break
        clock("decode_s")
        self.times["decode_steps"] += steps
        self.times["batches"] += 1
        new = self.out[:n].cpu().numpy()
        stops = np.isin(new, self.stop_ids) if self.stop_ids else np.zeros(new.shape, bool)
        result = []
        for r in range(n):
            hit = np.nonzero(stops[r])[0]
            m = int(hit[0]) + 1 if len(hit) else new.shape[1]
            result.append(new[r, :m].astype(np.int64))
        return result


# --------------------------------------------------------------------------------------------
# dflash-eval's loop, batched: several prompts' speculative verify steps at once (greedy)


class _RowKV(_LinearCacheAPI):
    """Duck-typed cache for a speculative step: each row writes its keys at its own positions.

    prefill (`rows` a slice): positions [0, w) of those rows are written and the new keys are attended as
    they are. A step writes the first `n` new positions of every row at `wpos` [R, n] (a device tensor, so
    a captured graph follows each row's own position) and attends the first `view` cached positions, then
    the `tail` new rows that are not stored (the drafter's block rows; 0 for the target). A hybrid target's
    linear-attention layers keep their states in `linear` (_LinearStates) and get no KV buffer."""

    is_compileable = False

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 tail: int = 0, linear: _LinearStates | None = None):
        shape = (batch, kv_heads, capacity, head_dim)
        self.linear = linear
        skip = set(linear.ids) if linear is not None else set()
        self.k = [None if i in skip else torch.zeros(shape, dtype=dtype, device=device) for i in range(layers)]
        self.v = [None if i in skip else torch.zeros(shape, dtype=dtype, device=device) for i in range(layers)]
        self.capacity, self.tail = capacity, tail
        self.wpos: torch.Tensor | None = None
        self.view = capacity
        self.rows: slice | None = None     # prefill rows, or None for a step of every row

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.rows is not None:
            w = key_states.shape[2] - self.tail
            k[self.rows, :, :w] = key_states[:, :, :w]
            v[self.rows, :, :w] = value_states[:, :, :w]
            return key_states, value_states
        n = self.wpos.shape[1]
        idx = self.wpos[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
        k.scatter_(2, idx, key_states[:, :, :n])
        v.scatter_(2, idx, value_states[:, :, :n])
        ks, vs = k[:, :, :self.view], v[:, :, :self.view]
        if self.tail:
            ks = torch.cat([ks, key_states[:, :, n:]], dim=2)
            vs = torch.cat([vs, value_states[:, :, n:]], dim=2)
        return ks, vs

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.k)


class BatchedSpecDecoder:
    """Greedy speculative generation (dflash-eval's loop, trainer/model/modeling_dflash.py `dflash_generate`) of up
    to `batch_size` prompts at once, each row with its own position, accept length and stop.

    A step verifies every row's block [last token, B-1 drafts] in one target forward (each row's keys written
    at its own positions of a preallocated cache, a row attending its positions up to the query's), accepts
    each row's matching prefix plus the bonus token, then drafts every row's next block in one drafter forward
    (the B new context rows of the verified block are all written; those past a row's accepted prefix sit at
    positions the mask hides and the next step overwrites). Rows that finished stay in the batch, frozen.
    The target's attention folds the query heads of one KV head into rows of one attention
    (`_verify_attention`): the KV cache is read once per step, not once per query head.
    On a GPU the step is one CUDA graph per KV view length (`graphs`), captured once and replayed; the host
    reads each row's position and stop flag once per step. The prefill runs eagerly: the target over the
    right-padded rows (causal, so the padding changes nothing before each row's end), then the drafter's
    first block row by row. Same accept lengths as `dflash_generate` (tests/test_eval_specgen.py compares
    them on the CPU)."""

    def __init__(self, target, drafter, device, batch_size: int, max_new_tokens: int, stop_ids,
                 graphs: bool | None = None, view_step: int = 128, prefill_tokens: int = 16384):
        from trainer.model.target import decoder

        self.target, self.drafter, self.device = target, drafter, torch.device(device)
        self.base = decoder(target)
        self.head = target.get_output_embeddings()
        self.embed = target.get_input_embeddings()
        self.cfg = self.base.config
        self.batch, self.max_new = batch_size, max_new_tokens
        self.block = drafter.block_size
        self.taps = [i + 1 for i in drafter.target_layer_ids]   # HF hidden_states index of each tap
        self.stop_ids = list(stop_ids)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs and self.device.type == "cuda")
        self.view_step, self.prefill_tokens = view_step, prefill_tokens
        params = inspect.signature(self.base.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.dtype = next(target.parameters()).dtype
        # a hybrid target: its linear-attention states are rolled back to each row's accepted length (on
        # transformers >= trainer/model/hybrid.py's floor, else one line, here)
        check_hybrid_transformers(self.cfg)
        why = hybrid_unsupported(self.base, speculative=True)
        if why:
            raise ValueError(f"the batched loop cannot run this target: {why}")
        self.linear_ids = linear_layer_ids(self.cfg)
        self.capacity = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0
        self.steps = 0            # batched steps run (each verifies every unfinished row once)
        _register_attention()

    # ---------------------------------------------------------------- state
    def _alloc(self, capacity: int) -> None:
        if self.capacity >= capacity:
            return
        capacity = -(-capacity // self.view_step) * self.view_step
        self._graphs.clear()
        self._pool = None
        self.tcache = self.dcache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        c, d, dev, r, bs = self.cfg, self.drafter.config, self.device, self.batch, self.block

        def kv(cfg, layers, tail, linear=None):
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            dtype = next(self.drafter.parameters()).dtype if tail else self.dtype
            return _RowKV(layers, r, kv_heads, capacity, head_dim, dtype, dev, tail, linear)

        self.tcache = kv(c, c.num_hidden_layers, 0,
                         _LinearStates(self.base, r, self.dtype, dev) if self.linear_ids else None)
        self.dcache = kv(d, d.num_hidden_layers, bs)
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)
        self.start, self.ngen, self.step = z(r), z(r), z(1)
        self.done = z(r, dt=torch.bool)
        self.tokens = z(r, bs)                          # [last token, drafts] per row: the block to verify
        self.out = z(r, self.max_new + bs + 1)          # generated tokens; the last column takes discards
        self.accepted = z(r, max(1, self.max_new))      # tokens emitted per step (0: no step for that row)
        self.kv_pos = torch.arange(capacity, device=dev)
        self.slot = torch.arange(bs, device=dev)
        self.stop = torch.tensor(self.stop_ids or [-1], dtype=torch.long, device=dev)
        self.capacity = capacity

    @contextmanager
    def _target_attn(self):
        prev = self.cfg._attn_implementation
        self.cfg._attn_implementation = VERIFY_ATTN_NAME
        try:
            yield
        finally:
            self.cfg._attn_implementation = prev

    def _draft(self, first: torch.Tensor, new_taps: torch.Tensor, position_ids: torch.Tensor, mask) -> torch.Tensor:
        """The drafter's block [first, MASK ...] -> [rows, B-1] greedy drafts (trainer/model/modeling_dflash.py
        `draft_logits`, batched)."""
        d = self.drafter
        block = torch.full((first.shape[0], self.block), d.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = first
        hidden = d(position_ids=position_ids, noise_embedding=self.embed(block), target_hidden=new_taps,
                   attention_mask=mask, past_key_values=self.dcache)
        return self.head(hidden[:, 1:].to(self.head.weight.dtype)).float().argmax(-1)

    def _rollback(self):
        """A hybrid's chunked kernel reporting to the cache (rollback_kernels), for the forwards inside."""
        return rollback_kernels(self.base, self.tcache.linear) if self.tcache.linear is not None else nullcontext()

    def _step(self, view: int) -> None:
        with self._rollback():
            self._step_inner(view)

    def _step_inner(self, view: int) -> None:
        """One verify step of every row, then the next drafts: all on the device, no host reads."""
        bs, tc, dc = self.block, self.tcache, self.dcache
        pos = self.start[:, None] + self.slot[None]                       # [R, B] the block's positions
        tc.rows, tc.view, tc.wpos = None, view, pos
        mask = self.kv_pos[None, None, None, :view] <= pos[:, None, :, None]
        if tc.linear is not None:   # a hybrid: record the block, commit each row's accepted prefix below
            mask = {"full_attention": mask, LINEAR: None}
            tc.linear.defer = True
        out = self.base(input_ids=self.tokens, position_ids=pos, attention_mask=mask, use_cache=True,
                        output_hidden_states=True, **{self.cache_kw: tc})
        choice = self.head(out.last_hidden_state).float().argmax(-1)      # [R, B] the target's tokens
        taps = torch.cat([out.hidden_states[i] for i in self.taps], dim=-1)
        ok = (self.tokens[:, 1:] == choice[:, :-1]).long().cumprod(-1)
        acc = ok.sum(-1)                                                  # drafts accepted per row
        nxt = choice.gather(1, acc[:, None])[:, 0]                        # the bonus token
        if tc.linear is not None:   # linear-attention states after [last token, accepted drafts]
            tc.linear.defer = False
            tc.linear.commit(acc + 1)
        live = ~self.done
        emitted = self.slot[None] <= acc[:, None]                         # [R, B]: choice[:, :acc+1] is emitted
        self.accepted.index_copy_(1, self.step, torch.where(live, acc + 1, 0)[:, None])
        col = torch.where(emitted & live[:, None], self.ngen[:, None] + self.slot[None], self.out.shape[1] - 1)
        self.out.scatter_(1, col, choice)
        hit = ((choice[..., None] == self.stop).any(-1) & emitted).any(-1)
        ngen = self.ngen + acc + 1
        start = self.start + acc + 1
        self.done |= live & (hit | (ngen >= self.max_new))
        self.ngen.copy_(torch.where(live, ngen, self.ngen))
        self.start.copy_(torch.where(live, start, self.start))
        # the next drafts: context rows = the verified block (positions pos), block rows from the new start
        dc.rows, dc.view, dc.wpos = None, view, pos
        bpos = self.start[:, None] + self.slot[None]
        dmask = torch.cat([(self.kv_pos[None, :view] < self.start[:, None]),
                           torch.ones_like(bpos, dtype=torch.bool)], dim=1)[:, None, None, :]
        drafts = self._draft(nxt, taps, torch.cat([pos, bpos], dim=1), dmask.expand(-1, 1, bs, -1))
        self.tokens[:, 0] = nxt
        self.tokens[:, 1:] = drafts
        self.step.add_(1)

    def _capture(self, view: int) -> torch.cuda.CUDAGraph:
        """This step, run eagerly (the warm-up outside the capture), then the graph of the next ones captured
        (capturing runs nothing): the warm-up is kept, as GraphDecoder._capture says why."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(view)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(view)
        self.captures += 1
        return g

    # ---------------------------------------------------------------- one batch
    @torch.no_grad()
    def generate(self, prompts: list[np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
        """For each prompt: (tokens emitted per verify step, generated tokens), as dflash_generate gives them."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return self._generate(prompts)
        return self._generate(prompts)

    def _generate(self, prompts: list[np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
        n, r, bs, dev = len(prompts), self.batch, self.block, self.device
        assert 1 <= n <= r, (n, r)
        rows = list(prompts) + [prompts[-1]] * (r - n)       # a short batch: repeated rows, finished at once
        lens = [len(p) for p in rows]
        width = -(-max(lens) // PAD_TO) * PAD_TO
        self._alloc(max(lens) + self.max_new + 2 * bs)
        ids = torch.zeros((r, width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, :len(p)] = torch.as_tensor(np.asarray(p), dtype=torch.long)
        ids = ids.to(dev)
        last = torch.as_tensor(lens, device=dev) - 1
        tc, dc = self.tcache, self.dcache
        self.out.zero_()
        self.accepted.zero_()
        self.step.zero_()
        with self._target_attn(), self._rollback():
            # target prefill, right padded, in row chunks; first token and taps of each row
            chunk = max(1, self.prefill_tokens // width)
            causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()[None, None]
            pos = torch.arange(width, device=dev)[None]
            first = torch.empty(r, dtype=torch.long, device=dev)
            taps = []
            for r0 in range(0, r, chunk):
                r1 = min(r, r0 + chunk)
                tc.rows = slice(r0, r1)
                mask = causal.expand(r1 - r0, -1, -1, -1)
                if tc.linear is not None:   # a hybrid: each row's states after its own prompt, not the padding
                    mask = {"full_attention": mask, LINEAR: None}
                    tc.linear.rows, tc.linear.fresh, tc.linear.keep = slice(r0, r1), True, last[r0:r1] + 1
                o = self.base(input_ids=ids[r0:r1], position_ids=pos.expand(r1 - r0, -1),
                              attention_mask=mask, use_cache=True,
                              output_hidden_states=True, **{self.cache_kw: tc})
                h_last = o.last_hidden_state[torch.arange(r1 - r0, device=dev), last[r0:r1]]
                first[r0:r1] = self.head(h_last).float().argmax(-1)
                taps.append(torch.cat([o.hidden_states[i] for i in self.taps], dim=-1))
            if tc.linear is not None:
                tc.linear.rows, tc.linear.fresh, tc.linear.keep = slice(None), False, None
            taps = torch.cat(taps)
            # the drafter's first block, row by row (its context is the whole prompt)
            for i in range(r):
                dc.rows = slice(i, i + 1)
                p = lens[i]
                self.tokens[i, 0] = first[i]
                self.tokens[i, 1:] = self._draft(first[i:i + 1], taps[i:i + 1, :p],
                                                 torch.arange(p + bs, device=dev)[None], None)[0]
            del taps
            self.out[:, 0] = first
            self.ngen.fill_(1)
            self.start.copy_(last + 1)
            stopped = (first[:, None] == self.stop).any(-1) if self.stop_ids else torch.zeros_like(self.done)
            self.done.copy_(stopped | (self.max_new <= 1))
            self.done[n:] = True
            steps = 0
            while True:
                top, finished = torch.stack([self.start.max(), self.done.all().long()]).tolist()
                if finished:
                    break
                view = -(-(top + bs) // self.view_step) * self.view_step
                if self.graphs:
                    g = self._graphs.get(view)
                    if g is None:       # the capture runs this step eagerly
                        self._graphs[view] = self._capture(view)
                    else:
                        g.replay()
                else:
                    self._step(view)
                steps += 1
        self.steps += steps
        acc = self.accepted[:n, :steps].cpu().numpy()
        out = self.out[:n].cpu().numpy()
        ngen = self.ngen[:n].cpu().numpy()
        result = []
        for i in range(n):
            lengths = [int(x) for x in acc[i] if x > 0]
            toks = out[i, :min(int(ngen[i]), self.max_new)]
            hit = np.nonzero(np.isin(toks, self.stop_ids))[0] if self.stop_ids else []
            if len(hit):
                toks = toks[:int(hit[0]) + 1]
            result.append((lengths, toks.astype(np.int64)))
        return result
