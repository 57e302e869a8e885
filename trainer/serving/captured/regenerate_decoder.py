"""The regeneration loop (GraphDecoder, dflash-regenerate --decoder captured): a preallocated KV cache, the
decode step captured as CUDA graphs.

`generate` (transformers) spends most of a decode step in Python and launches, and its static-cache
attention copies every key/value head once per query head (`repeat_kv`: 4-5x the KV bytes of the step).
This loop keeps the target's own modules (transformers' decoder layers, rotary embedding, norms, LM head)
and changes only what is around them:

* one KV buffer per layer, ``[batch, kv_heads, capacity, head_dim]``, allocated once and reused by every
  batch (no allocation, no copy per step: kv_cache.KVCache); a step's attention reads only the prefix its
  position needs (capacity in steps of `view_step` positions), not the whole buffer;
* the attention of a decode step folds the query heads of one KV head into rows of one query
  (attention.py): keys and values are read once, never repeated; the prefill attends with the keys
  repeated, through SDPA, as transformers' sdpa does;
* `fuse`: the step's small ops compiled (fused_ops.fused_small_ops);
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
  and recurrent states live in buffers allocated once (linear_states.LinearStates, answering transformers'
  cache API), KV buffers only for the attention layers (docs/serving.md, "Hybrid targets").

Same tokens as `generate` (greedy): left padding, position ids counted from each row's first real token,
the EOS ids stop a row; tests/serving/test_regenerate.py compares the two on the CPU, where the same loop runs
without graphs. Sampling (temperature > 0) is Gumbel-max over softmax(logits / T) with noise hashed from
(seed, prompt index, step): a prompt's sample does not depend on its batch, device or the capture.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from trainer.model.families import check_hybrid_transformers
from trainer.model.target import decoder
from trainer.serving.captured.attention import (
    DECODE_KERNELS,
    decode_attention,
    layer_masks,
    register_attention,
    sliding_window,
)
from trainer.serving.captured.fused_ops import fused_small_ops
from trainer.serving.captured.kv_cache import PAD_TO, KVCache
from trainer.serving.captured.linear_states import (
    LinearStates,
    hybrid_unsupported,
    inplace_recurrent_state,
    linear_layer_ids,
)


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


@dataclass(frozen=True)
class DecoderOptions:
    """GraphDecoder's switches, by name. Numerics-neutral unless said (kv_fp8, state_dtype change them)."""
    # graphs: the decode step captured as CUDA graphs (None: on CUDA devices; never on a CPU)
    graphs: bool | None = None
    # view_step: the KV prefix a step attends grows in steps of this many positions (one graph per view)
    view_step: int = 128
    # check_every: the host reads the stop flags every this many steps
    check_every: int = 16
    # prefill_tokens: about this many positions per prefill row chunk
    prefill_tokens: int = 16384
    # decode_kernel: the decode attention (attention.DECODE_KERNELS; "triton": trainer/ops/decode_attn.py's
    # split-KV kernel)
    decode_kernel: str = "sdpa"
    # float_mask: the step's boolean mask turned into one additive mask per step, not one conversion per layer
    # inside SDPA
    float_mask: bool = True
    # fuse: the decode step's norms, rotary and SiLU gate compiled (fused_small_ops); the prefill stays eager
    fuse: bool = False
    # prefill_trim: each prefill row chunk runs at its own width (its longest prompt, rounded up to PAD_TO),
    # not the batch's: the left padding of a chunk of short prompts is not computed
    prefill_trim: bool = True
    # kv_fp8: the KV cache in fp8 e4m3 (half the bytes a decode step reads; changes numerics), read by the
    # split-KV kernel only
    kv_fp8: bool = False
    # fuse_mlp: with fuse, each MLP compiled whole, its GEMMs included (no gain with bf16 weights: a switch for
    # the benchmark's fp8-weight variants, docs/performance-archive.md "Sixth call")
    fuse_mlp: bool = False
    # state_inplace: a hybrid's decode step writes each recurrent state in place (inplace_recurrent_state; FLA
    # on GPUs only)
    state_inplace: bool = False
    # state_dtype: the recurrent states' storage (fp32 as transformers keeps them; bf16 halves the bytes a step
    # moves, as serving engines store them by default, and changes the numerics; off until measured)
    state_dtype: torch.dtype = torch.float32
    # fuse_linear: with fuse, a hybrid's gated norm and one-position conv update compiled
    fuse_linear: bool = True
    # recurrent_tile: with state_inplace, FLA's recurrent kernel launched with this (BV, num_warps) state tile
    # (_AliasFinalState); None: FLA's own (8, 1). Off until measured (regenerate_bench's `-bv32`)
    recurrent_tile: tuple[int, int] | None = None

    def __post_init__(self):
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel: one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        if self.kv_fp8 and self.decode_kernel != "triton":
            raise ValueError("kv_fp8 needs decode_kernel='triton' (SDPA does not read an fp8 cache)")


