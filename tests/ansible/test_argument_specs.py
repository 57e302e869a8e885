"""Every role's argument specs (issue 41 item 8): each key of defaults/main.yml is declared in
meta/argument_specs.yml and each declared option is a default (or a documented input without
one); every `tasks_from` entry point used anywhere has a spec of its own; a variable of another role
or of the inventory that a role reads is declared in that role's spec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "meta" / "argument_specs.yml").exists())


def _spec(role):
    return yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]


def _defaults(role):
    path = REPO / "roles" / role / "defaults" / "main.yml"
    return yaml.safe_load(path.read_text()) or {} if path.exists() else {}


@pytest.mark.parametrize("role", ROLES)
def test_defaults_and_the_main_spec_declare_the_same_variables(role):
    declared = set(_spec(role)["main"]["options"])
    defaults = set(_defaults(role))
    assert sorted(defaults - declared) == [], f"{role}: defaults without a spec"
    own = {k for k in declared if k.startswith(role + "_")}
    inputs = {k for k, v in _spec(role)["main"]["options"].items() if v.get("required")}
    assert sorted(own - defaults - inputs) == [], f"{role}: spec options without a default"


def _entry_points():
    """(role, tasks_from) for every include_role/import_role with tasks_from in the repo."""
    found = set()
    files = [*REPO.glob("*.yml"), *REPO.glob("playbooks/*.yml"), *REPO.glob("roles/*/tasks/*.yml"),
             *REPO.glob("roles/*/handlers/*.yml"), *REPO.glob("molecule/*/*.yml")]
    for f in files:
        text = f.read_text()
        for m in re.finditer(r"name:\s*(dflash_\w+)\s*\n\s*tasks_from:\s*(\w+)", text):
            found.add((m.group(1), m.group(2)))
    return sorted(found)


def test_the_entry_points_are_found():
    assert ("dflash_service", "restart") in _entry_points() and ("dflash_node", "exists") in _entry_points()


@pytest.mark.parametrize("role, entry", _entry_points())
def test_every_tasks_from_entry_point_has_an_argument_spec(role, entry):
    spec = _spec(role)
    assert entry in spec, f"{role}: no argument_specs entry for tasks_from {entry}"
    assert spec[entry].get("short_description")


# variables a role reads that belong to another role or to the inventory
FOREIGN = re.compile(r"\b((?:dflash_(?:node|provision|service|trainer|weights)_\w+)|proxmox_vmid|proxmox_node)\b")


def _expressions(text: str) -> list:
    """What Ansible evaluates in a task file or template: {{ }} / {% %} and the conditions (when,
    that, failed_when, changed_when, until: one line, or their list items); not the prose of a msg."""
    out = re.findall(r"\{[{%](.*?)[%}]\}", text, re.S)
    cond = False
    for line in text.splitlines():
        m = re.match(r"^(\s*)(?:- )?(when|that|failed_when|changed_when|until):\s*(.*)$", line)
        if m:
            out.append(m.group(3))
            cond, indent = not m.group(3), len(m.group(1))
        elif cond and re.match(r"^\s*- ", line) and len(line) - len(line.lstrip()) >= indent:
            out.append(line)
        else:
            cond = False
    return out


@pytest.mark.parametrize("role", ROLES)
def test_variables_of_other_roles_that_a_role_reads_are_declared(role):
    declared = set()
    for entry in _spec(role).values():
        declared |= set(entry.get("options") or {})
    texts = [p.read_text() for p in (REPO / "roles" / role).rglob("*") if p.is_file() and p.suffix in (".yml", ".j2")
             and "meta" not in p.parts]
    used = {m.group(1) for t in texts for expr in _expressions(t) for m in FOREIGN.finditer(expr)}
    registered = {m.group(1) for t in texts for m in re.finditer(r"register:\s*(\w+)", t)}
    facts = {m.group(1) for t in texts for m in re.finditer(r"^\s{4,}(dflash_\w+):", t, re.M)}
    foreign = {v for v in used if not v.startswith(role + "_") and v not in registered | facts}
    assert sorted(foreign - declared) == [], f"{role} reads these without declaring them"
