"""The trainer on torch.distributed, on the CPU with gloo: several ranks, real launcher, real signals.

Layouts are given the way users give them: `--target-gpus cpu --drafter-gpus cpu` with
`--cpu-target-workers T --cpu-drafter-replicas D` starts D drafter ranks and T target ranks
(1 + 1 is world size 1: one rank holds both roles).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.engine.test_trainer import _wait_for, losses, tiny_args, train_here
from trainer.__main__ import main as train_main
from trainer.config.options import parse_args
from trainer.data.dataset import BatchPlanner, load_dataset

THREE_RANKS = ("--cpu-target-workers", "1", "--cpu-drafter-replicas", "2")


def _status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _final_weights(out: Path) -> dict:
    last = sorted(out.glob("step-*"))[-1]
    return load_file(str(last / "model.safetensors"))


def _procs_with(needle: str) -> list[str]:
    """Command lines of live processes that mention `needle` (orphan ranks would)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmd and " -m trainer " in cmd:
                out.append(cmd)
    return out


# ------------------------------------------------------------------------------------ same results

@pytest.mark.slow
def test_one_target_two_drafter_ranks_train_what_world_size_one_trains(uninterrupted, tiny_small_dir, tmp_path):
    """1 target + 2 drafter ranks (grad accum 2: DFlash's uninterrupted run below, the default loss) and world
    size 1 (grad accum 4) see the same 4 micro-batches per step. Per-step losses and final weights agree to
    float rounding: not 0, because the gradients are summed in another order (per rank, then reduce-scattered)
    and fp32 addition is not associative; measured differences are ~1e-7 relative. (Soft labels on these
    layouts: tests/chain/test_hybrid_chain.py's three ranks.)"""
    three, one = uninterrupted("dflash"), tmp_path / "world1"
    assert train_here(tiny_args(tiny_small_dir, one, "--max-steps", "6", "--grad-accum", "4")) == 0
    a, b = losses(one), losses(three)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), f"step {step}"
    wa, wb = _final_weights(one), _final_weights(three)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), k
    st = _status(three)
    assert st["phase"] == "done" and st["world_size"] == 3
    assert [r["role"] for r in st["ranks"]] == ["drafter", "drafter", "target"]


# ------------------------------------------------------------------------------------ dispatch

def test_dispatch_balances_planned_rows_and_both_ends_see_one_schedule(tiny_small_dir):
    from trainer.distributed.dispatch import DispatchPlan
    ds = load_dataset(tiny_small_dir / "data")
    cfg = parse_args(tiny_args(tiny_small_dir, Path("/nonexistent"), "--grad-accum", "4"))
    planner = BatchPlanner(ds.lengths, cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size, seed=cfg.seed)
    D, T = 3, 2
    plan = DispatchPlan(planner, ds, cfg, T, D)
    steps = planner.num_batches * 4 // plan.per_step
    load = np.zeros(D)
    for s in range(steps):
        got = plan.step(s)
        assert [a.seq for a in got] == list(range(s * plan.per_step, (s + 1) * plan.per_step))
        assert {a.drafter for a in got} == set(range(D)), "every drafter rank gets work every step"
        for a in got:
            load[a.drafter] += a.rows
        # the point-to-point schedule as each end computes it, independently
        sends = {t: [(a.seq, a.drafter) for a in plan.for_target(t, s)] for t in range(T)}
        recvs = {d: [(a.seq, a.target) for a in plan.for_drafter(d, s)] for d in range(D)}
        from_sends = sorted((seq, t, d) for t, xs in sends.items() for seq, d in xs)
        from_recvs = sorted((seq, t, d) for d, xs in recvs.items() for seq, t in xs)
        assert from_sends == from_recvs
        for xs in list(sends.values()) + list(recvs.values()):
            assert [x[0] for x in xs] == sorted(x[0] for x in xs), "posted in sequence order"
    spread = (load.max() - load.min()) / load.mean()
    assert spread < 0.05, f"planned rows per drafter rank {load} (spread {spread:.3f})"
    # a second planner (another rank) computes the identical plan
    again = DispatchPlan(BatchPlanner(ds.lengths, cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size,
                                      seed=cfg.seed), ds, cfg, T, D)
    assert all(again.step(s) == plan.step(s) for s in range(steps))


