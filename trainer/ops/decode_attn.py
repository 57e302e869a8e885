"""Split-KV ("flash-decoding") attention of one query token per row, for the captured decoder.

A decode step's attention reads the whole KV prefix to produce one output row per query head: it is a
memory-bound read of K and V. PyTorch's SDPA (cuDNN flash on an H200) runs it with 64-row query tiles of
which the 4 query heads of one KV head use 4, reading the prefix well under the copy rate (results/INDEX.md,
h200-8b-regenerate-step-variants.json). Here:

* the G query heads of one KV head are the rows of one small tile (padded to 16 for the tensor cores), so
  K and V are read once per (row, KV head);
* the prefix [0, L) is split into chunks of `split_len` positions, one program per (row, KV head, chunk),
  each keeping its own running max, sum and unnormalised output (online softmax over `block_n` tiles);
  a second small kernel merges the chunks by log-sum-exp (none when there is one chunk);
* a row's positions before `row_start[row]` (its left padding) and after `last[0]` (the newest key; the
  view is rounded up to 128 positions) are not read at all: those tiles are skipped, the mask does the rest.
  Both are device tensors, so a CUDA graph captured once per view length stays right as they change.

The grid depends only on the shapes (rows, KV heads, L): no host sync, capturable. `split_kv_reference`
is the same algorithm in plain torch (chunks, per-chunk max / sum / output, the log-sum-exp merge); the
CPU tests compare it with SDPA, and the Triton kernel with it (under TRITON_INTERPRET=1 where Triton is
installed). trainer/lab/gpu/regenerate_bench.py compares the kernel with SDPA on the GPU.
"""

from __future__ import annotations

import torch

try:   # absent on CPU-only installs: the reference path is used there
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the install
    triton = None
    tl = None

LOG2E = 1.4426950408889634

# the kernel's tile and split; trainer/lab/gpu/regenerate_bench.py may set them from its own sweep
# (the fastest of the sweep in results/h200-8b-regenerate-triton.json, its results/INDEX.md row)
# fp8_convert: how the kernel turns an fp8 cache's tiles into tensor-core operands (results/h200-8b-regenerate-fp8.json:
# "bf16", Triton's e4m3 -> bf16 cast, left the fp8 read no faster than bf16's). "fp16": Triton's e4m3 -> fp16 cast
# (a hardware conversion on sm_89+), q and p in fp16; "shift": the e4m3 bits moved into an fp16's (fp8_bits_to_fp16),
# which is the value / 256, the 256 folded into the score scale and the output. Both fp16 modes change only the
# rounding of q and p (fp16 has more mantissa than bf16; |q| must stay under 65,504). "dot": no conversion of
# the cache at all: q is quantized to e4m3 once per program (one scale, its amax to 448) and the
# probabilities times 256 to e4m3, and both products run on fp8 tensor cores (split_kv_reference(fp8_products=True)).
# fp8_block_n / fp8_num_warps / fp8_num_stages: an fp8 cache's tile where it differs (None: the same as bf16's).
# The fp8 cache's own tile, 64 keys x 4 warps x 3 stages, is what made it faster than the bf16 cache
# (results/h200-8b-decode-attn-modes-refactor.json), where the bf16 tile had left every fp8 mode no faster.
# With it "fp16" and "dot" run the decode in the same time (results/h200-8b-regenerate-fp8-fp16-tile.json) and
# "fp16" keeps the error of the e4m3 storage alone (dot rounds q and p as well, a larger mean error), so "fp16"
# is the default. The figures: those files' rows in results/INDEX.md.
CONFIG = {"block_n": 128, "split_len": 1024, "num_warps": 8, "num_stages": 2, "fp8_convert": "fp16",
          "fp8_block_n": 64, "fp8_num_warps": 4, "fp8_num_stages": 3}
FP8_CONVERT = {"bf16": 0, "fp16": 1, "shift": 2, "dot": 3}
P_SCALE = 256.0   # "dot": the probabilities (<= 1) times this before e4m3, so small ones keep 3 mantissa bits
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """A KV cache entry in fp8 (e4m3, scale 1, saturated at +-448: a cast would make NaN of larger values)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_bits_to_fp16(u8: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8) -> fp16 of the value / 256, by bits alone (what the kernel's "shift" mode does per
    element): sign to bit 15, the 4 exponent and 3 mantissa bits to bits 13-7. An fp16 exponent has bias 15
    where e4m3's has 7, so the fp16 read of those bits is the e4m3 value x 2^-8, subnormals included. The
    e4m3 NaN code (0x7f/0xff) becomes a finite 480 / 256; to_fp8 never writes it."""
    x = u8.to(torch.int32)
    bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    return bits.to(torch.int16).view(torch.float16)


