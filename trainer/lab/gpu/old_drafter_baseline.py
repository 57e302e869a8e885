"""Re-measure an older checkout's drafter stage on one GPU, in the same device call as today's code.

    git archive df36c97 trainer | tar -x -C .bench_old
    python trainer/lab/gpu/old_drafter_baseline.py .bench_old --target-layers 8 -- \
        --shape 27b --settings b16 --steps 2 --parts drafter --target-gpus 0 --drafter-gpus 0 ...

Not part of the test suite. A speed-up is a ratio against the code before it (the in-process engine,
e.g. df36c97), whose figures were taken on another machine; so this runs that code's own
`python -m trainer.bench` again beside today's. Runs only that checkout's bench `main` with the
arguments after `--`; nothing of today's trainer is imported.

Two changes, each only when asked for. With --target-layers N: the older bench builds the target model on the drafter's GPU
even for the drafter-alone part (today's drops it first), and a 27B-class target (53 GB) does not fit one
H200 beside the 27B-width drafter. The drafter-alone part feeds the drafter random tap tensors, so the
target's depth changes none of the timed work: the target is cut to its first N layers, as long as the
drafter still gets as many distinct taps as before (checked; N = 8 gives taps [1, 2, 3, 4, 5]). The JSON's
meta records the cut.

With --no-freeze, the older trainer does not freeze its compiled graphs after the warmup. That code
(df36c97) freezes them, and then the multi-sequence drafter chunks its one-sequence warmup did not cover
run FlexAttention eagerly: at 27b that materialises a 51.6 GiB score matrix and runs out of memory. The
27.9K figure of results/h200x2-27b-b16-compiled.json was taken before the freeze existed (its log says
"warmup done", not "graphs frozen"): the bench's first, untimed step compiled those shapes. --no-freeze
restores that; the JSON's compiles_in_timed_window says whether a timed step compiled anyway.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="old_drafter_baseline", description=__doc__.splitlines()[0])
    p.add_argument("checkout", help="a directory holding the older trainer/ package")
    p.add_argument("--target-layers", type=int, default=0, help="cut the target to its first N layers (0: keep)")
    p.add_argument("--no-freeze", action="store_true", help="leave compiled graphs unfrozen after the warmup")
    a = p.parse_args(own)
    root = Path(a.checkout).resolve()
    # where the checkout keeps its bench: the flat layout before the wings, the wings', or the lab's
    layouts = {"flat": "trainer/bench.py", "wings": "trainer/tools/bench.py", "lab": "trainer/lab/bench/run.py"}
    layout = next((k for k, f in layouts.items() if (root / f).is_file()), None)
    if layout is None:
        print(f"old_drafter_baseline: {a.checkout}: no {', '.join(layouts.values())} there", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    if layout == "flat":   # the older checkout's, from here on
        from trainer import bench, model, train
    else:
        from trainer.engine import train
        from trainer.model import drafter as model
        if layout == "wings":
            from trainer.tools import bench
        else:
            from trainer.lab.bench import run as bench
    if a.no_freeze:
        train.freeze_compiled = lambda on: None

    shape = rest[rest.index("--shape") + 1] if "--shape" in rest else "tiny"
    cut = None
    if a.target_layers:
        sets = bench.parse_sets([rest[i + 1] for i, x in enumerate(rest[:-1]) if x == "--set"])
        taps = sets.get("num_draft_layers", bench.TrainConfig.num_draft_layers)   # one tap per drafter layer
        layers = bench.SHAPES[shape].layers
        before, after = model.tap_layers(layers, taps), model.tap_layers(a.target_layers, taps)
        if len(set(after)) != len(before):
            print(f"old_drafter_baseline: --target-layers {a.target_layers}: gives taps {after}, "
                  f"not {len(before)} distinct ones like {before}", file=sys.stderr)
            return 2
        bench.make_target_factory = functools.partial(bench.make_target_factory, layers=a.target_layers)
        cut = {"target_layers": a.target_layers, "of": layers, "taps": after, "taps_uncut": before}
    rc = bench.main(rest)
    out = rest[rest.index("--out") + 1] if "--out" in rest else ""
    if out and Path(out).is_file():
        d = json.loads(Path(out).read_text())
        d["meta"]["baseline"] = {"checkout": str(root), "target_cut": cut, "no_freeze": a.no_freeze}
        Path(out).write_text(json.dumps(d, indent=2, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
