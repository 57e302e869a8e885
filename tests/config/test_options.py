"""trainer/config/options.py is the option system alone (issue 42): it imports, builds the parser, parses and checks
flags with torch unavailable, and so does `python -m trainer.config`, the Ansible controller's flag check and
argument-spec generator (the controller has no torch). Measurement-only flags (group "measurement") are
hidden from the operator's --help and the role's spec, and still parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATHS = ["--target-model", "/m", "--data-dir", "/d", "--output-dir", "/o"]
NO_TORCH = "import sys\nsys.modules['torch'] = None\n"   # `import torch` raises ImportError from here on


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=600)


def test_options_import_build_and_parse_with_torch_blocked():
    r = _run("import trainer.config.options as o\n"
             "p = o.build_parser()\n"
             "cfg = o.parse_args(['--target-model', '/m', '--data-dir', '/d', '--output-dir', '/o',\n"
             "                    '--target-gpus', '0,1', '--drafter-gpus', '2', '--block-size', '16'])\n"
             "o.validate_flags(cfg, gpu_count=-1)\n"
             "assert isinstance(cfg, o.TrainConfig) and cfg.block_size == 16 and cfg.target_gpus == [0, 1]\n"
             "o.flag_spec(); o.ansible_spec_yaml()\n"
             "try:\n"
             "    o.validate_flags(o.parse_args(['--target-model', '/m', '--data-dir', '/d', '--output-dir', '/o',\n"
             "                                   '--block-size', '1']), gpu_count=-1)\n"
             "except o.ConfigError as e:\n"
             "    print(e)\n"
             "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] == 'torch'))\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["--block-size: must be >= 2, got 1", "[]"]


def test_the_controller_entry_point_runs_with_torch_blocked():
    """`python -m trainer.config FLAGS` and `--ansible-spec`, as the role runs them, without torch."""
    r = _run("import runpy\nsys.argv = ['trainer.config', '--ansible-spec']\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n")
    assert r.returncode == 0, r.stderr
    from trainer.config.options import ansible_spec_yaml
    assert r.stdout == ansible_spec_yaml()
    r = _run("import runpy\nsys.argv = ['trainer.config', *%r, '--block-size', '1']\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n" % (PATHS,))
    assert r.returncode == 2 and r.stderr == "dflash-train: error: --block-size: must be >= 2, got 1\n"
    r = _run("import runpy\nsys.argv = ['trainer.config', *%r]\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n" % (PATHS,))
    assert r.returncode == 0 and r.stdout == "flags ok\n", r.stderr


# ------------------------------------------------------------------------------ measurement-only flags

# the flags that exist only for A/B measurements (their help says "the same math", "the old behaviour", or, for
# --fsdp-prefetch forward, an order known to hang): the bench's variants and the stream checker set them
MEASUREMENT = {"split_fc": "--split-fc", "async_pipeline": "--async", "loss_dedup": "--loss-dedup",
               "flex_full_blocks": "--flex-full-blocks", "flex_ctx_group": "--flex-ctx-group",
               "fp32_logits": "--fp32-logits", "fsdp_prefetch": "--fsdp-prefetch"}


def test_measurement_flags_are_hidden_from_help_and_the_role_spec_but_still_parse():
    from trainer.config.options import build_parser, cli_fields, flag_of, flag_spec, is_measurement, parse_args
    assert {f.name: flag_of(f) for f in cli_fields() if is_measurement(f)} == MEASUREMENT
    text = build_parser().format_help()
    spec = flag_spec()
    for name, flag in MEASUREMENT.items():
        assert flag not in text and "--no-" + flag[2:] not in text, flag
        assert flag[2:].replace("-", "_") not in spec and name not in spec, name
    assert "measurement" not in text
    assert "--block-size" in text and "--transport" in text and "block_size" in spec   # the others stay
    cfg = parse_args(PATHS + ["--split-fc", "--no-async", "--no-loss-dedup", "--no-flex-full-blocks",
                              "--flex-ctx-group", "16", "--no-fp32-logits", "--fsdp-prefetch", "forward"])
    assert (cfg.split_fc, cfg.async_pipeline, cfg.loss_dedup, cfg.flex_full_blocks, cfg.flex_ctx_group,
            cfg.fp32_logits, cfg.fsdp_prefetch) == (True, False, False, False, 16, False, "forward")
    defaults = parse_args(PATHS)
    assert (defaults.async_pipeline, defaults.loss_dedup, defaults.fsdp_prefetch) == (True, True, "step")


def test_measurement_flags_keep_their_checks_and_the_bench_still_sets_them():
    from trainer.config.options import ConfigError, parse_args, validate_flags
    with pytest.raises(ConfigError, match="^argument --fsdp-prefetch: invalid choice"):
        parse_args(PATHS + ["--fsdp-prefetch", "never"])
    with pytest.raises(ConfigError, match="^--flex-ctx-group: must be >= 0, got -1"):
        validate_flags(parse_args(PATHS + ["--flex-ctx-group", "-1"]), gpu_count=-1)
    from trainer.lab.bench.run import parse_sets
    assert parse_sets(["fsdp_prefetch=forward", "loss-dedup=false", "flex_ctx_group=16"]) == {
        "fsdp_prefetch": "forward", "loss_dedup": False, "flex_ctx_group": 16}


def test_the_controller_refuses_a_bad_measurement_flag_in_one_line():
    r = _run("import runpy\nsys.argv = ['trainer.config', *%r, '--fsdp-prefetch', 'never']\n"
             "runpy.run_module('trainer.config', run_name='__main__')\n" % (PATHS,))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--fsdp-prefetch" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ every CLI through one option system


def test_dflash_eval_and_regenerate_are_generated_from_their_config_dataclasses():
    """dflash-eval's EvalConfig and dflash-regenerate's RegenerateConfig go through the trainer's parser
    builder: the same --x/--no-x switches, ranges named in the help, and the flags and defaults they had."""
    from trainer.config.options import build_parser, parse_options
    from trainer.serving.evaluate import EvalConfig
    from trainer.serving.regenerate import RegenerateConfig
    eval_help = build_parser("dflash-eval", EvalConfig).format_help()
    for text in ("--no-block-accuracy", "--untrained", "--allow-target-change", "--json", "[>= 1]", "--loop"):
        assert text in eval_help, text
    a = parse_options(EvalConfig, ["--target-model", "/m", "--data-dir", "/d", "--checkpoint", "/c", "--device", "cpu"])
    assert (a.max_prompts, a.max_new_tokens, a.temperature, a.seed, a.loop, a.batch_size, a.block_accuracy,
            a.untrained, a.allow_target_change, a.json, a.output_dir) == (16, 128, 0.0, 0, "auto", 16, True, False,
                                                                          False, False, "")
    assert parse_options(EvalConfig, ["--target-model", "/m", "--data-dir", "/d", "--no-block-accuracy",
                                      "--json"]).block_accuracy is False
    regen_help = build_parser("dflash-regenerate", RegenerateConfig).format_help()
    for text in ("--static-cache auto|on|off", "--kv-fp8 on|off", "--decoder auto|generate|captured", "[>= 0]"):
        assert text in regen_help, text
    r = parse_options(RegenerateConfig, ["--target-model", "/m", "--output-dir", "/o", "--input", "a.jsonl",
                                         "--input", "b.jsonl", "--devices", "cuda:0,cuda:1", "--kv-fp8", "on"])
    assert (r.input, r.device_list(), r.batch_size, r.max_new_tokens, r.shard_size, r.max_records, r.static_cache,
            r.decoder, r.fuse, r.decode_attention, r.kv_fp8, r.data_dir) == (
        ["a.jsonl", "b.jsonl"], ["cuda:0", "cuda:1"], 32, 1024, 10000, 0, "auto", "auto", "auto", "auto", "on", "")
    assert parse_options(RegenerateConfig, ["--target-model", "/m", "--output-dir", "/o"]).input == []


def test_the_keyword_call_of_regenerate_is_the_same_config():
    from trainer.config.options import ConfigError, check_ranges
    from trainer.serving.regenerate import RegenerateConfig
    cfg = RegenerateConfig.of("/d", "/m", "/o", batch_size=8, devices=["cpu", "cpu"], static_cache=False,
                              decoder="captured", fuse=None, kv_fp8=True)
    assert cfg == RegenerateConfig(target_model="/m", output_dir="/o", data_dir="/d", devices="cpu,cpu", batch_size=8,
                                   static_cache="off", decoder="captured", fuse="auto", kv_fp8="on")
    assert RegenerateConfig.of(None, "/m", "/o", inputs=["x.jsonl"]).data_dir == ""
    with pytest.raises(ConfigError, match=r"^--temperature: must be >= 0, got -1.0"):
        check_ranges(RegenerateConfig(target_model="/m", output_dir="/o", temperature=-1.0))
    with pytest.raises(ConfigError, match=r"^--decoder: unknown 'fast'"):
        check_ranges(RegenerateConfig(target_model="/m", output_dir="/o", decoder="fast"))


@pytest.mark.parametrize("module, prog, argv, needle", [
    ("trainer.serving.regenerate", "dflash-regenerate", ["--target-model", "/m", "--output-dir", "/o", "--batch-size", "many"],
     "argument --batch-size: invalid int value: 'many'"),
    ("trainer.serving.regenerate", "dflash-regenerate", ["--target-model", "/m", "--output-dir", "/o", "--kv-fp8", "yes"],
     "argument --kv-fp8: invalid choice"),
    ("trainer.serving.regenerate", "dflash-regenerate", ["--output-dir", "/o"], "--target-model"),
    ("trainer.serving.evaluate", "dflash-eval", ["--target-model", "/m", "--data-dir", "/d", "--max-prompts", "x"],
     "argument --max-prompts: invalid int value: 'x'"),
    ("trainer.serving.evaluate", "dflash-eval", ["--target-model", "/m", "--data-dir", "/d", "--block-accuracy=no"],
     "--block-accuracy"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(module, prog, argv, needle, capsys):
    import importlib
    assert importlib.import_module(module).main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and needle in err, err
