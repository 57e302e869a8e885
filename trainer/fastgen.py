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
* `decode_kernel="triton"`: the decode attention is trainer/decode_attn.py's split-KV kernel (1.8-1.9x
  SDPA per layer on the H200; its plain-torch reference on the CPU); `kv_fp8`: the cache in fp8 e4m3, read
  by that kernel only (half the memory and, with the fp8 tile of decode_attn.CONFIG, 1.12x the decode on the
  8B shape; changes the numerics, off by default).

Same tokens as `generate` (greedy): left padding, position ids counted from each row's first real token,
the EOS ids stop a row; tests/test_regenerate.py compares the two on the CPU, where the same loop runs
without graphs. Sampling (temperature > 0) is Gumbel-max over softmax(logits / T) with noise hashed from
(seed, prompt index, step): a prompt's sample does not depend on its batch, device or the capture.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

ATTN_NAME = "dflash_decode"   # registered in transformers' AttentionInterface while this loop runs
PAD_TO = 64                   # prompt widths rounded up to this (the KV capacity is width + new tokens)


DECODE_KERNELS = ("sdpa", "matmul", "triton")
_decode_kernel = ["sdpa"]     # set by GraphDecoder around its forwards (a switch to measure both)
# "triton" (trainer/decode_attn.py): each row's first cached position and the newest one (device tensors,
# so a captured graph follows them); tiles outside [row_start, last] are not read
_decode_ctx: dict = {"row_start": None, "last": None}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with a [B, 1, Q, L] mask (bool, True = attend, or additive); a one-token query groups
    its heads per KV head. Decode kernel "sdpa": PyTorch's SDPA; "matmul": two batched matmuls and an
    fp32 softmax (K and V read once each either way); "triton": the split-KV kernel of
    trainer/decode_attn.py (its plain-torch reference where Triton cannot run)."""
    b, h, q, d = query.shape
    hk = key.shape[1]
    g = h // hk
    if q == 1 and _decode_kernel[0] == "triton":
        from .decode_attn import split_kv_attention

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


def _silu_mul(g, u):
    return F.silu(g) * u


def _mlp(x, gate_w, up_w, down_w):
    """A SiLU-gated MLP from its weights (bias-free), compiled whole with fuse_mlp."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


@contextmanager
def fused_small_ops(model, whole_mlp: bool = False):
    """While active, the target's RMSNorm, rotary embedding and SiLU-gated MLP product run as compiled
    (fused) kernels: about 50 eager kernels per layer of a decode step become about 20. Only the classes
    and functions recognised here are replaced (RMSNorm with `variance_epsilon`; the attention module's
    `apply_rotary_pos_emb`; an MLP with gate/up/down projections and SiLU); others stay as they are.
    whole_mlp: the MLP's projections are compiled with it (one graph per shape for every layer: the
    weights are its arguments), so that work around its GEMMs (e.g. the input quantizations of quantized
    weights, tests/gpu/regenerate_bench.py's `w8` variants) fuses too."""
    import sys

    from .target import decoder

    saved = []   # (owner, name, original)
    base = decoder(model)

    def patch(owner, name, new):
        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, new)

    rms = _compile("rms", _rms)
    silu_mul = _compile("silu_mul", _silu_mul)
    norm_classes = {type(m) for m in base.modules() if hasattr(m, "variance_epsilon") and hasattr(m, "weight")}
    for cls in norm_classes:
        patch(cls, "forward", lambda self, x: rms(x, self.weight, self.variance_epsilon))
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
    from .decode_attn import to_fp8
    return to_fp8(x)