def test_planned_rows_are_the_rows_the_plan_makes(tiny_small_dir):
    """The dispatch counts anchors from the loss mask alone; it must match what plan_micro_batch builds."""
    from trainer.data.dataset import collate
    from trainer.distributed.dispatch import DispatchPlan
    from trainer.ops.plan import plan_micro_batch
    ds = load_dataset(tiny_small_dir / "data")
    cfg = parse_args(tiny_args(tiny_small_dir, Path("/nonexistent")))
    planner = BatchPlanner(ds.lengths, cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size, seed=cfg.seed)
    plan = DispatchPlan(planner, ds, cfg, 1, 1)
    for a in plan.step(0) + plan.step(1):
        ep, bi = divmod(a.seq, planner.num_batches)
        b = collate(ds, planner.epoch_batches(ep)[bi], cfg.max_seq_len, cfg.pad_multiple)
        p = plan_micro_batch(b.input_ids.numpy(), b.loss_mask.numpy(), b.lengths.numpy(), b.sample_ids, ep,
                             seed=cfg.seed, block_size=cfg.block_size, max_anchors=cfg.max_anchors, mask_token_id=3,
                             gamma=cfg.gamma, soft_labels=False, chunk_rows=cfg.drafter_chunk_rows, flex=False)
        assert a.rows == sum(len(c.q_seq) for c in p.chunks)
        assert a.tokens == b.input_ids.numel()


# ------------------------------------------------------------------------------------ routing

def test_a_drafter_rank_refuses_hidden_states_that_are_not_on_its_device():
    """Today's bug was every slot's destination on the first drafter GPU; a drafter rank now receives
    into buffers it allocated on its own device and checks that on every receive."""
    from trainer.distributed.transport import Posted, Receiver
    r = Receiver(torch.device("cpu"), 64, torch.float32, 2, k=2, hidden=4)
    r.bufs[0] = torch.empty(64, device="meta")   # a buffer that lives elsewhere

    class Done:
        def wait(self):
            pass
    r.free.popleft()
    r.posted.append(Posted(7, 0, Done(), rows=4, final_rows=0))
    with pytest.raises(RuntimeError, match="micro-batch 7 arrived on meta"):
        r.take(7)


# ------------------------------------------------------------------------------------ lifecycle

# DFlash2 (issue 43): its candidate selector runs outside the drafter's forward, on the root FSDP unit's
# parameters, and its optimizer state is sharded and restored like the rest (--loss ce+dpace: hard labels)
ARCHS = {"dflash": [], "dflash2": ["--arch", "dflash2", "--loss", "ce+dpace", "--no-use-soft-labels"]}
# 1 target + 2 drafter ranks, 6 steps, a checkpoint every 2 (all kept): the uninterrupted run that the resumes
# below must equal, and world size 1 must train to float rounding
LIFECYCLE = ["--max-steps", "6", "--save-interval", "2", "--keep-checkpoints", "0", "--grad-accum", "2",
             *THREE_RANKS]


# DFlash's uninterrupted run holds each checkpoint 12 s (fault injection; a host-side sleep before the rename,
# nothing the numbers see) under --dist-timeout 4: test_a_checkpoint_longer_than_the_dist_timeout_does_not_fail_the_job
SLOW_CHECKPOINT = {"dflash": ("12", ["--dist-timeout", "4"])}


@pytest.fixture(scope="module")
def uninterrupted(tiny_small_dir, tmp_path_factory):
    """arch -> the output dir of LIFECYCLE's uninterrupted run of that arch, trained once per module (this process
    supervises) and read by every test that resumes from it or compares with it (none writes into it)."""
    runs: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{arch}") / "out"
            held, extra = SLOW_CHECKPOINT.get(arch, (None, []))
            with pytest.MonkeyPatch.context() as mp:   # the ranks' environment
                if held:
                    mp.setenv("DFLASH_FAULT_SLOW_CHECKPOINT", held)
                assert train_main(tiny_args(tiny_small_dir, out, *LIFECYCLE, *ARCHS[arch], *extra)) == 0
            runs[arch] = out
        return runs[arch]
    return get


