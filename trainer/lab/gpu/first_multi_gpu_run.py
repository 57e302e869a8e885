#!/usr/bin/env python
"""The first run of a multi-GPU layout, ready to go: run as is on a machine with 1, 2, 4 or 8 GPUs.

    python trainer/lab/gpu/first_multi_gpu_run.py --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7 \
        [--target-model DIR --data-dir DIR | --arch qwen3_5] [--steps 200] [--step-bound 900] \
        [--out results/NAME.json]

It imports the repo from its own place (nothing to install) and starts every child with the environment
run.sh exports (dflash_service_run_env in roles/dflash_service/vars/main.yml: NVLS off, the flight
recorder, the allocator, the device order, kernels in host order), plus NCCL_DEBUG=INFO for INIT and P2P
into a log file per process. What it does, in order, each phase with a time bound:
  1. prints the point-to-point mode of the installed torch (whether eager NCCL init serialises unbatched
     P2P with every other op of a group: the build carries that message) and the transport the trainer
     uses (--transport pair: a communicator per (target, drafter) pair, docs/distributed.md);
  2. an NCCL smoke on the GPUs of the layout: a 2-rank send/recv for every pair of GPUs, an all-gather
     over all of them (8 on a full node), and one all-gather of an FSDP unit's size, each timed; on one
     GPU only what one GPU allows (a 1-rank all-gather), and it says so;
  3. the trainer's own ranks (`python -m trainer`, the supervisor run.sh starts) for --steps steps, a
     SIGTERM at half way, then the same command again, which resumes. A run with no status.json within
     --status-bound seconds of its start (the ranks' init, sized by the layout), no step within
     --startup-bound seconds (loading is not progress), or no next step within --step-bound (more for
     the first steps, whose compiles come then), is a stall: the script writes a `py-spy dump` of every rank (when py-spy is
     installed), sends every rank SIGUSR1 (faulthandler: all its threads' stacks into the log) before
     it stops the run, and names the NCCL logs and flight-recorder dumps, as it does for a run that
     fails (an NCCL timeout ends a hung step before the stall clock). The start-up bound is the
     trainer's own for the config, a tiny target's much shorter (--startup-bound overrides it); every
     run shares one kernel cache under --work, as the service's restarts do;
  4. the same steps again without the interruption, comparing the losses (resumed vs uninterrupted),
     counting recompiles after the warmup, and writing per-rank rates and peak GPU memory with the
     verdicts to --out.
Without --target-model/--data-dir it makes a tiny random target (--arch: dflash-tiny's, qwen3 by default,
qwen3_5 for the seeds' hybrid architecture) and data set (dflash-tiny) and a tiny
recipe (block 8, 64 anchors, 2 draft layers), and says so: ordering, resume and recompiles are
checked; rates mean nothing then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:      # the repo as is: no install needed
    sys.path.insert(0, str(REPO))

import trainer  # noqa: E402,F401  (fails here, not in a child, when the repo is incomplete)

RUN_ENV_FILE = REPO / "roles" / "dflash_service" / "vars" / "main.yml"
# The core of torch's warning when eager init serialises unbatched P2P (ProcessGroupNCCL.cpp). Some builds
# assemble it from several literals (torch 2.11 splits it in two), so it is matched by its three-word
# windows; the variable that silences the warning (newer builds) is a marker too.
P2P_SENTENCE = "unbatched P2P ops are treated as independent collective ops"
P2P_SWITCH = b"TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"
# the seed recipe spelled out (the trainer's defaults until 2026-12-06: block 32, soft labels, CE)
SEED_RECIPE = ["--block-size", "32", "--max-anchors", "1024", "--grad-accum", "4", "--gamma", "10",
               "--use-soft-labels", "--loss", "ce"]
TINY_RECIPE = ["--block-size", "8", "--max-anchors", "64", "--grad-accum", "4", "--gamma", "4",
               "--token-budget", "4096", "--max-seq-len", "512", "--num-draft-layers", "2"]


def carries_sentence(blob: bytes, sentence: str = P2P_SENTENCE, share: float = 0.6) -> bool:
    """Whether a library's bytes carry `sentence`, even cut into separate literals: most of its three-word
    windows are found (a cut loses at most two of them)."""
    words = sentence.split()
    windows = [" ".join(words[i:i + 3]).encode() for i in range(len(words) - 2)]
    return sum(w in blob for w in windows) >= share * len(windows)


def p2p_mode() -> dict:
    import torch
    lib = Path(torch.__file__).parent / "lib"
    found = False
    for f in lib.glob("libtorch_cuda*.so*"):
        if f.is_file():
            blob = f.read_bytes()
            found = found or carries_sentence(blob) or P2P_SWITCH in blob
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
            "eager_init_serialises_p2p": found}


def run_env(output_dir: str | Path, source: Path = RUN_ENV_FILE, ranks: int = 1,
            kernel_cache: str | Path | None = None) -> dict[str, str]:
    """run.sh's environment (the role's dflash_service_run_env) for a run writing into `output_dir`; the
    kernel caches in `kernel_cache` (default: the output dir's kernel-cache/); the compile workers this
    machine's share for `ranks` ranks (the role sizes them from the container's cores, unknown here)."""
    import yaml
    mapping = yaml.safe_load(source.read_text())["dflash_service_run_env"]
    paths = {"{{ dflash_service_output_dir }}": str(output_dir),
             "{{ dflash_service_kernel_cache_dir }}": str(kernel_cache or Path(output_dir) / "kernel-cache")}
    env = {}
    for k, v in mapping.items():
        v = str(v)
        if k == "TORCHINDUCTOR_COMPILE_THREADS":
            v = str(max(1, len(os.sched_getaffinity(0)) // max(1, ranks)))
        for var, path in paths.items():
            v = v.replace(var, path)
        if "{{" in v:
            raise ValueError(f"dflash_service_run_env's {k} names a variable run_env does not know: {v}")
        env[k] = v
    return env


def child_env(output_dir: Path, logs: Path, name: str) -> dict[str, str]:
    """A child's environment: run.sh's, the kernel caches shared by every run of this `logs` (--work)
    directory, as the service keeps one across its restarts (a second run compiles warm, as a restarted
    unit does), NCCL's INIT/P2P log per process."""
    env = dict(os.environ, **run_env(output_dir, kernel_cache=logs / "kernel-cache"))
    env.update(PYTHONPATH=str(REPO), TORCH_LOGS="recompiles", NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P",
               NCCL_DEBUG_FILE=str(logs / f"nccl-{name}-%h-%p.log"))
    return env


