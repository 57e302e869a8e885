"""The recipe judged by tau on a real model: one training run per variant, the same data, seed, steps and
token budget, each measured on held-out prompts at greedy and at T = 1, with its learning curve.

    python -m trainer.lab.recipe --cache DIR --work DIR --out results/real-recipe.json
        [--variants base,b32,...] [--steps 400] [--eval-every 50] [--device cpu | cuda:0]
        [--parallel N] [--deadline-s S] [--set FLAG=VALUE ...] [--train-prompts FILE]
        [--speed-prompts N] [--speed-batch 1,16] [--t1-prompts N]

`--cache` is dflash-real's cache (the model and the prompt sets). The data is built once under --work and
reused: the held-out HumanEval prompts (dflash-prepare), the training prompts' completions written by the
target itself (dflash-regenerate, greedy), and for the `raw` variant the same prompts with the library's own
source as the answer. Then every variant trains as its own dflash-train run (up to --parallel at once on
the one device), with the in-training eval every --eval-every steps giving its curve, and at its end
dflash-eval measures tau on --final-prompts held-out prompts greedy (batched loop), on --t1-prompts at T = 1,
and on the first --speed-prompts the wall clock: the target decoding alone against speculative decoding with
the drafter and with prompt lookup (the n-gram baseline), at each --speed-batch, outputs checked lossless;
the speed evals run last and alone on the device, so that no other eval shares the clock.
--train-prompts picks the training prompts (dflash-real --prompts large writes the set at scale).

Variants (each changes one thing against `base`: DFlash at block 16, gamma 7, soft labels, annealed noise,
CE, on regenerated data, every one of these passed explicitly, so a change of the trainer's defaults does not
move them; the other flags are --set's and BASE's):
    base, b32 (block 32, gamma 10: the seed recipe's block, the default until 2026-12-06), dflash2, hard (hard labels),
    dpace (CE + D-PACE, hard labels: compare with `hard`; the trainer's defaults since 2026-12-06), nonoise (noise off), raw (human-written answers
    instead of the target's own)
Rerunnable: a variant's run resumes from its last checkpoint, a finished one is not retrained, and a
measured tau is kept. --deadline-s stops the runs (SIGTERM: each writes a checkpoint) and returns; the
same command later carries on. The JSON (rewritten as the runs go) holds the commit, the flags, per variant
the curve [step, tokens, tau], the final tau at greedy and T = 1, the speed table and the seconds; an SVG of the curves goes
beside it, and each in-training eval's loop and seconds (`eval_loops`: [step, loop, seconds]). Exit codes: 0 done or stopped at the deadline, 1 a run failed, 2 bad arguments (one line on
stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.model import architectures

PROG = "recipe"
VARIANTS = {
    "base": [],
    "b32": ["--block-size", "32", "--gamma", "10"],
    **{name: ["--arch", name] for name in architectures.names() if name != architectures.DEFAULT},
    "hard": ["--no-use-soft-labels"],
    "dpace": ["--no-use-soft-labels", "--loss", "ce+dpace"],
    "nonoise": ["--noise-start", "0", "--noise-end", "0"],
    "raw": [],   # the same flags on the raw completions
}
BASE = ["--block-size", "16", "--gamma", "7", "--use-soft-labels", "--loss", "ce", "--seed", "0",
        "--keep-checkpoints", "1"]
MODEL_DIR = "smollm2-135m-instruct"


def tool(fn: str, *args) -> list[str]:
    """A console script's command line without its installed entry point (trainer/cli.py)."""
    return [sys.executable, "-c", f"import sys, trainer.cli as c; sys.exit(c.{fn}(sys.argv[1:]))", *map(str, args)]


