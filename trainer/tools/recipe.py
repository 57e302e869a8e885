"""The recipe judged by tau on a real model: one training run per variant, the same data, seed and token
budget, each measured on held-out prompts at greedy and at T = 1, with its learning curve.

    python -m trainer.tools.recipe --target-model DIR --data-dir DIR [--raw-data-dir DIR] --heldout DIR
        --out results/real-recipe-cpu.json [--variants base,b32,...] [--steps 300] [--eval-every 50]
        [--device cpu | --gpu 0] [--set FLAG=VALUE ...]

Variants (each changes one thing against `base`, DFlash at block 16, gamma 7, soft labels, annealed
noise, CE, on regenerated data):
    base, b32 (block 32, gamma 10: the seed recipe's block), dflash2, hard (hard labels), dpace (CE + D-PACE,
    hard labels: compare with `hard`), nonoise (noise off), raw (--raw-data-dir: human-written answers
    instead of the target's own)
Writes one JSON (rows: variant, flags, tau greedy and T=1, the curve [step, tokens, tau], seconds) with the
commit, and an SVG of the curves beside it. The run's own logs stay under OUT's directory/recipe-runs/.
Exit codes: 0 done, 2 bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROG = "recipe"
VARIANTS = {
    "base": [],
    "b32": ["--block-size", "32", "--gamma", "10"],
    "dflash2": ["--arch", "dflash2"],
    "hard": ["--no-use-soft-labels"],
    "dpace": ["--no-use-soft-labels", "--loss", "ce+dpace"],
    "nonoise": ["--noise-start", "0", "--noise-end", "0"],
    "raw": [],   # the same flags on --raw-data-dir
}
BASE = ["--block-size", "16", "--gamma", "7", "--seed", "0", "--save-interval", "100000", "--keep-checkpoints", "1"]


def run_variant(name: str, a, work: Path, log) -> dict:
    out = work / name
    data = a.raw_data_dir if name == "raw" else a.data_dir
    devs = ["--target-gpus", "cpu", "--drafter-gpus", "cpu"] if a.gpu is None else \
        ["--target-gpus", str(a.gpu), "--drafter-gpus", str(a.gpu)]
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in (s.split("=", 1) for s in a.set)]
    cmd = [sys.executable, "-m", "trainer", "--target-model", a.target_model, "--data-dir", data,
           "--output-dir", str(out), *devs, *BASE, *VARIANTS[name], *extra, "--max-steps", str(a.steps),
           "--eval-data-dir", a.heldout, "--eval-every", str(a.eval_every), "--eval-prompts", str(a.eval_prompts),
           "--eval-max-new-tokens", str(a.eval_tokens), "--no-resume"]
    t0 = time.monotonic()
    log(f"{name}: {' '.join(cmd[2:])}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"variant": name, "error": (r.stderr.strip().splitlines() or ["?"])[-1], "flags": VARIANTS[name]}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tokens, curve = 0, []
    for m in metrics:
        if m.get("kind") == "eval":
            curve.append([m["step"], tokens, m["tau"]])
        elif "tokens" in m:
            tokens += int(m["tokens"])
    row = {"variant": name, "flags": VARIANTS[name], "data": str(data), "steps": a.steps, "tokens": tokens,
           "curve": curve, "train_seconds": round(time.monotonic() - t0, 1)}
    dev = "cpu" if a.gpu is None else f"cuda:{a.gpu}"
    for key, temp in (("tau_greedy", "0"), ("tau_t1", "1")):
        e = subprocess.run([sys.executable, "-m", "trainer.serving.evaluate", "--target-model", a.target_model,
                            "--output-dir", str(out), "--data-dir", a.heldout, "--device", dev, "--temperature",
                            temp, "--max-prompts", str(a.eval_prompts), "--max-new-tokens", str(a.eval_tokens),
                            "--no-block-accuracy", "--json"], capture_output=True, text=True)
        row[key] = json.loads(e.stdout.strip().splitlines()[-1])["tau"] if e.returncode == 0 else None
    log(f"{name}: tau {row['tau_greedy']} greedy, {row['tau_t1']} at T=1 after {tokens} tokens")
    return row


def svg(rows: list[dict], path: Path, title: str) -> None:
    """Tau against training tokens, one polyline a variant (no plotting package needed)."""
    pts = [(c[1], c[2]) for r in rows for c in r.get("curve", [])]
    if not pts:
        return
    x1, y0 = max(p[0] for p in pts) or 1, 1.0
    y1 = max(max(p[1] for p in pts), 1.1)
    w, h, m = 640, 360, 48
    sx = lambda x: m + (w - 2 * m) * x / x1  # noqa: E731
    sy = lambda y: h - m - (h - 2 * m) * (y - y0) / (y1 - y0)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{m}" y="20" font-size="13">{title}</text>',
             f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
             f'<text x="{w / 2}" y="{h - 12}">training tokens (max {x1:,})</text>',
             f'<text x="6" y="{m - 8}">tau</text>',
             f'<text x="{m - 30}" y="{sy(y0) + 4}">{y0:.2f}</text><text x="{m - 30}" y="{sy(y1) + 4}">{y1:.2f}</text>']
    for i, r in enumerate(rows):
        c = r.get("curve") or []
        if not c:
            continue
        col = colors[i % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="'
                     + " ".join(f"{sx(t):.1f},{sy(tau):.1f}" for _, t, tau in c) + '"/>')
        parts.append(f'<text x="{w - m + 4 - 40}" y="{m + 14 * i}" fill="{col}">{r["variant"]}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-model", required=True)
    ap.add_argument("--data-dir", required=True, help="regenerated training shards")
    ap.add_argument("--raw-data-dir", default="", help="the same prompts with human-written answers (variant raw)")
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--out", required=True, help="the result JSON (the SVG goes beside it, or to --svg)")
    ap.add_argument("--svg", default="")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--gpu", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], help="FLAG=VALUE for every variant, e.g. max_anchors=64")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        print(f"{PROG}: error: --variants: unknown {bad or 'none given'} (known: {', '.join(VARIANTS)})",
              file=sys.stderr)
        return 2
    if "raw" in names and not a.raw_data_dir:
        print(f"{PROG}: error: --variants raw needs --raw-data-dir", file=sys.stderr)
        return 2
    if a.steps < 1 or a.eval_every < 1 or any("=" not in s for s in a.set):
        print(f"{PROG}: error: --steps and --eval-every must be >= 1, --set takes FLAG=VALUE", file=sys.stderr)
        return 2
    out = Path(a.out)
    work = out.parent / "recipe-runs" / out.stem
    work.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"{PROG}: {msg}", flush=True)  # noqa: E731
    rows = [run_variant(n, a, work, log) for n in names]
    from trainer.tools.bench import git_commit  # the one commit record results/INDEX.md reads
    doc = {**git_commit(), "target_model": a.target_model, "steps": a.steps, "eval_prompts": a.eval_prompts,
           "eval_tokens": a.eval_tokens, "device": "cpu" if a.gpu is None else f"cuda:{a.gpu}",
           "set": a.set, "base_flags": BASE, "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    svg(rows, Path(a.svg) if a.svg else out.with_suffix(".svg"), f"tau on held-out prompts ({doc['device']}, {a.steps} steps)")
    print("| variant | tau greedy | tau T=1 | tokens |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r.get('tau_greedy')} | {r.get('tau_t1')} | {r.get('tokens', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
