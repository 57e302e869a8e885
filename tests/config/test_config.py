"""trainer.config.options and trainer.preflight: the command line generated from TrainConfig, the recommended defaults, and the cheap
checks that turn bad input into exit 2 with one line naming the flag or file (shard headers, the output
directory, GPU indices), plus the TensorBoard sink. No model is loaded here."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.__main__ import main as train_main
from trainer.config.options import (
    ConfigError,
    TrainConfig,
    build_parser,
    cli_fields,
    flag_of,
    flag_spec,
    parse_args,
    validate_flags,
)
from trainer.config.preflight import check_safetensors_header, check_target_shards, validate

REPO = Path(__file__).resolve().parents[2]

# The seed run, as it was typed by hand (docs/contracts.md). Its recipe was the trainer's default until
# 2026-12-06; it predates --loss, whose default (CE) it left to, and which is ce+dpace now.
ORIGINAL = ("--target-model /m --data-dir /d --output-dir /o --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7 --epochs 6 "
            "--lr 6e-4 --warmup-ratio 0.04 --weight-decay 0.01 --grad-accum 4 --grad-clip 1.0 --token-budget 49152 "
            "--max-seq-len 8192 --max-batch-size 64 --block-size 32 --max-anchors 1024 --num-draft-layers 5 "
            "--gamma 10.0 --noise-start 0.05 --noise-end 0.01 --noise-type uniform --use-soft-labels")
PATHS = ["--target-model", "/m", "--data-dir", "/d", "--output-dir", "/o"]


def tiny_cli(tiny: Path, out: Path, *extra: str) -> list[str]:
    return ["--target-model", str(tiny / "target"), "--data-dir", str(tiny / "data"), "--output-dir", str(out),
            "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--token-budget", "1024", "--max-seq-len", "256",
            "--block-size", "8", "--max-anchors", "8", "--num-draft-layers", "2", *extra]


# ------------------------------------------------------------------------------ one source


def test_every_field_is_a_flag_with_help_and_every_flag_a_field():
    parser = build_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == {f.name for f in cli_fields()}
    for f in cli_fields():
        assert f.metadata["help"], f"{f.name} has no help text"
    # save_final: set by the benchmark; given: by parse_args (the flags the command line wrote)
    assert {f.name for f in dataclasses.fields(TrainConfig)} - dests == {"save_final", "given"}


def test_defaults_are_the_recommended_recipe_and_the_seed_run_differs_in_four_flags():
    """The defaults follow docs/performance.md's 2026-12-06 table (block 16, hard labels, CE + D-PACE); the
    seed run is the defaults but for --block-size 32 --gamma 10 --use-soft-labels --loss ce."""
    defaults = parse_args(PATHS)
    assert (defaults.block_size, defaults.max_anchors, defaults.gamma, defaults.use_soft_labels, defaults.loss,
            defaults.arch) == (16, 1024, 7.0, False, "ce+dpace", "dflash")
    validate_flags(defaults, gpu_count=-1)
    original = parse_args(ORIGINAL.split() + ["--loss", "ce"])
    validate_flags(original, gpu_count=-1)
    assert (original.block_size, original.max_anchors, original.gamma, original.use_soft_labels, original.loss) == (
        32, 1024, 10.0, True, "ce")
    seed = parse_args(PATHS + ["--block-size", "32", "--gamma", "10", "--use-soft-labels", "--loss", "ce"])
    assert dataclasses.replace(original, target_gpus=[], drafter_gpus=[]) == seed


def test_soft_labels_alone_are_refused_naming_loss_ce():
    """--use-soft-labels under the default --loss ce+dpace: one line that says to add --loss ce (exit 2);
    with --loss ce+dpace written, it says to drop the soft labels or take --loss ce."""
    with pytest.raises(ConfigError, match="^--loss: the default ce\\+dpace is defined on hard labels: "
                                          "--use-soft-labels needs --loss ce too$"):
        validate_flags(parse_args(PATHS + ["--use-soft-labels"]), gpu_count=-1)
    with pytest.raises(ConfigError, match="^--loss: ce\\+dpace is defined on hard labels: add --no-use-soft-labels "
                                          "\\(or --loss ce to train on soft labels\\)$"):
        validate_flags(parse_args(PATHS + ["--use-soft-labels", "--loss", "ce+dpace"]), gpu_count=-1)
    validate_flags(parse_args(PATHS + ["--use-soft-labels", "--loss", "ce"]), gpu_count=-1)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "trainer.config", *PATHS, "--use-soft-labels"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and r.stderr == ("dflash-train: error: --loss: the default ce+dpace is defined on hard "
                                              "labels: --use-soft-labels needs --loss ce too\n")


def test_switches_can_be_turned_off_and_contract_spellings_stay():
    cfg = parse_args(PATHS + ["--no-use-soft-labels", "--no-resume", "--no-async", "--split-fc"])
    assert (cfg.use_soft_labels, cfg.resume, cfg.async_pipeline, cfg.split_fc) == (False, False, False, True)
    assert cfg.status_file == "/o/status.json" and cfg.log_dir == "/o/logs"
    # --use-soft-labels is off by default since 2026-12-06: its positive spelling turns it on
    assert parse_args(PATHS + ["--use-soft-labels", "--loss", "ce"]).use_soft_labels is True


def test_env_backed_defaults(monkeypatch):
    monkeypatch.setenv("DFLASH_PROFILE_INTERVAL", "12")
    assert parse_args(PATHS).profile_interval == 12.0
    assert parse_args(PATHS + ["--profile-interval", "5"]).profile_interval == 5.0
    monkeypatch.setenv("DFLASH_PROFILE_INTERVAL", "soon")
    with pytest.raises(ConfigError, match="DFLASH_PROFILE_INTERVAL"):
        parse_args(PATHS)


def test_flag_spec_is_what_the_role_argument_specs_declare():
    """roles/dflash_service/meta/argument_specs.yml restates the trainer's flags for Ansible's up-front type
    check; it must say exactly what TrainConfig says (regenerate with `python -m trainer.config --ansible-spec`)."""
    yaml = pytest.importorskip("yaml")
    specs = yaml.safe_load((REPO / "roles/dflash_service/meta/argument_specs.yml").read_text())
    declared = specs["argument_specs"]["main"]["options"]["dflash_service_trainer_flags"]["options"]
    assert declared == flag_spec()


@pytest.mark.parametrize("flag", [flag_of(f) for f in cli_fields() if f.metadata.get("ge") is not None
                                  or f.metadata.get("gt") is not None])
def test_every_range_is_checked_naming_its_flag(flag):
    f = next(f for f in cli_fields() if flag_of(f) == flag)
    low = f.metadata["gt"] if f.metadata.get("gt") is not None else f.metadata["ge"] - 1
    cfg = parse_args(PATHS + [flag, str(int(low) if isinstance(f.default, int) else low)])
    with pytest.raises(ConfigError, match=f"^{flag}: must be"):
        validate_flags(cfg, gpu_count=-1)


def test_controller_flag_check_prints_one_line_and_exits_2():
    """`python -m trainer.config` is what the Ansible role runs on the controller before a deploy changes
    anything: the trainer's own rule and message, no file read, no torch."""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "trainer.config", *PATHS, "--block-size", "1"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and r.stderr == "dflash-train: error: --block-size: must be >= 2, got 1\n"
    r = subprocess.run([sys.executable, "-m", "trainer.config", *PATHS, "--no-such-flag"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([sys.executable, "-c", "import sys, trainer.config, trainer.ops.plan; "
                        "sys.exit('torch' in sys.modules)"], env=env)
    assert r.returncode == 0, "config and host-side planning must not import torch"


# ------------------------------------------------------------------------------ bug 8: GPU indices


def test_missing_gpu_index_is_blamed_on_the_flag_that_lists_it():
    cfg = parse_args(PATHS + ["--target-gpus", "3", "--drafter-gpus", "5"])
    with pytest.raises(ConfigError) as e:
        validate_flags(cfg, gpu_count=2)
    assert str(e.value).startswith("--target-gpus: GPU index(es) [3] do not exist")
    cfg = parse_args(PATHS + ["--target-gpus", "0", "--drafter-gpus", "5,1"])
    with pytest.raises(ConfigError, match=r"^--drafter-gpus: GPU index\(es\) \[5\] do not exist"):
        validate_flags(cfg, gpu_count=2)


# ------------------------------------------------------------------------------ bug 2: output dir


@pytest.mark.parametrize("flag", ["--output-dir", "--log-dir", "--tensorboard-dir"])
def test_a_directory_under_a_regular_file_is_bad_input(tiny_small_dir, tmp_path, capsys, monkeypatch, flag):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # tensorboard "installed"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    args = tiny_cli(tiny_small_dir, tmp_path / "o", "--check-config")
    if flag == "--output-dir":
        args[args.index("--output-dir") + 1] = str(blocker / "run")
    else:
        args += [flag, str(blocker / "sub")]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dflash-train: error: {flag}: ") and str(blocker) in err and err.count("\n") == 1


# ------------------------------------------------------------------------------ bug 1: target shards


def _copy_target(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny / "target", dest)
    return dest


def test_truncated_shard_fails_check_config_naming_the_file(tiny_small_dir, tmp_path, capsys):
    model = _copy_target(tiny_small_dir, tmp_path / "model")
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    rc = train_main(tiny_cli(tiny_small_dir, tmp_path / "o", "--check-config", "--target-model", str(model)))
    err = capsys.readouterr().err
    assert rc == 2, "a truncated shard must not pass --check-config"
    assert err.startswith(f"dflash-train: error: --target-model: {shard}: truncated") and err.count("\n") == 1


def test_corrupt_header_and_index_mismatch_name_the_shard(tiny_small_dir, tmp_path):
    model = _copy_target(tiny_small_dir, tmp_path / "model")
    shard = model / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[10:20] = b"\xff" * 10  # inside the JSON header
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=f"{shard}: corrupt safetensors header"):
        check_target_shards(model)
    shard.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ConfigError, match=f"{shard}: not a safetensors file or truncated"):
        check_target_shards(model)

    good = _copy_target(tiny_small_dir, tmp_path / "sharded")
    header = check_safetensors_header(good / "model.safetensors")
    (good / "model.safetensors").rename(good / "model-00001-of-00001.safetensors")
    names = [k for k in header if k != "__metadata__"]
    (good / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model-00001-of-00001.safetensors" for n in names}, "extra.weight": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ConfigError, match="lacks 1 tensor.*extra.weight"):
        check_target_shards(good)


def test_a_whole_target_passes(tiny_small_dir, tmp_path):
    check_target_shards(tiny_small_dir / "target")
    validate(parse_args(tiny_cli(tiny_small_dir, tmp_path / "o")))


# ------------------------------------------------------------------------------ TensorBoard


def test_tensorboard_dir_without_tensorboard_is_bad_input(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    with pytest.raises(ConfigError, match="^--tensorboard-dir: needs the tensorboard package"):
        validate_flags(parse_args(PATHS + ["--tensorboard-dir", "/tmp/tb"]), gpu_count=-1)


def test_tensorboard_sink_writes_scalars_per_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.engine.metrics_sinks import open_tensorboard
    sink = open_tensorboard(str(tmp_path / "tb"), "run-1")
    for step in (1, 2, 3):
        sink.write(step, {"loss": 3.0 - step, "lr": 1e-4 * step, "grad_norm": float("nan"), "skipped": False,
                          "acc": [0.9, None, 0.5], "stage_s": {"target": 0.25, "drafter": 0.5}})
    sink.close()
    ev = EventAccumulator(str(tmp_path / "tb" / "run-1"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert tags == {"loss", "lr", "acc/pos_01", "acc/pos_03", "stage_s/target", "stage_s/drafter"}
    assert [(s.step, s.value) for s in ev.Scalars("loss")] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert open_tensorboard("") is None


# ------------------------------------------------------------------------------ issue 30: the last bad inputs


def test_help_prints_a_percent_sign_not_a_dict():
    """--flex-ctx-group's help said '+1-2%'; argparse read '% a' as a format and printed its dict. No help
    carries a figure today (CONTRIBUTING.md), so the flag's field is given such a help here and expanded as
    argparse would expand it."""
    import copy
    import types

    from trainer.config.options import _help
    f = copy.copy(next(f for f in cli_fields() if f.name == "flex_ctx_group"))
    f.metadata = types.MappingProxyType({**f.metadata, "help": "measured +1-2% at block 32"})
    text = " ".join((_help(f) % {"default": f.default, "prog": "dflash-train"}).split())
    assert "measured +1-2% at block 32" in text and "{'" not in text
    assert "{'" not in build_parser().format_help()


def test_every_missing_gpu_index_is_named():
    cfg = parse_args(PATHS + ["--target-gpus", "9", "--drafter-gpus", "8"])
    with pytest.raises(ConfigError) as e:
        validate_flags(cfg, gpu_count=8)
    msg = str(e.value)
    assert "--target-gpus: GPU index(es) [9] do not exist" in msg and "--drafter-gpus: GPU index(es) [8]" in msg
    assert "\n" not in msg


def test_corrupted_shard_of_the_right_size_is_caught_by_check_config_and_at_start(tiny_small_dir, tmp_path, capfd):
    """A shard changed in place (same size: the cheap checks pass) is found by --check-config, and the
    real start fails with our one line before any rank starts (no launcher lines); status.json says why."""
    data = tmp_path / "data"
    shutil.copytree(tiny_small_dir / "data", data)
    shard = sorted(data.glob("shard-*.parquet"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[100:200] = bytes(100)
    shard.write_bytes(bytes(raw))
    out = tmp_path / "o"
    args = tiny_cli(tiny_small_dir, out, "--max-steps", "1") + ["--data-dir", str(data)]
    for extra in (["--check-config"], []):
        assert train_main(args + extra) == 2
        err = capfd.readouterr().err
        assert err.startswith(f"dflash-train: error: --data-dir: {shard}: sha256 mismatch") and err.count("\n") == 1, err
        if extra:
            assert not out.exists(), "--check-config writes nothing"
    assert [p.name for p in out.iterdir()] == ["status.json"]
    st = json.loads((out / "status.json").read_text())
    assert st["phase"] == "failed" and f"{shard}: sha256 mismatch" in st["error"]
