"""A hybrid target on a transformers older than our cache API stops in one line (trainer/model/families.py: check_hybrid_transformers).

The H200 run of trainer/lab/gpu/regenerate_bench.py --shape qwen3.6-27b on transformers 5.17 failed in every
variant with `AttributeError: '_KVCache' object has no attribute 'has_previous_state'`: 5.17's Gated
DeltaNet asks the cache another API than the one of transformers >= 5.25 that our loops answer. Every hybrid
generation path now checks the release first (the installed version is monkeypatched here, not the install):
- dflash-eval and dflash-regenerate (captured decoder) exit 2 with one line naming the installed release
  and the needed one, before reading the checkpoint or loading the target;
- dflash-train with --eval-data-dir (the in-training and final tau) exits 2 at validation;
- the library's entry points (the two captured decoders, evaluate.generate_each, regenerate.TargetGenerator)
  raise HybridTransformersTooOld, a ValueError;
- the GPU scripts stop before building their target;
- dense targets, and transformers' own generate (dflash-regenerate --decoder generate), run on any release.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.model import families

OLD = "5.17.0"


@pytest.fixture
def old(monkeypatch):
    monkeypatch.setattr(families, "installed_transformers", lambda: OLD)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def needs(line: str) -> bool:
    return f"transformers >= {families.HYBRID_TRANSFORMERS}, installed {OLD}" in line


def test_the_clis_exit_2_with_one_line_on_a_hybrid_and_run_a_dense_target(old, tiny_hybrid_dir, tiny_small_dir,
                                                                          tmp_path, capsys):
    from trainer.__main__ import main as train_main
    from trainer.serving.evaluate import main as eval_main
    from trainer.serving.regenerate import main as regen_main

    target = tiny_hybrid_dir / "target"
    # the checkpoint does not exist: the check comes before anything is read
    assert eval_main(["--target-model", str(target), "--checkpoint", str(tmp_path / "none"), "--data-dir",
                      str(tiny_hybrid_dir / "heldout"), "--device", "cpu"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"dflash-eval: error: --target-model {target} is a hybrid") and needs(line), line

    out = tmp_path / "regen"
    assert regen_main(["--target-model", str(target), "--data-dir", str(tiny_hybrid_dir / "data"), "--output-dir",
                       str(out), "--decoder", "captured"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("dflash-regenerate: error: --target-model") and needs(line) and "--decoder generate" in line
    assert not out.exists()

    args = ["--target-model", str(target), "--data-dir", str(tiny_hybrid_dir / "data"), "--output-dir",
            str(tmp_path / "o"), "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--num-draft-layers", "2",
            "--block-size", "8", "--check-config"]
    assert train_main(args + ["--eval-data-dir", str(tiny_hybrid_dir / "heldout")]) == 2
    err = capsys.readouterr().err
    assert "--eval-data-dir: --target-model" in err and needs(err) and "Traceback" not in err, err
    assert train_main(args) == 0          # no generation asked for: training a hybrid needs no cache
    capsys.readouterr()

    # a dense target generates on the same (patched) release
    assert regen_main(["--target-model", str(tiny_small_dir / "target"), "--data-dir", str(tiny_small_dir / "data"),
                       "--output-dir", str(tmp_path / "dense"), "--decoder", "captured", "--max-records", "2",
                       "--max-new-tokens", "2"]) == 0


def test_every_library_path_raises_the_one_error_on_a_hybrid_only(old, tiny_hybrid_dir, tiny_small_dir):
    from trainer.model.target import load_target
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
    from trainer.serving.captured.regenerate_decoder import GraphDecoder
    from trainer.serving.evaluate import generate_each
    from trainer.serving.regenerate import TargetGenerator

    torch.set_num_threads(1)
    model = load_target(str(tiny_hybrid_dir / "target"), torch.device("cpu"), torch.float32)
    drafter = type("Drafter", (), {"block_size": 4, "target_layer_ids": [0]})()
    for build in (lambda: GraphDecoder(model, "cpu", 2, 4, 0.0, [], 0),
                  lambda: BatchedSpecDecoder(model, drafter, "cpu", 2, 4, []),
                  lambda: generate_each(model, drafter, [[1, 2, 3]], 4),
                  lambda: TargetGenerator(model, "cpu", 4, 0.0, 2, decoder="captured")):
        with pytest.raises(families.HybridTransformersTooOld) as e:
            build()
        assert needs(str(e.value)) and "\n" not in str(e.value) and isinstance(e.value, ValueError)
    assert TargetGenerator(model, "cpu", 4, 0.0, 2, decoder="generate").decoder == "generate"
    with pytest.raises(families.HybridTransformersTooOld):   # config.json's form: layer_types under text_config
        families.check_hybrid_transformers(model.config.to_dict())
    from trainer.config.preflight import check_model_dir
    families.check_hybrid_transformers(check_model_dir(str(tiny_small_dir / "target")))   # dense: nothing


def test_the_gpu_scripts_stop_before_building_a_hybrid_target(old, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "trainer" / "lab" / "gpu"))
    import eval_bench
    import regenerate_bench

    def no_target(*a, **k):
        raise AssertionError("the target was built")

    for mod in (regenerate_bench, eval_bench):
        monkeypatch.setattr(mod, "make_target_factory", no_target)
        assert mod.main(["--shape", "qwen3.6-27b"]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"{mod.__name__}: error: --shape qwen3.6-27b is a hybrid") and needs(line), line


def test_the_release_comparison_and_the_installed_transformers_pass():
    assert families.release("5.25.0.dev0") == (5, 25, 0) and families.release("5.24.9") < families.release("5.25")
    assert families.release("5.25.0rc1") >= families.release(families.HYBRID_TRANSFORMERS)
    families.check_hybrid_transformers(True)   # this venv's transformers (pyproject's floor) is new enough
