"""dflash-regenerate: the target writes the completions (issue 12, "data the target would write").

Specifications: the output is dflash-prepare's shard format with the loss mask on exactly the generated
tokens, which are the target's own greedy continuation of each record's prompt; a run killed with
SIGKILL resumes without redoing finished shards and ends byte-identical to an uninterrupted run; bad
input exits 2 with one line naming it; and a drafter trained on regenerated data reaches a higher tau
(real speculative generation) than one trained on the same prompts with answers the target would not
write.
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

from trainer.data.dataset import load_dataset, write_shards
from trainer.serving.evaluate import heldout_prompts, load_target, stop_token_ids
from trainer.serving.regenerate import MANIFEST_NAME, lock_output_dir, main, regenerate

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda msg: None)


@pytest.fixture(scope="module")
def target(tiny_small_dir):
    torch.set_num_threads(1)
    return load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if not p.name.startswith(".")}


def test_output_is_prepare_shards_masked_on_the_targets_own_greedy_continuation(tiny_small_dir, target,
                                                                                tmp_path):
    src, out = tiny_small_dir / "data", tmp_path / "regen"
    stats = regenerate(src, tiny_small_dir / "target", out, batch_size=8, max_new_tokens=24,
                       shard_size=16, **QUIET)
    ds, source = load_dataset(out), load_dataset(src)            # the trainer's reader, sha256 checked
    prompts = heldout_prompts(source, len(source))
    assert len(ds) == len(prompts) == stats["records"] and len(ds.index["shards"]) == 3
    gen = ds.index["regenerated"]
    assert gen["target_model"] == str((tiny_small_dir / "target").absolute())
    assert (gen["max_new_tokens"], gen["temperature"]) == (24, 0.0)
    assert gen["source"]["hash"] == source.index["hash"]
    assert stats["tokens_generated"] == ds.num_supervised_tokens > 0 and stats["tokens_per_s"] > 0

    stops = stop_token_ids(target)
    for i, p in enumerate(prompts):
        ids, mask = ds[i]
        assert np.array_equal(ids[:len(p)], p)                        # the prompt, unchanged
        assert not mask[:len(p)].any() and mask[len(p):].all()        # supervised = generated, exactly
        comp = ids[len(p):].tolist()
        assert 1 <= len(comp) <= 24
        assert len(comp) == 24 or comp[-1] in stops                   # stopped at EOS (kept) or the limit
        assert not set(comp[:-1]) & set(stops)
    for i in (0, 5, len(prompts) - 1):                                # re-count: unbatched, unpadded
        p = torch.as_tensor(prompts[i])[None]
        ref = target.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=stops, pad_token_id=0)
        assert ds[i][0][p.shape[1]:].tolist() == ref[0, p.shape[1]:].tolist()


def test_jsonl_input_gives_the_shards_of_prepare_and_data_dir(tiny_small_dir, tmp_path):
    """--input goes through dflash-prepare's chat-template code: the same prompts as prepare + --data-dir.
    (--devices, the same bytes over several replicas: test_two_captured_devices_are_two_processes_writing_the_same_shards,
    whose worker processes run whichever decoder they are given.)"""
    from trainer.data.prepare import prepare

    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"ab cd {w}", "completion": "human words"}) + "\n"
                             for w in ("ef", "gh ij", "kl", "mn op qr", "st")))
    target = tiny_small_dir / "target"
    prepare(target, [jsonl], tmp_path / "prepared", log=lambda *a: None)
    common = dict(batch_size=2, max_new_tokens=8, shard_size=2, **QUIET)
    regenerate(None, target, tmp_path / "from-jsonl", inputs=[jsonl], **common)
    regenerate(tmp_path / "prepared", target, tmp_path / "from-dir", **common)
    a, b = (files(tmp_path / d) for d in ("from-jsonl", "from-dir"))
    shards = [n for n in a if n.startswith("shard-")]
    assert len(shards) == 3 and all(a[n] == b[n] for n in shards)


def test_prompt_only_jsonl_is_what_regeneration_answers(tiny_small_dir, tmp_path, capsys):
    """Regeneration writes the answers, so prompt-only JSONL (messages without an assistant turn, or a
    'prompt' alone) is its input: the same shards as the same prompts with answers the target replaces.
    A record that is neither still exits 2 naming its file and line."""
    words = ("ef", "gh ij", "kl", "mn op qr", "st")
    with_answers, prompt_only = tmp_path / "chats.jsonl", tmp_path / "prompts.jsonl"
    with_answers.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"ab cd {w}"},
                                                             {"role": "assistant", "content": "x y"}]}) + "\n"
                                    for w in words))
    prompt_only.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"ab cd {w}"}]}
                                              if i % 2 else {"prompt": f"ab cd {w}"}) + "\n"
                                   for i, w in enumerate(words)))
    target = tiny_small_dir / "target"
    common = dict(batch_size=2, max_new_tokens=8, shard_size=2, **QUIET)
    regenerate(None, target, tmp_path / "a", inputs=[with_answers], **common)
    regenerate(None, target, tmp_path / "b", inputs=[prompt_only], **common)
    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    shards = [n for n in a if n.startswith("shard-")]
    assert len(shards) == 3 and all(a[n] == b[n] for n in shards)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ab"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    capsys.readouterr()
    rc = main(["--target-model", str(target), "--input", str(bad), "--output-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"{bad}:2" in err[0]


def test_a_static_cache_writes_the_same_shards(tiny_small_dir, tmp_path):
    """--static-cache (transformers' static KV cache, prompts padded wider to few shapes; compiled on GPUs)
    generates the same tokens as the dynamic cache, and is part of the output's configuration."""
    common = dict(batch_size=8, max_new_tokens=24, shard_size=16, max_records=24, **QUIET)
    regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "dyn", static_cache=False, **common)
    regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "static", static_cache=True, **common)
    a, b = files(tmp_path / "dyn"), files(tmp_path / "static")
    shards = [n for n in a if n.startswith("shard-")]
    assert len(shards) == 2 and all(a[n] == b[n] for n in shards)
    assert json.loads(b["index.json"])["regenerated"]["static_cache"] is True
    with pytest.raises(Exception, match="static_cache"):   # a resume must not mix the two
        regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "static", static_cache=False,
                   **common)


