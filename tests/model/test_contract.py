"""The drafter's contract (issue 51): one MASK rule with its sources, the family table, --draft-contract.

Targets here are config and tokenizer files only (the rule and the contract read nothing else), laid out
as the real ones are: Qwen3.5's specials from 248044 in a 248,320-row vocabulary, Qwen3's from 151643 in
151,936 rows, SmolLM2's code-pretraining specials at ids 0..16 in a vocabulary with no spare row. The tiny
hybrid and the dense tiny Qwen3 (dflash-tiny) train with the resolved choices.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config import drafter_choices
from trainer.config.options import parse_args
from trainer.model import families, identity

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                 "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                 "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                 "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
                 "<empty_output>"]
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")


def write_target(d: Path, config: dict, specials: list[str], first_id: int, roles: dict, vocab_rows: int = 0):
    """config.json + tokenizer_config.json (added_tokens_decoder from first_id) [+ tokenizer.json whose
    model vocabulary holds ids 0..vocab_rows-1 beside the added tokens]."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    dec = {str(first_id + i): {"content": t, "special": True} for i, t in enumerate(specials)}
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": dec, "chat_template": CHATML,
                                                         **roles}))
    if vocab_rows:
        vocab = {f"t{i}": i for i in range(vocab_rows) if str(i) not in dec}
        added = [{"id": int(k), "content": v["content"], "special": True} for k, v in dec.items()]
        (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added}))
    return d


def qwen3_5_27b(d: Path) -> Path:
    """Qwen3.6-27B's shape and its tokenizer's special-token layout (specials 248044..248069)."""
    text = dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, vocab_size=248320, intermediate_size=17408,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
                bos_token_id=248044, eos_token_id=248046, pad_token_id=248044)
    return write_target(d, dict(model_type="qwen3_5", text_config=text), QWEN_SPECIALS, 248044,
                        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"))


def qwen3_8b(d: Path) -> Path:
    cfg = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, intermediate_size=12288)
    return write_target(d, cfg, QWEN_SPECIALS, 151643, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"))


def smollm2(d: Path) -> Path:
    """SmolLM2-135M-Instruct: a Llama of 49,152 rows, every row a token, no mask token."""
    cfg = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, intermediate_size=1536, bos_token_id=1, eos_token_id=2)
    return write_target(d, cfg, SMOL_SPECIALS, 0, dict(bos_token="<|im_start|>", eos_token="<|im_end|>",
                                                       pad_token="<|im_end|>", unk_token="<|endoftext|>"),
                        vocab_rows=49152)


# ------------------------------------------------------------------------------ the MASK rule


def test_qwen3_5_family_takes_the_published_mask_248070_and_says_why(tmp_path):
    t = qwen3_5_27b(tmp_path / "q35")
    c = families.contract_for(json.loads((t / "config.json").read_text()))
    got = identity.resolve_mask_token(t, 248320, contract=c)
    assert got.token_id == 248070
    assert "qwen3_5 family's published contract (z-lab/Qwen3.6-27B-DFlash" in got.source
    # without the contract the rule finds the same row: the first one past the tokenizer's 248,070 tokens
    plain = identity.resolve_mask_token(t, 248320)
    assert plain.token_id == 248070 and "past the tokenizer's 248070 tokens" in plain.source
    assert 151669 not in (got.token_id, plain.token_id)   # a text token of this vocabulary


def test_qwen3_keeps_151669_and_the_flag_wins(tmp_path):
    t = qwen3_8b(tmp_path / "q3")
    c = families.contract_for(json.loads((t / "config.json").read_text()))
    assert identity.resolve_mask_token(t, 151936, contract=c).token_id == 151669
    assert identity.resolve_mask_token(t, 151936).token_id == 151669
    assert identity.resolve_mask_token(t, 151936, 151650, contract=c) == identity.MaskChoice(151650, "--mask-token-id")
    with pytest.raises(ValueError, match=r"^--mask-token-id: 151936 is outside the vocabulary"):
        identity.resolve_mask_token(t, 151936, 151936)


def test_a_vocabulary_without_mask_token_or_spare_row_takes_an_unused_special_token(tmp_path):
    """SmolLM2: bos/eos/pad/unk and what the chat template writes are never the MASK; the highest-id
    special token left is (<empty_output>, 16), not the last row, which is a text token."""
    t = smollm2(tmp_path / "smol")
    got = identity.resolve_mask_token(t, 49152, contract=families.contract_for(json.loads((t / "config.json").read_text())))
    assert got.token_id == 16 and "'<empty_output>'" in got.source and "no spare row" in got.source
    # a tokenizer that lost the special flags (rebuilt from a GGUF file) still gets the same token
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    flags = {k: dict(v) for k, v in cfg["added_tokens_decoder"].items()}
    for v in cfg["added_tokens_decoder"].values():
        v["special"] = False
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    tj = json.loads((t / "tokenizer.json").read_text())
    for a in tj["added_tokens"]:
        a["special"] = False
    (t / "tokenizer.json").write_text(json.dumps(tj))
    plain = identity.resolve_mask_token(t, 49152)
    assert plain.token_id == 16 and "added token (not marked special) '<empty_output>'" in plain.source
    cfg["added_tokens_decoder"] = flags
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    # with no such token left: the last row, and the source says so
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg["chat_template"] += "".join(SMOL_SPECIALS)
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    last = identity.resolve_mask_token(t, 49152)
    assert last.token_id == 49151 and last.source.startswith("the last row")


