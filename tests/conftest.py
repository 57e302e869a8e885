"""Shared pytest fixtures.

Data / dflash-tiny fixtures (owned by the data tests): ``tiny_small_dir`` builds one small
dflash-tiny output per test session (target model + tokenizer, 48 train / 8 held-out sequences);
``tiny_hybrid_dir`` the same on the hybrid Qwen3.5 architecture (dflash-tiny --arch qwen3_5);
``tiny_arch_dir(arch)`` the same for any --arch (one per target family); ``tiny_trained_dir`` a 2-step
run on ``tiny_small_dir`` (one checkpoint), ``tiny_learning_run`` a 6-step one that learns and
``tiny_hybrid_run`` a 4-step one on ``tiny_hybrid_dir``, ``tiny_dflash2_run`` a 3-step DFlash2 one, each trained
once per session.
"""

import pytest

from trainer.optional import defer

# The suite is a program: torchao loads only where a test asks for it (allow), as in the console scripts.
# Importing trainer no longer defers it (trainer/optional.py); tests/repo/test_import_state.py checks both.
defer()


@pytest.fixture(scope="session")
def tiny_arch_dir(tmp_path_factory):
    """arch -> a small dflash-tiny OUTDIR of that --arch (target/, data/, heldout/; 48 train / 8 held-out
    sequences), each built once per session: one per target family (tests/model/test_families.py). With
    DFLASH_TINY_CACHE set (tests/run.sh: a directory of the run), once per run for all its lanes: the build
    is deterministic (seed 0), the first lane to ask builds it under a lock and marks it complete, the
    others wait and read it. Tests copy what they change (the dirs are shared within a session anyway)."""
    import fcntl
    import os
    import shutil
    from pathlib import Path

    from trainer.tools.tiny import make_tiny

    shared = os.environ.get("DFLASH_TINY_CACHE")
    built = {}

    def build(out, arch):
        make_tiny(out, seed=0, num_train=48, num_heldout=8, log=lambda *a, **k: None, arch=arch)

    def get(arch: str):
        if arch in built:
            return built[arch]
        if shared:
            root = Path(shared) / arch
            root.mkdir(parents=True, exist_ok=True)
            with open(root / ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (root / ".complete").exists():
                    shutil.rmtree(root / "out", ignore_errors=True)   # a lane killed mid-build
                    build(root / "out", arch)
                    (root / ".complete").touch()
            built[arch] = root / "out"
        else:
            built[arch] = tmp_path_factory.mktemp(f"dflash-tiny-{arch}") / "out"
            build(built[arch], arch)
        return built[arch]
    return get


@pytest.fixture(scope="session")
def tiny_small_dir(tiny_arch_dir):
    """A small dflash-tiny OUTDIR (target/, data/, heldout/), built once per session."""
    return tiny_arch_dir("qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tiny_arch_dir):
    """``tiny_small_dir``'s twin on the seeds' real architecture (dflash-tiny --arch qwen3_5): a
    Qwen3_5ForConditionalGeneration with a tiny vision tower, 2 x (3 Gated DeltaNet + 1 gated full
    attention) layers and partial mRoPE; 48 train / 8 held-out sequences it generated itself."""
    return tiny_arch_dir("qwen3_5")


@pytest.fixture(scope="session")
def tiny_trained_dir(tiny_small_dir, tmp_path_factory):
    """An output dir of a 2-step run on ``tiny_small_dir`` at the trainer's defaults (DFlash, CE + D-PACE on
    hard labels) at world size 1, grad accum 1, block 8, 2 draft layers (test_identity.py's tiny_args): one
    checkpoint, step 2. Built once per session for the tests that resume from it, refuse to, or export it
    (tests/model/test_identity.py, tests/engine/test_resume_contract.py, tests/engine/test_warm_start.py) and
    Qwen3's family run (tests/model/test_families.py); none writes into it (a test that trains on from it copies
    it first)."""
    from tests.model.test_identity import tiny_args
    from trainer.__main__ import main as train_main
    out = tmp_path_factory.mktemp("tiny-trained") / "out"
    assert train_main(tiny_args(tiny_small_dir, out, "--max-steps", "2")) == 0
    return out


# A short run that learns: 6 steps at lr 5e-3, grad accum 1, the end-of-run eval on the held-out data (4 prompts, 32
# new tokens), on tests/engine/test_trainer.py's tiny_args. ``tiny_learning_run`` trains it once per session as the
# reference of the tests that change one switch of it (tests/engine/test_fp8.py, tests/ops/test_loss_no_redundant_work.py).
LEARNING_RUN = ("--max-steps", "6", "--lr", "5e-3", "--grad-accum", "1", "--save-interval", "6")
LEARNING_EVAL = ("--eval-prompts", "4", "--eval-max-new-tokens", "32")


def learning_run_args(tiny, out, *flags: str, evaluate: bool = True) -> list[str]:
    """The learning run's command line on the dflash-tiny OUTDIR `tiny`, writing `out`, with `flags` added;
    without its end-of-run eval where not `evaluate` (the eval comes after the last step: no loss sees it)."""
    from tests.engine.test_trainer import tiny_args
    ev = ("--eval-data-dir", str(tiny / "heldout"), *LEARNING_EVAL) if evaluate else ()
    return tiny_args(tiny, out, *LEARNING_RUN, *ev, *flags)


@pytest.fixture(scope="session")
def tiny_learning_run(tiny_small_dir, tmp_path_factory):
    """The output dir of the learning run (learning_run_args) on ``tiny_small_dir``, trained once per session;
    none writes into it."""
    from trainer.__main__ import main as train_main
    out = tmp_path_factory.mktemp("learning-run") / "out"
    assert train_main(learning_run_args(tiny_small_dir, out)) == 0
    return out


# The hybrid's reference run: the seeds' flags at a tiny size (--sliding-window 16, so that the sliding draft layers,
# the default for this target: [sliding, full], cut the tiny sequences' context), 4 steps, a checkpoint every 2.
HYBRID_RUN = ("--max-steps", "4", "--save-interval", "2", "--use-soft-labels", "--loss", "ce", "--sliding-window", "16")


@pytest.fixture(scope="session")
def tiny_hybrid_run(tiny_hybrid_dir, tmp_path_factory):
    """The output dir of HYBRID_RUN on ``tiny_hybrid_dir`` at world size 1 (one rank: target and drafter), grad
    accum 4, on tests/engine/test_trainer.py's tiny_args: tests/chain/test_hybrid_chain.py's reference run and
    the qwen3_5 family's run (tests/model/test_families.py), trained once per session; none writes into it."""
    from tests.engine.test_trainer import tiny_args
    from trainer.__main__ import main as train_main
    out = tmp_path_factory.mktemp("hybrid-world1") / "out"
    assert train_main(tiny_args(tiny_hybrid_dir, out, *HYBRID_RUN, "--grad-accum", "4")) == 0
    return out


def dflash2_run_args(tiny, out) -> list[str]:
    """DFlash2 on the dflash-tiny OUTDIR `tiny` (tests/engine/test_trainer.py's tiny_args), writing `out`: 3 steps of
    CE + D-PACE on hard labels, its checkpoint at step 3, the in-training eval at step 2 and at the end (2 prompts,
    12 new tokens)."""
    from tests.engine.test_trainer import tiny_args
    return tiny_args(tiny, out, "--max-steps", "3", "--no-use-soft-labels", "--arch", "dflash2", "--loss", "ce+dpace",
                     "--save-interval", "3", "--eval-data-dir", str(tiny / "heldout"), "--eval-every", "2",
                     "--eval-prompts", "2", "--eval-max-new-tokens", "12")


@pytest.fixture(scope="session")
def tiny_dflash2_run(tiny_small_dir, tmp_path_factory):
    """The output dir of dflash2_run_args on ``tiny_small_dir``, its rank started with OMP_NUM_THREADS=2
    (tests/model/test_dflash2.py's determinism test trains it again and compares), trained once per session
    (this process supervises); read by test_dflash2.py and tests/engine/test_warm_start.py, none writes into it."""
    from trainer.__main__ import main as train_main
    out = tmp_path_factory.mktemp("dflash2-run") / "out"
    with pytest.MonkeyPatch.context() as mp:   # the rank's environment: the launcher passes it on
        mp.setenv("OMP_NUM_THREADS", "2")
        assert train_main(dflash2_run_args(tiny_small_dir, out)) == 0
    return out


def run_molecule(scenario: str) -> None:
    """`molecule test -s <scenario>` from the repo root with this venv's tools first on PATH;
    skipped where the stand-in cannot exist (not root, no lxc/debootstrap, no molecule)."""
    import os
    import shutil
    import subprocess
    import sys
    import time
    from pathlib import Path

    if os.geteuid() != 0 or shutil.which("lxc-start") is None or shutil.which("debootstrap") is None:
        pytest.skip("needs root, lxc and debootstrap (tests/setup-host.sh)")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "molecule").exists():
        pytest.skip("molecule not installed")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    started = time.time()
    r = subprocess.run([str(bin_dir / "molecule"), "test", "-s", scenario], cwd=Path(__file__).resolve().parents[1],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        # the failing task's own message sits before long command output (debootstrap, pip), so show
        # every line that names a failure (with the lines after a fatal one: molecule folds a long
        # message over several), then the tails of both streams
        lines = (r.stdout + "\n" + r.stderr).splitlines()
        keys = ("fatal:", "FAILED!", "\"msg\"", "msg:", "ERROR", "rc:")
        marks, after = [], 0
        for ln in lines:
            if "fatal:" in ln:
                after = 8
            if after or any(k in ln for k in keys):
                marks.append(ln)
            after = max(0, after - 1)
        # the provision scenario's destroy keeps the PVE API stand-in's log (the reason behind a 500)
        standin = Path("/var/log/dflash-standin-pve_api.log")
        api_log = ""
        if standin.exists() and standin.stat().st_mtime >= started:
            api_log = "\n--- PVE API stand-in log tail ---\n" + standin.read_text(errors="replace")[-4000:]
        pytest.fail(f"molecule test -s {scenario} exited {r.returncode}\n--- lines naming the failure ---\n"
                    + "\n".join(marks[-80:]) + api_log + "\n--- stdout tail ---\n" + r.stdout[-4000:]
                    + "\n--- stderr tail ---\n" + r.stderr[-3000:])


# CPU per test, beside pytest's wall-clock --durations: on a 2-core machine the suite's wall time is
# its CPU time shared out, so the tests that cost the most CPU (their own process and every child
# they waited for; containers' processes are not children) are the ones to make cheaper. A test's
# figure includes its fixtures' setup (a module fixture's cost lands on its first test), which
# --durations splits apart. tests/run.sh's summary quotes the first lines of this table per lane.
_COST = {}


def _cpu_now() -> float:
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time

    cpu, wall = _cpu_now(), time.monotonic()
    yield
    _COST[item.nodeid] = (_cpu_now() - cpu, time.monotonic() - wall)


def pytest_terminal_summary(terminalreporter):
    if not _COST:
        return
    import json
    import os

    if os.environ.get("DFLASH_TEST_CPU_JSON"):   # every test's figures, for a closer look than the top 15
        with open(os.environ["DFLASH_TEST_CPU_JSON"], "w") as f:
            json.dump({k: {"cpu_s": round(c, 2), "wall_s": round(w, 2)} for k, (c, w) in _COST.items()}, f, indent=1)
    top = sorted(_COST.items(), key=lambda kv: -kv[1][0])[:15]
    cpu_all, wall_all = sum(c for c, _ in _COST.values()), sum(w for _, w in _COST.values())
    terminalreporter.write_sep("=", f"most CPU (this process and its children): {cpu_all:.0f}s in all, "
                                    f"{wall_all:.0f}s wall")
    for nodeid, (cpu, wall) in top:
        terminalreporter.write_line(f"{cpu:8.1f}s cpu {wall:8.1f}s wall  {nodeid}")


def perturb_dflash2(model, hidden_size: int, seed: int = 5) -> None:
    """A DFlash2 drafter's own parts moved off their init: the convolutions off the identity (so a cached
    layer's convolution is exercised) and the selector's codebooks drawn so its path leaves the unary argmax."""
    import torch  # here, as the fixtures import what they use: defer() above runs before any torch import
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "conv" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
            elif "selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 if "codebook" in n else 0.6 / hidden_size ** 0.5))
