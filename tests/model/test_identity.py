"""The drafter knows its target (issue 30): every checkpoint and export records the target's identity
(trainer/model/identity.py), and a drafter that meets another target (a resumed run, --check-config,
dflash-eval, dflash-export --target-model, the data's tokenizer) exits 2 with one line naming what
differs, leaving the output untouched; --allow-target-change continues where the weights still fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.__main__ import main as train_main
from trainer.config.options import ConfigError, parse_args
from trainer.config.preflight import validate
from trainer.model import identity


def tiny_args(tiny: Path, out: Path, *extra: str, target: Path | None = None) -> list[str]:
    return ["--target-model", str(target or tiny / "target"), "--data-dir", str(tiny / "data"), "--output-dir",
            str(out), "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--token-budget", "1024", "--max-seq-len",
            "256", "--block-size", "8", "--max-anchors", "8", "--num-draft-layers", "2", "--grad-accum", "1",
            "--profile-interval", "600", *extra]


def make_variant(src: Path, dst: Path, rebuild: dict | None = None, config: dict | None = None,
                 swap_tokens: bool = False) -> Path:
    """A copy of the tiny target: `rebuild` re-initialises the model with these config changes (another
    depth or width, loadable); `config` only edits config.json; `swap_tokens` swaps two vocabulary ids."""
    shutil.copytree(src, dst)
    cj = json.loads((dst / "config.json").read_text())
    if rebuild:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        cj.update(rebuild)
        cj["layer_types"] = ["full_attention"] * cj["num_hidden_layers"]
        torch.manual_seed(0)
        keep = {k: v for k, v in cj.items() if k not in ("model_type", "architectures", "transformers_version")}
        Qwen3ForCausalLM(Qwen3Config(**keep)).to(torch.bfloat16).save_pretrained(dst)
    if config:
        cj.update(config)
        (dst / "config.json").write_text(json.dumps(cj, indent=2))
    if swap_tokens:
        tj = json.loads((dst / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        a, b = [k for k in vocab if not k.startswith("<|")][:2]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


@pytest.fixture(scope="module")
def targets(tiny_small_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    src = tiny_small_dir / "target"
    return {"same": src,
            "shallow": make_variant(src, root / "shallow", rebuild={"num_hidden_layers": 6}),
            "narrow": make_variant(src, root / "narrow", rebuild={"hidden_size": 32, "head_dim": 8}),
            "retok": make_variant(src, root / "retok", swap_tokens=True),
            "revision": make_variant(src, root / "revision", config={"initializer_range": 0.01})}


@pytest.fixture(scope="module")
def trained(tiny_trained_dir):
    """An output dir with one checkpoint (step 2) trained on the tiny target: tiny_args' 2-step run
    (tests/conftest.py, shared with the other tests that resume from it; none writes into it)."""
    return tiny_trained_dir


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------ the definition


def test_taps_and_mask_token_follow_the_trainers_rules(tiny_small_dir):
    from trainer.model.drafter import tap_layers
    for layers in (2, 3, 4, 8, 36, 64):
        for k in (1, 2, 5):
            assert identity.tap_layers(layers, k) == tap_layers(layers, k)
    target = str(tiny_small_dir / "target")
    assert identity.resolve_mask_token(target, 512) == identity.MaskChoice(3, "the tokenizer's mask token '<|mask|>'")
    assert identity.resolve_mask_token_id(target, 512, 7) == 7


def test_checkpoint_records_the_target_identity(tiny_small_dir, trained):
    meta = json.loads((trained / "step-00000002" / "meta.json").read_text())
    rec = meta[identity.RECORD_KEY]
    want = identity.for_run(tiny_small_dir / "target", 2, None, None)
    assert rec == want.to_dict()
    assert rec["num_hidden_layers"] == 8 and rec["hidden_size"] == 64 and rec["target_layer_ids"] == [1, 5]
    assert len(rec["tokenizer"]) == 64 and len(rec["config"]) == 64


def test_identity_ignores_the_copys_path_but_not_the_models_files(tiny_small_dir, targets, tmp_path):
    staged = tmp_path / "staged"
    shutil.copytree(tiny_small_dir / "target", staged)
    a, b = identity.of_target(tiny_small_dir / "target"), identity.of_target(staged)
    assert (a.tokenizer, a.config) == (b.tokenizer, b.config)
    assert identity.differences(a, b) == []
    assert identity.of_target(targets["retok"]).tokenizer != a.tokenizer
    assert identity.of_target(targets["revision"]).config != a.config


# ------------------------------------------------------------------------------ resume / --check-config


@pytest.mark.parametrize("variant, needle", [
    ("shallow", "target has 6 layers, the checkpoint was trained on 8"),
    ("narrow", "target has hidden size 32, the checkpoint was trained on 64"),
    ("retok", "target's tokenizer differs from the one the checkpoint was trained with"),
    ("revision", "target's config.json differs from the one the checkpoint was trained on"),
])
def test_resume_on_another_target_exits_2_naming_what_differs(tiny_small_dir, targets, trained, variant, needle,
                                                             capfd):
    before = snapshot(trained)
    args = tiny_args(tiny_small_dir, trained, "--max-steps", "4", target=targets[variant])
    assert train_main(args + ["--check-config"]) == 2
    line = one_line(capfd.readouterr().err)
    assert line.startswith("dflash-train: error: --target-model: ") and needle in line, line
    assert train_main(args) == 2                      # the real start: the same line, before any rank starts
    assert one_line(capfd.readouterr().err) == line
    assert snapshot(trained) == before, "nothing in the output dir may be touched"


def test_allow_target_change_resumes_and_the_run_log_says_so(tiny_small_dir, targets, trained, tmp_path, capfd):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    args = tiny_args(tiny_small_dir, out, "--max-steps", "3", target=targets["shallow"])
    assert train_main(args + ["--allow-target-change"]) == 0
    log = (out / "logs" / "latest.log").read_text()
    assert "--allow-target-change: resuming" in log and "target has 6 layers" in log
    rec = json.loads((out / "step-00000003" / "meta.json").read_text())[identity.RECORD_KEY]
    assert rec["num_hidden_layers"] == 6 and rec["target_layer_ids"] == [1, 3]
    assert train_main(args + ["--check-config"]) == 0    # its checkpoints now record the new target
    # a width the drafter's weights cannot take is refused even with the flag
    capfd.readouterr()
    narrow = tiny_args(tiny_small_dir, out, "--allow-target-change", "--check-config", target=targets["narrow"])
    assert train_main(narrow) == 2
    assert "even with --allow-target-change" in one_line(capfd.readouterr().err)


def test_changed_taps_or_mask_token_on_resume_are_refused(tiny_small_dir, trained, capfd):
    for extra, needle in ((["--target-layers", "2,6"], "this run taps layers [2, 6]"),
                          (["--mask-token-id", "9"], "this run's mask token is 9")):
        assert train_main(tiny_args(tiny_small_dir, trained, *extra, "--check-config")) == 2
        assert needle in one_line(capfd.readouterr().err)


def test_data_tokenized_with_another_tokenizer_is_refused(tiny_small_dir, targets, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_small_dir / "data", data)
    index = json.loads((data / "index.json").read_text())
    index[identity.RECORD_KEY] = identity.record_for_data(targets["retok"])
    (data / "index.json").write_text(json.dumps(index))
    cfg = parse_args(tiny_args(tiny_small_dir, tmp_path / "o") + ["--data-dir", str(data)])
    with pytest.raises(ConfigError, match=r"^--data-dir: .* another tokenizer than the target's"):
        validate(cfg)
    cfg.target_model = str(targets["retok"])
    validate(cfg)   # the tokenizer the record names


# ------------------------------------------------------------------------------ dflash-eval / dflash-export


@pytest.mark.parametrize("variant, needle", [("shallow", "target has 6 layers, the drafter was trained on 8"),
                                             ("narrow", "target has hidden size 32, the drafter was trained on 64")])
def test_eval_refuses_another_target(tiny_small_dir, targets, trained, variant, needle, capsys):
    from trainer.serving.evaluate import main as eval_main
    args = ["--target-model", str(targets[variant]), "--checkpoint", str(trained), "--data-dir",
            str(tiny_small_dir / "heldout"), "--device", "cpu", "--max-prompts", "1", "--max-new-tokens", "4",
            "--no-block-accuracy"]
    assert eval_main(args) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("dflash-eval: error: --target-model: ") and needle in line
    if variant == "shallow":   # the same width: the flag evaluates anyway
        assert eval_main(args + ["--allow-target-change", "--json"]) == 0


def test_evaluate_checkpoint_refuses_another_target(tiny_small_dir, targets, trained):
    from trainer.serving.evaluate import evaluate_checkpoint
    with pytest.raises(identity.TargetMismatch, match="target has hidden size 32"):
        evaluate_checkpoint(str(trained), str(targets["narrow"]), str(tiny_small_dir / "heldout"), device="cpu")


def test_export_refuses_another_target_and_records_the_identity(tiny_small_dir, targets, trained, tmp_path, capsys):
    from trainer.serving.export import main as export_main
    out = tmp_path / "export"
    assert export_main([str(trained), str(out), "--target-model", str(targets["shallow"])]) == 2
    assert "target has 6 layers, the drafter was trained on 8" in one_line(capsys.readouterr().err)
    assert not out.exists()
    out.mkdir()
    (out / "keep").write_text("x")
    assert export_main([str(trained), str(out), "--target-model", str(targets["narrow"]), "--force"]) == 2
    assert [p.name for p in out.iterdir()] == ["keep"], "a refused export touches nothing"
    shutil.rmtree(out)
    assert export_main([str(trained), str(out), "--target-model", str(targets["same"])]) == 0
    rec = json.loads((out / "export.json").read_text())[identity.RECORD_KEY]
    assert rec == json.loads((trained / "step-00000002" / "meta.json").read_text())[identity.RECORD_KEY]
    # an export of the export still knows its target
    again = tmp_path / "again"
    assert export_main([str(out), str(again), "--target-model", str(targets["shallow"])]) == 2
    assert not again.exists()


def test_regenerate_refuses_data_of_another_tokenizer(tiny_small_dir, targets, tmp_path, capsys):
    from trainer.serving.regenerate import main as regen_main
    data = tmp_path / "data"
    shutil.copytree(tiny_small_dir / "heldout", data)
    index = json.loads((data / "index.json").read_text())
    index[identity.RECORD_KEY] = identity.record_for_data(targets["retok"])
    (data / "index.json").write_text(json.dumps(index))
    out = tmp_path / "regen"
    assert regen_main(["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(data),
                       "--output-dir", str(out), "--max-new-tokens", "4"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--data-dir: " in line and "another tokenizer than the target's" in line
    assert not out.exists()


def test_in_training_eval_refuses_heldout_data_of_another_tokenizer(tiny_small_dir, targets, tmp_path):
    from trainer.engine.evaltrain import check_drafter_fits, check_eval_data
    from trainer.model.drafter import DFlashConfig
    data = tmp_path / "heldout"
    shutil.copytree(tiny_small_dir / "heldout", data)
    check_eval_data(str(data), str(tiny_small_dir / "target"))      # no record: nothing to compare
    index = json.loads((data / "index.json").read_text())
    index[identity.RECORD_KEY] = identity.record_for_data(targets["retok"])
    (data / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"^\S+heldout was tokenized with another tokenizer"):
        check_eval_data(str(data), str(tiny_small_dir / "target"))
    check_eval_data(str(data), str(targets["retok"]))
    tc = json.loads((tiny_small_dir / "target" / "config.json").read_text())
    from transformers import Qwen3Config
    dcfg = DFlashConfig.from_target(Qwen3Config(**{k: v for k, v in tc.items() if k != "model_type"}),
                                    num_draft_layers=2, block_size=8, mask_token_id=3)
    check_drafter_fits(dcfg, tc)
    with pytest.raises(identity.TargetMismatch, match="target has 6 layers"):
        check_drafter_fits(dcfg, dict(tc, num_hidden_layers=6))