def test_no_tokenizer_files_falls_to_the_last_row(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    got = identity.resolve_mask_token(tmp_path, 1000)
    assert got.token_id == 999 and "no tokenizer files" in got.source


# ------------------------------------------------------------------------------ --draft-contract


def choices(cfg_dir: Path, *extra: str, arch: str = "dflash"):
    cfg = parse_args(["--target-model", str(cfg_dir), "--data-dir", "d", "--output-dir", "o", "--arch", arch, *extra])
    got = {c.name: c for c in drafter_choices.resolve_run(cfg, json.loads((cfg_dir / "config.json").read_text()))}
    return cfg, got


def test_auto_on_the_seeds_target_is_the_published_contract_and_keeps_the_block_it_is_given(tmp_path):
    t = qwen3_5_27b(tmp_path / "q35")
    cfg, got = choices(t)
    assert (cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim) == (32, 8, 128)
    assert cfg.draft_layer_types == "sliding,sliding,sliding,sliding,full" and cfg.sliding_window == 2048
    assert cfg.target_layers == [1, 16, 31, 46, 61] and cfg.mask_token_id == 248070
    # the default block (16 since 2026-12-06, the same as this contract's) comes from the flag's default, never
    # from the contract: the seed recipe's block 32 stays 32, and DFlash2's contract (block 8) leaves it 16
    assert cfg.block_size == 16 and cfg.max_anchors == 1024
    cfg32, got32 = choices(t, "--block-size", "32")
    assert cfg32.block_size == 32 and got32["block_size"].source == "--block-size"
    src = "the qwen3_5 family's published contract (z-lab/Qwen3.6-27B-DFlash)"
    assert got["heads"].source == got["layer_types"].source == got["sliding_window"].source == src
    assert got["taps"].source.startswith("evenly spread") and got["block_size"].source == "--block-size default"
    # DFlash2: its own published taps and all-sliding layers
    cfg2, got2 = choices(t, arch="dflash2")
    assert cfg2.target_layers == [5, 19, 33, 47, 61] and cfg2.draft_layer_types == ",".join(["sliding"] * 5)
    assert "Qwen3.8-27B DFlash2" in got2["taps"].source
    assert cfg2.block_size == 16 and got2["block_size"].source == "--block-size default"


def test_flags_given_override_the_contract_and_none_keeps_the_generic_rules(tmp_path):
    t = qwen3_5_27b(tmp_path / "q35")
    cfg, got = choices(t, "--draft-heads", "24", "--draft-kv-heads", "4", "--draft-head-dim", "256",
                       "--mask-token-id", "248071", "--draft-layer-types", "full,full,full,full,full")
    assert (cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim, cfg.mask_token_id) == (24, 4, 256, 248071)
    assert got["heads"].source.startswith("--draft-heads") and got["mask_token_id"].source == "--mask-token-id"
    assert "sliding_window" not in got and got["layer_types"].source == "--draft-layer-types"
    cfg, got = choices(t, "--draft-contract", "none")
    assert (cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim) == (24, 4, 256)
    assert got["heads"].source == "the target's own attention heads"
    assert cfg.draft_layer_types == "sliding,sliding,sliding,sliding,full"   # --draft-layer-types auto's rule
    # resolving twice (the supervisor, then each rank) gives the same answer and the same sources
    again = {c.name: c for c in drafter_choices.resolve_run(cfg, json.loads((t / "config.json").read_text()))}
    assert again == got


def test_dense_qwen3_keeps_its_own_heads_and_full_layers(tmp_path):
    cfg, got = choices(qwen3_8b(tmp_path / "q3"))
    assert (cfg.draft_heads, cfg.draft_kv_heads, cfg.draft_head_dim) == (32, 8, 128)   # the target's own
    assert got["heads"].source == "the target's own attention heads"
    assert cfg.draft_layer_types == "full,full,full,full,full" and cfg.mask_token_id == 151669
    assert "z-lab/Qwen3-8B-DFlash-b16" in got["mask_token_id"].source


def widened_hybrid(tiny_hybrid_dir: Path, d: Path) -> Path:
    """The tiny hybrid with the real vocabulary's layout: 248,320 embedding and head rows (the new ones
    random), and the Qwen3.5 special tokens at 248044..248069 in its tokenizer_config.json."""
    import shutil

    import safetensors.torch
    import torch
    shutil.copytree(tiny_hybrid_dir / "target", d)
    cfg = json.loads((d / "config.json").read_text())
    old = cfg["text_config"]["vocab_size"]
    cfg["text_config"]["vocab_size"] = 248320
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    for f in d.glob("*.safetensors"):
        w = safetensors.torch.load_file(str(f))
        for k, t in w.items():
            if k.endswith(("embed_tokens.weight", "lm_head.weight")) and t.shape[0] == old:
                extra = torch.randn(248320 - old, t.shape[1], generator=g) * 0.02
                w[k] = torch.cat([t, extra.to(t.dtype)])
        safetensors.torch.save_file(w, str(f), metadata={"format": "pt"})
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.setdefault("added_tokens_decoder", {}).update({str(248044 + i): {"content": t + "_q35", "special": True}
                                       for i, t in enumerate(QWEN_SPECIALS)})
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


def _train(target: Path, data: Path, out: Path, *extra: str) -> tuple[dict, str]:
    from tests.engine.test_trainer import tiny_args
    from trainer.__main__ import main as train_main
    args = tiny_args(data, out, "--max-steps", "1", "--num-draft-layers", "2", *extra)
    args[args.index("--target-model") + 1] = str(target)
    assert train_main(args) == 0
    return _trained(out)


def _trained(out: Path) -> tuple[dict, str]:
    """A run's last checkpoint's config.json and its log's drafter contract line."""
    from trainer.model.checkpoint_format import CheckpointManager
    cfg = json.loads((CheckpointManager(out).latest() / "config.json").read_text())
    log = (out / "logs" / "latest.log").read_text()
    return cfg, next(ln for ln in log.splitlines() if "drafter contract:" in ln)


@pytest.mark.parametrize("hybrid", [True, False], ids=["tiny-hybrid", "tiny-qwen3"])
def test_tiny_targets_train_with_the_resolved_choices_and_the_log_names_each_source(hybrid, tiny_hybrid_dir,
                                                                                    request, tmp_path):
    """dflash-train on the tiny hybrid (a qwen3_5 model type: the family's layer types; at width 64 its own
    heads; its 512 rows have no row 248070, so its tokenizer's <|mask|>) and on the dense tiny Qwen3: there the
    session's 2-step run (tests/conftest.py's tiny_trained_dir), whose draft flags are _train's (block 8,
    2 layers, nothing else of the drafter's shape)."""
    if hybrid:
        cfg, line = _train(tiny_hybrid_dir / "target", tiny_hybrid_dir, tmp_path / "run")
    else:
        cfg, line = _trained(request.getfixturevalue("tiny_trained_dir"))
    assert "mask_token_id 3: the tokenizer's mask token '<|mask|>'" in line
    if hybrid:
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 2048
        assert "layer_types ['sliding_attention', 'full_attention']: the qwen3_5 family's published contract" in line
        assert "is published for targets of width >= 2048; this one is 64" in line
    else:
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
        assert cfg.get("layer_types") is None
        assert "heads (4, 2, 16): the target's own attention heads;" in line
    assert cfg["mask_token_id"] == 3 and cfg["block_size"] == 8


@pytest.mark.slow   # a 248,320-row LM head on the CPU
def test_the_hybrid_with_the_real_vocabulary_layout_trains_with_mask_248070(tiny_hybrid_dir, tmp_path):
    target = widened_hybrid(tiny_hybrid_dir, tmp_path / "target")
    cfg, line = _train(target, tiny_hybrid_dir, tmp_path / "run")
    assert cfg["mask_token_id"] == 248070 and cfg["vocab_size"] == 248320
    assert ("mask_token_id 248070: the qwen3_5 family's published contract (z-lab/Qwen3.6-27B-DFlash, a row the "
            "tokenizer never produces)") in line
    cfg, line = _train(target, tiny_hybrid_dir, tmp_path / "none", "--draft-contract", "none")
    assert cfg["mask_token_id"] == 3 and "mask_token_id 3: the tokenizer's mask token" in line


# ------------------------------------------------------------------------------ tap numbering


def test_our_taps_are_the_reference_packages_numbering_on_the_dense_target(tiny_small_dir):
    """target_layer_ids name decoder layers; the trainer's target stage captures layer i's output, which is
    HF hidden_states[i + 1]: the reference package's own extract_context_feature on the same ids gives the
    same features (so a z-lab drafter's taps mean the same layers here, and speculators' aux ids, one
    higher, are converted: tests/engine/test_warm_start.py)."""
    from types import SimpleNamespace

    import torch
    ref = pytest.importorskip("dflash.model", reason="the reference package: pip install -e .[test]")
    from trainer.distributed.transport import unpack
    from trainer.engine.target_stage import TargetStage
    from trainer.model.target import load_target
    model = load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 500, (1, 29), generator=g)
    taps = identity.tap_layers(model.config.num_hidden_layers, 5)
    assert taps == [1, 2, 3, 4, 5]
    stage = TargetStage(model, torch.device("cpu"), taps, soft_labels=False, rows=29, num_slots=1,
                        dtype=torch.float32, keep_head=True)
    slot = stage.next_slot()
    stage.forward_pack(SimpleNamespace(input_ids=ids, ctx_gather=torch.arange(29), final_gather=None, seq_no=0), slot)
    got, _ = unpack(slot.flat, 29, 0, len(taps), stage.hidden)
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    want = ref.extract_context_feature(list(hs), taps)[0]
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, ref.extract_context_feature(list(hs), [t - 1 for t in taps])[0], atol=1e-3)
