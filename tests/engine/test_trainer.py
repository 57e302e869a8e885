"""The trainer on the CPU with tiny models: mask, loss, async == sync, resume, NaN guard, bad input."""

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

from trainer.__main__ import main as train_main
from trainer.config.options import ConfigError, parse_args
from trainer.config.preflight import validate
from trainer.model.drafter import DFlashConfig, DFlashDrafter, PackedMeta, init_drafter_weights, tap_layers
from trainer.ops.loss import dflash_loss
from trainer.ops.plan import plan_micro_batch

# The seed run as typed by hand (docs/contracts.md): block 32, gamma 10, soft labels, and the loss then the
# default, CE (the defaults since 2026-12-06 are block 16, hard labels, CE + D-PACE).
ORIGINAL = ("--target-model /dev/shm/Qwen3.6-27B --data-dir /workspace/tokenized_completions "
            "--output-dir /workspace/checkpoints --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7 --epochs 6 --lr 6e-4 "
            "--warmup-ratio 0.04 --weight-decay 0.01 --grad-accum 4 --grad-clip 1.0 --token-budget 49152 "
            "--max-seq-len 8192 --max-batch-size 64 --block-size 32 --max-anchors 1024 --num-draft-layers 5 "
            "--gamma 10.0 --noise-start 0.05 --noise-end 0.01 --noise-type uniform --use-soft-labels")


def tiny_args(tiny: Path, out: Path, *extra: str) -> list[str]:
    return ["--target-model", str(tiny / "target"), "--data-dir", str(tiny / "data"), "--output-dir", str(out),
            "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--token-budget", "1024", "--max-seq-len", "256",
            "--block-size", "8", "--max-anchors", "8", "--num-draft-layers", "2", "--gamma", "4",
            "--grad-accum", "2", "--lr", "3e-3", "--epochs", "40", "--save-interval", "1000",
            "--profile-interval", "600", "--noise-start", "0.02", "--noise-end", "0.01", *extra]


