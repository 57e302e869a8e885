"""The fp8 cache's conversions in the split-KV decode kernel (decode_attn.CONFIG["fp8_convert"], issue 29 goal 3).

"shift" turns e4m3 bytes into fp16 operands by moving bits (no conversion instruction); the CPU checks that
arithmetic for every byte, and where Triton is installed, each conversion mode of the kernel against the
reference in Triton's interpreter. Speed is measured on the GPU (trainer/lab/gpu/regenerate_bench.py
--attention-check --attn-fp8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.ops.decode_attn import FP8, FP8_CONVERT, fp8_bits_to_fp16, to_fp8

REPO = Path(__file__).resolve().parents[2]


def test_shifted_bits_are_the_e4m3_value_over_256_for_every_byte():
    u = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = u.view(FP8).float()
    got = fp8_bits_to_fp16(u).float() * 256
    finite = ~torch.isnan(want)
    assert int(finite.sum()) == 254                        # 0x7f and 0xff are e4m3fn's NaN
    assert torch.equal(got[finite], want[finite])          # exact: subnormals, zeros and +-448 included
    assert torch.equal(got[~finite].abs(), torch.tensor([480.0, 480.0]))


def test_to_fp8_never_writes_the_nan_code():
    x = torch.tensor([1e6, -1e6, 448.0, 500.0, float("inf")])
    assert not torch.isnan(to_fp8(x).float()).any()


def test_each_fp8_conversion_of_the_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    code = r"""
import torch
from trainer.ops import decode_attn as da
from tests.ops.test_decode_attn import _case
q, k, v, mask, start, last, keep = _case(2, 2, 4, 200, 32, "float", dtype=torch.float16)
kq, vq = da.to_fp8(k), da.to_fp8(v)
r = da.split_kv_reference(q, kq, vq, mask, None, start, last, split_len=64, block_n=16)
# "dot": against the reference that rounds q and the probabilities as the kernel does. Not to the bit: the
# kernel rounds each tile's probabilities against its running max, the reference against the chunk's, and
# the interpreter's fp32 -> e4m3 emulation (Triton 3.x) drops the carry into the exponent (7.89 -> 4, where
# the GPU's cvt.rn gives 8). The bounds catch a wrong scale (q's, the x256 of the probabilities), which is
# off by orders of magnitude; r8 - r is the rounding's own size (mean about 4e-3 here).
r8 = da.split_kv_reference(q, kq, vq, mask, None, start, last, split_len=64, block_n=16, fp8_products=True)
worst, mean = {}, {}
for mode in da.FP8_CONVERT:
    da.CONFIG["fp8_convert"] = mode
    t = da.split_kv_triton(q, kq, vq, mask, None, start, last, split_len=64, block_n=16)
    d = ((r8 if mode == "dot" else r).float() - t.float()).abs()
    worst[mode], mean[mode] = d.max().item(), d.mean().item()
print(worst, mean, (r8 - r).float().abs().mean().item())
assert all(w < 2e-3 for m, w in worst.items() if m != "dot"), worst
assert worst["dot"] < 0.08 and mean["dot"] < 4 * (r8 - r).float().abs().mean().item(), (worst, mean)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_modes_are_named():
    assert set(FP8_CONVERT) == {"bf16", "fp16", "shift", "dot"}