class Recipe:
    def __init__(self, a):
        self.a = a
        self.cache, self.work, self.out = Path(a.cache), Path(a.work), Path(a.out)
        self.model = self.cache / MODEL_DIR
        self.t0 = time.monotonic()
        self.extra = [f"--{k.replace('_', '-')}={v}" for k, v in (s.split("=", 1) for s in a.set)]

    def log(self, msg: str) -> None:
        print(f"{PROG} [{time.monotonic() - self.t0:6.0f}s]: {msg}", flush=True)

    def left(self) -> float:
        return (self.a.deadline_s or 1e12) - (time.monotonic() - self.t0)

    # ---------------------------------------------------------------------------------------- data

    def sh(self, cmd: list[str], what: str, logfile: Path) -> None:
        self.log(f"{what}: {' '.join(cmd[3:])}")
        t = time.monotonic()
        with open(logfile, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            tail = logfile.read_text().strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{what} failed (exit {r.returncode}): {tail[0]} (log {logfile})")
        self.log(f"{what}: done in {time.monotonic() - t:.0f}s")

    def train_prompts(self) -> Path:
        """The prompt-only JSONL the target answers: --train-prompts, else dflash-real's small set."""
        return Path(self.a.train_prompts) if self.a.train_prompts else self.cache / "prompts" / "stdlib.jsonl"

    def data(self, names: list[str]) -> dict[str, Path]:
        d = self.work / "data"
        d.mkdir(parents=True, exist_ok=True)
        prompts = self.cache / "prompts"
        want = {"heldout": prompts / "humaneval.jsonl"}
        if "raw" in names:
            want["raw"] = prompts / "stdlib-raw.jsonl"
        for name, src in want.items():
            if not (d / name / "index.json").is_file():
                self.sh(tool("prepare", "--target-model", self.model, "--input", src, "--output-dir", d / name,
                             "--max-seq-len", self.a.max_seq_len), f"prepare {name}", d / f"{name}.log")
        if any(n != "raw" for n in names):
            # dflash-regenerate checks each finished shard's sha256 on a rerun and does only what is missing
            self.sh(tool("regenerate", "--target-model", self.model, "--input", self.train_prompts(),
                         "--output-dir", d / "regen", "--max-new-tokens", self.a.regen_tokens,
                         "--batch-size", self.a.regen_batch, "--max-records", self.a.regen_records,
                         "--device", self.a.device, "--json"),
                    "regenerate", d / "regen.log")
            self.keep_regen_stats(d)
        return {"heldout": d / "heldout", "regen": d / "regen", "raw": d / "raw"}

    def keep_regen_stats(self, d: Path) -> None:
        """dflash-regenerate's summary (its last line: tokens, seconds, tok/s) into regen-stats.json; a rerun that
        found every shard done generated nothing and keeps the first run's figures."""
        try:
            stats = json.loads((d / "regen.log").read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            return
        if isinstance(stats, dict) and stats.get("shards_generated"):
            (d / "regen-stats.json").write_text(json.dumps(stats, indent=1) + "\n")

    def regen_stats(self) -> dict | None:
        try:
            return json.loads((self.work / "data" / "regen-stats.json").read_text())
        except (OSError, ValueError):
            return None

    # ---------------------------------------------------------------------------------------- runs

    def devices(self) -> list[str]:
        dev = self.a.device
        gpu = "cpu" if dev == "cpu" else dev.split(":", 1)[1] if ":" in dev else "0"
        return ["--target-gpus", gpu, "--drafter-gpus", gpu]

    def train_cmd(self, name: str, data: dict[str, Path]) -> list[str]:
        a = self.a
        return [sys.executable, "-m", "trainer", "--target-model", str(self.model),
                "--data-dir", str(data["raw" if name == "raw" else "regen"]),
                "--output-dir", str(self.run_dir(name)), *self.devices(), *BASE, *VARIANTS[name], *self.extra,
                "--max-steps", str(a.steps), "--save-interval", str(a.eval_every),
                "--eval-data-dir", str(data["heldout"]), "--eval-every", str(a.eval_every),
                "--eval-prompts", str(a.eval_prompts), "--eval-max-new-tokens", str(a.eval_tokens)]

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def row(self, name: str) -> dict:
        """What the run directory says: the curve from metrics.jsonl, the final taus once measured."""
        rd = self.run_dir(name)
        row = {"variant": name, "flags": VARIANTS[name], "data": "raw" if name == "raw" else "regenerated"}
        try:
            row.update(json.loads((rd / "recipe.json").read_text()))
        except (OSError, ValueError):
            pass
        tokens, curve, evals, step = 0, [], [], 0
        try:
            lines = (rd / "metrics.jsonl").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                m = json.loads(line)
            except ValueError:
                continue   # a line being written
            if m.get("kind") == "eval":
                if "tau" in m:
                    curve.append([m["step"], tokens, m["tau"]])
                    evals.append([m["step"], m.get("loop"), m.get("seconds")])   # the generation's seconds
            elif "tokens" in m and "step" in m and m["step"] > step:   # a resumed run repeats no step
                tokens += int(m["tokens"])
                step = m["step"]
        row.update(step=step, tokens=tokens, curve=curve, eval_loops=evals)
        return row

    def save_row(self, name: str, **kv) -> None:
        p = self.run_dir(name) / "recipe.json"
        try:
            cur = json.loads(p.read_text())
        except (OSError, ValueError):
            cur = {}
        cur.update(kv)
        p.write_text(json.dumps(cur, indent=1) + "\n")

    def write(self, names: list[str], state: str) -> list[dict]:
        from trainer.lab.bench.run import git_commit  # the one commit record results/INDEX.md reads
        rows = [self.row(n) for n in names]
        a = self.a
        doc = {**git_commit(), "state": state, "target_model": MODEL_DIR, "device": a.device,
               "device_name": device_name(a.device), "steps": a.steps, "eval_every": a.eval_every,
               "eval_prompts": a.eval_prompts, "eval_tokens": a.eval_tokens, "final_prompts": a.final_prompts,
               "final_tokens": a.final_tokens, "t1_prompts": a.t1_prompts or a.final_prompts,
               "speed_prompts": a.speed_prompts, "speed_batch": a.speed_batch,
               "train_prompts": str(self.train_prompts()), "regen_tokens": a.regen_tokens, "regen_records": a.regen_records, "set": a.set, "base_flags": BASE,
               "regeneration": self.regen_stats(), "rows": rows}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(doc, indent=1) + "\n")
        svg(rows, Path(a.svg) if a.svg else self.out.with_suffix(".svg"),
            f"tau on held-out HumanEval prompts ({doc['device_name']}, {a.steps} steps)")
        return rows

    def train(self, names: list[str], data: dict[str, Path]) -> bool:
        """Every variant to --steps (or the deadline); True when all reached it."""
        todo = [n for n in names if self.row(n)["step"] < self.a.steps and "error" not in self.row(n)]
        running: dict[str, tuple[subprocess.Popen, float]] = {}
        stopping = False
        last_write = 0.0
        while todo or running:
            while todo and len(running) < self.a.parallel and not stopping:
                n = todo.pop(0)
                rd = self.run_dir(n)
                rd.mkdir(parents=True, exist_ok=True)
                cmd = self.train_cmd(n, data)
                self.log(f"{n}: start ({' '.join(cmd[4:])})")
                with open(rd / "recipe-train.log", "a") as f:
                    running[n] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                   start_new_session=True), time.monotonic())
            time.sleep(self.a.poll_s)
            if not stopping and self.left() < self.a.stop_margin_s:
                self.log(f"deadline: stopping {', '.join(running) or 'nothing'} (each writes a checkpoint); "
                         "the same command carries on")
                for p, _ in running.values():
                    os.killpg(p.pid, signal.SIGTERM)
                stopping, todo = True, []
            for n, (p, started) in list(running.items()):
                if p.poll() is None:
                    continue
                del running[n]
                secs = time.monotonic() - started
                prev = self.row(n).get("train_seconds", 0.0)
                self.save_row(n, train_seconds=round(prev + secs, 1))
                r = self.row(n)
                if p.returncode != 0 and not stopping:
                    tail = (self.run_dir(n) / "recipe-train.log").read_text().strip().splitlines()[-1:] or ["?"]
                    self.save_row(n, error=f"exit {p.returncode}: {tail[0]}")
                    self.log(f"{n}: FAILED (exit {p.returncode}): {tail[0]}")
                else:
                    self.log(f"{n}: {'stopped' if stopping else 'done'} at step {r['step']} in {secs:.0f}s, "
                             f"curve {[c[2] for c in r['curve']]}")
            if time.monotonic() - last_write > 30:
                rows = self.write(names, "training")
                self.log("progress: " + ", ".join(f"{r['variant']} {r['step']}/{self.a.steps}"
                                                  + (f" tau {r['curve'][-1][2]:.3f}" if r["curve"] else "")
                                                  for r in rows))
                last_write = time.monotonic()
        return not stopping

    def final_evals(self, names: list[str], data: dict[str, Path]) -> None:
        """Each finished run's last checkpoint: tau at greedy (--final-prompts) and at T = 1 (--t1-prompts), the
        untrained drafter's tau, and the wall-clock section (dflash-eval --speed-batch: the target alone, the
        drafter and the n-gram baseline, with the lossless check) on the first --speed-prompts prompts."""
        a = self.a
        evals = {"tau_greedy": (0, a.final_prompts, ["--speed-batch", ""]),
                 "tau_t1": (1, a.t1_prompts or a.final_prompts, []),
                 "speed": (0, a.speed_prompts, ["--speed-batch", a.speed_batch])}
        if not a.speed_prompts or not a.speed_batch:
            del evals["speed"]
        jobs = []
        for n in names:
            r = self.row(n)
            if "error" in r or r["step"] < a.steps:
                continue
            jobs += [(n, key, *spec) for key, spec in evals.items() if r.get(key) is None]
        if "base" in names and self.row("base").get("tau_untrained") is None and self.row("base")["step"]:
            jobs.append(("base", "tau_untrained", 0, a.final_prompts, ["--untrained", "--speed-batch", ""]))
        # the wall clock is timed alone on the device: the speed evals go last, one at a time, nothing beside them
        # (four evals sharing a GPU put the target alone at 155-261 tok/s, and each ratio in the noise)
        jobs.sort(key=lambda j: j[1] == "speed")
        running: list[tuple] = []
        while jobs or running:
            while jobs and len(running) < a.parallel and not any(key == "speed" for _, key, _ in running) \
                    and (jobs[0][1] != "speed" or not running):
                n, key, temp, prompts, extra = jobs.pop(0)
                cmd = tool("evaluate", "--target-model", self.model, "--output-dir", self.run_dir(n),
                           "--data-dir", data["heldout"], "--device", a.device, "--temperature", temp,
                           "--max-prompts", prompts, "--max-new-tokens", a.final_tokens,
                           "--no-block-accuracy", "--json", *extra)
                self.log(f"{n}: {key} (dflash-eval, T={temp}, {prompts} prompts)")
                running.append((n, key, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                         text=True, start_new_session=True)))
            time.sleep(2)
            if self.left() < 0:
                for *_, p in running:
                    os.killpg(p.pid, signal.SIGKILL)
                self.log("deadline: final evals left for the next run of this command")
                return
            for item in list(running):
                n, key, p = item
                if p.poll() is None:
                    continue
                running.remove(item)
                out, err = p.communicate()
                res = None
                try:   # a failed lossless check still prints its JSON (exit 1): keep the table and the verdict
                    res = json.loads(out.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    pass
                if res is not None and key == "speed" and "speed" in res:
                    self.save_row(n, speed=res["speed"])
                    sp = {(r["drafter"], r["batch"]): r.get("speedup") for r in res["speed"]["rows"]}
                    self.log(f"{n}: speed {sp}, lossless {res['speed']['lossless']['ok']}")
                elif res is not None and p.returncode == 0:
                    self.save_row(n, **{key: res["tau"], f"{key}_prompts": res["prompts"],
                                        f"{key}_verify_steps_per_s": res.get("verify_steps_per_s")})
                    self.log(f"{n}: {key} = {res['tau']:.3f}")
                else:
                    self.save_row(n, **{f"{key}_error": (err.strip().splitlines() or ["?"])[-1]})
                    self.log(f"{n}: {key} failed: {(err.strip().splitlines() or ['?'])[-1]}")


def device_name(dev: str) -> str:
    if dev == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    try:
        import torch
        return torch.cuda.get_device_name(int(dev.split(":")[1]) if ":" in dev else 0)
    except Exception:   # noqa: BLE001  a name for the record only
        return dev


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
             f'<text x="{w / 2 - 60}" y="{h - 12}">training tokens (max {x1:,})</text>',
             f'<text x="6" y="{m - 8}">tau</text>',
             f'<text x="{m - 30}" y="{sy(y0) + 4}">{y0:.2f}</text><text x="{m - 30}" y="{sy(y1) + 4}">{y1:.2f}</text>']
    for i, r in enumerate(rows):
        c = r.get("curve") or []
        if not c:
            continue
        col = colors[i % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="'
                     + " ".join(f"{sx(t):.1f},{sy(tau):.1f}" for _, t, tau in c) + '"/>')
        parts.append(f'<text x="{w - m - 36}" y="{m + 14 * i}" fill="{col}">{r["variant"]}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def parse(argv):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, help="dflash-real's cache (the model and the prompt sets)")
    ap.add_argument("--work", required=True, help="the data and the runs (reused by a rerun)")
    ap.add_argument("--out", required=True, help="the result JSON (the SVG goes beside it, or to --svg)")
    ap.add_argument("--svg", default="")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50, help="steps between in-training evals (and checkpoints)")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--final-prompts", type=int, default=64)
    ap.add_argument("--final-tokens", type=int, default=128)
    ap.add_argument("--t1-prompts", type=int, default=0, help="held-out prompts of the T = 1 tau (0: --final-prompts)")
    ap.add_argument("--speed-prompts", type=int, default=16,
                    help="held-out prompts of the wall-clock section (0: none)")
    ap.add_argument("--speed-batch", default="1,16", help="its batch sizes (dflash-eval --speed-batch)")
    ap.add_argument("--train-prompts", default="",
                    help="prompt-only JSONL the target answers (default: the cache's prompts/stdlib.jsonl; "
                         "dflash-real --prompts large writes prompts/large.jsonl)")
    ap.add_argument("--regen-tokens", type=int, default=256, help="tokens the target writes per training prompt")
    ap.add_argument("--regen-batch", type=int, default=64)
    ap.add_argument("--regen-records", type=int, default=0, help="the first N training prompts only (0: all)")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="for the prepared held-out and raw data")
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N (every run shares it)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once on the device")
    ap.add_argument("--deadline-s", type=float, default=0, help="stop the runs after this many seconds (0: none)")
    ap.add_argument("--stop-margin-s", type=float, default=60, help="seconds before the deadline to stop the runs")
    ap.add_argument("--poll-s", type=float, default=5)
    ap.add_argument("--set", action="append", default=[], help="FLAG=VALUE for every variant, e.g. max_anchors=64")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    err = None
    if bad or not names:
        err = f"--variants: unknown {bad or 'none given'} (known: {', '.join(VARIANTS)})"
    elif min(a.steps, a.eval_every, a.parallel, a.eval_prompts, a.final_prompts, a.regen_tokens) < 1:
        err = "--steps, --eval-every, --parallel, --eval-prompts, --final-prompts and --regen-tokens must be >= 1"
    elif any("=" not in s for s in a.set):
        err = f"--set takes FLAG=VALUE, got {next(s for s in a.set if '=' not in s)!r}"
    elif not (a.device == "cpu" or a.device.startswith("cuda")):
        err = f"--device: cpu or cuda:N, got {a.device!r}"
    elif a.train_prompts and not Path(a.train_prompts).is_file():
        err = f"--train-prompts {a.train_prompts}: no such file"
    elif not (Path(a.cache) / MODEL_DIR / "config.json").is_file():
        err = f"--cache {a.cache}: no {MODEL_DIR}/config.json (build it with dflash-real --cache {a.cache})"
    return a, names, err


