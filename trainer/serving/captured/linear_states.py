"""A hybrid target's linear-attention layers in the captured decoders (Qwen3.5/3.6: Gated DeltaNet layers
beside gated full attention): every hybrid fact of serving's loops is here.

transformers' own layers run unchanged; they ask the cache for their conv and recurrent states
(get_/update_conv_state, get_/update_recurrent_state), and `LinearStates` answers from buffers allocated
once (KV buffers only for the attention layers: kv_cache.py), so the decode step stays capturable as a
CUDA graph. The speculative loop rolls the states back to each row's accepted prefix after a verify step
(`rollback_kernels`; docs/serving.md, "Hybrid targets"); a one-token step may write the recurrent state in
place (`inplace_recurrent_state`); with `fuse`, the conv's one-position update is compiled
(`fused_conv_update`). `hybrid_unsupported` says what these loops cannot hold, for the callers' fallback.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from trainer.model.families import LINEAR
from trainer.model.target import kernel_choice

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


class LinearStates:
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


class LinearCacheAPI:
    """The linear-attention part of transformers' cache API, delegated to `self.linear` (LinearStates)."""

    linear: LinearStates | None = None

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.linear.get_conv_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        return self.linear.update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.linear.get_recurrent_state(layer_idx, state_idx)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        return self.linear.update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        return 0          # no per-position states: the rollback re-runs the accepted prefix (LinearStates)

    def is_recording_past(self, layer_idx) -> bool:
        return False      # one-token steps: transformers' in-place conv update on the buffer

    def increase_count(self, layer_idx, state_idx=0) -> None:
        pass              # positions are the loop's, not the cache's


@contextmanager
def rollback_kernels(base, states: LinearStates):
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
def inplace_recurrent_state(base, states: LinearStates, fla_module=None, tile: tuple[int, int] | None = None):
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


@contextmanager
def timed_recurrent_steps(base, timer):
    """While active, each call of the linear layers' one-token recurrent kernel (RECURRENT_FN) is the phase
    "record" of `timer` (trainer/serving/phases.py): in the single loop those are transformers' recording of a
    state per position of the verified block (`activate_past_recording`: 16 one-token calls a layer at
    B = 16), inside its verify and prefill. Nothing is patched for a dense target or a timer that records
    nothing."""
    import sys

    ids = linear_layer_ids(base.config) if timer.enabled else []
    mods = {sys.modules[type(base.layers[i].linear_attn).__module__] for i in ids}
    saved = [(mod, mod.__dict__[RECURRENT_FN]) for mod in mods if RECURRENT_FN in mod.__dict__]
    for mod, orig in saved:
        def recurrent(*args, _orig=orig, **kwargs):
            with timer.phase("record"):
                return _orig(*args, **kwargs)
        setattr(mod, RECURRENT_FN, recurrent)
    try:
        yield
    finally:
        for mod, orig in saved:
            setattr(mod, RECURRENT_FN, orig)


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


def fused_conv_update(base, compile_fn) -> tuple | None:
    """(module, "causal_conv1d_update", the compiled one-position update) for the decoder stack `base` of a
    hybrid whose conv update runs transformers' torch fallback, to patch in while fused ops are active
    (fused_ops.fused_small_ops); None for a dense target, or where causal-conv1d's kernel runs (installed,
    on its device: it stays). `compile_fn(name, fn)` compiles."""
    import sys

    lin = next((lyr.linear_attn for lyr in base.layers if getattr(lyr, "linear_attn", None) is not None), None)
    if lin is None:
        return None
    lin_mod = sys.modules[type(lin).__module__]
    orig = lin_mod.__dict__.get("causal_conv1d_update")
    choice = kernel_choice(orig, lin.conv1d.weight.device.type) if orig is not None else None
    if choice is None or choice[2] == "package":
        return None
    compiled = {None: compile_fn("conv_step", _conv_step_none), "silu": compile_fn("conv_step_silu", _conv_step_silu)}
    return lin_mod, "causal_conv1d_update", _fused_conv_update(orig, compiled)
