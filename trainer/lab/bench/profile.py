"""What the benchmark reads of the device while it runs: the GPU's name, host and GPU memory (and its
flatness over a run: the pipeline's buffers are preallocated, so growth is a leak), GPU time per kernel
class (torch.profiler), and the graphs dynamo compiled.
"""

from __future__ import annotations

import platform
import re

import torch

from trainer.ops.compiling import compile_counters


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory from /proc/self/status: VmRSS (all of it), or RssAnon (the heap and
    other anonymous pages only, without the file pages the kernel may evict and fault back in)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mem_snapshot(devices) -> dict:
    out = {"host_rss_bytes": rss_bytes()}
    for d in {str(x): x for x in devices}.values():
        if d.type == "cuda":
            out[f"peak_{d}"] = torch.cuda.max_memory_allocated(d)
            out[f"alloc_{d}"] = torch.cuda.memory_allocated(d)
    return out


def reset_peaks(devices):
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def sync_all(devices):
    for d in {str(x): x for x in devices}.values():
        if d.type == "cuda":
            torch.cuda.synchronize(d)


KERNEL_CLASSES = ["gemm", "attention", "elementwise/reduce (eager)", "fused (triton)", "triton (libraries)",
                  "copy/memset"]


def _kernel_class(name: str) -> str:
    """One of KERNEL_CLASSES for a profiler kernel name. "fused (triton)" is what inductor generated
    (triton_poi_/_red_/_per_...); "triton (libraries)" a library's hand-written Triton kernel, whose name is
    the plain function name (flash-linear-attention's delta-rule, cumsum and conv kernels); eager PyTorch
    kernels carry C++ signatures (void at::native::...)."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "cudnn", "triton_tem")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy/memset"
    if n.startswith("triton_"):
        return "fused (triton)"
    if re.fullmatch(r"[a-z_][a-z0-9_]*", n):
        return "triton (libraries)"
    return "elementwise/reduce (eager)"


def kernel_profile(fn, device, top: int = 12) -> dict:
    """GPU time per kernel class over one call of fn (torch.profiler, CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile
    sync_all([device])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync_all([device])
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append((e.key, us / 1000.0, e.count))
    total = sum(r[1] for r in rows)
    by = {}
    for name, ms, _ in rows:
        c = _kernel_class(name)
        by[c] = by.get(c, 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    return {"gpu_ms": total, "by_class_ms": dict(sorted(by.items(), key=lambda kv: -kv[1])),
            "by_class_share": {k: v / total for k, v in by.items()} if total else {},
            "top": [{"kernel": n[:110], "ms": ms, "calls": c, "class": _kernel_class(n)} for n, ms, c in rows[:top]]}


def compiles_since(before: dict) -> int:
    """Graphs dynamo compiled since `before` (a recompile inside a timed window would be a stall)."""
    now = compile_counters()
    return now.get("unique_graphs", 0) - before.get("unique_graphs", 0)


def memory_flatness(mem_log: list[dict], window: int = 100) -> dict:
    """Peak of each counter over the first and the last `window` steps (halves when the run is shorter),
    and the growth between them: the pipeline's buffers are preallocated, so growth means a leak."""
    if len(mem_log) < 2:
        return {}
    n = min(window, len(mem_log) // 2)
    first, last = mem_log[:n], mem_log[-n:]
    keys = [k for k in mem_log[0] if k != "step"]
    out = {"steps": len(mem_log), "window": n}
    for k in keys:
        a, b = max(m[k] for m in first), max(m[k] for m in last)
        out[k] = {"first_max": a, "last_max": b, "growth_bytes": b - a}
    return out