def test_resumes_after_kill_9_without_redoing_finished_shards(tiny_small_dir, tmp_path, capsys):
    args = ["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(tiny_small_dir / "data"),
            "--max-records", "24", "--shard-size", "3", "--batch-size", "2", "--max-new-tokens", "24"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main(args + ["--output-dir", str(ref)]) == 0
    total = len(json.loads((ref / MANIFEST_NAME).read_text())["done"])
    assert total == 8

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "trainer.serving.regenerate", *args, "--output-dir", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest, deadline = out / MANIFEST_NAME, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if manifest.is_file() and json.loads(manifest.read_text())["done"]:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        err = proc.communicate()[1].decode()
    assert proc.returncode == -signal.SIGKILL, err
    done = json.loads(manifest.read_text())["done"]
    assert 1 <= len(done) < total, f"killed with {len(done)} of {total} shards done"
    mtimes = {e["file"]: (out / e["file"]).stat().st_mtime_ns for e in done.values()}

    capsys.readouterr()
    assert main(args + ["--output-dir", str(out)]) == 0
    assert f"{len(done)} of {total} shard(s) already finished, kept" in capsys.readouterr().err
    assert {f: (out / f).stat().st_mtime_ns for f in mtimes} == mtimes    # not regenerated
    assert files(out) == files(ref)                                        # shards, index, manifest
    assert len(load_dataset(out)) == 24

    # a finished output: a rerun does nothing; another configuration is refused, the output kept
    assert main(args + ["--output-dir", str(out)]) == 0
    assert "already complete" in capsys.readouterr().err
    assert main(args[:-1] + ["12", "--output-dir", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "max_new_tokens" in lines[0]
    assert files(out) == files(ref)


def _no_prompt_data(d: Path) -> Path:
    write_shards([([5, 6, 7], [1, 1, 1])], d, tokenizer_name="x")
    return d


@pytest.mark.parametrize("case", ["missing data dir", "empty data dir", "no prompts", "not a model",
                                  "foreign output", "busy output", "missing jsonl"])
def test_bad_input_exits_2_with_one_line_naming_it(tiny_small_dir, tmp_path, capsys, case):
    model, data, out = tiny_small_dir / "target", tiny_small_dir / "data", tmp_path / "out"
    src, held = ["--data-dir", str(data)], None
    if case == "missing data dir":
        src = ["--data-dir", str(tmp_path / "nope")]
        named = tmp_path / "nope"
    elif case == "empty data dir":
        (tmp_path / "empty").mkdir()
        src, named = ["--data-dir", str(tmp_path / "empty")], tmp_path / "empty"
    elif case == "no prompts":
        named = _no_prompt_data(tmp_path / "noprompt")
        src = ["--data-dir", str(named)]
    elif case == "not a model":
        model = named = tmp_path
    elif case == "foreign output":                  # a prepared data dir: never overwritten
        out = named = tmp_path / "prepared"
        write_shards([([1, 2, 3], [0, 1, 1])], out, tokenizer_name="x")
    elif case == "busy output":                     # another run holds it
        out.mkdir()
        held, named = lock_output_dir(out), out
    else:
        src = ["--input", str(tmp_path / "missing.jsonl")]
        named = tmp_path / "missing.jsonl"
    before = files(out) if out.is_dir() else None
    rc = main(["--target-model", str(model), *src, "--output-dir", str(out), "--max-new-tokens", "4"])
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-regenerate: error: ") and str(named) in lines[0]
    assert (files(out) if out.is_dir() else None) == before
    if held is not None:
        os.close(held)


# ------------------------------------------------------------------------------- the point of it


def human_answers(tiny: Path, dest: Path) -> Path:
    """The tiny data with every answer replaced by text the target does not write (random words of the
    tiny vocabulary, as a person would type them), each answer exactly as many tokens as before."""
    from trainer.tools.tiny import build_tokenizer

    tok, words = build_tokenizer(0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rng = np.random.default_rng(7)
    ds, recs = load_dataset(tiny / "data"), []
    for i in range(len(ds)):
        ids, mask = ds[i]
        p, n = int(np.argmax(mask)), int(mask.sum())
        answer = tok(" ".join(rng.choice(words, size=n)), add_special_tokens=False)["input_ids"][:n - 1] + [end]
        assert len(answer) == n
        recs.append((list(ids[:p]) + answer, [0] * p + [1] * n))
    write_shards(recs, dest, shard_size=64, tokenizer_name=str(tiny / "target"))
    return dest


@pytest.mark.slow
def test_a_drafter_trained_on_regenerated_data_reaches_a_higher_tau(tiny_small_dir, target, tmp_path):
    from tests.serving.test_evaluate import train_drafter
    from trainer.model.checkpoint_format import CheckpointManager
    from trainer.serving.evaluate import evaluate_checkpoint

    human = human_answers(tiny_small_dir, tmp_path / "human")
    regen = tmp_path / "regen"
    regenerate(human, tiny_small_dir / "target", regen, batch_size=16, max_new_tokens=56, **QUIET)
    h, r = load_dataset(human), load_dataset(regen)
    assert len(h) == len(r) and r.num_supervised_tokens <= h.num_supervised_tokens   # no more to learn from

    tau = {}
    for name, data in (("human", human), ("regenerated", regen)):
        cfg, model = train_drafter(target, data, epochs=10)                 # identical settings and steps
        CheckpointManager(tmp_path / name).save(10, model.state_dict(), cfg.to_dict(), {})
        res = evaluate_checkpoint(str(tmp_path / name), str(tiny_small_dir / "target"),
                                  str(tiny_small_dir / "heldout"), device="cpu", max_prompts=8,
                                  max_new_tokens=64, target=target, with_block_accuracy=False)
        tau[name] = res["tau"]
    # measured: human 1.00 (it learnt words the target never says), regenerated 1.39
    assert tau["regenerated"] > tau["human"] + 0.2, tau


# ------------------------------------------------------------- issue 29: the captured decode loop


def test_the_captured_decoder_writes_the_same_shards_as_generate(tiny_small_dir, tmp_path):
    """--decoder captured (trainer/serving/captured/regenerate_decoder.py: one preallocated KV cache, grouped-query decode attention,
    CUDA graphs on GPUs; the same loop eagerly on the CPU) writes the bytes of transformers' generate,
    greedy, with a short last batch and rows stopping at EOS; the decoder is part of the configuration."""
    common = dict(max_new_tokens=24, shard_size=16, max_records=40, **QUIET)
    regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "gen", batch_size=8,
               decoder="generate", **common)
    regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "cap", batch_size=6,
               decoder="captured", **common)
    a, b = files(tmp_path / "gen"), files(tmp_path / "cap")
    shards = [n for n in a if n.startswith("shard-")]
    assert len(shards) == 3 and all(a[n] == b[n] for n in shards)
    assert json.loads(b["index.json"])["regenerated"]["decoder"] == "captured"
    with pytest.raises(Exception, match="decoder"):     # a resume must not mix the two
        regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "cap", batch_size=6,
                   decoder="generate", **common)


def test_captured_sampling_does_not_depend_on_the_batch(tiny_small_dir, target):
    """Sampling noise is keyed by (seed, prompt index, step): a prompt's sample is the same whatever batch
    it runs in, and it follows softmax(logits / T) (tokens differ from greedy, different keys differ)."""
    from trainer.serving.captured.regenerate_decoder import GraphDecoder

    prompts = heldout_prompts(load_dataset(tiny_small_dir / "data"), 6)
    stops = stop_token_ids(target)
    kw = dict(max_new_tokens=16, temperature=1.5, stop_ids=stops, pad_id=0)
    six = GraphDecoder(target, "cpu", batch_size=6, **kw).generate(prompts, keys=range(6))
    two = [c for s in range(0, 6, 2)
           for c in GraphDecoder(target, "cpu", batch_size=2, **kw).generate(prompts[s:s + 2], range(s, s + 2))]
    assert all(np.array_equal(x, y) for x, y in zip(six, two))
    other = GraphDecoder(target, "cpu", batch_size=6, **kw).generate(prompts, keys=range(100, 106))
    greedy = GraphDecoder(target, "cpu", batch_size=6, **(kw | dict(temperature=0.0))).generate(prompts, range(6))
    assert any(not np.array_equal(x, y) for x, y in zip(six, other))
    assert any(not np.array_equal(x, y) for x, y in zip(six, greedy))


def test_hash_uniforms_are_uniform():
    from trainer.serving.captured.regenerate_decoder import _hash_uniform

    u = _hash_uniform(torch.arange(64), 4096)
    assert u.shape == (64, 4096) and 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    # 23-bit values: about n^2 / 2^24 = 4,096 birthday collisions among n = 262,144 draws
    assert abs(u.numel() - len(torch.unique(u)) - 4096) < 400


def test_two_captured_devices_are_two_processes_writing_the_same_shards(tiny_small_dir, tmp_path):
    """--devices: one worker process per device (each its own replica), shards handed out one at a time;
    the bytes are those of one device."""
    common = dict(batch_size=4, max_new_tokens=12, shard_size=5, max_records=20, decoder="captured", **QUIET)
    regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "one", **common)
    stats = regenerate(tiny_small_dir / "data", tiny_small_dir / "target", tmp_path / "two",
                       devices=["cpu", "cpu"], **common)
    assert stats["shards_generated"] == 4 and stats["tokens_generated"] > 0
    assert files(tmp_path / "one") == files(tmp_path / "two")