def train_here(args: list[str]) -> int:
    """One world-size-1 job with its rank in this process: what train_main's launched rank runs (train_rank, its
    exit code), without the supervisor and the rank's own process (about 5 CPU-s a job, most of it the rank's
    imports), for the tests about what a run computes, writes and resumes, not about its processes (those call
    train_main or start `python -m trainer`). This process is left as it was: the launcher's environment, the
    signal handlers and faulthandler's, the root logger's handlers, no process group."""
    import faulthandler
    import logging

    import torch.distributed as dist

    from trainer.distributed.groups import single_env
    from trainer.engine.rank import train_rank
    cfg = parse_args(args)
    env = single_env(cfg)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    warnings_logged = getattr(logging, "_warnings_showwarning", None) is not None
    handled = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.MonkeyPatch.context() as mp:   # the launcher's environment for its one rank
            for k, v in env.items():
                mp.setenv(k, v)
            for k in ("DFLASH_SUPERVISED", "DFLASH_SUPERVISOR_PID"):   # left here by an earlier train_main
                mp.delenv(k, raising=False)
            return train_rank(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for s in (signal.SIGUSR1, signal.SIGTERM):
            faulthandler.unregister(s)
        for s, h in handled.items():
            signal.signal(s, h)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        logging.captureWarnings(warnings_logged)


def records(out: Path, kind: str = "step") -> list[dict]:
    """metrics.jsonl's records of one kind: "step" (no `kind` key: one per optimizer step) or "eval"."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("kind", "step") == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out)}


# ------------------------------------------------------------------------------------ model facts

def test_taps_spread_like_the_recipe():
    assert tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert tap_layers(64, 5) == [1, 16, 31, 46, 61]


def _tiny_drafter(block=4):
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=512, block_size=block, target_layer_ids=[0, 1], mask_token_id=49,
                       target_num_hidden_layers=4)
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    init_drafter_weights(m, std=0.2)
    return cfg, m.eval()


def _one_sequence_batch(block=4, n=24):
    ids = np.random.default_rng(1).integers(0, 48, size=(1, n))
    mask = np.zeros((1, n), bool)
    mask[0, 6:] = True
    plan = plan_micro_batch(ids, mask, np.array([n]), [0], 0, seed=3, block_size=block, max_anchors=3,
                            mask_token_id=49, gamma=4.0, soft_labels=False, chunk_rows=10_000, flex=False)
    c = plan.chunks[0]
    t = lambda a: torch.from_numpy(a)
    meta = PackedMeta(t(c.ctx_seq), t(c.ctx_pos), t(c.q_seq), t(c.q_anchor), t(c.q_pos), block)
    return ids, c, meta


def test_mask_blocks_see_only_context_before_their_anchor_and_their_own_block():
    cfg, model = _tiny_drafter()
    ids, c, meta = _one_sequence_batch()
    anchors = c.q_anchor[:: cfg.block_size]
    assert len(anchors) == 3 and all(anchors >= 6)
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(len(c.ctx_seq), 64, generator=g)
    emb = torch.randn(len(c.q_seq), 32, generator=g)
    base = model(taps, emb, meta)
    j, a = 1, int(anchors[1])
    rows = slice(j * 4, (j + 1) * 4)

    at_or_after = taps.clone()
    at_or_after[a:] += 5.0            # the anchor's own hidden state and everything later
    assert torch.allclose(model(at_or_after, emb, meta)[rows], base[rows], atol=1e-6)

    other_block = emb.clone()
    other_block[0:4] += 5.0           # block 0's tokens
    other_block[8:12] += 5.0          # block 2's tokens
    assert torch.allclose(model(taps, other_block, meta)[rows], base[rows], atol=1e-6)

    before = taps.clone()
    before[a - 1] += 5.0              # the last context row the block may see
    assert not torch.allclose(model(before, emb, meta)[rows], base[rows], atol=1e-4)

    own = emb.clone()
    own[rows.start + 3] += 5.0        # a later slot of the same block (bidirectional inside a block)
    assert not torch.allclose(model(taps, own, meta)[rows.start], base[rows.start], atol=1e-4)


def test_plan_labels_are_the_tokens_at_anchor_plus_slot():
    ids, c, _ = _one_sequence_batch()
    for r in range(len(c.q_seq)):
        slot = r % 4
        pos = c.q_anchor[r] + slot
        if slot == 0:
            assert c.labels[r] == -1 and c.block_tokens[r] == ids[0, c.q_anchor[r]] and c.row_weight[r] == 0
        else:
            assert c.block_tokens[r] == 49
            if pos < ids.shape[1]:
                assert c.labels[r] == ids[0, pos]
                assert c.row_weight[r] == pytest.approx(np.exp(-(slot - 1) / 4.0))


@pytest.mark.parametrize("soft", [False, True])
def test_chunked_loss_matches_full_logits_reference(soft):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (10,), generator=g)
    labels[3] = -1
    w = torch.rand(10, generator=g, dtype=torch.float64)
    w[3] = 0.0
    soft_rows = torch.randn(10, 16, generator=g, dtype=torch.float64) if soft else None
    loss, _ = dflash_loss(hidden, weight, labels, w, 2.5, soft_rows=soft_rows, chunk=3)
    loss.backward()
    h2 = hidden.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(h2 @ weight.t(), -1)
    if soft:
        ce = -(torch.softmax(soft_rows @ weight.t(), -1) * logp).sum(-1)
    else:
        ce = -logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    ref = (ce * w).sum() / 2.5
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # fp32 logits by design
    assert torch.allclose(hidden.grad, h2.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ whole-run behaviour

@pytest.fixture(scope="module")
def three_steps(tiny_small_dir, tmp_path_factory):
    """Three 3-step runs of the same flags, read by the two tests below: "p1" (async, --pad-multiple 1),
    "p96" (async, --pad-multiple 96) and "sync" (--no-async, --pad-multiple 1). name -> step -> loss."""
    root = tmp_path_factory.mktemp("three-steps")
    extra = ["--max-steps", "3", "--use-soft-labels", "--loss", "ce"]
    runs = {}
    for name, flags in (("p1", ["--pad-multiple", "1"]), ("p96", ["--pad-multiple", "96"]),
                        ("sync", ["--pad-multiple", "1", "--no-async"])):
        assert train_here(tiny_args(tiny_small_dir, root / name, *extra, *flags)) == 0
        runs[name] = losses(root / name)
    return runs


def test_padding_batches_to_a_multiple_changes_no_loss(three_steps):
    """--pad-multiple only adds right padding the causal target never attends to from real tokens:
    the same steps give the same losses with and without it."""
    a, b = three_steps["p1"], three_steps["p96"]
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5, abs=1e-6)


def test_no_async_runs_the_same_math(three_steps):
    """--no-async waits for every stage on the host; the numbers are the async run's."""
    a, s = three_steps["p1"], three_steps["sync"]
    assert sorted(a) == sorted(s) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(s[step], rel=1e-6, abs=1e-7)


def _wait_for(pred, timeout, what, proc=None, log=None):
    """Poll ``pred`` until it holds. The bound is generous (a 2-core CI host running four lanes
    starts a torch process in minutes, not seconds); a watched ``proc`` that exits first fails at
    once with the tail of its ``log``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}:\n{tail}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues_the_same_run(tiny_small_dir, tmp_path):
    extra = ["--max-steps", "14"]
    ref = tmp_path / "ref"
    assert train_here(tiny_args(tiny_small_dir, ref, *extra)) == 0
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "trainer", *tiny_args(tiny_small_dir, out, *extra)]
    # 1 s per step: the signal lands mid-run however fast this host trains the tiny model
    env = dict(os.environ, DFLASH_FAULT_STEP_DELAY="1.0")
    log = tmp_path / "interrupted.stderr"
    with open(log, "wb") as err:  # a file, not a pipe: nobody drains a pipe while we wait
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    _wait_for(lambda: _status(out).get("step", 0) >= 4, 600, "step 4", p, log)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == 0, log.read_text()[-2000:]
    st = _status(out)
    stopped_at = st["step"]
    assert st["phase"] == "done" and 4 <= stopped_at < 14
    assert (out / f"step-{stopped_at:08d}" / "model.safetensors").is_file()
    # the restart (the same command line) in this process: resuming is not the signal's business
    assert train_here(tiny_args(tiny_small_dir, out, *extra)) == 0
    st = _status(out)
    assert st["resumed_from"].endswith(f"step-{stopped_at:08d}") and st["step"] == 14
    a, b = losses(ref), losses(out)
    for step in range(stopped_at + 1, 15):
        assert b[step] == pytest.approx(a[step], rel=1e-5), f"step {step} differs after resume"


def test_nan_storm_fails_the_run_and_keeps_the_last_good_checkpoint(tiny_small_dir, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    monkeypatch.setenv("DFLASH_FAULT_NAN_FROM_STEP", "3")
    rc = train_here(tiny_args(tiny_small_dir, out, "--max-steps", "20", "--save-interval", "2",
                              "--max-nan-skips", "3"))
    assert rc == 1
    st = _status(out)
    assert st["phase"] == "failed" and "consecutive" in st["error"] and st["nan_skips"] >= 3
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000002"]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, False, True, True, True]


# ------------------------------------------------------------------------------------ bad input

def test_original_command_line_parses(tiny_small_dir):
    args = ORIGINAL.replace("/dev/shm/Qwen3.6-27B", str(tiny_small_dir / "target")).replace(
        "/workspace/tokenized_completions", str(tiny_small_dir / "data")).replace(
        "/workspace/checkpoints", "/tmp/dflash-original-parse").split()
    cfg = parse_args(args)
    assert cfg.target_gpus == [0, 1, 2, 3, 4] and cfg.drafter_gpus == [5, 6, 7]
    assert (cfg.block_size, cfg.max_anchors, cfg.gamma, cfg.token_budget, cfg.grad_accum) == (32, 1024, 10.0, 49152, 4)
    assert cfg.use_soft_labels and cfg.noise_type == "uniform" and cfg.noise_start == 0.05
    # typed today it meets the default --loss ce+dpace, defined on hard labels: one line says what to add
    with pytest.raises(ConfigError, match="^--loss: the default ce\\+dpace is defined on hard labels: "
                                          "--use-soft-labels needs --loss ce too$"):
        validate(cfg, gpu_count=8)
    cfg = parse_args(args + ["--loss", "ce"])
    assert cfg.loss == "ce"
    validate(cfg, gpu_count=8)  # on an 8-GPU node this is a valid run


def _bad(tiny, tmp_path, **override):
    a = dict(zip(tiny_args(tiny, tmp_path / "o")[0::2], tiny_args(tiny, tmp_path / "o")[1::2]))
    a.update(override)
    return [x for kv in a.items() for x in kv]


@pytest.mark.parametrize("override,needle", [
    ({"--target-gpus": "0,1", "--drafter-gpus": "1,2"}, "--drafter-gpus"),
    ({"--target-gpus": "0", "--drafter-gpus": "1"}, "do not exist"),
    ({"--block-size": "1"}, "--block-size"),
    ({"--gamma": "0"}, "--gamma"),
    ({"--token-budget": "128"}, "--token-budget"),
    ({"--noise-end": "0.5"}, "--noise-end"),
    ({"--noise-type": "pink"}, "--noise-type"),
    ({"--target-model": "/nonexistent/model"}, "--target-model"),
])
def test_bad_flags_exit_2_naming_the_flag(tiny_small_dir, tmp_path, capsys, override, needle):
    assert train_main(_bad(tiny_small_dir, tmp_path, **override)) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists(), "nothing may be written before validation passes"


def test_bad_files_exit_2_naming_the_file(tiny_small_dir, tmp_path, capsys):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_small_dir / "target", model)
    (model / "config.json").unlink()
    assert train_main(_bad(tiny_small_dir, tmp_path, **{"--target-model": str(model)})) == 2
    assert "config.json" in capsys.readouterr().err

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_small_dir / "target", sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert train_main(_bad(tiny_small_dir, tmp_path, **{"--target-model": str(sharded)})) == 2
    assert "model-00002-of-00002.safetensors" in capsys.readouterr().err

    empty = tmp_path / "empty-data"
    empty.mkdir()
    assert train_main(_bad(tiny_small_dir, tmp_path, **{"--data-dir": str(empty)})) == 2
    assert "--data-dir" in capsys.readouterr().err


def test_malformed_shard_exits_2_naming_the_shard(tiny_small_dir, tmp_path, capfd):
    """A shard that passes the cheap checks (present, non-empty) but is corrupt when read is bad
    input too: exit 2 (dflash.service does not restart it) and the error names the shard."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(tiny_small_dir / "data", data)
    shard = sorted(data.glob("shard-*.parquet"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[100:200] = bytes(100)
    shard.write_bytes(bytes(raw))
    out = tmp_path / "o"
    assert train_main(_bad(tiny_small_dir, tmp_path, **{"--data-dir": str(data)})) == 2
    err = capfd.readouterr().err     # the rank is a process of its own; the supervisor prints its line
    assert f"dflash-train: error: --data-dir: {shard}: sha256 mismatch" in err
    st = _status(out)
    assert st["phase"] == "failed" and str(shard) in st["error"]
    assert not list(out.glob("step-*"))


def test_check_config_validates_without_loading(tiny_small_dir, tmp_path, capsys):
    assert train_main(tiny_args(tiny_small_dir, tmp_path / "o", "--check-config")) == 0
    assert "config ok" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_drafter_learns_the_targets_outputs_and_tau_rises(tiny_small_dir, tmp_path):
    from trainer.data.dataset import load_dataset
    from trainer.engine.evaltrain import eval_loop
    from trainer.model.drafter import init_drafter_weights
    from trainer.model.target import load_target
    from trainer.serving.evaluate import evaluate, load_drafter
    out = tmp_path / "learn"
    # hard labels: the data are the target's own greedy outputs (soft labels chase the tiny random target's
    # high-entropy distribution, whose loss cannot fall by a whole nat); CE, whose nats the bound below counts
    # (the default ce+dpace logs a confidence-weighted objective on another scale)
    rc = train_here(tiny_args(tiny_small_dir, out, "--no-use-soft-labels", "--loss", "ce", "--epochs", "12",
                              "--grad-accum", "1",
                              "--lr", "5e-3",
                              "--max-anchors", "16", "--eval-data-dir", str(tiny_small_dir / "heldout")))
    assert rc == 0
    curve = [v for _, v in sorted(losses(out).items())]
    assert len(curve) >= 60
    assert np.mean(curve[-10:]) < np.mean(curve[:5]) - 1.0, curve
    trained = json.loads((out / "eval.json").read_text())
    target = load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)
    model, dcfg = load_drafter(str(sorted(out.glob("step-*"))[-1]), "cpu")
    init_drafter_weights(model)
    # measured as the run's own eval measured the trained weights: its loop (batched; the single loop gives the
    # same accept lengths, tests/engine/test_evaltrain.py, at about twice the CPU), prompts and new tokens
    untrained = evaluate(target, model, dcfg, load_dataset(tiny_small_dir / "heldout"), torch.device("cpu"),
                         loop=eval_loop(dcfg))
    assert untrained["loop"] == trained["loop"]
    # tau is now measured by real speculative generation (tokens per verify step), not teacher-forced
    # blocks: on the tiny random target a trained drafter reaches about 1.2-1.4, an untrained one 1.0
    assert untrained["tau"] < 1.1
    assert trained["tau"] > untrained["tau"] + 0.12, (trained, untrained)
    assert trained["per_position_acceptance"][0] > 0.05


@pytest.mark.parametrize("ctx_group", [0, 1, 2])
def test_flex_block_sparse_path_matches_the_dense_mask(ctx_group):
    """The GPU path (FlexAttention with host-built block sparsity) computes what the dense mask says.
    Eager FlexAttention on the CPU applies both the tile list and the mask_mod. ctx_group > 0: each group
    of query tiles attends to its own copy of the context (plan.context_copies)."""
    cfg, model = _tiny_drafter(block=8)
    model.requires_grad_(False)
    rng = np.random.default_rng(0)
    lens = np.array([300, 77, 150])
    ids = rng.integers(0, 48, size=(3, lens.max()))
    mask = np.zeros(ids.shape, bool)
    for b, n in enumerate(lens):
        mask[b, n // 3:n] = True
    plan = plan_micro_batch(ids, mask, lens, [0, 1, 2], 0, seed=1, block_size=8, max_anchors=20, mask_token_id=49,
                            gamma=4.0, soft_labels=True, chunk_rows=10**6, flex=True, ctx_group=ctx_group)
    c = plan.chunks[0]
    assert (c.c1 - c.c0) % 128 == 0
    t = torch.from_numpy
    copies = {k: t(getattr(c, k)) for k in ("kv_ctx", "kv_ctx_seq", "q_copy_seq")} if ctx_group else {}
    meta = PackedMeta(t(c.ctx_seq), t(c.ctx_pos), t(c.q_seq), t(c.q_anchor), t(c.q_pos), 8,
                      t(c.kv_num_blocks), t(c.kv_indices), **copies)
    if ctx_group:
        assert len(c.kv_ctx) > len(c.ctx_seq)  # the query tiles of one sequence share its first tiles
    # every allowed (query, key) pair lies in a listed tile
    from trainer.model.drafter import dense_mask
    dm = dense_mask(meta).numpy()
    if not ctx_group:
        tiles = np.zeros((dm.shape[0] // 128 + 1, dm.shape[1] // 128 + 1), bool)
        for qb in range(c.kv_num_blocks.shape[2]):
            tiles[qb, c.kv_indices[0, 0, qb, :c.kv_num_blocks[0, 0, qb]]] = True
        qi, ki = np.nonzero(dm)
        assert tiles[qi // 128, ki // 128].all()
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(len(c.ctx_seq), 64, generator=g)
    emb = torch.randn(len(c.q_seq), 32, generator=g)
    ref = model(taps, emb, meta, backend="sdpa")
    out = model(taps, emb, meta, backend="flex")
    assert torch.allclose(out, ref, atol=1e-5)


def test_context_copies_sum_their_gradients_in_fp32():
    """The copies' backward adds every copy's gradient into its source row, in fp32, rounding once (the
    gradients through FlexAttention itself are checked on the GPU: trainer.lab.bench's flex check)."""
    from trainer.model.drafter import context_copies
    g = torch.Generator().manual_seed(0)
    t = torch.randn(256 + 40, 2, 8, generator=g).bfloat16().requires_grad_(True)
    kv_ctx = torch.cat([torch.arange(0, 256), torch.arange(0, 128), torch.arange(128, 256), torch.arange(0, 128)])
    out = context_copies(t, 256, kv_ctx)
    assert out.shape == (len(kv_ctx) + 40, 2, 8) and out.dtype == torch.bfloat16
    assert torch.equal(out[:len(kv_ctx)], t.detach()[kv_ctx]) and torch.equal(out[len(kv_ctx):], t.detach()[256:])
    up = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(up)
    want = torch.zeros(256 + 40, 2, 8, dtype=torch.float64)
    want.index_add_(0, kv_ctx, up[:len(kv_ctx)].double())
    want[256:] = up[len(kv_ctx):].double()
    assert torch.equal(t.grad, want.to(torch.bfloat16))  # one rounding of the exact sum


def test_extending_a_run_follows_the_new_length_without_repeating_the_warmup(tiny_small_dir, tmp_path):
    """Resume with a larger --max-steps: the warmup length of the first run is kept (stored in the
    checkpoint), the cosine follows the new total from the resumed step, so the first step after the
    resume is neither lr 0 nor a step back into warmup (it was lr 0.0, then 9.6e-4, before)."""
    from trainer.engine.optim import lr_at
    out = tmp_path / "ext"
    base = ["--warmup-ratio", "0.25", "--save-interval", "4"]
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "8", *base)) == 0
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "16", *base)) == 0
    recs = {json.loads(x)["step"]: json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()}
    assert sorted(recs) == list(range(1, 17))
    warm = 2                                   # 0.25 x 8 steps, kept when the run grows to 16
    for step in range(9, 17):                  # 1-based steps of the extension
        assert recs[step]["lr"] == pytest.approx(lr_at(step - 1, 3e-3, warm, 16))
    assert recs[9]["lr"] > recs[8]["lr"] > 0   # the new, longer cosine sits higher at step 9: by definition
    lrs = [recs[s]["lr"] for s in range(9, 17)]
    assert lrs == sorted(lrs, reverse=True)