def quantize_q_fp8(q: torch.Tensor, hk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The "dot" mode's query: [B, H, D] -> (e4m3 values, per-(row, KV head) scale [B, HK]) with one scale per
    program of the kernel (the G query heads of one KV head): amax -> 448. q ~= values / scale."""
    b, h, d = q.shape
    qf = q.float().reshape(b, hk, h // hk, d)
    qs = FP8_MAX / qf.abs().amax((-1, -2)).clamp(min=1e-30)
    return (qf * qs[..., None, None]).to(FP8).reshape(b, h, d), qs


def available(device) -> bool:
    """The Triton kernel can run for tensors on `device` (a CUDA device with Triton installed)."""
    return triton is not None and torch.device(device).type == "cuda"


def num_splits(length: int, split_len: int, block_n: int) -> int:
    """Chunks of the prefix [0, length): split_len rounded up to whole tiles."""
    split_len = max(block_n, -(-split_len // block_n) * block_n)
    return max(1, -(-length // split_len))


def _mask_2d(mask: torch.Tensor | None, b: int, length: int) -> torch.Tensor | None:
    """[B, 1, 1, L] (or [B, L]) mask -> [B, L] view; None stays None."""
    if mask is None:
        return None
    if mask.dim() == 4:
        assert mask.shape[1] == 1 and mask.shape[2] == 1, mask.shape
        mask = mask[:, 0, 0]
    assert mask.shape[-1] == length and mask.shape[0] in (1, b), (mask.shape, b, length)
    return mask.expand(b, length)


def split_kv_reference(q, k, v, mask=None, scale=None, row_start=None, last=None,
                       split_len: int | None = None, block_n: int | None = None,
                       fp8_products: bool = False) -> torch.Tensor:
    """Plain-torch split-KV decode attention. q [B, H, D] (one query token per row), k, v [B, HK, L, D]
    (H = HK * G; query head h reads KV head h // G; bf16, fp32 or fp8 e4m3, an fp8 cache), mask [B, 1, 1, L] additive (float) or bool (True =
    attend) or None, row_start [B] (positions before it are not read), last [1] (the newest position;
    those after it are not read). Returns [B, H, D] in q's dtype. Every row must attend at least one
    position. fp8_products: the kernel's "dot" mode (an fp8 cache): q rounded to e4m3 at one scale per
    (row, KV head) (quantize_q_fp8) and each chunk's probabilities x P_SCALE rounded to e4m3 before the
    product with V (the sum of the probabilities stays fp32)."""
    split_len = CONFIG["split_len"] if split_len is None else split_len
    block_n = CONFIG["block_n"] if block_n is None else block_n
    b, h, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    g = h // hk
    scale = d ** -0.5 if scale is None else scale
    qf = q.reshape(b, hk, g, d).float()
    if fp8_products:
        q8, qs = quantize_q_fp8(q, hk)
        qf = q8.float().reshape(b, hk, g, d) / qs[..., None, None]
    s = torch.einsum("bkgd,bkld->bkgl", qf, k.float()) * scale                 # [B, HK, G, L]
    pos = torch.arange(length, device=q.device)
    keep = torch.ones(b, length, dtype=torch.bool, device=q.device)
    m2 = _mask_2d(mask, b, length)
    if m2 is not None:
        if m2.dtype == torch.bool:
            keep &= m2
        else:
            s = s + m2.float()[:, None, None, :]
    if row_start is not None:   # skipped tiles: whole tiles before the row's first position
        keep &= pos[None, :] >= (row_start.long()[:, None] // block_n) * block_n
    if last is not None:
        keep &= pos[None, :] <= last.long().reshape(-1)[:1][:, None]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    n = num_splits(length, split_len, block_n)
    chunk = -(-length // n)
    chunk = -(-chunk // block_n) * block_n
    ms, ls, accs = [], [], []
    for c in range(n):
        sc = s[..., c * chunk:(c + 1) * chunk]
        if sc.shape[-1] == 0:
            continue
        m = sc.amax(-1).clamp(min=-1e30)                                          # finite: an empty chunk
        p = torch.exp(sc - m[..., None])
        ms.append(m)
        ls.append(p.sum(-1))
        pq = (p * P_SCALE).to(FP8).float() / P_SCALE if fp8_products else p.to(q.dtype).float()
        accs.append(torch.einsum("bkgl,bkld->bkgd", pq, v[:, :, c * chunk:(c + 1) * chunk].float()))
    m = torch.stack(ms)                                                           # [S, B, HK, G]
    top = m.amax(0)
    w = torch.exp(m - top)
    den = (w * torch.stack(ls)).sum(0)
    out = (w[..., None] * torch.stack(accs)).sum(0) / den[..., None]
    return out.reshape(b, h, d).to(q.dtype)


if triton is not None:
    @triton.jit
    def _kv_tile(ptrs, ok, q, FP8_MODE: tl.constexpr):
        """A [BLOCK_N, D] tile of K or V (rows past the chunk masked to 0) as the tensor-core operand that goes
        with q (after q's own conversion): mode 2 moves each e4m3 byte's bits into an fp16's (the value / 256,
        as fp8_bits_to_fp16), mode 3 ("dot") keeps the e4m3 tile as loaded, the others convert to q's dtype."""
        if FP8_MODE == 2:
            b = tl.load(ptrs, mask=ok[:, None], other=0).to(tl.uint16)
            t = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        elif FP8_MODE == 3:
            t = tl.load(ptrs, mask=ok[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=ok[:, None], other=0.0).to(q.dtype)
        return t

    @triton.jit
    def _decode_attention_split_kv(Q, K, V, M, RS, LAST, O, OP, MP, LP,
                         length, chunk, n_splits,
                         sqb, sqh, skb, skh, skn, svb, svh, svn, smb, smn, sob, soh,
                         scale_log2,
                         HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_RS: tl.constexpr,
                         HAS_LAST: tl.constexpr, DIRECT: tl.constexpr, FP8_MODE: tl.constexpr = 0):
        pid = tl.program_id(0)              # row * HK + kv head
        sid = tl.program_id(1)              # chunk
        row = pid // HK
        kvh = pid % HK
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        rn = tl.arange(0, BLOCK_N)
        gmask = rg < G
        q = tl.load(Q + row * sqb + (kvh * G + rg)[:, None] * sqh + rd[None, :], mask=gmask[:, None], other=0.0)
        if FP8_MODE == 1 or FP8_MODE == 2:      # fp8 cache read as fp16 operands (CONFIG["fp8_convert"])
            q = q.to(tl.float16)
        if FP8_MODE == 3:     # "dot": q to e4m3 at one scale for the program (quantize_q_fp8), folded into the scores
            qf = q.to(tl.float32)
            qs = 448.0 / tl.maximum(tl.max(tl.max(tl.abs(qf), 1), 0), 1e-30)
            q = (qf * qs).to(tl.float8e4nv)
            scale_log2 = scale_log2 / qs
        lo = sid * chunk
        hi = tl.minimum(lo + chunk, length)
        if HAS_RS:
            first = tl.load(RS + row).to(tl.int32)
            lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
        if HAS_LAST:
            hi = tl.minimum(hi, tl.load(LAST).to(tl.int32) + 1)
        m_i = tl.full([GP], -1e30, dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        kbase = K + row * skb + kvh * skh
        vbase = V + row * svb + kvh * svh
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + rn
            ok = n < hi
            k = _kv_tile(kbase + n[:, None] * skn + rd[None, :], ok, q, FP8_MODE)
            s = tl.dot(q, tl.trans(k)) * scale_log2                   # [GP, BLOCK_N], log2 units
            if MASK == 1:     # additive
                mk = tl.load(M + row * smb + n * smn, mask=ok, other=0.0).to(tl.float32)
                s = s + mk[None, :] * 1.4426950408889634
            if MASK == 2:     # bool (uint8), nonzero = attend
                mk = tl.load(M + row * smb + n * smn, mask=ok, other=0)
                s = tl.where((mk != 0)[None, :], s, float("-inf"))
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _kv_tile(vbase + n[:, None] * svn + rd[None, :], ok, q, FP8_MODE)
            if FP8_MODE == 3:     # probabilities x 256 in e4m3 (P_SCALE), undone below
                acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new
        if FP8_MODE == 2:     # V was read as its value / 256
            acc = acc * 256.0
        if FP8_MODE == 3:     # the probabilities were x 256
            acc = acc * (1.0 / 256.0)
        if DIRECT:            # one chunk: the normalised output, no merge
            out = acc / l_i[:, None]
            tl.store(O + row * sob + (kvh * G + rg)[:, None] * soh + rd[None, :], out.to(O.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            base = (pid * n_splits + sid) * GP
            tl.store(OP + (base + rg)[:, None] * D + rd[None, :], acc)
            tl.store(MP + base + rg, m_i)
            tl.store(LP + base + rg, l_i)

    @triton.jit
    def _decode_attention_merge(O, OP, MP, LP, n_splits, sob, soh,
                      HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      SP: tl.constexpr):
        pid = tl.program_id(0)              # (row * HK + kv head) * G + g
        g = pid % G
        rk = pid // G
        row = rk // HK
        kvh = rk % HK
        rs = tl.arange(0, SP)
        rd = tl.arange(0, D)
        ok = rs < n_splits
        idx = (rk * n_splits + rs) * GP + g
        m = tl.load(MP + idx, mask=ok, other=-1e30)
        den = tl.load(LP + idx, mask=ok, other=0.0)
        top = tl.max(m, 0)
        w = tl.exp2(m - top)
        w = tl.where(ok, w, 0.0)
        acc = tl.load(OP + idx[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(w * den, 0)
        tl.store(O + row * sob + (kvh * G + g) * soh + rd, out.to(O.dtype.element_ty))


def split_kv_triton(q, k, v, mask=None, scale=None, row_start=None, last=None, out=None,
                    split_len: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The Triton kernel; same arguments and result as `split_kv_reference` (`out` [B, H, D] optional)."""
    assert triton is not None, "triton is not installed"
    cfg = CONFIG
    pre = "fp8_" if k.dtype == FP8 else ""
    split_len = cfg["split_len"] if split_len is None else split_len
    block_n = (cfg.get(pre + "block_n") or cfg["block_n"]) if block_n is None else block_n
    num_warps = (cfg.get(pre + "num_warps") or cfg["num_warps"]) if num_warps is None else num_warps
    num_stages = (cfg.get(pre + "num_stages") or cfg["num_stages"]) if num_stages is None else num_stages
    b, h, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    g = h // hk
    assert h == hk * g and d == triton.next_power_of_2(d), (h, hk, d)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(3) != 1:
        k = k.contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    scale = d ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    m2 = _mask_2d(mask, b, length)
    kind = 0 if m2 is None else (2 if m2.dtype == torch.bool else 1)
    if kind == 2:
        m2 = m2.view(torch.uint8)
    fp8_mode = FP8_CONVERT[cfg.get("fp8_convert", "bf16")] if k.dtype == FP8 else 0
    if fp8_mode == 2:     # the kernel reads the bytes; K's 1/256 goes into the score scale
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    gp = max(16, triton.next_power_of_2(g))
    n = num_splits(length, split_len, block_n)
    chunk = -(-length // n)
    chunk = -(-chunk // block_n) * block_n
    n = -(-length // chunk)
    direct = n == 1
    if direct:
        op = mp = lp = out   # unused
    else:
        op = torch.empty((b * hk * n * gp, d), dtype=torch.float32, device=q.device)
        mp = torch.empty((b * hk * n * gp,), dtype=torch.float32, device=q.device)
        lp = torch.empty_like(mp)
    dummy = out
    _decode_attention_split_kv[(b * hk, n)](
        q, k, v, m2 if m2 is not None else dummy, row_start if row_start is not None else dummy,
        last if last is not None else dummy, out, op, mp, lp,
        length, chunk, n,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        m2.stride(0) if m2 is not None else 0, m2.stride(1) if m2 is not None else 0, out.stride(0), out.stride(1),
        scale * LOG2E * (256.0 if fp8_mode == 2 else 1.0),
        HK=hk, G=g, GP=gp, D=d, BLOCK_N=block_n, MASK=kind, HAS_RS=row_start is not None,
        HAS_LAST=last is not None, DIRECT=direct, FP8_MODE=fp8_mode, num_warps=num_warps, num_stages=num_stages)
    if not direct:
        _decode_attention_merge[(b * hk * g,)](out, op, mp, lp, n, out.stride(0), out.stride(1),
                                     HK=hk, G=g, GP=gp, D=d, SP=max(2, triton.next_power_of_2(n)), num_warps=4)
    return out


def split_kv_attention(q, k, v, mask=None, scale=None, row_start=None, last=None) -> torch.Tensor:
    """The Triton kernel where it can run (CUDA, Triton installed), else the torch reference."""
    if available(q.device):
        return split_kv_triton(q, k, v, mask, scale, row_start, last)
    return split_kv_reference(q, k, v, mask, scale, row_start, last,   # the kernel's numerics, "dot" included
                              fp8_products=k.dtype == FP8 and CONFIG["fp8_convert"] == "dot")


def kv_read_bytes(b: int, hk: int, length: int, d: int, itemsize: int) -> int:
    """Bytes of K and V a decode attention over [0, length) reads (the floor's numerator)."""
    return 2 * b * hk * length * d * itemsize


__all__ = ["CONFIG", "FP8", "FP8_CONVERT", "P_SCALE", "fp8_bits_to_fp16", "quantize_q_fp8", "to_fp8", "available", "split_kv_reference", "split_kv_triton", "split_kv_attention",
           "num_splits", "kv_read_bytes"]
