"""The target families (trainer/model/families.py) and the checklist of docs/adding-a-target.md (issue 55).

Every family in the table has a tiny target (dflash-tiny --arch) and a bench shape, and its tiny target runs
the short CPU chain: it loads as the family's class, trains two steps at world size 1 with the choices its
family resolves (the MASK token named by its source), and exports a drafter that the identity check passes.
A new family is covered here by its entry, its --arch and its shape alone. A model_type without an entry
keeps the generic rules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.test_trainer import tiny_args
from trainer.lab.bench.shapes import SHAPES
from trainer.model import families
from trainer.model.families import FAMILIES, GENERIC, GENERIC_HYBRID, family_for
from trainer.tools import tiny

REPO = Path(__file__).resolve().parents[2]


def test_every_family_has_a_tiny_arch_and_a_bench_shape():
    """The checklist's claim: an entry, a dflash-tiny --arch of the same name, a bench --shape of its
    model_type; and no tiny arch or shape without a family."""
    shaped = {family_for({"model_type": s.model_type}).name for s in SHAPES.values()}
    assert set(FAMILIES) == set(tiny.ARCHES) == shaped


def test_family_for_reads_the_wrapper_then_the_text_config_and_keeps_unknown_targets_generic():
    q35 = FAMILIES["qwen3_5"]
    assert family_for({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}) is q35
    assert family_for({"model_type": "something_vl", "text_config": {"model_type": "qwen3_5_text"}}) is q35
    # unknown: any dense causal LM keeps the generic rules; one that declares linear-attention layers the hybrid ones
    assert family_for({"model_type": "mistral"}) is GENERIC
    assert family_for({"model_type": "x", "text_config": {"layer_types": ["linear_attention", "full_attention"]}}) \
        is GENERIC_HYBRID
    assert GENERIC.contract() is None and GENERIC.auto_layer_types(5) is None and not GENERIC.linear_attention
    assert GENERIC_HYBRID.auto_layer_types(3) == ["sliding_attention", "sliding_attention", "full_attention"]


def test_the_family_table_is_standard_library_only():
    """preflight and the Ansible controller's flag check import it without torch or transformers."""
    code = ("import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
            "from trainer.model import families\nprint(families.family_for({'model_type': 'qwen3'}).name)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "qwen3", r.stderr


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_run(request, tiny_arch_dir, tmp_path_factory):
    """(family, dflash-tiny OUTDIR of its --arch, the output dir of a short world-size-1 run on it: two steps, or
    the session's run on the same tiny target where there is one (tests/conftest.py): Qwen3's tiny_trained_dir
    (its layers are all full attention: it needs no --sliding-window), qwen3_5's tiny_hybrid_run (4 steps))."""
    from trainer.__main__ import main as train_main
    d = tiny_arch_dir(request.param)
    shared = {"qwen3": "tiny_trained_dir", "qwen3_5": "tiny_hybrid_run"}.get(request.param)
    if shared:
        return FAMILIES[request.param], d, request.getfixturevalue(shared)
    out = tmp_path_factory.mktemp(f"family-{request.param}") / "out"
    assert train_main(tiny_args(d, out, "--max-steps", "2", "--save-interval", "2", "--sliding-window", "16")) == 0
    return FAMILIES[request.param], d, out


def test_the_tiny_target_of_each_family_trains_exports_and_keeps_its_identity(family_run, tmp_path):
    import torch

    from trainer.model import identity
    from trainer.model.target import load_target
    from trainer.serving.export import main as export_main
    fam, d, out = family_run
    target = d / "target"
    config = json.loads((target / "config.json").read_text())
    assert family_for(config) is fam
    assert type(load_target(str(target), torch.device("cpu"), torch.float32)).__name__ == fam.causal_lm
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "done" and status["step"] >= 2
    step = out / f"step-{status['step']:08d}"      # the run's last step
    rec = json.loads((step / "meta.json").read_text())[identity.RECORD_KEY]
    assert rec == identity.for_run(target, 2, None, None).to_dict() and rec["model_type"] in fam.model_types
    # the MASK the rule gives this family's tokenizer (its contract's where the vocabulary has that row)
    c = fam.contract("dflash")
    mask = identity.resolve_mask_token(target, rec["vocab_size"], contract=c)
    assert rec["mask_token_id"] == mask.token_id
    drafter = json.loads((step / "config.json").read_text())
    assert (drafter.get("layer_types") or None) == fam.auto_layer_types(2)
    dst = tmp_path / "drafter"
    assert export_main([str(out), str(dst), "--target-model", str(target)]) == 0
    token = identity.tokenizer_facts(target)
    text = {i: t for t, i in token.ids.items()}[mask.token_id]
    assert json.loads((dst / "config.json").read_text())["dflash_config"]["mask_token"] == text
    assert identity.check_drafter_on_target(dst, target) == []


def test_the_mask_rule_names_its_source_for_each_family(family_run):
    """What the family's tokenizer gives (docs/adding-a-target.md): a family whose vocabulary has no spare
    row and no mask token takes an unused special token, and says so."""
    from trainer.model import identity
    fam, d, _ = family_run
    target = d / "target"
    vocab = identity.of_target(target).vocab_size
    got = identity.resolve_mask_token(target, vocab, contract=fam.contract("dflash"))
    facts = identity.tokenizer_facts(target)
    if facts.size < vocab or "<|mask|>" in facts.ids:
        assert got.source.startswith(("the tokenizer's mask token", "the first row past")), got
    else:
        assert "no spare row" in got.source and got.token_id not in facts.role_ids, got


def test_families_docstring_points_at_the_checklist():
    assert "docs/adding-a-target.md" in families.__doc__
    assert (REPO / "docs" / "adding-a-target.md").is_file()
