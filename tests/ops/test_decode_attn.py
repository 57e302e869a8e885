"""The split-KV decode attention (trainer/ops/decode_attn.py; issue 29, goal 3), on the CPU.

Specifications: the plain-torch reference of the algorithm (prefix split into chunks, each with its own
max / sum / output, merged by log-sum-exp; tiles before a row's first position and after the newest one
not read) equals SDPA over the same mask, also when whole chunks are masked; the Triton kernel equals the
reference (Triton's interpreter, where Triton is installed); the captured decoder with
`decode_kernel="triton"` (the reference on the CPU) writes the same tokens as with SDPA; and
`--decode-attention` reaches the decoder and needs `--decoder captured`. The kernel itself is compared
with SDPA on the GPU by trainer/lab/gpu/regenerate_bench.py --decode-attention-parity.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.ops.decode_attn import FP8, num_splits, split_kv_reference, to_fp8

REPO = Path(__file__).resolve().parents[2]


def _case(b, hk, g, length, d, kind, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk * g, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hk, length + 7, d, generator=gen, dtype=dtype)[:, :, :length]   # a view, as the cache's
    v = torch.randn(b, hk, length + 7, d, generator=gen, dtype=dtype)[:, :, :length]
    start = torch.randint(0, length // 2, (b,), generator=gen)
    start[0] = 0
    last = torch.tensor([length - 6])
    pos = torch.arange(length)
    keep = (pos[None] >= start[:, None]) & (pos[None] <= last)
    if kind == "bool":
        mask = keep[:, None, None]
    else:
        mask = torch.zeros(b, 1, 1, length, dtype=dtype).masked_fill(~keep[:, None, None], float("-inf"))
    return q, k, v, mask, start, last, keep


def _sdpa(q, k, v, keep):
    b, h, d = q.shape
    hk = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, hk, h // hk, d), k, v, attn_mask=keep[:, None, None])
    return out.reshape(b, h, d)


@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("g,split_len,block_n", [(4, 64, 16), (4, 10_000, 32), (1, 32, 16), (2, 48, 16)])
def test_the_reference_equals_sdpa(kind, g, split_len, block_n):
    q, k, v, mask, start, last, keep = _case(5, 2, g, 200, 32, kind)
    want = _sdpa(q, k, v, keep)
    for rs, lst in ((None, None), (start, last)):   # skipping tiles changes nothing the mask lets through
        got = split_kv_reference(q, k, v, mask, None, rs, lst, split_len=split_len, block_n=block_n)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_whole_chunks_masked_merge_to_the_unsplit_result():
    """A row whose padding covers several chunks: those chunks have no position (max -inf, sum 0) and must
    weigh nothing in the merge, not NaN."""
    q, k, v, mask, start, last, keep = _case(3, 2, 4, 256, 16, "float")
    start[1] = 200
    keep = (torch.arange(256)[None] >= start[:, None]) & (torch.arange(256)[None] <= last)
    mask = torch.zeros(3, 1, 1, 256).masked_fill(~keep[:, None, None], float("-inf"))
    assert num_splits(256, 32, 16) == 8
    got = split_kv_reference(q, k, v, mask, 0.3, start, last, split_len=32, block_n=16)
    one = split_kv_reference(q, k, v, mask, 0.3, None, None, split_len=10_000, block_n=16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, one, atol=2e-6, rtol=2e-6)
    b, h, d = q.shape
    want = F.scaled_dot_product_attention(q.reshape(b, 2, 4, d), k, v, attn_mask=keep[:, None, None], scale=0.3)
    torch.testing.assert_close(got, want.reshape(b, h, d), atol=2e-6, rtol=2e-6)


def test_the_triton_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    code = r"""
import torch
from trainer.ops.decode_attn import split_kv_reference, split_kv_triton, to_fp8
from tests.ops.test_decode_attn import _case
worst = 0.0
for (b, hk, g, L, d, kind, sl, bn) in [(3, 2, 4, 200, 32, "float", 64, 16), (2, 2, 1, 130, 16, "bool", 32, 16),
                                       (2, 3, 2, 257, 64, "float", 10000, 32)]:
    q, k, v, mask, start, last, keep = _case(b, hk, g, L, d, kind)
    for rs, lst in ((None, None), (start, last)):
        r = split_kv_reference(q, k, v, mask, None, rs, lst, split_len=sl, block_n=bn)
        t = split_kv_triton(q, k, v, mask, None, rs, lst, split_len=sl, block_n=bn)
        worst = max(worst, (r - t).abs().max().item())