def status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


class Progress:
    """When a run is stalled: no status.json of this run within `status_bound` s of its start (the ranks' init:
    the rendezvous, NCCL init, the group splits and first connects come before rank 0 writes one), no step
    within `startup_bound` s of its start, or no new step within `step_bound` s of the last one, `first_extra` s
    more until `first_steps` steps have passed (the compiles after the warmup come then). Only a step counts:
    phases that write status.json every second (loading, warmup, checkpointing) do not reset the clock."""

    def __init__(self, startup_bound: float, step_bound: float, now: float, status_bound: float | None = None,
                 first_steps: int = 0, first_extra: float = 0.0):
        self.startup_bound, self.step_bound, self.status_bound = startup_bound, step_bound, status_bound
        self.first_steps, self.first_extra = first_steps, first_extra
        self.start = self.last_t = now
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.seen_status = False

    def update(self, st: dict, now: float, wall: float | None = None) -> str | None:
        """`st`: status.json now (`{}` when there is none); `wall`: the wall clock at the run's start, to tell a
        previous run's file (default: `now` is the wall clock)."""
        started = self.start if wall is None else wall
        if (st.get("updated_at") or 0) >= started or (st and st.get("updated_at") is None):
            self.seen_status = True
        if not self.seen_status:
            if self.status_bound is not None and now - self.start > self.status_bound:
                return (f"no status.json within {self.status_bound:.0f}s of the start (the ranks' init: the "
                        "rendezvous, NCCL init, the group splits, the first connects)")
            return None
        step = st.get("step")
        if step is not None and step != self.last_step and st.get("phase") in ("training", "checkpointing", "eval",
                                                                               "done"):
            if self.first_step is None:
                self.first_step = step
            self.last_step, self.last_t = step, now
        if self.last_step is None or self.last_step == self.first_step:
            if now - self.start > self.startup_bound:
                return (f"no step within {self.startup_bound:.0f}s of the start (phase {st.get('phase')}, "
                        f"step {step})")
            return None
        bound = self.step_bound + (self.first_extra if self.last_step - self.first_step < self.first_steps else 0)
        if now - self.last_t > bound:
            return f"no step for {bound:.0f}s after step {self.last_step} (phase {st.get('phase')})"
        return None


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (the supervisor's ranks)."""
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stack_dumps(pid: int, into: Path) -> list[str]:
    """`py-spy dump` of the supervisor and every rank, one file each; one line when py-spy is missing."""
    spy = shutil.which("py-spy")
    if spy is None:
        print("first_multi_gpu_run: py-spy is not installed: no stack dumps of the ranks", file=sys.stderr)
        return []
    files = []
    for p in [pid, *children(pid)]:
        f = into / f"py-spy-{p}.txt"
        r = subprocess.run([spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=60)
        f.write_text(r.stdout + r.stderr)
        files.append(str(f))
    return files


def faulthandler_stacks(pid: int) -> list[int]:
    """SIGUSR1 to the supervisor's ranks (its direct children): each rank's faulthandler (registered in
    groups.init_rank) writes every thread's stack into its stderr, the run's log, and runs on."""
    ranks = [c for c in children(pid) if _parent(c) == pid]
    for c in ranks:
        try:
            os.kill(c, signal.SIGUSR1)
        except OSError:
            pass
    return ranks


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def failure(name: str, why: str, out: Path, work: Path, log: Path, spies: list[str] | None = None,
            stacks: list[int] | None = None) -> str:
    """The one message of a failed run, on every failure path: what ended it, and where to look: the
    flight-recorder dumps (NCCL's last ops per rank, written on an NCCL timeout), the NCCL logs, the
    stacks, the log."""
    dumps = sorted(str(x) for x in out.glob("nccl_trace_rank_*"))
    nccl = sorted(str(x) for x in work.glob(f"nccl-{name}-*.log"))
    where = [f"flight recorder dumps: {dumps or 'none'}", f"NCCL INIT/P2P logs: {nccl or 'none'}"]
    if stacks is not None:
        where.append(f"faulthandler stacks of {len(stacks)} rank(s) in the log" if stacks else
                     "no rank to take stacks from")
    if spies is not None:
        where.append(f"py-spy dumps: {spies or 'none'}")
    err = status(out).get("error")
    return (f"first_multi_gpu_run: {name}: {why}{f' ({err})' if err else ''}; " + "; ".join(where)
            + f"; log {log}")


def run(argv: list[str], out: Path, work: Path, name: str, bounds: tuple,
        stop_at: int | None = None, cmd: list[str] | None = None) -> dict:
    """One `python -m trainer` run (`cmd`, its command); SIGTERM once status shows step >= stop_at. `bounds`:
    Progress's (startup, step[, status, first steps, their extra seconds]). Raises SystemExit naming the
    flight-recorder dumps on a stall and on a failed exit (an NCCL timeout ends the job before the stall
    clock does)."""
    log = work / f"{name}.log"
    with open(log, "a") as f:
        p = subprocess.Popen([*(cmd or [sys.executable, "-m", "trainer"]), *argv], stdout=f,
                             stderr=subprocess.STDOUT, env=child_env(out, work, name), cwd=REPO)
        prog, termed = Progress(bounds[0], bounds[1], time.time(), *bounds[2:]), False
        while p.poll() is None:
            st = status(out)
            stall = prog.update(st, time.time())
            if stall:
                spies = stack_dumps(p.pid, work)
                stacks = faulthandler_stacks(p.pid)    # before the stop: the stacks of the hang itself
                time.sleep(2.0)
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                raise SystemExit(failure(name, f"{stall}: a hang", out, work, log, spies, stacks))
            step = st.get("step") or 0
            if stop_at is not None and not termed and step >= stop_at:
                p.send_signal(signal.SIGTERM)
                termed = True
            time.sleep(1.0)
    if p.returncode != 0:
        raise SystemExit(failure(name, f"trainer exit {p.returncode}", out, work, log))
    return status(out)


# A tiny random target (no --target-model): it loads in seconds and a warmup shape compiles in a minute or
# two, so the 27B target's worst cases (compile_warmup.LOAD_S, COMPILED_SHAPE_S) would leave a hang unseen for
# hours.
TINY_LOAD_S, TINY_COMPILED_S, TINY_EAGER_S = 120.0, 300.0, 60.0
# The ranks' init before rank 0 writes status.json: imports and the rendezvous, then per communicator made
# (a group split) and per first-use connect (a host-blocking NCCL connect) a bound of its own.
INIT_BASE_S, INIT_PER_OP_S = 300.0, 30.0


def startup_bound(argv: list[str], margin: float = 300.0, tiny: bool = False) -> float:
    """Seconds from a run's start to its first step before the script calls it a hang: the trainer's own
    start barrier bound for this command line (compile_warmup.startup_bounds: the load and every warmup
    shape at its worst case; for a `tiny` target, TINY_*), plus a margin for the supervisor and the first
    step."""
    import dataclasses

    from trainer.config.options import parse_args
    from trainer.engine.compile_warmup import startup_bounds, target_warmup_shapes, warmup_batches
    from trainer.ops.compiling import wants
    cfg = parse_args(argv)
    bounds = startup_bounds(cfg)
    if not tiny:
        return bounds.barrier_s + margin
    shapes = {"target": len(target_warmup_shapes(cfg)),
              "drafter": len(warmup_batches(dataclasses.replace(cfg, compile=bounds.compile)))}
    return TINY_LOAD_S + max(n * (TINY_COMPILED_S if wants(bounds.compile, role) else TINY_EAGER_S)
                             for role, n in shapes.items()) + margin


def status_bound(argv: list[str]) -> float:
    """Seconds from a run's start to rank 0's first status.json: the ranks' init for this layout, its
    communicators (the control group, the drafters' two, a pair per target and drafter) and its first-use
    connects (one per pair, the drafters' all-gather)."""
    from trainer.config.options import parse_args
    from trainer.distributed.topology import local_roles
    roles = local_roles(parse_args(argv))
    targets = sum(r.target and not r.drafter for r in roles)
    drafters = sum(r.drafter for r in roles)
    return INIT_BASE_S + INIT_PER_OP_S * (3 + 2 * targets * drafters + 1)


# ------------------------------------------------------------------------------------------ NCCL smoke

def _smoke_rank(rank: int, gpus: list[int], port: int, unit_mib: int, results: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    dev = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(gpus),
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    out = []

    def timed(what, fn):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        out.append({"op": what, "s": round(time.perf_counter() - t0, 4)})

    n = len(gpus)
    msg = torch.ones(16 << 20, device=dev, dtype=torch.bfloat16)         # 32 MiB, a micro-batch's taps
    for a in range(n):
        for b in range(a + 1, n):
            g = dist.new_group([a, b])
            if rank == a:
                timed(f"send gpu {gpus[a]} -> gpu {gpus[b]} (32 MiB)", lambda: dist.send(msg, b, group=g))
            elif rank == b:
                timed(f"recv gpu {gpus[b]} <- gpu {gpus[a]} (32 MiB)", lambda: dist.recv(msg, a, group=g))
    small = torch.ones(1 << 20, device=dev)
    big = torch.empty(n * small.numel(), device=dev)
    timed(f"all_gather over {n} GPU(s) (4 MiB each)", lambda: dist.all_gather_into_tensor(big, small))
    shard = torch.ones((unit_mib << 20) // 2 // n, device=dev, dtype=torch.bfloat16)
    full = torch.empty(n * shard.numel(), device=dev, dtype=torch.bfloat16)
    timed(f"all_gather of an FSDP unit ({unit_mib} MiB) over {n} GPU(s)",
          lambda: dist.all_gather_into_tensor(full, shard))
    Path(results, f"smoke-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def smoke_child(gpus: list[int], unit_mib: int, results: str) -> None:
    import torch.multiprocessing as mp

    from trainer.distributed.launch import free_port
    mp.spawn(_smoke_rank, args=(gpus, free_port(), unit_mib, results), nprocs=len(gpus))


def smoke(gpus: list[int], work: Path, bound: float, unit_mib: int = 512) -> dict:
    """The NCCL smoke (module docstring, 2) in a child with run.sh's environment, bounded."""
    res = work / "smoke"
    shutil.rmtree(res, ignore_errors=True)
    res.mkdir(parents=True)
    note = ("one GPU: no pair to send between and a 1-rank all-gather only; point-to-point is not exercised"
            if len(gpus) == 1 else f"{len(gpus)} GPUs: every pair, then all of them")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--smoke-child", ",".join(map(str, gpus)),
           "--smoke-unit-mib", str(unit_mib), "--work", str(res)]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, env=child_env(res, work, "smoke"), cwd=REPO, timeout=bound, capture_output=True,
                           text=True)
    except subprocess.TimeoutExpired:
        nccl = sorted(str(x) for x in work.glob("nccl-smoke-*.log"))
        raise SystemExit(f"first_multi_gpu_run: the NCCL smoke did not finish within {bound:.0f}s: a hang in NCCL "
                         f"itself, before any trainer code. NCCL INIT/P2P logs: {nccl or 'none'}") from None
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-2000:]
        raise SystemExit(f"first_multi_gpu_run: the NCCL smoke failed (exit {r.returncode}):\n{tail}")
    ops = [op for f in sorted(res.glob("smoke-rank*.json")) for op in json.loads(f.read_text())]
    return {"gpus": gpus, "note": note, "wall_s": round(time.time() - t0, 1), "ops": ops}


# ------------------------------------------------------------------------------------------ verdicts

def losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind", "step") == "step" and r.get("loss") is not None}


def recompiles_after_warmup(log: Path) -> int:
    text = log.read_text(errors="replace")
    after = text.split("warmup done", 1)[1] if "warmup done" in text else ""
    return len(re.findall(r"Recompiling function", after))


def gpu_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-gpus", default="")
    ap.add_argument("--drafter-gpus", default="")
    ap.add_argument("--target-model", default="")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--startup-bound", type=float, default=None,
                    help="seconds from a run's start to its first step (load, warmup, compile) before it is a hang "
                         "(default: the trainer's start barrier bound for the config, plus a margin)")
    from trainer.tools.tiny import ARCHES
    ap.add_argument("--arch", default="qwen3", choices=ARCHES,
                    help="the tiny target's family without --target-model (dflash-tiny --arch; qwen3_5: the "
                         "seeds' hybrid)")
    ap.add_argument("--step-bound", type=float, default=900.0,
                    help="seconds without a new step before it is a hang (more for the first steps, which compile)")
    ap.add_argument("--status-bound", type=float, default=None,
                    help="seconds from a run's start to its first status.json (the ranks' init) before it is a hang "
                         "(default: sized by the layout's communicators and connects)")
    ap.add_argument("--smoke-bound", type=float, default=300.0, help="seconds for the whole NCCL smoke")
    ap.add_argument("--work", default="/tmp/dflash-first-run")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--smoke-unit-mib", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="more trainer flags (after --)")
    a = ap.parse_args()
    if a.smoke_child:
        smoke_child(gpu_list(a.smoke_child), a.smoke_unit_mib, a.work)
        return 0
    if not a.target_gpus or not a.drafter_gpus:
        print("first_multi_gpu_run: error: --target-gpus and --drafter-gpus are required (e.g. 0 and 0 on one GPU)",
              file=sys.stderr)
        return 2
    mode = p2p_mode()
    print("p2p:", json.dumps(mode), "| trainer: --transport pair (a communicator per target-drafter pair), "
          "--fsdp-prefetch step", flush=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    gpus = sorted(set(gpu_list(a.target_gpus) + gpu_list(a.drafter_gpus)))
    smoke_result = smoke(gpus, work, a.smoke_bound)
    print("nccl smoke:", json.dumps(smoke_result), flush=True)
    target, data, recipe, recipe_name = a.target_model, a.data_dir, SEED_RECIPE, "seed (block 32, 1,024 anchors)"
    if not target:
        from trainer.tools.tiny import make_tiny
        tiny = work / ("tiny" if a.arch == "qwen3" else f"tiny-{a.arch}")
        if not (tiny / "data").is_dir():      # a second run in the same --work reuses the set
            shutil.rmtree(tiny, ignore_errors=True)
            make_tiny(tiny, seed=0, num_train=512, num_heldout=8, log=lambda *x, **k: None, arch=a.arch)
        target, data = str(tiny / "target"), str(tiny / "data")
        recipe = TINY_RECIPE
        recipe_name = (f"tiny (block 8, 64 anchors, 2 draft layers; a tiny random {a.arch} target: rates mean "
                       "nothing)")
    print(f"recipe: {recipe_name}", flush=True)
    base = ["--target-model", target, "--data-dir", data, "--target-gpus", a.target_gpus,
            "--drafter-gpus", a.drafter_gpus, "--max-steps", str(a.steps), "--epochs", "100",
            "--save-interval", "100000", "--profile-interval", "60", *recipe, *a.extra]
    resumed, straight = work / "resumed", work / "straight"
    for d in (resumed, straight):
        shutil.rmtree(d, ignore_errors=True)
    for name in ("stopped", "resumed", "straight"):      # one log per run: recompiles are counted per run
        (work / f"{name}.log").unlink(missing_ok=True)
    from trainer.distributed.groups import FIRST_STEPS, FIRST_STEPS_EXTRA_S
    argv0 = [*base, "--output-dir", str(resumed)]
    tiny = not a.target_model
    first_extra = TINY_COMPILED_S if tiny else FIRST_STEPS_EXTRA_S
    bounds = (a.startup_bound or startup_bound(argv0, tiny=tiny), a.step_bound, a.status_bound or status_bound(argv0),
              FIRST_STEPS, first_extra)
    print(f"bounds: {bounds[2]:.0f}s to the first status.json (init), {bounds[0]:.0f}s to the first step, "
          f"{bounds[1]:.0f}s between steps ({bounds[1] + first_extra:.0f}s for the first {FIRST_STEPS}: the "
          f"compiles after the warmup); kernel caches shared by the runs: {work / 'kernel-cache'}", flush=True)
    t0 = time.time()
    run([*base, "--output-dir", str(resumed)], resumed, work, "stopped", bounds, stop_at=a.steps // 2)
    cut = status(resumed).get("step")
    st = run([*base, "--output-dir", str(resumed)], resumed, work, "resumed", bounds)
    wall = time.time() - t0
    run([*base, "--output-dir", str(straight)], straight, work, "straight", bounds)
    la, lb = losses(resumed), losses(straight)
    common = sorted(set(la) & set(lb))
    worst = max((abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-12) for s in common), default=None)
    from trainer.lab.bench.run import git_commit  # $DFLASH_GIT_COMMIT where the tree travelled without .git
    result = {**git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "p2p": mode, "nccl_smoke": smoke_result, "recipe": recipe_name,
              "layout": {"target_gpus": a.target_gpus, "drafter_gpus": a.drafter_gpus},
              "argv": base, "steps": st.get("step"), "stopped_at": cut, "wall_s": round(wall, 1),
              "tokens_per_s": st.get("tokens_per_s"), "ranks": st.get("ranks"),
              "resumed_vs_straight": {"steps_compared": len(common), "max_rel_loss_diff": worst},
              "recompiles_after_warmup": {name: recompiles_after_warmup(work / f"{name}.log")
                                          for name in ("stopped", "resumed", "straight")},
              "recompiles_in_status": st.get("recompiles")}   # the resumed run's count, all ranks (stop vote)
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = st.get("step") == a.steps and worst is not None and worst < 1e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
