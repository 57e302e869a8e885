"""GPU parity of the split attention path (issue 29; --flex-kernel-options SPLIT_BLOCKS=true, bench variant
`split`): FlexAttention over the context keys with its log-sum-exp, the in-block part apart, merged.

    python tests/gpu/split_attention.py --out results/h200-split-attention-parity.json

The CPU has no FlexAttention backward, so tests/test_split_attention.py checks the split path's gradients
with a dense context part; here the real one runs, with
gradients, against a float64 CPU reference of the dense-mask model (trainer.bench.check_flex_on_gpu):
compiled alone and inside compiled layers, grouped-query attention with 2 and 4 KV heads, and a loss mask
from position 0, so that some blocks anchor at 0 and see no context (their context log-sum-exp is -inf)
while the others see some. Passes when every relative error is below 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch
    from trainer.bench import check_flex_on_gpu
    dev = torch.device("cuda", 0)
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    # eager FlexAttention materialises every score with its gradient: slow, and the compiled kernels are
    # what trains, so the check runs them only (compiled alone and inside compiled layers)
    res["split_anchor0"] = check_flex_on_gpu(dev, split=True, cases=((2, 0), (4, 0)), supervised_from=0,
                                             eager=False)
    errs = [v for r in res["split_anchor0"].values() for k in r.values()
            for v in (k.values() if isinstance(k, dict) else [k])]
    res["passed"] = all(isinstance(e, float) and e < 1e-4 for e in errs)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
