"""Where SPLIT_BLOCKS=2 loses its gradients: results/h200-split-attention-parity.json showed relative
errors of 1.0 for fc and q_proj when drafter.BlockMerge runs inside compiled drafter layers, while its output
was right and SPLIT_BLOCKS=1 was right. This probe varies one thing at a time on a small drafter (fp32 on the
GPU, against a float64 CPU reference of the dense mask) and records each case's relative errors and gradient
norms:

    python trainer/lab/gpu/split2_compiled_probe.py --out results/h200-split2-compiled-probe.json

- eager: no compile (the reference path of the switch);
- layers_dynamic: compile_layers(dynamic=True), as the trainer does (the failing case);
- layers_static: compile_layers(dynamic=False);
- layers_dynamic_blockmerge_eager: as the trainer, with BlockMerge.apply run outside the graph
  (torch.compiler.disable: a graph break in each layer);
- layers_dynamic_dense_ctx: as the trainer, with the context part by the dense mask instead of FlexAttention
  (is it the pair with FlexAttention's higher-order op, or BlockMerge under dynamo alone?).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch
    import torch._dynamo

    from trainer.lab.bench.checks import flex_check_case
    from trainer.model import drafter as M
    from trainer.ops.compiling import compile_layers

    base, c, taps, emb, proj = flex_check_case(kv_heads=2, ctx_group=0, supervised_from=0)

    def grads(dev, dtype, split, compiled=None, blockmerge_eager=False, dense_ctx=False):
        m = copy.deepcopy(base).to(device=dev, dtype=dtype)
        for layer in m.layers:
            layer.self_attn.split_blocks = ("dense" if dense_ctx else "flex") if split else None
            layer.self_attn.split_fused = split == 2
        saved = M.BlockMerge
        if blockmerge_eager:
            class Eager:   # BlockMerge.apply outside the graph
                apply = staticmethod(torch.compiler.disable(saved.apply))
            M.BlockMerge = Eager
        try:
            if compiled is not None:
                torch._dynamo.reset()
                compile_layers(m.layers, dynamic=compiled)
            meta = M.PackedMeta.from_chunk({k: torch.from_numpy(v).to(dev) for k, v in c.arrays().items()}, 16)
            o = m(taps.to(dev, dtype), emb.to(dev, dtype), meta, backend="flex" if split else "sdpa")
            (o.double() * proj.to(dev)).sum().backward()
        finally:
            M.BlockMerge = saved
        gq = m.layers[0].self_attn.q_proj.weight.grad
        gf = m.fc.weight.grad
        return [o.detach().double().cpu(), None if gf is None else gf.double().cpu(),
                None if gq is None else gq.double().cpu()]

    ref = grads(torch.device("cpu"), torch.float64, 0)
    dev = torch.device("cuda", 0)
    from trainer.lab.bench.run import git_commit
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), **git_commit(), "cases": {}}
    # the cases most likely to tell first (each writes the file): eager FlexAttention with gradients is slow
    cases = {"layers_dynamic": dict(compiled=True),
             "layers_dynamic_blockmerge_eager": dict(compiled=True, blockmerge_eager=True),
             "layers_dynamic_dense_ctx": dict(compiled=True, dense_ctx=True), "layers_static": dict(compiled=False),
             "eager": dict()}
    for split in (2, 1):
        for name, kw in cases.items():
            key = f"split{split}/{name}"
            try:
                got = grads(dev, torch.float32, split, **kw)
                row = {}
                for what, x, y in zip(("out", "grad_fc", "grad_q"), got, ref):
                    row[what] = None if x is None else float((x - y).norm() / y.norm())
                    row[what + "_norm"] = None if x is None else float(x.norm())
                res["cases"][key] = row
            except Exception as e:   # a case that fails is a finding too
                res["cases"][key] = {"error": repr(e)[:400]}
            print(key, json.dumps(res["cases"][key]), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
    res["ref_norms"] = {"grad_fc": float(ref[1].norm()), "grad_q": float(ref[2].norm())}
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
