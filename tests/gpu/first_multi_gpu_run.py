#!/usr/bin/env python
"""The first run of a multi-GPU layout, ready to go: run as is on a machine with 1, 2, 4 or 8 GPUs.

    python tests/gpu/first_multi_gpu_run.py --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7 \
        [--target-model DIR --data-dir DIR] [--steps 200] [--step-bound 900] [--out results/NAME.json]

What it does, in order:
  1. prints the point-to-point mode of the installed torch (whether eager NCCL init serialises unbatched
     P2P with every other op of a group: the build carries that message), and the transport the trainer
     uses (--transport pair: a communicator per (target, drafter) pair, docs/distributed.md);
  2. runs the trainer's own ranks (`python -m trainer`, the supervisor that run.sh starts) at the seed
     recipe (block 32, 1,024 anchors, grad accum 4) for --steps steps on the layout given, with
     TORCH_LOGS=recompiles and NCCL's flight recorder dumping into the output dir; a SIGTERM at half way,
     then the same command again, which resumes;
  3. stops with an error, and the flight recorder's dumps listed, if no step completes within
     --step-bound seconds (a hang: the dumps say which op each rank was in);
  4. runs the same steps again without the interruption and compares the losses (resumed vs
     uninterrupted), counts recompiles after the warmup, and writes per-rank rates and peak GPU memory
     (status.json's ranks) with the verdicts to --out.
Without --target-model/--data-dir it makes a tiny random target and data set (dflash-tiny): ordering,
resume and recompiles are checked, rates are not meaningful then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MESSAGE = b"unbatched P2P ops are treated as independent collective ops"


def p2p_mode() -> dict:
    import torch
    lib = Path(torch.__file__).parent / "lib"
    found = any(MESSAGE in f.read_bytes() for f in lib.glob("libtorch_cuda*.so*") if f.is_file())
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
            "eager_init_serialises_p2p": found}


def status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def run(argv: list[str], out: Path, log: Path, bound: float, stop_at: int | None = None) -> dict:
    """One `python -m trainer` run; SIGTERM once status shows step >= stop_at. Raises on a stall."""
    env = dict(os.environ, TORCH_LOGS="recompiles", PYTHONPATH=str(REPO))
    with open(log, "a") as f:
        p = subprocess.Popen([sys.executable, "-m", "trainer", *argv], stdout=f, stderr=subprocess.STDOUT, env=env)
        last_step, last_t, termed = -1, time.time(), False
        while p.poll() is None:
            st = status(out)
            step = st.get("step") or 0
            if step != last_step or st.get("phase") in ("loading", "warmup", "checkpointing", "starting"):
                last_step, last_t = step, time.time()
            if time.time() - last_t > bound:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()
                dumps = sorted(str(x) for x in out.glob("nccl_trace_rank_*"))
                raise SystemExit(f"first_multi_gpu_run: no step for {bound:.0f}s after step {last_step}: a hang. "
                                 f"Flight recorder dumps: {dumps or 'none (see the log)'}; log {log}")
            if stop_at is not None and not termed and step >= stop_at:
                p.send_signal(signal.SIGTERM)
                termed = True
            time.sleep(1.0)
    if p.returncode != 0:
        raise SystemExit(f"first_multi_gpu_run: trainer exit {p.returncode}; log {log}")
    return status(out)


def losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind", "step") == "step" and r.get("loss") is not None}


def recompiles_after_warmup(log: Path) -> int:
    text = log.read_text(errors="replace")
    after = text.split("warmup done", 1)[1] if "warmup done" in text else ""
    return len(re.findall(r"Recompiling function", after))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-gpus", required=True)
    ap.add_argument("--drafter-gpus", required=True)
    ap.add_argument("--target-model", default="")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-bound", type=float, default=900.0, help="seconds without a step before it is a hang")
    ap.add_argument("--work", default="/tmp/dflash-first-run")
    ap.add_argument("--out", default="")
    ap.add_argument("extra", nargs="*", help="more trainer flags (after --)")
    a = ap.parse_args()
    mode = p2p_mode()
    print("p2p:", json.dumps(mode), "| trainer: --transport pair (a communicator per target-drafter pair), "
          "--fsdp-prefetch step", flush=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    target, data = a.target_model, a.data_dir
    recipe = ["--block-size", "32", "--max-anchors", "1024", "--grad-accum", "4", "--gamma", "10"]
    if not target:
        from trainer.tiny import make_tiny
        make_tiny(work / "tiny", seed=0, num_train=512, num_heldout=8, log=lambda *x, **k: None)
        target, data = str(work / "tiny" / "target"), str(work / "tiny" / "data")
        recipe = ["--block-size", "8", "--max-anchors", "64", "--grad-accum", "4", "--gamma", "4",
                  "--token-budget", "4096", "--max-seq-len", "512", "--num-draft-layers", "2"]
    base = ["--target-model", target, "--data-dir", data, "--target-gpus", a.target_gpus,
            "--drafter-gpus", a.drafter_gpus, "--max-steps", str(a.steps), "--epochs", "100",
            "--save-interval", "100000", "--profile-interval", "60", *recipe, *a.extra]
    resumed, straight = work / "resumed", work / "straight"
    for d in (resumed, straight):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    for name in ("stopped", "resumed", "straight"):      # one log per run: recompiles are counted per run
        (work / f"{name}.log").unlink(missing_ok=True)
    t0 = time.time()
    run([*base, "--output-dir", str(resumed)], resumed, work / "stopped.log", a.step_bound, stop_at=a.steps // 2)
    cut = status(resumed).get("step")
    st = run([*base, "--output-dir", str(resumed)], resumed, work / "resumed.log", a.step_bound)
    wall = time.time() - t0
    run([*base, "--output-dir", str(straight)], straight, work / "straight.log", a.step_bound)
    la, lb = losses(resumed), losses(straight)
    common = sorted(set(la) & set(lb))
    worst = max((abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-12) for s in common), default=None)
    result = {"p2p": mode, "layout": {"target_gpus": a.target_gpus, "drafter_gpus": a.drafter_gpus},
              "argv": base, "steps": st.get("step"), "stopped_at": cut, "wall_s": round(wall, 1),
              "tokens_per_s": st.get("tokens_per_s"), "ranks": st.get("ranks"),
              "resumed_vs_straight": {"steps_compared": len(common), "max_rel_loss_diff": worst},
              "recompiles_after_warmup": {name: recompiles_after_warmup(work / f"{name}.log")
                                          for name in ("stopped", "resumed", "straight")}}
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = st.get("step") == a.steps and worst is not None and worst < 1e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
