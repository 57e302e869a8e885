"""docs/contracts.md's tables of facts the code holds, rendered from the code so they cannot go
stale.

* status fields: what status.json reports, from trainer/status/schema.py's ``STATUS_SCHEMA``;
* dflash-train flags: every flag of the trainer's command line, from ``TrainConfig``'s fields through the
  option system (``cli_fields()``, ``flag_of()`` and each field's ``opt()`` metadata: help, default, choices,
  range, group), one table per group. Taken from trainer.config.options; a
  field marked hidden, or in the group "measurement" (flags for A/B measurements only), is left out.

Each table sits in docs/contracts.md between ``<!-- generated: NAME ... -->`` and ``<!-- end generated: NAME -->``;
the prose around them is written by hand.

    .venv/bin/python trainer/lab/contracts_tables.py --write    # render the tables into docs/contracts.md
    .venv/bin/python trainer/lab/contracts_tables.py --check    # exit 1 when docs/contracts.md is not the rendering

tests/lab/test_contracts_tables.py runs the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DOC = REPO / "docs" / "contracts.md"
COMMAND = ".venv/bin/python trainer/lab/contracts_tables.py --write"
HIDDEN_GROUPS = ("measurement",)
BLOCK_RE = re.compile(r"(<!-- generated: (?P<name>[\w .-]+?) \(.*?\) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)",
                      re.S)


def _cell(text: Any) -> str:
    """Text for one table cell: one line, pipes escaped (also inside code spans, as GitHub's tables need)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    return f"`{text}`"


# ------------------------------------------------------------------------------ status.json


def status_table() -> str:
    from trainer.status import PHASES, STATUS_SCHEMA
    lines = [
        "Rendered from trainer/status/schema.py's `STATUS_SCHEMA` (a `StatusWriter` refuses, under the tests, a key it "
        "does not declare). Present: *always* = in the file from the first write on (null until known); "
        "*once written* = absent before that.",
        "",
        "| field | present | written in phases | meaning |",
        "|---|---|---|---|",
    ]
    for f in STATUS_SCHEMA:
        phases = "every write" if set(f.phases) == set(PHASES) else ", ".join(_code(p) for p in f.phases)
        lines.append(f"| {_code(f.name)} | {'always' if f.always else 'once written'} | {phases} | {_cell(f.meaning)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ dflash-train flags


def option_module():
    """The option system (trainer/config/options.py)."""
    return importlib.import_module("trainer.config.options")


def _number(x: Any) -> str:
    return format(x, "g") if isinstance(x, float) else str(x)


def _default(f: dataclasses.Field, kind: str) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if kind == "bool":
        text = "on" if value else "off"
    elif kind == "gpus" and not value:
        text = _code("cpu")                    # no GPU ids: the run is on the CPU
    elif value in ("", None, []):
        text = "—"
    else:
        text = _code(",".join(map(str, value)) if isinstance(value, (list, tuple)) else _number(value))
    env = f.metadata.get("env")
    return f"{_code('$' + env)}, else {text}" if env else text


def _values(f: dataclasses.Field, kind: str) -> str:
    md = f.metadata
    if md.get("choices"):
        return " \\| ".join(_code(c) for c in md["choices"])
    words = {"bool": "switch", "int": "integer", "float": "number", "gpus": "GPU ids (`0,1,2`) or `cpu`",
             "ints": "integers, comma-separated"}
    text = words.get(kind) or ("path" if f.name.endswith(("_dir", "_model", "_file")) else "text")
    rng = [f">= {_number(md['ge'])}" if md.get("ge") is not None else "",
           f"> {_number(md['gt'])}" if md.get("gt") is not None else "",
           f"< {_number(md['lt'])}" if md.get("lt") is not None else ""]
    rng = " and ".join(r for r in rng if r)
    return f"{text}, {rng}" if rng else text


def _parser_flags(mod) -> dict[str, tuple[list[str], bool]]:
    """dest -> (option strings, hidden from --help), from the module's own parser where it has one."""
    build = getattr(mod, "build_parser", None)
    if build is None:
        return {}
    return {a.dest: (list(a.option_strings), a.help == argparse.SUPPRESS) for a in build()._actions
            if a.option_strings}


def train_flags():
    """(the option module, group -> its listed fields in order, the flags left out)."""
    mod = option_module()
    groups: dict[str, list[dataclasses.Field]] = {}
    left_out = []
    parsed = _parser_flags(mod)
    for f in mod.cli_fields():
        group = f.metadata.get("group", "operations")
        if group in HIDDEN_GROUPS or f.metadata.get("hidden") or parsed.get(f.name, ([], False))[1]:
            left_out.append(mod.flag_of(f))
            continue
        groups.setdefault(group, []).append(f)
    return mod, groups, left_out


def flag_table() -> str:
    mod, groups, left_out = train_flags()
    parsed = _parser_flags(mod)
    path = mod.__name__.replace(".", "/") + ".py"
    count = sum(len(v) for v in groups.values())
    lines = [f"Rendered from `TrainConfig`'s fields through {path}'s `cli_fields()`: {count} flags in "
             f"{len(groups)} groups, as `dflash-train --help` groups them."]
    if left_out:
        lines[0] += (f" Left out: {len(left_out)} flags for A/B measurements only (group "
                     f"{' / '.join(HIDDEN_GROUPS)}, or marked hidden).")
    for group, fields in groups.items():
        lines += ["", f"**{_cell(group)}**", "", "| flag | default | values | meaning |", "|---|---|---|---|"]
        for f in fields:
            kind = option_module()._kind(f)   # how the parser reads the field: the option system's rule
            flags = parsed.get(f.name, ([], False))[0] or (   # no parser to ask: a switch has both forms
                [mod.flag_of(f), "--no-" + mod.flag_of(f)[2:]] if kind == "bool" else [mod.flag_of(f)])
            lines.append(f"| {', '.join(_code(x) for x in flags)} | {_default(f, kind)} | {_values(f, kind)} "
                         f"| {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ the doc

TABLES = {"status fields": status_table, "dflash-train flags": flag_table}


def render(text: str) -> str:
    """``text`` with every generated block re-rendered; a table with no block, or a block no table renders, raises."""
    seen = set()

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise ValueError(f"docs/contracts.md: a generated block named {name!r}: no such table ({sorted(TABLES)})")
        seen.add(name)
        return m.group(1) + TABLES[name]() + m.group(4)

    out = BLOCK_RE.sub(sub, text)
    missing = sorted(set(TABLES) - seen)
    if missing:
        raise ValueError(f"docs/contracts.md has no block for {missing}: add "
                         + ", ".join(f"'<!-- generated: {n} ({COMMAND}) -->' ... '<!-- end generated: {n} -->'"
                                     for n in missing))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="render the tables into docs/contracts.md")
    g.add_argument("--check", action="store_true", help="exit 1 when docs/contracts.md is not the rendering")
    a = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if a.write:
        if new != text:
            DOC.write_text(new)
            print("docs/contracts.md: tables rendered")
        return 0
    if new != text:
        print(f"docs/contracts.md's generated tables are stale: run {COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
