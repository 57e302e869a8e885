"""--init-drafter (issue 51 item 1): a published drafter (DFlash or DFlash2; z-lab's, SpecForge's or
speculators' layout) starts a run after its contract check, trains, and exports what the reference
`dflash` package loads; every mismatch its weights cannot survive is one line naming the flag and both
values (exit 2); a flag given on purpose where the weights fit goes on, and the log says so. The runs that train
do so in this process (train_here: what they start from and write is the point, not their processes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.engine.test_trainer import tiny_args, train_here
from tests.model.test_identity import make_variant, one_line
from trainer.__main__ import main as train_main
from trainer.model.checkpoint_format import CheckpointManager
from trainer.serving.export import export_drafter

ref = pytest.importorskip("dflash.model", reason="the reference package: pip install -e .[test]")


def without(args: list[str], *flags: str) -> list[str]:
    """tiny_args without these flags and their values (left to the warm start's drafter)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def run_log(out: Path) -> str:
    return (out / "logs" / "latest.log").read_text()


def weights(d: Path) -> dict:
    return {k: v.float() for k, v in safetensors.torch.load_file(str(d / "model.safetensors")).items()}


@pytest.fixture(scope="module")
def published(tiny_trained_dir, tiny_small_dir, tmp_path_factory):
    """A drafter trained 2 steps on the tiny target (tests/conftest.py's run) and exported: our export is z-lab's
    layout."""
    root = tmp_path_factory.mktemp("published")
    return export_drafter(tiny_trained_dir, root / "export", target_model=str(tiny_small_dir / "target"))


def test_export_warm_start_train_export_loads_in_the_reference(published, tiny_small_dir, tmp_path):
    """export -> --init-drafter -> 20 steps -> export -> the reference class: the block size, the layer
    count and the taps come from the drafter (their flags left out), AdamW starts fresh, and the second
    export keeps the first one's contract."""
    out = tmp_path / "warm"
    args = without(tiny_args(tiny_small_dir, out, "--max-steps", "20", "--init-drafter", str(published)),
                   "--block-size", "--num-draft-layers")
    assert train_here(args) == 0
    log = run_log(out)
    assert f"warm start from --init-drafter {published} (z-lab layout) (dflash)" in log
    assert "AdamW moments start fresh, the schedule at step 0" in log
    line = next(ln for ln in log.splitlines() if "drafter contract:" in ln)
    assert f"block_size 8: --init-drafter {published} (z-lab layout)" in line
    dst = export_drafter(out, tmp_path / "export", target_model=str(tiny_small_dir / "target"))
    a, b = (json.loads((d / "config.json").read_text()) for d in (published, dst))
    keys = ("block_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "layer_types", "dflash_config")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    theirs, info = ref.DFlashDraftModel.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert theirs.target_layer_ids == a["dflash_config"]["target_layer_ids"]
    assert not torch.equal(weights(dst)["fc.weight"], weights(published)["fc.weight"])   # it trained
    # a checkpoint in --output-dir wins over --init-drafter: the run resumes its own drafter
    args[args.index("--max-steps") + 1] = "21"
    assert train_here(args) == 0
    assert f"--init-drafter {published}: not used, the run resumes its own checkpoint" in run_log(out)


def test_dflash2_warm_start_round_trip(tiny_dflash2_run, tiny_small_dir, tmp_path, capfd):
    """A DFlash2 drafter (the session's 3-step run, tests/conftest.py, exported): --arch comes from it, and the
    export loads in the reference DFlash2 class."""
    first = export_drafter(tiny_dflash2_run, tmp_path / "first")
    out = tmp_path / "warm"
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "3", "--no-use-soft-labels", "--loss",
                                "ce+dpace", "--init-drafter", str(first))) == 0
    assert "arch dflash2: --init-drafter" in run_log(out)
    dst = export_drafter(out, tmp_path / "export")
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    # a DFlash2 drafter of other selector or convolution sizes than this trainer builds: refused
    other = tmp_path / "other"
    shutil.copytree(first, other)
    c = json.loads((other / "config.json").read_text())
    c["dflash_config"]["selector_rank"] = 8
    (other / "config.json").write_text(json.dumps(c))
    assert train_main(tiny_args(tiny_small_dir, tmp_path / "o", "--no-use-soft-labels", "--init-drafter", str(other),
                                "--check-config")) == 2
    assert "--init-drafter: selector_rank: this run's 256, the drafter's 8" in capfd.readouterr().err
    _, info = ref.DFlash2DraftModel.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