def _resumed_exactly(ref: Path, out: Path) -> None:
    """Every step after the resume (from step 2) has the uninterrupted run's loss, bit for bit, and the final
    weights are its weights (the same layout: the same sums in the same order)."""
    a, b = losses(ref), losses(out)
    for step in range(3, 7):
        assert b[step] == a[step], f"step {step} differs after the restart"
    wa, wb = _final_weights(ref), _final_weights(out)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_and_the_restart_resumes_exactly(uninterrupted, tiny_small_dir, tmp_path, capfd):
    """A drafter rank SIGKILLed at step 3 ends the job (the supervisor names it, no rank is left behind); the
    restart resumes from step 2 and trains what the uninterrupted run trained, bit for bit. The fault path is
    the arch's business nowhere (the supervisor, status.json, the restart's metrics), so DFlash2 runs it: its
    selector sits on the root FSDP unit, outside the drafter's forward, and the selector's parameters and their
    AdamW state are sharded over the two drafter ranks, checkpointed and restored like the drafter's (DFlash's
    own state resumes onto another number of drafter ranks below)."""
    import threading
    ref, out = uninterrupted("dflash2"), tmp_path / "killed"
    args = tiny_args(tiny_small_dir, out, *LIFECYCLE, *ARCHS["dflash2"])
    # timed from step 2 (rank 1 dies at the top of step 3), not from the start: the startup's imports
    # are what a loaded CI machine stretches, not the detection
    at_step_2, ended = [], threading.Event()

    def watch():
        while not ended.is_set() and _status(out).get("step", 0) < 2:
            time.sleep(0.2)
        at_step_2.append(time.time())
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # this process supervises (no second torch import for a supervisor): the ranks are processes of their own
    # either way, and the SIGKILL is theirs (the fault's variables reach them through the environment)
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_FAULT_DIE_AT_STEP", "3")
        mp.setenv("DFLASH_FAULT_DIE_RANK", "1")
        rc = train_main(args)
    ended.set()
    watcher.join()
    took = time.time() - at_step_2[0]
    stderr = capfd.readouterr().err
    assert rc == 1, stderr[-2000:]
    st = _status(out)
    assert st["phase"] == "failed" and "rank 1" in st["error"] and "SIGKILL" in st["error"], st
    assert "error: rank 1 failed" in stderr
    assert took < 90, f"the job took {took:.0f}s after step 2 to notice the rank that died at step 3"
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000002"]
    assert not _procs_with(str(out)), "ranks left behind"
    # systemd restarts it (the same command line): it resumes from step 2 and trains what the uninterrupted
    # run trained
    assert train_main(args) == 0
    assert _status(out)["resumed_from"].endswith("step-00000002")
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6], "metrics.jsonl holds each step once"
    _resumed_exactly(ref, out)


@pytest.mark.slow
def test_dflash2_on_three_ranks_trains_what_world_size_one_trains(uninterrupted, tiny_small_dir, tmp_path):
    """DFlash2's uninterrupted run on 1 target + 2 drafter ranks and world size 1 (grad accum 4) train the same
    to float rounding (DFlash: test_one_target_two_drafter_ranks_train_what_world_size_one_trains; DFlash2's
    exact resume: test_a_dead_rank_ends_the_job_and_the_restart_resumes_exactly)."""
    ref, one = uninterrupted("dflash2"), tmp_path / "world1"
    assert train_here(tiny_args(tiny_small_dir, one, "--max-steps", "6", "--grad-accum", "4", *ARCHS["dflash2"])) == 0
    a, w1 = losses(ref), losses(one)
    assert sorted(w1) == sorted(a)
    for step in a:
        assert w1[step] == pytest.approx(a[step], rel=1e-5), f"step {step}: world size 1 vs 1 + 2 ranks"


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_once_and_leaves_no_rank(tiny_small_dir, tmp_path):
    out = tmp_path / "term"
    cmd = [sys.executable, "-m", "trainer",
           *tiny_args(tiny_small_dir, out, "--max-steps", "40", "--grad-accum", "2", *THREE_RANKS)]
    env = dict(os.environ, DFLASH_FAULT_STEP_DELAY="0.8")
    log = tmp_path / "term.stderr"
    with open(log, "wb") as err:  # a file, not a pipe: nobody drains a pipe while we wait
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    _wait_for(lambda: _status(out).get("step", 0) >= 3, 600, "step 3", p, log)
    ranks = _procs_with(str(out))
    assert len(ranks) >= 4, ranks          # the supervisor and its three ranks
    p.send_signal(signal.SIGTERM)          # what systemd sends (KillMode=mixed: the main process only)
    assert p.wait(timeout=300) == 0, log.read_text()[-2000:]
    st = _status(out)
    assert st["phase"] == "done" and 3 <= st["step"] < 40
    assert [x.name for x in out.glob("step-*")] == [f"step-{st['step']:08d}"]
    ck = out / f"step-{st['step']:08d}"
    assert (ck / "model.safetensors").is_file() and (ck / "dcp" / ".metadata").is_file()
    _wait_for(lambda: not _procs_with(str(out)), 10, "no rank left")


