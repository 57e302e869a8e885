"""trainer/lab/recipe.py, the recipe judged by tau on the real model: its arguments, what it reads back from a
run directory (a resumed run's repeated steps counted once), and its deadline (the runs stopped by SIGTERM,
their seconds kept, the command returning so that a rerun carries on). The GPU run itself: docs/performance.md,
"Real model (SmolLM2-135M-Instruct)"."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.lab import recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path):
    (tmp_path / "cache" / recipe.MODEL_DIR).mkdir(parents=True)
    (tmp_path / "cache" / recipe.MODEL_DIR / "config.json").write_text("{}")
    return tmp_path / "cache"


@pytest.mark.parametrize("extra, names", [
    (["--variants", "base,nope"], "--variants: unknown ['nope']"),
    (["--set", "lr"], "--set takes FLAG=VALUE, got 'lr'"),
    (["--steps", "0"], "--steps, --eval-every"),
    (["--device", "tpu"], "--device: cpu or cuda:N, got 'tpu'"),
    (["--train-prompts", "/nonexistent/large.jsonl"], "--train-prompts /nonexistent/large.jsonl: no such file"),
])
def test_bad_arguments_exit_2_in_one_line(tmp_path, cache, extra, names):
    r = subprocess.run([sys.executable, "-m", "trainer.lab.recipe", "--cache", str(cache), "--work",
                        str(tmp_path / "w"), "--out", str(tmp_path / "o.json"), *extra],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and names in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()   # nothing started


def test_a_cache_without_the_model_is_named(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainer.lab.recipe", "--cache", str(tmp_path), "--work",
                        str(tmp_path / "w"), "--out", str(tmp_path / "o.json")], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 2 and f"--cache {tmp_path}: no {recipe.MODEL_DIR}/config.json" in r.stderr


def _recipe(tmp_path, cache, *extra) -> recipe.Recipe:
    a, names, err = recipe.parse(["--cache", str(cache), "--work", str(tmp_path / "w"), "--out",
                                  str(tmp_path / "o.json"), *extra])
    assert err is None, err
    return recipe.Recipe(a)


def test_a_run_directory_reads_back_once_per_step(tmp_path, cache):
    r = _recipe(tmp_path, cache)
    rd = r.run_dir("base")
    rd.mkdir(parents=True)
    lines = [{"step": 1, "loss": 9.0, "tokens": 100}, {"step": 2, "loss": 8.0, "tokens": 100},
             {"kind": "eval", "step": 2, "tau": 1.1, "final": False, "loop": "batched", "seconds": 4.5},
             {"step": 2, "loss": 8.0, "tokens": 100},           # the resumed run repeats its checkpoint's step
             {"step": 3, "loss": 7.0, "tokens": 50}, {"kind": "eval", "step": 3, "error": "OOM"}]
    (rd / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n{\"step\": 4, \"lo")   # one being written
    r.save_row("base", tau_greedy=1.25)
    r.save_row("base", train_seconds=3.0)
    row = r.row("base")
    assert (row["step"], row["tokens"], row["curve"]) == (3, 250, [[2, 200, 1.1]])
    assert row["eval_loops"] == [[2, "batched", 4.5]]   # which loop paused the run, and for how long
    assert (row["tau_greedy"], row["train_seconds"]) == (1.25, 3.0)


class _Sleepy(recipe.Recipe):
    """A run that trains for a minute unless stopped; on SIGTERM it writes its step, as the trainer checkpoints."""

    def train_cmd(self, name, data):
        rd = self.run_dir(name)
        return [sys.executable, "-c",
                "import json, signal, sys, time\n"
                f"def stop(*a):\n open({str(rd / 'metrics.jsonl')!r}, 'a').write(json.dumps({{'step': 7, "
                "'tokens': 70}) + '\\n'); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)"]


def test_the_deadline_stops_every_run_and_keeps_its_progress(tmp_path, cache):
    r = _Sleepy(recipe.parse(["--cache", str(cache), "--work", str(tmp_path / "w"), "--out",
                              str(tmp_path / "o.json"), "--variants", "base,hard,raw", "--parallel", "2",
                              "--deadline-s", "4", "--stop-margin-s", "1", "--poll-s", "0.2"])[0])
    t = time.monotonic()
    finished = r.train(["base", "hard", "raw"], {})
    assert not finished and time.monotonic() - t < 20
    rows = {n: r.row(n) for n in ("base", "hard", "raw")}
    # the two started runs stopped at their step with their seconds; the third never started
    assert [rows[n]["step"] for n in ("base", "hard")] == [7, 7] and rows["raw"]["step"] == 0
    assert all(rows[n]["train_seconds"] >= 2 for n in ("base", "hard")) and "error" not in rows["base"]
    r.write(["base", "hard", "raw"], "partial")
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["state"] == "partial" and [x["variant"] for x in doc["rows"]] == ["base", "hard", "raw"]
    assert "commit" in doc


def test_final_evals_keep_tau_the_speed_table_and_a_failed_lossless_verdict(tmp_path, cache, monkeypatch):
    """Each finished run gets its greedy tau (no speed section), its T = 1 tau on --t1-prompts, and the speed
    section on --speed-prompts; a speed eval whose lossless check failed (exit 1, its JSON printed) keeps its
    table and the verdict instead of an error."""
    seen = []

    def fake_eval(fn, *args):
        args = [str(x) for x in args]
        seen.append(args)
        speed = "--speed-batch" in args and args[args.index("--speed-batch") + 1] != ""
        res = {"tau": 1.5 + 0.25 * float(args[args.index("--temperature") + 1]),
               "prompts": int(args[args.index("--max-prompts") + 1])}
        if speed:
            res["speed"] = {"rows": [{"drafter": "target", "batch": 1, "speedup": None},
                                     {"drafter": "dflash", "batch": 1, "speedup": 1.4}],
                            "lossless": {"ok": False, "error": "prompt 3 differs at token 7"}}
        return [sys.executable, "-c", f"import sys; print({json.dumps(res)!r}); sys.exit({1 if speed else 0})"]

    monkeypatch.setattr(recipe, "tool", fake_eval)
    r = _recipe(tmp_path, cache, "--variants", "dpace", "--steps", "2", "--final-prompts", "164",
                "--t1-prompts", "32", "--speed-prompts", "8", "--parallel", "3")
    rd = r.run_dir("dpace")
    rd.mkdir(parents=True)
    (rd / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens": 10}) + "\n")
    r.final_evals(["dpace"], {"heldout": tmp_path / "heldout"})
    row = r.row("dpace")
    assert (row["tau_greedy"], row["tau_greedy_prompts"], row["tau_t1"], row["tau_t1_prompts"]) == (1.5, 164, 1.75, 32)
    assert row["speed"]["lossless"] == {"ok": False, "error": "prompt 3 differs at token 7"}
    assert "speed_error" not in row and "error" not in row
    greedy = next(a for a in seen if a[a.index("--max-prompts") + 1] == "164")
    assert greedy[greedy.index("--speed-batch") + 1] == ""   # the 164-prompt tau is not timed
    r.final_evals(["dpace"], {"heldout": tmp_path / "heldout"})   # a rerun measures nothing again
    assert len(seen) == 3


def test_speed_evals_run_last_and_alone_on_the_device(tmp_path, cache, monkeypatch):
    """The wall clock is timed with nothing beside it: every tau eval (greedy, T = 1, untrained) has ended
    before the first speed eval starts, and the speed evals run one at a time, even at --parallel 3."""
    log = tmp_path / "evals.log"

    def fake_eval(fn, *args):
        args = [str(x) for x in args]
        speed = "--speed-batch" in args and args[args.index("--speed-batch") + 1] != ""
        kind = "speed" if speed else "tau"
        res = {"tau": 1.5, "prompts": 4}
        if speed:
            res["speed"] = {"rows": [], "lossless": {"ok": True, "error": None}}
        body = (f"import json, time; f = open({str(log)!r}, 'a'); f.write(f'start {kind} {{time.monotonic()}}\\n'); "
                f"f.flush(); time.sleep(0.2); f.write(f'end {kind} {{time.monotonic()}}\\n'); f.close(); "
                f"print({json.dumps(res)!r})")
        return [sys.executable, "-c", body]

    monkeypatch.setattr(recipe, "tool", fake_eval)
    fast = type("T", (), {"sleep": staticmethod(lambda s: time.sleep(0.02)), "monotonic": staticmethod(time.monotonic)})
    monkeypatch.setattr(recipe, "time", fast)
    r = _recipe(tmp_path, cache, "--variants", "base,dpace", "--steps", "2", "--final-prompts", "4",
                "--t1-prompts", "4", "--speed-prompts", "4", "--parallel", "3")
    for n in ("base", "dpace"):
        r.run_dir(n).mkdir(parents=True)
        (r.run_dir(n) / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens": 10}) + "\n")
    r.final_evals(["base", "dpace"], {"heldout": tmp_path / "heldout"})
    events = sorted((float(t), what, kind) for what, kind, t in (ln.split() for ln in log.read_text().splitlines()))
    starts = [(t, k) for t, w, k in events if w == "start"]
    assert [k for _, k in starts].count("speed") == 2 and [k for _, k in starts].count("tau") == 5
    first_speed = min(t for t, k in starts if k == "speed")
    assert max(t for t, w, k in events if k == "tau") < first_speed   # every tau eval ended first
    live = 0
    for _, what, kind in events:   # from the first speed start on, at most one eval is running at a time
        live += 1 if what == "start" else -1
        if kind == "speed":
            assert live <= 1
    assert all(r.row(n)["speed"]["lossless"]["ok"] for n in ("base", "dpace"))


def test_the_regeneration_summary_reaches_the_json_and_a_rerun_keeps_it(tmp_path, cache, monkeypatch):
    """dflash-regenerate --json's last line (tokens, seconds, tok/s) is the JSON's `regeneration`; a rerun whose
    shards were all done (it generated nothing) leaves the first figures in place."""
    runs = iter([{"shards_generated": 3, "tokens_generated": 8_700_000, "seconds": 150.0, "tokens_per_s": 58000.0},
                 {"shards_generated": 0, "tokens_generated": 0, "seconds": 0.1, "tokens_per_s": 0.0}])

    def fake_tool(fn, *args):
        args = [str(x) for x in args]
        if fn == "regenerate":
            assert "--json" in args
            return [sys.executable, "-c", f"print('progress'); print({json.dumps(next(runs))!r})"]
        out = Path(args[args.index("--output-dir") + 1])
        return [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(out)!r}); p.mkdir(parents=True); "
                                      "(p / 'index.json').write_text('{}')"]

    monkeypatch.setattr(recipe, "tool", fake_tool)
    r = _recipe(tmp_path, cache, "--variants", "base")
    for _ in range(2):
        r.data(["base"])
        r.write(["base"], "training")
        doc = json.loads((tmp_path / "o.json").read_text())
        assert doc["regeneration"]["tokens_generated"] == 8_700_000 and doc["regeneration"]["tokens_per_s"] == 58000.0


@pytest.mark.parametrize("name, want", [
    ("base", (16, 7.0, True, "ce", "dflash")),
    ("b32", (32, 10.0, True, "ce", "dflash")),
    ("dpace", (16, 7.0, False, "ce+dpace", "dflash")),
    ("hard", (16, 7.0, False, "ce", "dflash")),
    ("dflash2", (16, 7.0, True, "ce", "dflash2")),
])
def test_each_variant_says_its_recipe_whatever_the_trainers_defaults(tmp_path, cache, name, want):
    """A variant is base's flags plus its one change, all passed explicitly: the trainer's defaults
    (trainer/config/options.py) can move without moving the table's rows."""
    from trainer.config.options import build_parser
    r = _recipe(tmp_path, cache, "--variants", name)
    cmd = r.train_cmd(name, {"heldout": tmp_path / "h", "regen": tmp_path / "r", "raw": tmp_path / "w"})
    args = build_parser().parse_args(cmd[cmd.index("--target-model"):])
    assert (args.block_size, args.gamma, args.use_soft_labels, args.loss, args.arch) == want