@pytest.mark.slow
def test_fused_small_ops_give_the_same_tokens(target, tiny_small_dir):
    """GraphDecoder(fuse=True): the decode step's RMSNorm, rotary and SiLU gate compiled (inductor) give the
    eager loop's tokens (fp32), and the target's classes are restored afterwards."""
    import transformers.models.qwen3.modeling_qwen3 as mq

    from trainer.serving.captured.regenerate_decoder import GraphDecoder

    before = (mq.Qwen3RMSNorm.forward, mq.apply_rotary_pos_emb, mq.Qwen3MLP.forward)
    prompts = heldout_prompts(load_dataset(tiny_small_dir / "data"), 4)
    kw = dict(batch_size=4, max_new_tokens=12, temperature=0.0, stop_ids=[], pad_id=0)
    ref = GraphDecoder(target, "cpu", **kw).generate(prompts, range(4))
    fused = GraphDecoder(target, "cpu", fuse=True, **kw)
    assert fused.fuse_mlp is False            # plain weights: the MLP's GEMMs stay outside the compiled code
    assert all(np.array_equal(a, b) for a, b in zip(ref, fused.generate(prompts, range(4))))
    # fuse_mlp: each MLP compiled whole, its GEMMs included (the benchmark's fp8-weight variants)
    whole = GraphDecoder(target, "cpu", fuse=True, fuse_mlp=True, **kw).generate(prompts, range(4))
    assert all(np.array_equal(a, b) for a, b in zip(ref, whole))
    assert (mq.Qwen3RMSNorm.forward, mq.apply_rotary_pos_emb, mq.Qwen3MLP.forward) == before