@pytest.mark.slow
def test_resume_onto_a_different_number_of_drafter_ranks(uninterrupted, tiny_small_dir, tmp_path):
    """DCP reshards the model and AdamW state: 2 drafter ranks checkpoint at step 2 (the uninterrupted run), 1
    drafter rank (same micro-batches per step: grad accum 4 instead of 2) goes on and matches the 2-rank run."""
    import shutil
    two, one = uninterrupted("dflash"), tmp_path / "one"
    one.mkdir()
    shutil.copytree(two / "step-00000002", one / "step-00000002")
    assert train_here(tiny_args(tiny_small_dir, one, "--max-steps", "6", "--save-interval", "2",
                                "--keep-checkpoints", "0", "--grad-accum", "4")) == 0
    assert _status(one)["resumed_from"].endswith("step-00000002")
    a, b = losses(two), losses(one)
    for step in (3, 4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-5), f"step {step}"


# ------------------------------------------------------------------------------- node rank order

# Each node of the two-node jobs (two supervisors on loopback): a drafter rank and a target rank (global ranks 0, 1
# on node 0 and 2, 3 on node 1), the fewest that put both roles on both nodes. What these tests check is between
# the nodes; each rank process costs its imports (~5 CPU-s), so no second target per node.
PER_NODE = ("--cpu-target-workers", "1", "--cpu-drafter-replicas", "1")

@pytest.mark.slow
def test_global_ranks_follow_node_rank_whatever_the_nodes_are_called(tiny_small_dir, tmp_path):
    """Two supervisors on one host, both named "localhost" (the endpoint's name and this host's fqdn), node 1
    started first. c10d's rendezvous numbered nodes by sorting (address, pid), so node 1 became node 0 and
    its drafter global rank 0: the leader's status.json landed in node 1's file. With the static rendezvous
    the node ranks are the ones given: node 0's first drafter leads and node 1 writes no status.json."""
    import socket
    if socket.getfqdn() != "localhost":
        pytest.skip(f"this host's fqdn is {socket.getfqdn()!r}, not localhost: the names would not tie")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    args = [*tiny_args(tiny_small_dir, out, "--epochs", "1", "--max-steps", "2", "--seed", "0"), *PER_NODE,
            "--nnodes", "2", "--rdzv-endpoint", f"localhost:{port}", "--dist-timeout", "120"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]))
    node1 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "1",
                              "--status-file", str(tmp_path / "node1" / "status.json"),
                              "--log-dir", str(tmp_path / "node1")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    node0 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "0"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out0, _ = node0.communicate(timeout=300)
        out1, _ = node1.communicate(timeout=60)
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
    assert node0.returncode == 0 and node1.returncode == 0, (out0[-2000:], out1[-2000:])
    st = _status(out)
    assert st["phase"] == "done" and st["step"] >= 1
    assert not (tmp_path / "node1" / "status.json").exists(), "node 1 held the leader"
    assert "ranks: rank 0 drafter" in out0
    # one job with a shared output dir: the final checkpoint holds both nodes' drafter shards
    ckpt = out / f"step-{st['step']:08d}"
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "model.safetensors").is_file()


# ------------------------------------------------------------------------------- the logged loss

def test_the_logged_loss_is_the_mean_per_supervised_token_whatever_the_grad_accum(tiny_small_dir, tmp_path):
    """With a learning rate too small to move the weights, one step of 4 micro-batches logs the same loss
    as the weighted mean of 4 steps of one: sum(w * CE) / sum(w). The loss used to be summed over the
    step's micro-batches (about 4x at --grad-accum 4, 3 x 4 at 3 drafter ranks), so every layout, grad
    accum and resume onto another number of drafter ranks logged another scale."""
    extra = ["--max-steps", "4", "--lr", "1e-30", "--noise-start", "0", "--noise-end", "0"]
    one, four = tmp_path / "ga1", tmp_path / "ga4"
    assert train_here(tiny_args(tiny_small_dir, one, *extra, "--grad-accum", "1")) == 0
    assert train_here(tiny_args(tiny_small_dir, four, *extra, "--grad-accum", "4", "--max-steps", "1")) == 0
    recs1 = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()][:4]
    rec4 = json.loads((four / "metrics.jsonl").read_text().splitlines()[0])
    mean = sum(r["loss"] * r["loss_weight"] for r in recs1) / sum(r["loss_weight"] for r in recs1)
    assert rec4["loss"] == pytest.approx(mean, rel=1e-5)
    assert rec4["loss_weight"] == pytest.approx(sum(r["loss_weight"] for r in recs1), rel=1e-6)
    # a per-token mean of the untrained drafter: about ln(vocab), nowhere near 4x of it
    assert all(abs(r["loss"] - rec4["loss"]) < 0.5 * rec4["loss"] for r in recs1)


