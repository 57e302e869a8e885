"""The drafter architectures (trainer/model/architectures.py) and the checklist of docs/adding-an-architecture.md.

Every fact that differs between DFlash and DFlash2 is one entry's, and the trainer asks the entry. The proof
is a third entry, a stub that adds a candidate selector to DFlash and nothing else, registered in the table
alone: it reaches every seam (the --arch choices and help, the drafter config and model, the loss, the
checkpoint's resume record, the export's class name, keys and auto_map, --init-drafter's reading, the
bench's and the recipe's variants, dflash-eval's proposer), and a world-size-1 run with --arch stub trains,
checkpoints and exports.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.test_trainer import tiny_args
from trainer.model import architectures
from trainer.model.architectures import ARCHITECTURES, Architecture, architecture, for_config

REPO = Path(__file__).resolve().parents[2]
STUB = Architecture("stub", "StubDraftModel", summary="DFlash with a candidate selector",
                    config_keys={"selector_rank": 8, "selector_top_k": 4}, loss_terms=("lm_head", "selector"),
                    proposer="trainer.serving.dflash2_eval.DFlash2Proposer",
                    generate="trainer.serving.dflash2_eval.dflash2_generate", eval_loops=("single",))
# the stub's entry as every process of a run registers it (a sitecustomize: the --arch choices are read when
# options is imported, and the trainer's ranks are processes of their own)
REGISTER = ("from trainer.model import architectures as a\n"
            "a.ARCHITECTURES['stub'] = a.Architecture('stub', 'StubDraftModel', summary='DFlash with a selector', "
            "config_keys={'selector_rank': 8, 'selector_top_k': 4}, loss_terms=('lm_head', 'selector'))\n")


@pytest.fixture
def stub(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, "stub", STUB)
    return STUB


def test_the_architecture_table_is_standard_library_only():
    """The config wing (--arch's choices) and the Ansible controller's flag check import it without torch."""
    code = ("import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
            "from trainer.model import architectures\nprint(','.join(architectures.names()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "dflash,dflash2", r.stderr


def test_no_module_tests_an_arch_name_itself():
    """The seams ask the entry: no `arch == "dflash2"` or `is_dflash2` outside the table."""
    allowed = {"trainer/model/architectures.py"}
    bad = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel in allowed:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any(isinstance(c, ast.Constant) and c.value in ARCHITECTURES for c in sides) and \
                    "arch" in ast.unparse(node):   # (a peer's format name, e.g. speculators' "dflash", is not one)
                bad.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "is_dflash2":
                bad.append(f"{rel}:{node.lineno}")
    assert bad == [], bad


def test_options_take_the_choices_and_help_from_the_table():
    from trainer.config import options
    f = {f.name: f for f in __import__("dataclasses").fields(options.TrainConfig)}["arch"]
    assert options.ARCH_CHOICES == architectures.names() == tuple(ARCHITECTURES)
    assert f.default == architectures.DEFAULT
    assert architectures.help_text() in json.dumps(f.metadata, default=str)


def test_for_config_reads_the_class_name_then_the_keys(stub):
    assert for_config({"architectures": ["DFlash2DraftModel"]}).name == "dflash2"
    assert for_config({"architectures": ["StubDraftModel"]}) is stub
    # no class name: the entry whose keys are all set, the most of them
    assert for_config({"dflash_config": {"selector_rank": 8, "selector_top_k": 4}}) is stub
    assert for_config({k: 1 for k in ARCHITECTURES["dflash2"].config_keys}).name == "dflash2"
    assert for_config({}).name == "dflash"
    with pytest.raises(KeyError, match="unknown drafter architecture 'x'"):
        architecture("x")


def test_every_entry_names_what_resolves():
    """Each dotted name of an entry resolves, and each field holds one of the known values."""
    for a in ARCHITECTURES.values():
        for dotted in (a.check, a.proposer, a.generate):
            if dotted:
                assert callable(architectures.resolve(dotted)), dotted
        if a.auto_map:
            module, cls = a.auto_map.split(".")
            assert (REPO / "trainer/model" / f"{module}.py").is_file()
            assert f"class {cls}(" in (REPO / "trainer/model" / f"{module}.py").read_text()
        assert set(a.loss_terms) <= set(architectures.LOSS_TERMS) and "lm_head" in a.loss_terms
        assert set(a.eval_loops) <= set(architectures.EVAL_LOOPS) and a.eval_loops


def _tiny_cfg():
    from transformers import Qwen3Config

    from trainer.model.drafter import DFlashConfig
    t = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=96)
    return DFlashConfig.from_target(t, num_draft_layers=2, block_size=8, mask_token_id=95)


def test_a_stub_entry_reaches_the_model_config_export_and_published_seams(stub, tmp_path):
    from types import SimpleNamespace

    from trainer.model import published
    from trainer.model.checkpoint_format import ResumeChanged, check_resume_keeps
    from trainer.model.drafter import DFlashConfig, DFlashDrafter
    from trainer.serving.export import drafter_config_from_json, hf_config_dict

    cfg = _tiny_cfg().with_architecture("stub", selector_top_k=3)
    assert cfg.architecture is stub and cfg.architectures == ["StubDraftModel"]
    assert (cfg.selector_rank, cfg.selector_top_k, cfg.conv_kernel_size) == (8, 3, None)
    with pytest.raises(ValueError, match="stub has no conv_kernel_size"):
        _tiny_cfg().with_architecture("stub", conv_kernel_size=2)
    # the model: the selector, no convolutions
    m = DFlashDrafter(cfg)
    assert m.candidate_selector.top_k == 3 and m.layers[0].attention_conv is None
    # the checkpoint's config round-trips, and so does an export's
    saved = cfg.to_dict()
    assert saved["dflash_config"]["selector_top_k"] == 3 and "conv_kernel_size" not in saved["dflash_config"]
    assert DFlashConfig.from_dict(saved).architecture is stub
    hf = hf_config_dict(cfg)
    assert hf["architectures"] == ["StubDraftModel"] and "auto_map" not in hf
    assert hf["dflash_config"]["selector_rank"] == 8
    assert drafter_config_from_json(hf).architecture is stub
    # a published drafter of this architecture is read as one, with its keys' values
    d = tmp_path / "pub"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    (d / "model.safetensors").write_bytes(b"")
    pub = published.read(d)
    assert pub.arch == "stub" and pub.arch_config == {"selector_rank": 8, "selector_top_k": 3}
    # a checkpoint without a recorded run config: its config.json's class name says the architecture
    (d / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ResumeChanged, match="--arch: this run's dflash, the checkpoint's stub"):
        check_resume_keeps(SimpleNamespace(block_size=8, arch="dflash", loss="ce"), d)


@pytest.mark.slow   # two runs of the tiny target in a subprocess
def test_a_stub_entry_trains_checkpoints_and_exports_through_the_cli(tiny_small_dir, tmp_path):
    """--arch stub, registered in the table alone (before the options module reads the choices): the
    run's config, model, selector loss and checkpoint, the export, the variants, and a resume with another
    --arch refused by the checkpoint's record."""
    out, exp = tmp_path / "run", tmp_path / "export"
    train = tiny_args(tiny_small_dir, out, "--max-steps", "2", "--save-interval", "2", "--arch", "stub",
                      "--no-use-soft-labels", "--loss", "ce")
    resume = tiny_args(tiny_small_dir, out, "--max-steps", "3", "--no-use-soft-labels", "--loss", "ce")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(REGISTER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    code = f"""
import json
from trainer.__main__ import main
from trainer.model.checkpoint_format import CheckpointManager
from trainer.serving.export import export_drafter, read_checkpoint
from trainer.lab import recipe
from trainer.lab.bench import run as bench
assert main({train!r}) == 0
dst = export_drafter(CheckpointManager({str(out)!r}).latest(), {str(exp)!r})
print(json.dumps({{"arch": read_checkpoint(dst)[0].architecture.name, "resume": main({resume!r}),
                  "bench": bench.VARIANTS.get("stub"), "recipe": recipe.VARIANTS.get("stub")}}))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"arch": "stub", "resume": 2, "bench": {"arch": "stub"}, "recipe": ["--arch", "stub"]}, got
    assert "--arch: this run's dflash, the checkpoint's stub" in r.stderr
    hf = json.loads((exp / "config.json").read_text())
    assert hf["architectures"] == ["StubDraftModel"] and hf["dflash_config"]["selector_top_k"] == 4
    assert "auto_map" not in hf and not (exp / "modeling_dflash.py").exists()
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "kind" not in r]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
