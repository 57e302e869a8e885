"""docs/contracts.md says what status.json reports and which flags dflash-train takes, as the code has them
(issue 42): its generated tables are what trainer/lab/contracts_tables.py renders from trainer/status/schema.py's
STATUS_SCHEMA and TrainConfig's options, and a status key written but not declared fails."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("contracts_tables", REPO / "trainer" / "lab" / "contracts_tables.py")
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)


def test_contracts_md_is_what_the_generator_renders():
    text = ct.DOC.read_text()
    assert text == ct.render(text), \
        f"docs/contracts.md's generated tables are stale (status fields or dflash-train flags): run {ct.COMMAND}"


def test_the_check_command_fails_on_a_stale_table_and_names_the_fix(tmp_path, monkeypatch):
    fresh = ct.render(ct.DOC.read_text())
    stale = fresh.replace("| `--epochs` | `6` |", "| `--epochs` | `7` |")
    assert stale != fresh
    doc = tmp_path / "contracts.md"
    doc.write_text(stale)
    monkeypatch.setattr(ct, "DOC", doc)
    assert ct.main(["--check"]) == 1
    assert ct.main(["--write"]) == 0 and ct.main(["--check"]) == 0
    assert doc.read_text() == fresh


def test_the_check_runs_as_a_command_and_names_the_fix(tmp_path):
    """`--check` in a checkout whose doc is stale: exit 1 and the command that fixes it."""
    copy = tmp_path / "repo"
    (copy / "trainer" / "lab").mkdir(parents=True)
    (copy / "docs").mkdir()
    script = copy / "trainer" / "lab" / "contracts_tables.py"
    script.write_text((REPO / "trainer" / "lab" / "contracts_tables.py").read_text())
    (copy / "docs" / "contracts.md").write_text(ct.render(ct.DOC.read_text()).replace("| `pid` | always |", "| `pid` | once |"))
    r = subprocess.run([sys.executable, str(script), "--check"],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1 and ct.COMMAND in r.stderr, r.stdout + r.stderr


def test_a_missing_block_is_an_error_naming_the_markers():
    with pytest.raises(ValueError, match=r"no block for \['dflash-train flags', 'status fields'\].*"
                                         r"<!-- generated: status fields"):
        ct.render("# contracts\nno tables here\n")


def test_every_declared_status_field_and_every_listed_flag_is_in_the_doc():
    from trainer.status import STATUS_SCHEMA
    text = ct.DOC.read_text()
    for f in STATUS_SCHEMA:
        assert f"| `{f.name}` |" in text, f.name
    mod, groups, _ = ct.train_flags()
    for group, fields in groups.items():
        assert f"**{group}**" in text, group
        for f in fields:
            assert f"| `{mod.flag_of(f)}`" in text, mod.flag_of(f)


def test_measurement_and_hidden_flags_are_left_out(monkeypatch):
    """Flags for A/B measurements only (group "measurement", or marked hidden) are not offered in the doc."""
    mod = ct.option_module()
    real = mod.cli_fields()
    fields = []
    for f in real:
        if f.name == "split_fc":
            f = dataclasses.field(default=f.default, metadata={**f.metadata, "group": "measurement"})
            f.name, f.type = "split_fc", "bool"
        elif f.name == "flex_ctx_group":
            f = dataclasses.field(default=f.default, metadata={**f.metadata, "hidden": True})
            f.name, f.type = "flex_ctx_group", "int"
        fields.append(f)
    monkeypatch.setattr(mod, "cli_fields", lambda *a, **k: fields)
    table = ct.flag_table()
    assert "`--split-fc`" not in table and "`--flex-ctx-group`" not in table and "**measurement**" not in table
    left = sum(f.metadata.get("group") == "measurement" or bool(f.metadata.get("hidden")) for f in fields)
    assert left >= 2 and f"Left out: {left} flags for A/B measurements only" in table
    assert "`--epochs`" in table


def test_a_status_field_written_but_not_declared_fails(tmp_path):
    """The declaration cannot drift from the writers: a writer that puts an undeclared key into status.json
    raises under the tests (the trainer's own writes included: it inherits the test's environment)."""
    from trainer.status import STATUS_KEYS, StatusWriter, UndeclaredStatusField
    assert "gpu_temp" not in STATUS_KEYS
    w = StatusWriter(tmp_path / "status.json", "run")
    w.update(phase="training", step=1)
    with pytest.raises(UndeclaredStatusField, match="STATUS_SCHEMA"):
        w.update(step=2, gpu_temp=71)
    r = subprocess.run([sys.executable, "-c", "from trainer.status import StatusWriter as W; import sys; "
                        f"W({str(tmp_path / 's.json')!r}, 'r').update(gpu_temp=1)"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "UndeclaredStatusField" in r.stderr, r.stderr
