"""The benchmark's checks that are not timings: host memory per new attention input shape
(`probe_shape_cache`, --shape-cache-probe), and FlexAttention's parity with the dense-mask SDPA path and a
float64 CPU reference on the GPU (`check_flex_on_gpu`, run before a GPU benchmark unless --no-flex-check).
"""

from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from trainer.lab.bench.profile import rss_bytes
from trainer.lab.bench.shapes import make_target_factory

log = logging.getLogger("trainer.bench")

def probe_shape_cache(shape: str, device: torch.device, dtype, backends: list[str], n_shapes: int,
                      layers: int = 2, tokens: int = 16384) -> list[dict]:
    """Host memory per new attention input shape: a `layers`-layer target of `shape` runs forward (as the
    target worker does: inference mode, one thread of its own, one SDPA backend) over `n_shapes` batch
    shapes [B, S] it has not seen, then over the same shapes again. Per-shape caches (cuDNN's SDPA graph
    cache is one: per thread, keyed on exact shapes, unbounded) grow host RSS in the first pass only.
    RSS is read again after malloc_trim(0), which separates memory that is held from free memory glibc
    has not given back. RSS here is anonymous memory (RssAnon), what a cache holds: on a loaded host the
    kernel can evict pages of the mapped libraries and fault them back in, which moves VmRSS."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from trainer.model.target import decoder as _decoder
    from trainer.ops.compiling import sdpa_context
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except OSError:
        trim = lambda _: 0
    model = make_target_factory(shape, dtype, layers)(device)
    vocab = model.config.vocab_size
    decoder = _decoder(model)
    rows: list[dict] = []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_pass(backend, shapes):
        with torch.inference_mode(), sdpa_context(backend, device.type):
            for b, s in shapes:
                decoder(input_ids=torch.randint(0, vocab, (b, s), device=device), use_cache=False)
        sync()

    def body():
        for j, backend in enumerate(backends):
            # lengths no other backend's pass used (offset j), one [B, S] per length
            lens = [64 + 16 * i + j for i in range(n_shapes)]
            shapes = [(max(1, tokens // s), s) for s in lens]
            try:
                run_pass(backend, [(1, 64 + j)])  # first call: kernels load, handles are created
            except RuntimeError as e:  # e.g. 'efficient' has no kernel for grouped-query attention here
                rows.append({"backend": backend, "pass": "(not run)", "shapes": 0, "seconds": 0.0,
                             "rss_growth_bytes": 0, "rss_growth_after_trim_bytes": 0, "per_shape_bytes": 0,
                             "error": str(e).splitlines()[0][:200]})
                log.warning("shape-cache probe: backend %s cannot run this model: %s", backend, rows[-1]["error"])
                continue
            gc.collect()
            trim(0)
            base = rss_bytes("RssAnon")
            for label in ("new shapes", "same shapes again"):
                t0 = time.perf_counter()
                run_pass(backend, shapes)
                gc.collect()
                rss = rss_bytes("RssAnon")
                trim(0)
                rss_trim = rss_bytes("RssAnon")
                rows.append({"backend": backend, "pass": label, "shapes": len(shapes),
                             "seconds": round(time.perf_counter() - t0, 3),
                             "rss_growth_bytes": rss - base, "rss_growth_after_trim_bytes": rss_trim - base,
                             "per_shape_bytes": (rss - base) / len(shapes)})
                log.info("shape-cache probe: %s %s: RSS +%.1f MB (+%.1f MB after malloc_trim) over %d shapes",
                         backend, label, (rss - base) / 1e6, (rss_trim - base) / 1e6, len(shapes))
                base = rss_trim

    with ThreadPoolExecutor(1, thread_name_prefix="shape-cache-probe") as pool:
        pool.submit(body).result()  # re-raises the thread's error here
    model = decoder = None   # frees them (a del would unbind the name run_pass reads)
    gc.collect()
    return rows


def flex_check_case(kv_heads: int, ctx_group: int = 0, supervised_from: int = 4):
    """The small drafter and one planned chunk that the attention parity checks run (check_flex_on_gpu,
    trainer/lab/gpu/split2_compiled_probe.py): (drafter, chunk, taps, embeddings, projection of the loss), float64,
    seeded. supervised_from 0: the loss mask starts at position 0 (blocks anchored at 0 see no context)."""
    from trainer.model import drafter as M
    from trainer.ops.plan import plan_micro_batch
    cfg = M.DFlashConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, head_dim=64, vocab_size=1000, rms_norm_eps=1e-6,
                         rope_theta=1e6, max_position_embeddings=8192, block_size=16, target_layer_ids=[0, 1],
                         mask_token_id=999, target_num_hidden_layers=4)
    base = M.DFlashDrafter(cfg)
    M.init_drafter_weights(base, std=0.05)
    rng = np.random.default_rng(0)
    lens = np.array([700, 300, 1200])
    ids = rng.integers(0, 998, size=(len(lens), lens.max()))
    mask = np.zeros(ids.shape, bool)
    for b, n in enumerate(lens):
        mask[b, n // supervised_from if supervised_from else 0:n] = True
    plan = plan_micro_batch(ids, mask, lens, list(range(len(lens))), 0, seed=0, block_size=16,
                            max_anchors=64, mask_token_id=999, gamma=7.0, soft_labels=False,
                            chunk_rows=10**6, flex=True, ctx_group=ctx_group)
    c = plan.chunks[0]
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(len(c.ctx_seq), 512, generator=g, dtype=torch.float64)
    emb = torch.randn(len(c.q_seq), 256, generator=g, dtype=torch.float64)
    proj = torch.randn(len(c.q_seq), 256, generator=g, dtype=torch.float64)  # loss = <out, proj>
    return base, c, taps, emb, proj


def check_flex_on_gpu(device, split: bool | int = False, cases=((2, 0), (4, 0), (2, 2), (4, 1)),
                      supervised_from: int = 4, eager: bool = True) -> dict:
    """FlexAttention (compiled and eager, with grads) against the dense-mask SDPA path and a float64 CPU
    reference, with and without grouped-query attention, with one shared context and with context copies
    (--flex-ctx-group). split: the flex runs take the split path (SPLIT_BLOCKS=1 or 2). supervised_from 0: the
    loss mask starts at position 0, so some blocks anchor at 0 and see no context."""
    from trainer.model import drafter as M
    out = {}
    for kv_heads, ctx_group in cases:
        base, c, taps, emb, proj = flex_check_case(kv_heads, ctx_group, supervised_from)

        def grads(dev, dtype, backend, compiled=True, layers_compiled=False):
            m = __import__("copy").deepcopy(base).to(device=dev, dtype=dtype)
            for layer in m.layers:
                layer.self_attn.split_blocks = "flex" if split and backend == "flex" else None
                layer.self_attn.split_fused = split == 2
            if layers_compiled:
                from trainer.ops.compiling import compile_layers
                compile_layers(m.layers, dynamic=True)
            t = lambda a: torch.from_numpy(a).to(dev)
            meta = M.PackedMeta.from_chunk({k: t(v) for k, v in c.arrays().items()}, 16)
            saved = M._compiled_flex
            if not compiled:
                from torch.nn.attention.flex_attention import flex_attention
                M._compiled_flex = flex_attention
            try:
                o = m(taps.to(dev, dtype), emb.to(dev, dtype), meta, backend=backend)
                (o.double() * proj.to(dev)).sum().backward()
            finally:
                M._compiled_flex = saved
            return o.detach().double().cpu(), m.fc.weight.grad.double().cpu(), m.layers[0].self_attn.q_proj.weight.grad.double().cpu()

        ref = grads(torch.device("cpu"), torch.float64, "sdpa")
        rel = lambda a, b: float((a - b).norm() / b.norm())
        res = {}
        for name, args in (("sdpa_gpu", ("sdpa", True)), ("flex_compiled", ("flex", True)),
                           ("flex_eager", ("flex", False)), ("flex_in_compiled_layers", ("flex", True, True))):
            if name == "flex_eager" and not eager:
                continue
            try:
                r = grads(device, torch.float32, *args)
                res[name] = {"out": rel(r[0], ref[0]), "grad_fc": rel(r[1], ref[1]), "grad_q": rel(r[2], ref[2])}
            except Exception as e:
                res[name] = {"error": repr(e)[:300]}
        out[f"kv_heads={kv_heads},ctx_group={ctx_group}"] = res
    return out