# ----------------------------------------------------------- host phases longer than --dist-timeout

@pytest.mark.slow
def test_a_checkpoint_longer_than_the_dist_timeout_does_not_fail_the_job(uninterrupted):
    """The leader's checkpoints are held 12 s (fault injection) with --dist-timeout 4 (DFlash's uninterrupted run,
    checkpoints at steps 2, 4 and 6): the target rank must not sit in a send that times out meanwhile. Every
    rank waits for the checkpoint at the step it is taken (a host-side barrier on the gloo control group, whose
    timeout is HOST_PHASE_TIMEOUT_S). The fixture asserts the run exited 0."""
    out = uninterrupted("dflash")
    st = _status(out)
    assert st["phase"] == "done" and st["step"] == 6
    assert (out / "step-00000002").is_dir() and (out / "step-00000004").is_dir()
    log = "\n".join(f.read_text(errors="replace") for f in (out / "logs").glob("*.log"))
    assert log.count("fault injection: checkpoint") >= 2, "the checkpoints were not held"


# ------------------------------------------------------------------------------- a dead rank

@pytest.mark.slow
def test_a_dead_rank_on_one_node_ends_the_job_on_the_other_within_a_minute(tiny_small_dir, tmp_path):
    """Two nodes (two supervisors on loopback, PER_NODE's 2 ranks each); node 1's target (rank 3) is SIGKILLed at
    step 2.
    Node 1's launcher sees its rank die; node 0's sees nothing, and its ranks learn of the death from their
    next op with the peer. With NCCL, destroy_process_group then waits for the ops that involve the dead
    peer (until the NCCL timeout, 10 minutes): this test makes it block likewise (a sitecustomize on the
    ranks' path). The job must still end on both nodes within 60 s of the death: a failing rank aborts
    its process groups and exits."""
    import socket
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\n"
        "import torch.distributed as dist\n"
        "def _stuck(*a, **k):   # NCCL: waits for ops the dead peer never completes\n"
        "    time.sleep(10 ** 6)\n"
        "dist.destroy_process_group = _stuck\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{hook}:{Path(__file__).parents[2]}",
               DFLASH_FAULT_DIE_AT_STEP="2", DFLASH_FAULT_DIE_RANK="3")
    args = [*tiny_args(tiny_small_dir, out, "--max-steps", "50", "--stop-timeout", "300"), *PER_NODE,
            "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--dist-timeout", "600"]
    node1 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "1",
                              "--status-file", str(tmp_path / "node1" / "status.json"),
                              "--log-dir", str(tmp_path / "node1")],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node0 = subprocess.Popen([sys.executable, "-m", "trainer", *args, "--node-rank", "0"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        died = None
        deadline = time.time() + 300
        while any(p.poll() is None for p in (node0, node1)) and time.time() < deadline:
            if died is None and any("killing itself" in f.read_text(errors="replace")
                                    for f in (tmp_path / "node1").glob("*rank3.log")):
                died = time.time()          # rank 3 logs this line, then SIGKILLs itself
            if died is not None and time.time() - died > 90:
                break
            time.sleep(0.2)
        assert died is not None, "rank 3 never reached its death"
        assert node0.poll() is not None and node1.poll() is not None, \
            f"still running {time.time() - died:.0f}s after the death: node0 {node0.poll()}, node1 {node1.poll()}"
        assert time.time() - died < 60
        assert node0.returncode != 0 and node1.returncode != 0
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()


def test_a_drafter_unit_without_gradients_after_the_syncing_backward_is_named():
    """FSDP2 skips a unit's reduce-scatter when its parameters got no gradient: on one rank only, that is a
    collective mismatch. The drafter stage checks after its syncing backward."""
    from trainer.engine.drafter_stage import check_unit_gradients
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    model["used"](torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="unused.weight"):
        check_unit_gradients(model)
    model["unused"](torch.ones(1, 2)).sum().backward()
    check_unit_gradients(model)