def test_the_index_records_the_targets_tokenizer_as_prepare_does(tiny_small_dir, tmp_path):
    """Issue 29: the trainer and dflash-eval check data against their target by index.json's "target";
    regenerated shards carry it (the same record dflash-prepare writes), so a wrong target is refused."""
    from trainer.model.identity import RECORD_KEY, TargetMismatch, check_data_tokenizer, of_target, record_for_data
    out = tmp_path / "regen"
    regenerate(tiny_small_dir / "data", tiny_small_dir / "target", out, batch_size=8, max_new_tokens=4,
               shard_size=64, **QUIET)
    index = json.loads((out / "index.json").read_text())
    assert index[RECORD_KEY] == record_for_data(tiny_small_dir / "target")
    check_data_tokenizer(index, of_target(tiny_small_dir / "target"), "--data-dir", out)   # accepted
    other = dict(index, **{RECORD_KEY: dict(index[RECORD_KEY], tokenizer="0" * 64, vocab_size=7)})
    with pytest.raises(TargetMismatch):
        check_data_tokenizer(other, of_target(tiny_small_dir / "target"), "--data-dir", out)


def test_fuse_is_a_switch_of_the_captured_decoder(tiny_small_dir, target, tmp_path, capsys):
    """--fuse on|off|auto reaches the captured decoder (auto: on GPUs only); with --decoder generate it is
    refused with one line, before anything is written."""
    from trainer.serving.regenerate import TargetGenerator
    gen = TargetGenerator(target, "cpu", 8, 0.0, 4, decoder="captured", fuse=True)
    assert gen._fast_decoder().fuse is True
    assert TargetGenerator(target, "cpu", 8, 0.0, 4, decoder="captured")._fast_decoder().fuse is False
    out = tmp_path / "out"
    rc = main(["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(tiny_small_dir / "data"),
               "--output-dir", str(out), "--decoder", "generate", "--fuse", "on"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--fuse on: needs --decoder captured" in err, err
    assert not out.exists()



def test_samples_per_prompt_writes_that_many_sampled_completions_of_each_prompt(tiny_small_dir, tmp_path, capsys):
    """--samples-per-prompt N at T > 0: N records per prompt, side by side, each its prompt followed by its own
    draw (the copies differ), recorded in the index so a resume or the trainer can tell; greedy refuses it
    in one line (every copy would be the same)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"ab cd {w}"}) + "\n" for w in ("ef", "gh ij", "kl")))
    target = tiny_small_dir / "target"
    for decoder in ("generate", "captured"):
        out = tmp_path / decoder
        stats = regenerate(None, target, out, inputs=[prompts], batch_size=4, max_new_tokens=8, shard_size=4,
                           temperature=1.0, samples_per_prompt=3, decoder=decoder, **QUIET)
        ds = load_dataset(out)
        assert stats["records"] == len(ds) == 9
        recs = [ds[i] for i in range(9)]
        for p in range(3):
            copies = recs[3 * p:3 * p + 3]
            heads = {bytes(ids[:int(np.argmax(mask))].astype(np.int64)) for ids, mask in copies}
            answers = {bytes(ids[mask.astype(bool)].astype(np.int64)) for ids, mask in copies}
            assert len(heads) == 1, "the copies share their prompt"
            assert len(answers) > 1, f"{decoder}: prompt {p}'s three samples are all the same"
        assert ds.index["regenerated"]["samples_per_prompt"] == 3
    capsys.readouterr()
    rc = main(["--target-model", str(target), "--input", str(prompts), "--output-dir", str(tmp_path / "g"),
               "--samples-per-prompt", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--samples-per-prompt 2" in err[0] and "--temperature" in err[0]


def test_the_batch_sweep_reports_tok_s_per_batch_size_on_the_same_tokens(tiny_small_dir, tmp_path, capsys):
    """trainer/lab/gpu/regenerate_sweep.py on the CPU: one row per batch size, each completing the same
    prompts; greedy in fp32, so the completions are the same bytes at every batch size, and the slot use is
    the generated tokens over each batch's rows x its longest completion."""
    from trainer.lab.gpu import regenerate_sweep
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "ab cd " + "ef " * i}) + "\n" for i in range(7)))
    rc = regenerate_sweep.main(["--target-model", str(tiny_small_dir / "target"), "--input", str(prompts),
                                "--batches", "2,5", "--prompts", "6", "--max-new-tokens", "6", "--device", "cpu",
                                "--decoder", "captured", "--out", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    res = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and [r["batch_size"] for r in res["rows"]] == [2, 5]
    a, b = res["rows"]
    assert a["prompts"] == b["prompts"] == 6 and a["tokens"] == b["tokens"] > 0
    assert a["completions_sha256"] == b["completions_sha256"]
    assert all(0 < r["slot_use"] <= 1 and r["tokens_per_s"] > 0 for r in res["rows"])
    assert "tok/s" in err and json.loads((tmp_path / "r.json").read_text())["rows"] == res["rows"]
    assert regenerate_sweep.slot_use([[1], [1, 2]], [[5, 5, 5], [5]], 2) == 4 / 6
