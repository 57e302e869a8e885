"""DFlash vs DFlash2, CE vs CE + D-PACE: four drafters on the same data and steps, judged by tau.

    python trainer/lab/gpu/dflash2_compare.py --out results/h200-dflash2-compare.json     # one H200, ~7 minutes

Not part of the test suite: it needs a GPU (`--dry-run` prints the commands and checks their flags, which
tests/lab/test_dflash2_compare.py does on the CPU; `--gpu cpu` runs it all at a tiny size). Offline: nothing is
downloaded. The real pipeline, end to end, as trainer/lab/gpu/fp8_parity.py runs it:

1. dflash-tiny writes a wider random target (width 1,024: the shape of docs/performance.md's "FP8 parity",
   where DFlash's tau reached 1.85 in 640 steps) and data that target generated itself (--device cuda).
2. The drafter stage alone, one variant at a time on the idle GPU: `python -m trainer.lab.bench --parts drafter
   --variants base,dflash2` at --bench-shape (1.7b: width 2,048, the real vocabulary), so DFlash2's cost
   per block row stands beside DFlash's at a real width.
3. Four dflash-train runs started together on the one GPU, the same seed (the same batches in the same
   order), the same flags but the recipe's: dflash/ce, dflash/ce+dpace, dflash2/ce, dflash2/ce+dpace;
   hard labels (--no-use-soft-labels: D-PACE is defined on them, and tau measures the greedy tokens).
   Each evaluates tau every --eval-every steps and at its end with dflash-eval's code (evaluate_state:
   greedy speculative generation on the held-out prompts; DFlash2 through its selector's loop).

The JSON (rewritten every --poll-s seconds, so a time limit still leaves the curves): meta (argv, commit
from bench.git_commit, device, versions, the target's shape), the bench's drafter-stage rates per variant
(block rows/s, tok/s, and dflash2 / dflash), per run every step's loss, the evals, the mean loss of the
last 10% and tau, the LM head's teacher-forced accuracy per position over the last 10% (acc_tail), and a
loss table at a few steps side by side. Each loss is its recipe's own objective (DFlash2's adds the
selector's K-way loss, D-PACE reweights blocks): compare tau and acc_tail across recipes, losses within one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_parity import collect, curve_table  # noqa: E402  (the same records, the same summary)

REPO = Path(__file__).resolve().parents[3]
RUNS = {  # name: the recipe's flags
    "dflash-ce": ["--arch", "dflash", "--loss", "ce"],
    "dflash-dpace": ["--arch", "dflash", "--loss", "ce+dpace"],
    "dflash2-ce": ["--arch", "dflash2", "--loss", "ce"],
    "dflash2-dpace": ["--arch", "dflash2", "--loss", "ce+dpace"],
}
# the target of docs/performance.md's FP8 parity runs (tau ~1.85 after 640 steps of DFlash)
WIDE = {"hidden-size": 1024, "intermediate-size": 3072, "num-heads": 16, "num-kv-heads": 8, "init-range": 0.0175}


def plan(a) -> dict:
    """The commands: {"tiny": argv, "bench": argv or None, "runs": {name: argv}}."""
    work = Path(a.work)
    tiny = work / "tiny"
    gpu = a.gpu
    shape = [] if gpu == "cpu" else [x for k, v in WIDE.items() for x in ("--" + k, str(v))]
    tiny_argv = [sys.executable, "-m", "trainer.tools.tiny", str(tiny), "--num-train", str(a.num_train),
                 "--num-heldout", str(a.eval_prompts), "--force", *shape,
                 *([] if gpu == "cpu" else ["--device", f"cuda:{gpu}"])]
    bench = None
    if a.bench_shape:
        bench = [sys.executable, "-m", "trainer.lab.bench", "--shape", a.bench_shape, "--settings", "b16",
                 "--parts", "drafter", "--variants", "base,dflash2", "--steps", str(a.bench_steps),
                 "--dataset-tokens", str(a.bench_tokens), "--no-flex-check", "--work", str(work / "bench"),
                 "--out", str(work / "bench.json"),
                 *(["--target-gpus", "cpu", "--drafter-gpus", "cpu"] if gpu == "cpu"
                   else ["--target-gpus", gpu, "--drafter-gpus", gpu]),
                 *[x for s in a.bench_set for x in ("--set", s)]]
    runs = {}
    for name in a.runs.split(","):
        runs[name] = [sys.executable, "-m", "trainer", "--target-model", str(tiny / "target"),
                      "--data-dir", str(tiny / "data"), "--output-dir", str(work / name),
                      "--target-gpus", gpu, "--drafter-gpus", gpu, "--max-steps", str(a.steps), "--seed", "0",
                      "--token-budget", str(a.token_budget), "--max-seq-len", "512",
                      "--block-size", str(a.block_size), "--max-anchors", str(a.max_anchors),
                      "--num-draft-layers", str(a.num_draft_layers), "--grad-accum", "1", "--lr", a.lr,
                      "--epochs", "1000", "--save-interval", str(10 ** 6), "--no-use-soft-labels",
                      "--gamma", "10",   # the ce runs' decay as measured (the default until 2026-12-06)
                      "--eval-data-dir", str(tiny / "heldout"), "--eval-prompts", str(a.eval_prompts),
                      "--eval-max-new-tokens", str(a.eval_max_new_tokens), "--eval-every", str(a.eval_every),
                      "--profile-interval", "600", *shlex.split(a.extra), *RUNS[name]]
    return {"tiny": tiny_argv, "bench": bench, "runs": runs}


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a run's log (its one-line error), so the JSON says why a run failed on a machine
    whose /tmp does not come back."""
    try:
        text = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError as e:
        return f"no log ({e.strerror})"
    return " | ".join(text[-lines:])[-1500:]


