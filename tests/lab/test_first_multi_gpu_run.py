"""trainer/lab/gpu/first_multi_gpu_run.py, the one command for a fresh GPU machine: its CPU-checkable parts."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.tools.tiny import ARCHES

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "trainer" / "lab" / "gpu" / "first_multi_gpu_run.py"


@pytest.fixture(scope="module")
def first_run():
    spec = importlib.util.spec_from_file_location("first_multi_gpu_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_it_runs_from_anywhere_without_the_repo_installed(tmp_path):
    """site-packages without its .pth files (the venv's editable install of the repo is one), from /tmp."""
    import torch
    site = str(Path(torch.__file__).parents[1])
    code = (f"import sys, runpy; sys.path.append({site!r}); sys.argv = [{str(SCRIPT)!r}, '--help']; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--target-gpus" in r.stdout


def test_the_p2p_mode_is_found_whole_or_cut_into_literals(first_run):
    """torch 2.13 carries torch's sentence in one literal; 2.11 in two (found false there before)."""
    whole = (b"\x00An unbatched P2P op (send/recv) was called on this ProcessGroup with size \x00. In eager "
             b"initialization mode, unbatched P2P ops are treated as independent collective ops, and are thus "
             b"serialized with all other ops on this ProcessGroup, including other P2P ops.\x00")
    cut = first_run.P2P_SENTENCE.encode()
    at = cut.index(b"independent")
    split = b"\x00junk\x00" + cut[:at] + b"\x00other literals\x00" + cut[at:] + b"\x00"
    assert first_run.carries_sentence(whole)
    assert first_run.carries_sentence(split)
    assert not first_run.carries_sentence(b"\x00unbatched P2P ops\x00 something else entirely\x00")


def test_the_child_environment_is_the_one_run_sh_renders(first_run, tmp_path):
    """One list: the role's dflash_service_run_env, which run.sh.j2 loops over and the script reads."""
    mapping = yaml.safe_load((REPO / "roles/dflash_service/vars/main.yml").read_text())["dflash_service_run_env"]
    env = first_run.run_env(tmp_path)
    assert set(env) == set(mapping)
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_LAUNCH_ORDER_IMPLICIT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/nccl_trace_rank_"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TRITON_CACHE_DIR"] == f"{tmp_path}/kernel-cache/triton"
    assert not any("{{" in v for v in env.values())
    child = first_run.child_env(tmp_path, tmp_path, "x")
    assert all(child[k] == v for k, v in env.items())
    template = (REPO / "roles/dflash_service/templates/run.sh.j2").read_text()
    assert "dflash_service_run_env.items()" in template
    assert not set(re.findall(r"^export (\w+)=", template, re.M)) & set(mapping), "an env var written twice"


def test_loading_is_not_progress_and_every_phase_is_bounded(first_run):
    p = first_run.Progress(startup_bound=100, step_bound=10, now=0)
    for t in range(0, 100, 5):      # status.json rewritten every few seconds while loading: no step
        assert p.update({"phase": "loading", "step": 0}, t) is None
    assert "of the start" in p.update({"phase": "warmup", "step": 0}, 101)
    p = first_run.Progress(startup_bound=100, step_bound=10, now=0)
    assert p.update({"phase": "training", "step": 1}, 50) is None
    assert p.update({"phase": "training", "step": 2}, 55) is None
    assert p.update({"phase": "checkpointing", "step": 2}, 64) is None
    assert "after step 2" in p.update({"phase": "checkpointing", "step": 2}, 66)


def test_a_stall_without_py_spy_is_one_line(first_run, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(first_run.shutil, "which", lambda name: None)
    assert first_run.stack_dumps(os.getpid(), tmp_path) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "py-spy" in err


def test_the_tiny_recipe_does_not_call_itself_the_seed_recipe(first_run):
    assert "--block-size" in first_run.TINY_RECIPE and first_run.TINY_RECIPE[1] != "32"
    text = SCRIPT.read_text()
    assert "tiny (block 8" in text and "at the seed\n     recipe" not in text


# ----------------------------------------------------------------------------- failures (issue 54)

FAKE_TRAINER_EXIT = r"""
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for r in (0, 1):   # what TORCH_NCCL_DUMP_ON_TIMEOUT leaves: one dump per rank
    (out / f"nccl_trace_rank_{r}").write_bytes(b"trace")
(out / "status.json").write_text(json.dumps({"phase": "failed", "step": 3, "error":
    "rank 1 failed (signal 6): Watchdog caught collective operation timeout"}))
sys.exit(1)
"""

FAKE_HUNG_SUPERVISOR = r"""
import json, os, subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
rank = "import faulthandler, signal, time\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n" \
       "def hung_in_warmup():\n    time.sleep(120)\nhung_in_warmup()\n"
kids = [subprocess.Popen([sys.executable, "-c", rank]) for _ in range(2)]
import signal
signal.signal(signal.SIGTERM, lambda *a: ([k.kill() for k in kids], os._exit(0)))   # the stop: ranks go too
time.sleep(1.0)
(out / "nccl_trace_rank_1").write_bytes(b"trace")
while True:
    (out / "status.json").write_text(json.dumps({"phase": "warmup", "step": 0, "updated_at": time.time()}))
    time.sleep(0.2)
"""


def test_a_watchdog_ended_run_names_its_flight_recorder_dumps(first_run, tmp_path):
    """An NCCL timeout ends a hung step (the ranks' watchdog, --dist-timeout) before the script's own stall
    clock: the trainer exits 1. The report names each rank's flight-recorder dump and the job's error."""
    script = tmp_path / "trainer.py"
    script.write_text(FAKE_TRAINER_EXIT)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        first_run.run([str(out)], out, tmp_path, "resumed", (60, 60), cmd=[sys.executable, str(script)])
    msg = str(e.value)
    assert "trainer exit 1" in msg and "Watchdog caught collective operation timeout" in msg
    assert f"{out}/nccl_trace_rank_0" in msg and f"{out}/nccl_trace_rank_1" in msg
    assert "\n" not in msg


def test_a_stall_takes_every_ranks_stacks_before_the_stop_and_names_the_dumps(first_run, tmp_path, monkeypatch):
    """A start-up past its bound: SIGUSR1 to every rank first (faulthandler: their stacks into the log, the
    hung frame named), then the stop; the report names the dumps and the stacks."""
    monkeypatch.setattr(first_run.shutil, "which", lambda name: None)    # no py-spy: faulthandler alone
    script = tmp_path / "supervisor.py"
    script.write_text(FAKE_HUNG_SUPERVISOR)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        first_run.run([str(out)], out, tmp_path, "stopped", (4, 60), cmd=[sys.executable, str(script)])
    msg = str(e.value)
    assert "no step within 4s of the start" in msg and "faulthandler stacks of 2 rank(s)" in msg
    assert f"{out}/nccl_trace_rank_1" in msg
    log = (tmp_path / "stopped.log").read_text()
    # two ranks dump at once into one log: faulthandler writes " in " and the frame's name in separate
    # write()s, so another rank's bytes can fall between them; the name itself is one write
    assert log.count("hung_in_warmup") == 2, log[-2000:]


def test_the_runs_share_one_kernel_cache(first_run, tmp_path):
    """The stopped, resumed and straight runs write into different output dirs but compile into one cache
    under --work, as the service's restarts share /opt/dflash/kernel-cache: the straight run is warm."""
    envs = [first_run.child_env(tmp_path / name, tmp_path, name) for name in ("resumed", "straight")]
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert envs[0][key] == envs[1][key] and envs[0][key].startswith(f"{tmp_path}/kernel-cache/")
    assert envs[0]["TORCH_FR_DUMP_TEMP_FILE"] != envs[1]["TORCH_FR_DUMP_TEMP_FILE"]   # dumps stay per run


def test_the_startup_bound_is_the_trainers_own_for_the_config(first_run):
    from trainer.config.options import parse_args
    from trainer.engine.compile_warmup import startup_bounds
    base = ["--target-model", "/x", "--data-dir", "/y", "--output-dir", "/z", "--target-gpus", "0",
            "--drafter-gpus", "1"]
    eager, compiled = (first_run.startup_bound([*base, "--compile", c]) for c in ("none", "all"))
    assert compiled > eager
    assert eager == startup_bounds(parse_args([*base, "--compile", "none"])).barrier_s + 300


def test_the_tiny_target_can_be_the_hybrid(first_run):
    text = SCRIPT.read_text()
    assert '"--arch", default="qwen3", choices=ARCHES' in text and "arch=a.arch" in text and "qwen3_5" in ARCHES
    r = subprocess.run([sys.executable, str(SCRIPT), "--target-gpus", "0", "--drafter-gpus", "0", "--arch", "mamba"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--arch" in r.stderr


# ------------------------------------------------------------------- bounds sized by the layout (issue 61)

BASE = ["--target-model", "/x", "--data-dir", "/y", "--output-dir", "/z"]


def test_no_status_within_the_init_bound_is_a_hang_and_a_previous_runs_file_is_not_status(first_run):
    """The ranks' init (rendezvous, NCCL init, splits, connects) writes no status.json: the script's own bound.
    A status.json left by the previous run (the resumed run's output dir) does not count."""
    p = first_run.Progress(startup_bound=1000, step_bound=10, now=100.0, status_bound=50)
    old = {"phase": "done", "step": 100, "updated_at": 90.0}
    assert p.update(old, 140.0) is None
    assert "no status.json within 50s of the start" in p.update(old, 151.0)
    p = first_run.Progress(startup_bound=1000, step_bound=10, now=100.0, status_bound=50)
    assert p.update({"phase": "starting", "step": 0, "updated_at": 120.0}, 140.0) is None
    assert p.update({"phase": "loading", "step": 0, "updated_at": 150.0}, 160.0) is None   # init is over


def test_the_init_bound_grows_with_the_layouts_communicators(first_run):
    one = first_run.status_bound([*BASE, "--target-gpus", "0", "--drafter-gpus", "1"])
    node = first_run.status_bound([*BASE, "--target-gpus", "0,1,2,3,4", "--drafter-gpus", "5,6,7"])
    assert first_run.INIT_BASE_S < one < node
    assert node == first_run.INIT_BASE_S + first_run.INIT_PER_OP_S * (3 + 2 * 15 + 1)


def test_a_tiny_targets_startup_bound_is_not_the_27b_targets(first_run):
    """The start-up bound was 9,300 s for every layout, the tiny recipe included."""
    argv = [*BASE, "--target-gpus", "0,1,2,3,4", "--drafter-gpus", "5,6,7", *first_run.TINY_RECIPE]
    tiny, real = first_run.startup_bound(argv, tiny=True), first_run.startup_bound(argv)
    assert tiny < real / 4 and tiny < 3600


def test_the_first_steps_may_compile_before_a_missing_step_is_a_hang(first_run):
    p = first_run.Progress(startup_bound=100, step_bound=10, now=0, first_steps=3, first_extra=50)
    assert p.update({"phase": "training", "step": 1}, 5) is None
    assert p.update({"phase": "training", "step": 2}, 6) is None
    assert p.update({"phase": "training", "step": 2}, 50) is None      # a compile after the warmup: 60 s allowed
    assert p.update({"phase": "training", "step": 4}, 60) is None      # the first 3 steps are over
    assert "no step for 10s after step 4" in p.update({"phase": "training", "step": 4}, 71)