# fp16 as well (the GPU runs bf16, whose tl.dot the interpreter does not emulate; fp16's it does)
q, k, v, mask, start, last, keep = _case(2, 2, 4, 200, 32, "float", dtype=torch.float16)
r = split_kv_reference(q, k, v, mask, None, start, last, split_len=64, block_n=16)
t = split_kv_triton(q, k, v, mask, None, start, last, split_len=64, block_n=16)
half = (r.float() - t.float()).abs().max().item()
# an fp8 e4m3 cache (--kv-fp8), read by the same kernel converting its tiles to q's dtype (the "bf16" mode;
# tests/ops/test_decode_attn_fp8.py checks each mode, the default "dot" included, against its reference)
from trainer.ops.decode_attn import CONFIG
CONFIG["fp8_convert"] = "bf16"
kq, vq = to_fp8(k), to_fp8(v)
r = split_kv_reference(q, kq, vq, mask, None, start, last, split_len=64, block_n=16)
t = split_kv_triton(q, kq, vq, mask, None, start, last, split_len=64, block_n=16)
fp8 = (r.float() - t.float()).abs().max().item()
print(worst, half, fp8)
assert worst < 1e-5 and half < 2e-3 and fp8 < 2e-3, (worst, half, fp8)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def target(tiny_small_dir):
    from trainer.serving.evaluate import load_target
    torch.set_num_threads(1)
    return load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)


def test_the_captured_decoder_with_the_split_kv_attention_writes_the_same_tokens(target, tiny_small_dir):
    from trainer.data.dataset import load_dataset
    from trainer.serving.captured.regenerate_decoder import GraphDecoder
    from trainer.serving.evaluate import heldout_prompts

    prompts = heldout_prompts(load_dataset(tiny_small_dir / "data"), 5)   # mixed lengths: left padding
    kw = dict(batch_size=6, max_new_tokens=20, temperature=0.0, stop_ids=[], pad_id=0, view_step=16)
    ref = GraphDecoder(target, "cpu", **kw).generate(prompts, range(5))
    split = GraphDecoder(target, "cpu", decode_kernel="triton", **kw).generate(prompts, range(5))
    assert len({len(p) for p in prompts}) > 1
    assert all(np.array_equal(a, b) for a, b in zip(ref, split))