def main(argv: list[str] | None = None) -> int:
    a, names, err = parse(argv)
    if err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    r = Recipe(a)
    try:
        data = r.data(names)
    except RuntimeError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    r.write(names, "training")
    done = r.train(names, data)
    if done:
        r.final_evals(names, data)
    finished = done and all(r.row(n).get("tau_t1") is not None for n in names)
    rows = r.write(names, "done" if finished else "partial")
    print("| variant | steps | tokens | tau greedy | tau T=1 | speedup b1 / n-gram b1 | lossless | in-training curve |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in rows:
        sp = {(r["drafter"], r["batch"]): r.get("speedup") for r in (x.get("speed") or {}).get("rows", [])}
        b1 = next((v for (d, b), v in sp.items() if b == 1 and d not in ("target", "ngram")), None)
        print(f"| {x['variant']} | {x['step']} | {x['tokens']:,} | {x.get('tau_greedy')} | {x.get('tau_t1')} | "
              f"{b1} / {sp.get(('ngram', 1))} | {(x.get('speed') or {}).get('lossless', {}).get('ok')} | "
              f"{' '.join(f'{c[2]:.2f}' for c in x['curve'])} |")
    if "base" in names:
        print(f"untrained (base's flags): tau {r.row('base').get('tau_untrained')}")
    return 1 if any("error" in x for x in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