class GraphDecoder:
    """Batched greedy (or sampled) decoding of left-padded prompts with `model` (a transformers causal LM).

    `generate(prompts, keys)` returns each prompt's generated tokens, the stop token kept; `keys` (one
    int per prompt) seed its sampling noise. The switches are `options` (DecoderOptions); keywords of its
    field names replace single ones (`GraphDecoder(..., fuse=True)`)."""

    def __init__(self, model, device, batch_size: int, max_new_tokens: int, temperature: float,
                 stop_ids, pad_id: int, options: DecoderOptions | None = None, **switches):
        opts = replace(options or DecoderOptions(), **switches)   # TypeError naming an unknown switch
        self.options = opts
        self.model, self.device = model, torch.device(device)
        self.base = decoder(model)
        self.head = model.get_output_embeddings()
        self.cfg = self.base.config
        self.batch, self.max_new, self.temperature = batch_size, max_new_tokens, float(temperature)
        self.stop_ids, self.pad_id = list(stop_ids), int(pad_id)
        self.graphs = (self.device.type == "cuda") if opts.graphs is None else bool(opts.graphs and
                                                                                    self.device.type == "cuda")
        self.view_step, self.check_every, self.prefill_tokens = opts.view_step, opts.check_every, opts.prefill_tokens
        self.decode_kernel, self.float_mask = opts.decode_kernel, opts.float_mask
        self.fuse, self.fuse_mlp, self.fuse_linear = opts.fuse, opts.fuse_mlp, opts.fuse_linear
        self.prefill_trim, self.kv_fp8 = opts.prefill_trim, opts.kv_fp8
        params = inspect.signature(self.base.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.dtype = next(model.parameters()).dtype
        # a hybrid target (Qwen3.5): its linear-attention layers' states live in the cache too (LinearStates),
        # which answers the cache API of transformers >= trainer/model/families.py's floor (else one line, here)
        check_hybrid_transformers(self.cfg)
        why = hybrid_unsupported(self.base)
        if why:
            raise ValueError(f"the captured decoder cannot run this target: {why}")
        self.linear_ids = linear_layer_ids(self.cfg)
        # a target whose layers slide (Mistral/Gemma-style, or Qwen3 with use_sliding_window): those layers see
        # the last `window` positions only (attention.layer_masks), as `generate` runs them
        self.window = sliding_window(self.cfg)
        self.state_inplace, self.state_dtype, self.recurrent_tile = (opts.state_inplace, opts.state_dtype,
                                                                     opts.recurrent_tile)
        self.cache: KVCache | None = None
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
        register_attention()

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
        linear = LinearStates(self.base, b, self.dtype, dev, self.state_dtype) if self.linear_ids else None
        self.cache = KVCache(c.num_hidden_layers, b, kv_heads, capacity, head_dim, self.dtype, dev, fp8=self.kv_fp8,
                              linear=linear)
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)
        self.tok, self.pos, self.step, self.keys = z(b), z(b), z(1), z(b)
        self.first = z(b)            # each row's first real position (its left padding ends there)
        self.done = z(b, dt=torch.bool)
        self.mask = z(b, capacity, dt=torch.bool)
        self.out = z(b, self.max_new)
        self.stop = torch.tensor(self.stop_ids or [-1], dtype=torch.long, device=dev)

    def _attn(self):
        return decode_attention(self.cfg, self.decode_kernel, self.first, self.cache.slot)

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
        keep = None
        if self.window is not None:   # slots and positions differ by each row's padding alone
            keep = torch.arange(view, device=self.device) > cache.slot - self.window
        additive = (lambda m: torch.zeros(m.shape, dtype=self.dtype, device=self.device)   # noqa: E731
                    .masked_fill_(~m, float("-inf"))) if self.float_mask else None
        # a hybrid: the mask of its attention layers (a decode step has no padding for its linear layers)
        mask = layer_masks(self.cfg, mask, keep, self.linear_ids, None, additive)
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
            if self.window is not None:   # key slot > query slot - W
                ar = torch.arange(width, device=dev)
                window = ar[None, :] > ar[:, None] - self.window
            last = torch.empty((b, self.head.weight.shape[0]), dtype=torch.float32, device=dev)
            cache.prefill = True
            for r0 in range(0, b, chunk):
                r1 = min(b, r0 + chunk)
                c0 = width - -(-max(lens[r0:r1]) // PAD_TO) * PAD_TO if self.prefill_trim else 0
                m = (causal[None, c0:, c0:] & self.mask[r0:r1, None, c0:width]) | eye[c0:, c0:]   # a padding row sees itself
                cache.rows, cache.offset = slice(r0, r1), c0
                if cache.linear is not None:   # a hybrid: its linear layers zero the left padding's inputs
                    cache.linear.rows, cache.linear.fresh = slice(r0, r1), True
                keep = window[c0:, c0:] if self.window is not None else None
                mask = layer_masks(self.cfg, m[:, None], keep, self.linear_ids, self.mask[r0:r1, c0:width])
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