def test_decode_attention_is_a_switch_of_the_captured_decoder(tiny_small_dir, target, tmp_path, capsys):
    from trainer.serving.regenerate import RegenerateError, TargetGenerator, main

    gen = TargetGenerator(target, "cpu", 8, 0.0, 4, decoder="captured", decode_attention="triton")
    assert gen._fast_decoder().decode_kernel == "triton"
    assert TargetGenerator(target, "cpu", 8, 0.0, 4, decoder="captured")._fast_decoder().decode_kernel == "sdpa"
    with pytest.raises(RegenerateError):
        TargetGenerator(target, "cpu", 8, 0.0, 4, decoder="captured", decode_attention="flash")
    out = tmp_path / "out"
    rc = main(["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(tiny_small_dir / "data"),
               "--output-dir", str(out), "--decoder", "generate", "--decode-attention", "triton"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--decode-attention triton: needs --decoder captured" in err, err
    assert not out.exists()


def test_a_prefill_trimmed_to_each_row_chunks_width_writes_the_same_tokens(target, tiny_small_dir):
    """prefill_trim: a prefill chunk of short prompts runs at its own width (the batch's left padding of those
    rows is not computed; their cache positions before it stay masked): the same tokens."""
    from trainer.data.dataset import load_dataset
    from trainer.serving.captured.kv_cache import PAD_TO
    from trainer.serving.captured.regenerate_decoder import GraphDecoder
    from trainer.serving.evaluate import heldout_prompts

    prompts = heldout_prompts(load_dataset(tiny_small_dir / "data"), 6)
    prompts = sorted(prompts, key=len, reverse=True)
    prompts[0] = np.concatenate(prompts[:3])   # the batch's width 128 or more; the other rows fit in 64
    prompts[-1] = prompts[-1][:3]
    assert len(prompts[0]) > PAD_TO >= max(len(p) for p in prompts[1:])
    kw = dict(batch_size=6, max_new_tokens=16, temperature=0.0, stop_ids=[], pad_id=0, view_step=16,
              prefill_tokens=1)          # one row per prefill chunk
    ref = GraphDecoder(target, "cpu", **kw).generate(prompts, range(6))
    for kernel in ("sdpa", "triton"):
        dec = GraphDecoder(target, "cpu", prefill_trim=True, decode_kernel=kernel, **kw)
        dec.generate(prompts[::-1], range(6))   # a batch before: the cache holds another batch's keys
        trimmed = dec.generate(prompts, range(6))
        assert all(np.array_equal(a, b) for a, b in zip(ref, trimmed)), kernel


def test_an_fp8_cache_is_read_as_its_rounded_values():
    """--kv-fp8: keys and values stored in e4m3 (saturated, never NaN); the attention is that of the rounded
    values, exactly."""
    q, k, v, mask, start, last, keep = _case(3, 2, 4, 160, 32, "float")
    k = k * 100                                  # some beyond e4m3's 448: saturated
    kq, vq = to_fp8(k), to_fp8(v)
    assert kq.dtype == FP8 and torch.isfinite(kq.float()).all() and kq.float().abs().max() == 448
    got = split_kv_reference(q, kq, vq, mask, 0.01, start, last, split_len=64, block_n=16)
    b, h, d = q.shape
    want = F.scaled_dot_product_attention(q.reshape(b, 2, 4, d), kq.float(), vq.float(),
                                          attn_mask=keep[:, None, None], scale=0.01).reshape(b, h, d)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_the_captured_decoder_with_an_fp8_cache(target, tiny_small_dir, tmp_path, capsys):
    """kv_fp8: the decoder runs with its cache in e4m3 (the first token comes from the unrounded prefill, so
    it is the same); it needs the triton attention, and dflash-regenerate refuses it otherwise."""
    from trainer.data.dataset import load_dataset
    from trainer.serving.captured.regenerate_decoder import GraphDecoder
    from trainer.serving.evaluate import heldout_prompts
    from trainer.serving.regenerate import main

    prompts = heldout_prompts(load_dataset(tiny_small_dir / "data"), 4)
    kw = dict(batch_size=4, max_new_tokens=8, temperature=0.0, stop_ids=[], pad_id=0, view_step=16)
    ref = GraphDecoder(target, "cpu", decode_kernel="triton", **kw).generate(prompts, range(4))
    dec = GraphDecoder(target, "cpu", decode_kernel="triton", kv_fp8=True, **kw)
    got = dec.generate(prompts, range(4))
    assert dec.cache.k[0].dtype == FP8
    assert [len(x) for x in got] == [8] * 4 and [x[0] for x in got] == [x[0] for x in ref]
    with pytest.raises(ValueError):
        GraphDecoder(target, "cpu", kv_fp8=True, **kw).generate(prompts, range(4))
    out = tmp_path / "out"
    rc = main(["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(tiny_small_dir / "data"),
               "--output-dir", str(out), "--decoder", "captured", "--kv-fp8", "on"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--kv-fp8 on: needs --decode-attention triton" in err, err
    assert not out.exists()