class _KVCache:
    """Duck-typed transformers cache: `update(k, v, layer_idx)` writes into the preallocated buffers.

    Prefill (`rows` a slice, `prefill` True) writes positions [0, W) of those rows and attends the new
    keys themselves; a decode step writes position `slot` (a device tensor, so a captured graph advances
    it) of every row and attends the first `view` positions."""

    is_compileable = False

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 fp8: bool = False):
        shape = (batch, kv_heads, capacity, head_dim)
        # fp8: the buffers hold e4m3 (trainer/decode_attn.py to_fp8); only the split-KV kernel reads them
        self.fp8 = fp8
        if fp8:
            from .decode_attn import FP8
            dtype = FP8
        # zeros, not empty: a masked position still enters attention with probability 0, and 0 * NaN is NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
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
                 fuse_mlp: bool = False):
        from .target import decoder

        self.model, self.device = model, torch.device(device)
        self.base = decoder(model)
        self.head = model.get_output_embeddings()
        self.cfg = self.base.config
        self.batch, self.max_new, self.temperature = batch_size, max_new_tokens, float(temperature)
        self.stop_ids, self.pad_id = list(stop_ids), int(pad_id)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs and self.device.type == "cuda")
        self.view_step, self.check_every, self.prefill_tokens = view_step, check_every, prefill_tokens
        # decode_kernel: the decode attention (DECODE_KERNELS; "triton": trainer/decode_attn.py's split-KV
        # kernel); float_mask: the step's boolean mask turned into one additive mask per step, not one
        # conversion per layer inside SDPA
        assert decode_kernel in DECODE_KERNELS, decode_kernel
        self.decode_kernel, self.float_mask = decode_kernel, float_mask
        # fuse: the decode step's norms, rotary and SiLU gate compiled (fused_small_ops); the prefill stays eager.
        # fuse_mlp: with fuse, each MLP compiled whole, its GEMMs included (no gain with bf16 weights: a switch
        # for the benchmark's fp8-weight variants, docs/performance.md "Sixth call")
        self.fuse = fuse
        self.fuse_mlp = fuse_mlp
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
        self.cache: _KVCache | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0
        # timed=True: the device is synchronised around the prefill and the decode loop of each batch and
        # their seconds summed here (the benchmark's breakdown; off in dflash-regenerate)
        self.timed = False
        self.times = {"prefill_s": 0.0, "decode_s": 0.0, "capture_s": 0.0, "decode_steps": 0, "batches": 0}
        _register_attention()

    # ---------------------------------------------------------------- state
    def _alloc(self, capacity: int) -> None:
        if self.cache is not None and self.cache.capacity >= capacity and self.cache.fp8 == self.kv_fp8:
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
        self.cache = _KVCache(c.num_hidden_layers, b, kv_heads, capacity, head_dim, self.dtype, dev, fp8=self.kv_fp8)
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
        if self.fuse:
            with fused_small_ops(self.model, whole_mlp=self.fuse_mlp):
                return self._decode_step_inner(view)
        return self._decode_step_inner(view)

    def _decode_step_inner(self, view: int) -> None:
        cache = self.cache
        cache.view, cache.prefill, cache.rows = view, False, slice(None)
        self.mask.index_fill_(1, cache.slot, True)
        mask = self.mask[:, None, None, :view]
        if self.float_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        h = self.base(input_ids=self.tok[:, None], position_ids=self.pos[:, None],
                      attention_mask=mask, use_cache=True,
                      **{self.cache_kw: cache}).last_hidden_state
        self._emit(self._next(self.head(h[:, -1]).float()))
        self.pos.add_(1)
        cache.slot.add_(1)

    def _capture(self, view: int) -> torch.cuda.CUDAGraph:
        state = [t.clone() for t in (self.tok, self.pos, self.step, self.done, self.mask, self.cache.slot)]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):     # warm-up: lazy initialisations happen outside the capture
            self._decode_step(view)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip((self.tok, self.pos, self.step, self.done, self.mask, self.cache.slot), state):
            t.copy_(s)                    # undo the warm-up's step (its KV write is overwritten later)
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

        def clock(key):
            if not self.timed:
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            if key is not None:
                self.times[key] += now - last[0]
            last[0] = now
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
                h = self.base(input_ids=ids[r0:r1, c0:], position_ids=pos[r0:r1, c0:], attention_mask=m[:, None],
                              use_cache=True, **{self.cache_kw: cache}).last_hidden_state
                last[r0:r1] = self.head(h[:, -1]).float()
            cache.prefill, cache.offset = False, 0
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
                    if g is None:
                        clock("decode_s")
                        g = self._graphs[view] = self._capture(view)
                        clock("capture_s")
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


