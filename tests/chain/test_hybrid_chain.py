"""The whole chain on the seeds' real architecture (issue 39 item 1): a tiny Qwen3.5 hybrid (Gated DeltaNet +
gated attention, VL wrapper, partial mRoPE; dflash-tiny --arch qwen3_5) is trained at world size 1 and at
1 target + 2 drafter ranks, a rank is killed (SIGKILL) and the restart resumes, the run is exported, and
the target identity guards it, with the helpers the dense tests use (tests/engine/test_trainer.py,
tests/distributed/test_multi_rank.py, tests/model/test_identity.py). Evaluation and regeneration on hybrids: their own tests.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import HYBRID_RUN
from tests.distributed.test_multi_rank import THREE_RANKS, _final_weights, _status
from tests.engine.test_trainer import losses, tiny_args
from tests.model.test_identity import one_line, snapshot
from trainer.__main__ import main as train_main
from trainer.model import identity

# the seeds' flags at a tiny size (tests/conftest.py's HYBRID_RUN: 4 steps, a checkpoint every 2, --sliding-window 16)
EXTRA = list(HYBRID_RUN)


def test_prepare_tokenizes_chats_with_the_hybrid_target(tiny_hybrid_dir, tmp_path, capsys):
    """dflash-prepare with the VL checkpoint's tokenizer (its chat template, the vision tokens among the
    specials): the shards are the template's rendering, supervised on the assistant turns only, recorded
    with that tokenizer, and a run accepts them."""
    from transformers import AutoTokenizer

    from tests.data.test_prepare import CONVS, expected_assistant_text, masked_text, write_jsonl
    from trainer.data.dataset import load_dataset
    from trainer.data.prepare import main as prepare_main
    target = tiny_hybrid_dir / "target"
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVS])
    out = tmp_path / "shards"
    assert prepare_main(["--target-model", str(target), "--input", str(src), "--output-dir", str(out)]) == 0
    ds = load_dataset(out)
    assert len(ds) == len(CONVS)
    for i, msgs in enumerate(CONVS):
        ids, mask = ds[i]
        assert tok.decode(ids.tolist()) == tok.apply_chat_template(msgs, tokenize=False)
        assert masked_text(tok, ids, mask) == expected_assistant_text(msgs)
    assert ds.index["target"]["tokenizer"] == identity.tokenizer_fingerprint(target)
    capsys.readouterr()
    assert train_main(tiny_args(tiny_hybrid_dir, tmp_path / "o", "--check-config") + ["--data-dir", str(out)]) == 0


@pytest.fixture(scope="module")
def world1(tiny_hybrid_run):
    """World size 1 (one rank: target and drafter), grad accum 4: the reference run (tests/conftest.py's, shared
    with the qwen3_5 family's test; none writes into it)."""
    return tiny_hybrid_run


def test_world_size_one_trains_the_hybrid_with_sliding_draft_layers(world1, tiny_hybrid_dir):
    st = _status(world1)
    assert st["phase"] == "done" and st["step"] == 4
    assert sorted(losses(world1)) == [1, 2, 3, 4]
    cfg = json.loads((world1 / "step-00000004" / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 16
    rec = json.loads((world1 / "step-00000004" / "meta.json").read_text())[identity.RECORD_KEY]
    assert rec == identity.for_run(tiny_hybrid_dir / "target", 2, None, None).to_dict()
    assert rec["model_type"] == "qwen3_5_text" and rec["num_hidden_layers"] == 8 and rec["hidden_size"] == 64


@pytest.mark.slow
def test_three_ranks_killed_and_resumed_train_what_world_size_one_trains(world1, tiny_hybrid_dir, tmp_path):
    """1 target + 2 drafter ranks (grad accum 2: the same 4 micro-batches per step); drafter rank 1 is
    SIGKILLed at step 3, the job ends, the restart resumes from step 2; every step's loss and the final
    weights are world size 1's to float rounding (test_multi_rank.py says why not exactly)."""
    out = tmp_path / "killed"
    args = tiny_args(tiny_hybrid_dir, out, *EXTRA, "--grad-accum", "2", *THREE_RANKS)
    # this process supervises both jobs (no second torch import for a supervisor): the ranks are processes of
    # their own either way, and the SIGKILL is theirs (the fault's variables reach them through the environment)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_FAULT_DIE_AT_STEP", "3")
        mp.setenv("DFLASH_FAULT_DIE_RANK", "1")
        assert train_main(args) == 1
    st = _status(out)
    assert st["phase"] == "failed" and "rank 1" in st["error"] and "SIGKILL" in st["error"], st
    assert sorted(q.name for q in out.glob("step-*")) == ["step-00000002"]
    assert train_main(args) == 0     # the restart: the same command line
    st = _status(out)
    assert st["resumed_from"].endswith("step-00000002") and st["step"] == 4 and st["world_size"] == 3
    a, b = losses(world1), losses(out)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), f"step {step}"
    wa, wb = _final_weights(world1), _final_weights(out)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), k


def test_export_of_the_hybrid_run_loads_with_its_sliding_layers(world1, tiny_hybrid_dir, tmp_path):
    from transformers import AutoModel

    from trainer.serving.export import main as export_main
    dst = tmp_path / "drafter"
    assert export_main([str(world1), str(dst), "--target-model", str(tiny_hybrid_dir / "target")]) == 0
    c = json.loads((dst / "config.json").read_text())
    assert c["layer_types"] == ["sliding_attention", "full_attention"] and c["sliding_window"] == 16
    assert c["num_target_layers"] == 8 and c["dflash_config"]["mask_token"] == "<|mask|>"
    assert json.loads((dst / "export.json").read_text())[identity.RECORD_KEY]["model_type"] == "qwen3_5_text"
    hf = AutoModel.from_pretrained(dst, trust_remote_code=True, dtype=torch.float32)
    assert [layer.self_attn.sliding_window for layer in hf.layers] == [16, None]


def test_the_hybrid_run_refuses_another_target(world1, tiny_hybrid_dir, tiny_small_dir, tmp_path, capfd):
    """Resuming on an edited hybrid (its text_config changed) exits 2 in one line naming config.json and
    touches nothing; exporting for the dense tiny target (same width and depth) names the tokenizer."""
    from trainer.serving.export import main as export_main
    edited = tmp_path / "edited"
    shutil.copytree(tiny_hybrid_dir / "target", edited)
    cj = json.loads((edited / "config.json").read_text())
    cj["text_config"]["initializer_range"] = 0.01
    (edited / "config.json").write_text(json.dumps(cj, indent=2))
    out = tmp_path / "out"
    shutil.copytree(world1, out)
    before = snapshot(out)
    args = tiny_args(tiny_hybrid_dir, out, *EXTRA, "--max-steps", "6")
    args[args.index("--target-model") + 1] = str(edited)
    assert train_main(args + ["--check-config"]) == 2
    line = one_line(capfd.readouterr().err)
    assert "target's config.json differs from the one the checkpoint was trained on" in line, line
    assert snapshot(out) == before
    # the resumed drafter keeps its attention: other layer types or another window exit 2 naming the flag
    args = tiny_args(tiny_hybrid_dir, out, *EXTRA, "--max-steps", "6")
    for extra, needle in ((["--draft-layer-types", "full,full"], "--draft-layer-types: this run's draft layers "
                                                                 "are full,full, the checkpoint's sliding,full"),
                          (["--sliding-window", "32"], "--sliding-window: 32, the checkpoint's sliding layers "
                                                       "were trained with 16"),
                          (["--draft-heads", "8", "--draft-head-dim", "16"], "--draft-heads: this run's draft layers "
                                                                             "have 8 query heads, 2 kv heads of dim "
                                                                             "16, the checkpoint's 4, 2 of dim 32")):
        assert train_main(args + extra + ["--check-config"]) == 2
        line = one_line(capfd.readouterr().err)
        assert needle in line, line
    assert snapshot(out) == before
    assert train_main(args + ["--check-config"]) == 0
    capfd.readouterr()
    assert export_main([str(world1), str(tmp_path / "e"), "--target-model", str(tiny_small_dir / "target")]) == 2
    line = one_line(capfd.readouterr().err)
    assert line.startswith("dflash-export: error: ") and "target" in line, line
    assert not (tmp_path / "e").exists()