def bench_rates(path: Path) -> dict:
    """The bench's drafter-stage figures per variant, and DFlash2's over DFlash's."""
    try:
        results = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return {}
    out = {}
    for r in results:
        if "variant" in r and isinstance(r.get("drafter"), dict):
            d = r["drafter"]
            out[r["variant"]] = {k: d.get(k) for k in ("block_rows_per_s", "tok_s", "tflops", "mfu", "error")}
    b, d2 = (out.get(v, {}).get("block_rows_per_s") for v in ("base", "dflash2"))
    if b and d2:
        out["dflash2_over_dflash"] = d2 / b
    return out


def acc_tail(out: Path) -> list[float] | None:
    """Per draft position, the teacher-forced accuracy of the LM head's argmax (metrics' acc) averaged over
    the last 10% of the steps: comparable across the recipes, where the losses are not (DFlash2's adds the
    selector's K-way loss; D-PACE reweights the blocks)."""
    accs = []
    try:
        for line in (out / "metrics.jsonl").read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind", "step") == "step" and r.get("acc"):
                accs.append(r["acc"])
    except OSError:
        return None
    tail = accs[-max(1, len(accs) // 10):]
    return [sum(x[k] for x in tail) / len(tail) for k in range(len(tail[0]))] if tail else None


def summary(res: dict) -> dict:
    """tau per run and each run's difference from dflash-ce (the baseline)."""
    base = res.get("dflash-ce", {}).get("tau")
    return {name: {"tau": r.get("tau"), "final_loss": r.get("final_loss"), "acc_tail": r.get("acc_tail"),
                   "tau_minus_dflash_ce": (r["tau"] - base) if base is not None and r.get("tau") is not None
                   else None}
            for name, r in res.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash2_compare", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="JSON results file (default: $OUT/dflash2-compare.json where $OUT is "
                                             "set, else results/dflash2-compare.json)")
    p.add_argument("--work", default="/tmp/dflash2-compare")
    p.add_argument("--gpu", default="0", help="GPU index, or cpu (a tiny smoke run of the whole script)")
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--eval-every", type=int, default=160)
    p.add_argument("--num-train", type=int, default=2048)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-anchors", type=int, default=64)
    p.add_argument("--num-draft-layers", type=int, default=5)
    p.add_argument("--extra", default="--compile none",
                   help="more dflash-train flags for every run (default: uncompiled, as the FP8 parity runs)")
    p.add_argument("--bench-shape", default="1.7b", help="the drafter-stage bench's shape ('' skips the bench)")
    p.add_argument("--bench-steps", type=int, default=3)
    p.add_argument("--bench-tokens", type=int, default=2_000_000)
    p.add_argument("--bench-set", action="append", default=["compile=none"], metavar="FIELD=VALUE",
                   help="the bench's --set (default compile=none, as the runs)")
    p.add_argument("--poll-s", type=float, default=10.0)
    p.add_argument("--dry-run", action="store_true", help="print the commands, check the runs' flags, run nothing")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    unknown = [n for n in a.runs.split(",") if n not in RUNS]
    if unknown:
        print(f"dflash2_compare: error: --runs: unknown {', '.join(map(repr, unknown))} (known: {', '.join(RUNS)})",
              file=sys.stderr)
        return 2
    if not a.out:
        a.out = str(Path(os.environ["OUT"]) / "dflash2-compare.json") if os.environ.get("OUT") \
            else str(REPO / "results" / "dflash2-compare.json")
    cmds = plan(a)
    if a.dry_run:
        from trainer.config.options import parse_args, validate_flags
        for name, argv_ in cmds["runs"].items():   # the flags as dflash-train reads them (no files read)
            validate_flags(parse_args(argv_[3:]), gpu_count=-1)
        for argv_ in [cmds["tiny"], cmds["bench"], *cmds["runs"].values()]:
            if argv_:
                print(shlex.join(argv_))
        return 0
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    meta = {"argv": sys.argv[1:] if argv is None else list(argv), "gpu": a.gpu, "steps": a.steps,
            "commands": {"tiny": cmds["tiny"][1:], "bench": (cmds["bench"] or [None])[1:],
                         "runs": {n: v[1:] for n, v in cmds["runs"].items()}}}
    try:
        sys.path.insert(0, str(REPO))
        from trainer.lab.bench.run import git_commit
        meta.update(git_commit())
        import torch
        import transformers
        meta.update(torch=torch.__version__, transformers=transformers.__version__,
                    device=torch.cuda.get_device_name(int(a.gpu)) if a.gpu != "cpu" else "cpu")
    except Exception as e:   # the figures stand without these
        meta["versions_error"] = repr(e)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    res, bench = {}, {}

    def write(status: str) -> None:
        meta["wall_s"] = round(time.time() - t0, 1)
        tmp = Path(a.out + ".tmp")
        tmp.write_text(json.dumps({"status": status, "meta": meta, "summary": summary(res),
                                   "drafter_stage": bench, "loss_table": curve_table(res, a.steps), "runs": res},
                                  indent=1) + "\n")
        tmp.replace(a.out)

    subprocess.run(cmds["tiny"], check=True, cwd=REPO)
    meta["tiny_s"] = round(time.time() - t0, 1)
    tiny_json = work / "tiny" / "tiny.json"
    if tiny_json.exists():
        tj = json.loads(tiny_json.read_text())
        meta["target"] = {k: tj.get(k) for k in ("shape", "init_range", "teacher_forced_agreement", "data", "heldout")}
    if cmds["bench"]:   # alone on the GPU, before the runs share it
        t1 = time.time()
        r = subprocess.run(cmds["bench"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        bench.update(bench_rates(work / "bench.json"))
        meta["bench_s"] = round(time.time() - t1, 1)
        if r.returncode != 0:
            bench["error"] = f"exit {r.returncode}: {r.stderr[-1500:]}"
    write("running")

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    procs = {}
    for name, argv_ in cmds["runs"].items():
        out = work / name
        if out.exists():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        log = open(work / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(argv_, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), out, log)
    try:
        while any(proc.poll() is None for proc, _, _ in procs.values()):
            res.update({name: {**collect(out), "acc_tail": acc_tail(out)} for name, (_, out, _) in procs.items()})
            write("running")
            time.sleep(a.poll_s)
    except BaseException:   # a time limit's TERM or ^C: the runs end too, the JSON keeps what they wrote
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.terminate()
        res.update({name: collect(out) for name, (_, out, _) in procs.items()})
        write("stopped")
        raise
    for name, (proc, out, log) in procs.items():
        log.close()
        res[name] = {**collect(out), "acc_tail": acc_tail(out)}
        if proc.returncode != 0:
            res[name]["error"] = f"exit {proc.returncode}: {log_tail(work / (name + '.log'))}"
    write("done")
    print(f"{'run':<14} {'final loss':>10} {'tau':>6}  evals")
    for name, r in res.items():
        evs = " ".join(f"{e['step']}:{e['tau']:.3f}" for e in r["evals"] if e.get("tau") is not None)
        print(f"{name:<14} {r.get('final_loss', float('nan')):>10.4f} {r.get('tau') or float('nan'):>6.3f}  {evs}"
              + (f"  {r['error']}" if "error" in r else ""))
    if "dflash2_over_dflash" in bench:
        print(f"drafter stage ({a.bench_shape}): DFlash2 {bench['dflash2_over_dflash']:.3f}x DFlash's block rows/s")
    print(f"wrote {a.out} ({meta['wall_s']:.0f} s)")
    return 0 if all("error" not in r and r.get("tau") is not None for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
