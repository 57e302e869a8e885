"""The captured decoders' KV caches: preallocated buffers, written in place, that answer transformers' cache
API (duck-typed: `update(k, v, layer_idx)`), so no step allocates or copies the cache and a decode step
stays capturable as a CUDA graph.

  KVCache  the regeneration loop's (regenerate_decoder.GraphDecoder): one buffer per attention layer,
           ``[batch, kv_heads, capacity, head_dim]``, a decode step writing one position of every row and
           reading only the prefix its position needs; optionally fp8 e4m3 (`kv_fp8`, read by the split-KV
           kernel only)
  RowKV    the speculative loop's (eval_decoder.BatchedSpecDecoder): each row writes its block at its own
           positions
A hybrid target's linear-attention layers get no KV buffer: their states are linear_states.LinearStates,
which both caches hand the layers through linear_states.LinearCacheAPI.
"""

from __future__ import annotations

import torch

from trainer.serving.captured.linear_states import LinearCacheAPI, LinearStates

PAD_TO = 64                   # prompt widths rounded up to this (the KV capacity is width + new tokens)


def _fp8(x):
    from trainer.ops.decode_attn import to_fp8
    return to_fp8(x)


class KVCache(LinearCacheAPI):
    """Duck-typed transformers cache: `update(k, v, layer_idx)` writes into the preallocated buffers.

    Prefill (`rows` a slice, `prefill` True) writes positions [0, W) of those rows and attends the new
    keys themselves; a decode step writes position `slot` (a device tensor, so a captured graph advances
    it) of every row and attends the first `view` positions. A hybrid target's linear-attention layers
    (`linear`, LinearStates) get no KV buffer (None in `k`, `v`)."""

    is_compileable = False

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 fp8: bool = False, linear: LinearStates | None = None):
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


class RowKV(LinearCacheAPI):
    """Duck-typed cache for a speculative step: each row writes its keys at its own positions.

    prefill (`rows` a slice): positions [0, w) of those rows are written and the new keys are attended as
    they are. A step writes the first `n` new positions of every row at `wpos` [R, n] (a device tensor, so
    a captured graph follows each row's own position) and attends the first `view` cached positions, then
    the `tail` new rows that are not stored (the drafter's block rows; 0 for the target). A hybrid target's
    linear-attention layers keep their states in `linear` (LinearStates) and get no KV buffer."""

    is_compileable = False

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 tail: int = 0, linear: LinearStates | None = None):
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