class _RowKV:
    """Duck-typed cache for a speculative step: each row writes its keys at its own positions.

    prefill (`rows` a slice): positions [0, w) of those rows are written and the new keys are attended as
    they are. A step writes the first `n` new positions of every row at `wpos` [R, n] (a device tensor, so
    a captured graph follows each row's own position) and attends the first `view` cached positions, then
    the `tail` new rows that are not stored (the drafter's block rows; 0 for the target)."""

    is_compileable = False

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 tail: int = 0):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
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
    """Greedy speculative generation (dflash-eval's loop, trainer/modeling_dflash.py `dflash_generate`) of up
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
        from .target import decoder

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

        def kv(cfg, layers, tail):
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            dtype = next(self.drafter.parameters()).dtype if tail else self.dtype
            return _RowKV(layers, r, kv_heads, capacity, head_dim, dtype, dev, tail)

        self.tcache = kv(c, c.num_hidden_layers, 0)
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
        """The drafter's block [first, MASK ...] -> [rows, B-1] greedy drafts (trainer/modeling_dflash.py
        `draft_logits`, batched)."""
        d = self.drafter
        block = torch.full((first.shape[0], self.block), d.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = first
        hidden = d(position_ids=position_ids, noise_embedding=self.embed(block), target_hidden=new_taps,
                   attention_mask=mask, past_key_values=self.dcache)
        return self.head(hidden[:, 1:].to(self.head.weight.dtype)).float().argmax(-1)

    def _step(self, view: int) -> None:
        """One verify step of every row, then the next drafts: all on the device, no host reads."""
        bs, tc, dc = self.block, self.tcache, self.dcache
        pos = self.start[:, None] + self.slot[None]                       # [R, B] the block's positions
        tc.rows, tc.view, tc.wpos = None, view, pos
        mask = self.kv_pos[None, None, None, :view] <= pos[:, None, :, None]
        out = self.base(input_ids=self.tokens, position_ids=pos, attention_mask=mask, use_cache=True,
                        output_hidden_states=True, **{self.cache_kw: tc})
        choice = self.head(out.last_hidden_state).float().argmax(-1)      # [R, B] the target's tokens
        taps = torch.cat([out.hidden_states[i] for i in self.taps], dim=-1)
        ok = (self.tokens[:, 1:] == choice[:, :-1]).long().cumprod(-1)
        acc = ok.sum(-1)                                                  # drafts accepted per row
        nxt = choice.gather(1, acc[:, None])[:, 0]                        # the bonus token
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
        live = (self.start, self.ngen, self.step, self.done, self.tokens)
        state = [t.clone() for t in live]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):     # warm-up outside the capture; its writes are redone by the replay
            self._step(view)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(live, state):
            t.copy_(s)
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
        with self._target_attn():
            # target prefill, right padded, in row chunks; first token and taps of each row
            chunk = max(1, self.prefill_tokens // width)
            causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()[None, None]
            pos = torch.arange(width, device=dev)[None]
            first = torch.empty(r, dtype=torch.long, device=dev)
            taps = []
            for r0 in range(0, r, chunk):
                r1 = min(r, r0 + chunk)
                tc.rows = slice(r0, r1)
                o = self.base(input_ids=ids[r0:r1], position_ids=pos.expand(r1 - r0, -1),
                              attention_mask=causal.expand(r1 - r0, -1, -1, -1), use_cache=True,
                              output_hidden_states=True, **{self.cache_kw: tc})
                h_last = o.last_hidden_state[torch.arange(r1 - r0, device=dev), last[r0:r1]]
                first[r0:r1] = self.head(h_last).float().argmax(-1)
                taps.append(torch.cat([o.hidden_states[i] for i in self.taps], dim=-1))
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
                    if g is None:
                        g = self._graphs[view] = self._capture(view)
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