# ------------------------------------------------------------------------------ the peers' layouts


def specforge_layout(src: Path, dst: Path) -> Path:
    """SpecForge: its configs/qwen3.6-27b-dflash.json's keys (block_size at the top, dflash_config with taps
    and MASK only, auto_map dflash.DFlashDraftModel); a training checkpoint's "draft_model." names and the
    target's embedding beside them."""
    c = json.loads((src / "config.json").read_text())
    keep = ("architectures", "attention_bias", "attention_dropout", "block_size", "head_dim", "hidden_act",
            "hidden_size", "intermediate_size", "layer_types", "max_position_embeddings", "max_window_layers",
            "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers",
            "rms_norm_eps", "sliding_window", "tie_word_embeddings", "use_cache", "use_sliding_window",
            "vocab_size", "rope_theta", "rope_scaling", "dtype")
    cfg = {k: c[k] for k in keep if k in c}
    cfg.update(model_type="qwen3", auto_map={"AutoModel": "dflash.DFlashDraftModel"},
               dflash_config={"mask_token_id": c["dflash_config"]["mask_token_id"],
                              "target_layer_ids": c["dflash_config"]["target_layer_ids"]})
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    w = {f"draft_model.{k}": v.to(torch.bfloat16) for k, v in weights(src).items()}
    w["embed_tokens.weight"] = torch.zeros(c["vocab_size"], c["hidden_size"], dtype=torch.bfloat16)
    safetensors.torch.save_file(w, str(dst / "model.safetensors"))
    return dst


def speculators_layout(src: Path, dst: Path) -> Path:
    """speculators' DFlashSpeculatorConfig: the Qwen3 shape under transformer_layer_config, the taps as
    aux_hidden_state_layer_ids (HF hidden_states indices: ours + 1, as its converter writes z-lab's), and the
    verifier's embedding, heads and norm among the weights."""
    c = json.loads((src / "config.json").read_text())
    tl = {k: c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "layer_types",
                            "sliding_window", "max_position_embeddings", "hidden_act") if k in c}
    tl["model_type"] = "qwen3"
    cfg = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "transformer_layer_config": tl,
           "draft_vocab_size": c["vocab_size"], "block_size": c["block_size"],
           "aux_hidden_state_layer_ids": [i + 1 for i in c["dflash_config"]["target_layer_ids"]],
           "mask_token_id": c["dflash_config"]["mask_token_id"], "sliding_window_non_causal": False,
           "speculators_version": "0.5.0"}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    w = {k: v.to(torch.bfloat16) for k, v in weights(src).items()}
    v, h = c["vocab_size"], c["hidden_size"]
    w.update({"embed_tokens.weight": torch.zeros(v, h), "lm_head.weight": torch.zeros(v, h),
              "verifier_lm_head.weight": torch.zeros(v, h), "verifier_norm.weight": torch.ones(h)})
    safetensors.torch.save_file({k: t.to(torch.bfloat16) for k, t in w.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("layout", ["z-lab", "specforge", "speculators"])
def test_each_peers_layout_starts_the_run_from_its_own_weights(layout, published, tiny_small_dir, tmp_path):
    """At a learning rate too small to move them, the run's first checkpoint holds the drafter's weights:
    names mapped, the target's tensors dropped, speculators' taps converted to ours."""
    src = {"z-lab": lambda: published, "specforge": lambda: specforge_layout(published, tmp_path / "sf"),
           "speculators": lambda: speculators_layout(published, tmp_path / "sp")}[layout]()
    out = tmp_path / "warm"
    args = without(tiny_args(tiny_small_dir, out, "--max-steps", "1", "--lr", "1e-12", "--init-drafter", str(src)),
                   "--block-size", "--num-draft-layers")
    assert train_here(args) == 0
    got = weights(CheckpointManager(out).latest())
    want = weights(published)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k
    cfg = json.loads((CheckpointManager(out).latest() / "config.json").read_text())
    pub = json.loads((published / "config.json").read_text())
    assert cfg["target_layer_ids"] == pub["dflash_config"]["target_layer_ids"]
    if layout == "speculators":
        assert "aux_hidden_state_layer_ids [" in run_log(out) and "HF hidden_states indices" in run_log(out)


# ------------------------------------------------------------------------------ the contract check


def edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k in ("target_layer_ids", "mask_token_id"):
            c["dflash_config"][k] = v
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    return dst


REFUSALS = [
    (["--num-draft-layers", "3"], {}, "--num-draft-layers: draft layer count: this run's 3, the drafter's 2"),
    (["--arch", "dflash2"], {}, "--arch: architecture: this run's dflash2, the drafter's dflash"),
    (["--draft-heads", "8", "--draft-kv-heads", "2", "--draft-head-dim", "8"], {},
     "--draft-heads: draft attention (query heads, kv heads, head dim): this run's (8, 2, 8), the drafter's (4, 2, 16)"),
    (["--target-layers", "1,3,5"], {}, "--target-layers: taps: this run's [1, 3, 5], the drafter's"),
    ([], {"vocab_size": 1000}, "--target-model: the target's vocabulary: this run's 512, the drafter's 1000"),
    ([], {"intermediate_size": 96}, "--target-model: the target's MLP width: this run's 128, the drafter's 96"),
    ([], {"num_target_layers": 36}, "--target-model: the target's depth: this run's 8 layers, the drafter's 36"),
    ([], {"target_layer_ids": [1, 8]}, "--init-drafter: the drafter's taps [1, 8] reach past the target's 8 layers"),
    ([], {"mask_token_id": 600}, "--init-drafter: the drafter's MASK token 600 is outside the target's vocabulary"),
]


@pytest.mark.parametrize("flags, edit, needle", REFUSALS, ids=[r[2].split(":")[0] + "-" + str(i)
                                                               for i, r in enumerate(REFUSALS)])
def test_each_mismatch_the_weights_cannot_survive_is_one_line_and_exit_2(flags, edit, needle, published,
                                                                         tiny_small_dir, tmp_path, capfd):
    src = edited(published, tmp_path / "d", **edit) if edit else published
    out = tmp_path / "out"
    args = tiny_args(tiny_small_dir, out, "--init-drafter", str(src), "--check-config", *flags)
    assert train_main(args) == 2
    err = one_line(capfd.readouterr().err)
    assert err.startswith("dflash-train: error: " + needle.split(":")[0]) and needle in err, err
    assert not out.exists()


def test_a_narrower_target_is_refused(published, tiny_small_dir, tmp_path, capfd):
    narrow = make_variant(tiny_small_dir / "target", tmp_path / "narrow", rebuild={"hidden_size": 32, "head_dim": 8})
    capfd.readouterr()   # the save's progress bar
    args = tiny_args(tiny_small_dir, tmp_path / "o", "--init-drafter", str(published), "--check-config",
                     "--target-model", str(narrow))
    assert train_main(args) == 2
    assert "--target-model: the target's hidden size: this run's 32, the drafter's 64" in one_line(capfd.readouterr().err)


def test_flags_given_on_purpose_where_the_weights_fit_go_on_and_say_so(published, tiny_small_dir, tmp_path, caplog):
    args = tiny_args(tiny_small_dir, tmp_path / "o", "--init-drafter", str(published), "--check-config",
                     "--block-size", "4", "--mask-token-id", "9", "--target-layers", "2,6",
                     "--draft-layer-types", "sliding,full", "--sliding-window", "16")
    with caplog.at_level("WARNING", logger="trainer.contract"):
        assert train_main(args) == 0
    err = caplog.text
    for needle in ("--block-size 4 given on purpose: the drafter was trained with 8",
                   "--mask-token-id 9 given on purpose", "--target-layers [2, 6] given on purpose",
                   "--draft-layer-types sliding,full given on purpose: the drafter was trained with full,full"):
        assert needle in err, err


def test_unreadable_or_foreign_drafters_are_refused(published, tmp_path, tiny_small_dir, capfd):
    sp = speculators_layout(published, tmp_path / "sp")
    c = json.loads((sp / "config.json").read_text())
    c["draft_vocab_size"] = 256
    (sp / "config.json").write_text(json.dumps(c))
    for src, needle in ((tmp_path / "missing", "--init-drafter: " + str(tmp_path / "missing") + "/config.json"),
                        (sp, "drafts over a reduced vocabulary (draft_vocab_size 256 of 512")):
        assert train_main(tiny_args(tiny_small_dir, tmp_path / "o", "--init-drafter", str(src), "--check-config")) == 2
        assert needle in one_line(capfd.readouterr().err)
