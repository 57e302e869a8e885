"""The docs name only things that exist (issue 28): a removed command, role variable, test file or
code identifier named in README.md or docs/*.md fails here, naming the doc and the name.

What counts as a name, in backticks or bare: `dflash-*` commands and units, `dflash_*` variables,
paths into the repo (trainer/..., tests/..., roles/..., docs/..., ...), test files, and CamelCase or
dotted code identifiers (`EventWaiter`, `Trainer.shutdown`). A name exists when it occurs in the repo
outside the docs (code, roles, templates, tests, inventories); a path when the file or directory does.
The fault suite's results block of docs/reliability.md must list exactly the suite's cases.

Dotted Python names (issue 55), lowercase too: `trainer.a.b.name` and `module.name` (`drafter.build_drafter`),
in the current docs and in trainer/'s docstrings and comments, resolve in today's source (see
`_python_name_exists`); a bare `name.py` is a file the repo has.
"""

import ast
import io
import re
import subprocess
import sys
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCES = ("trainer", "roles", "tests", "molecule", "playbooks", "inventory", ".ci", "pyproject.toml",
           "ansible.cfg", "deploy.yml", "restart.yml")
# Names of other projects the docs cite (they are not ours to have).
EXTERNAL = {
    "ConnectionRefusedError", "OSError", "RuntimeError", "ValueError", "FileExistsError", "ModuleNotFoundError",
    "PyTorch", "FlexAttention", "TensorBoard", "DeepSpeed", "SpecForge", "TorchSpec", "AngelSlim", "ModelOpt",
    "Float8Linear", "Float8LinearConfig", "HuggingFace", "GitHub", "JavaScript", "ProxyJump", "IdentityFile",
    "LimitCORESoft", "LimitCORE", "TimeoutStartSec", "TimeoutStopSec", "TimeoutStopUSec", "WatchdogSec",
    "RestartSec", "StartLimitBurst", "StartLimitIntervalSec", "RestartPreventExitStatus", "KillMode",
    "ExecMainCode", "ExecMainStatus", "ActiveState", "SubState", "NRestarts", "MainPID", "LimitMEMLOCK",
}
# Names the docs may use that the repo does not hold, each with why.
ALLOWED = {
    "dflash-infra": "the repo's own name (README title)",
    "inventory/production/group_vars/dflash_containers/vault.yml": "the operator creates it (README, secrets)",
}
PATH_RE = re.compile(r"(?<![\w/.-])((?:trainer|tests|roles|docs|molecule|playbooks|inventory|results|\.ci)/[\w./-]*\w)")
COMMAND_RE = re.compile(r"(?<![\w/.-])(dflash-[a-z][a-z0-9-]*[a-z0-9])\b")
VARIABLE_RE = re.compile(r"(?<![\w/.-])(dflash_[a-z][a-z0-9_]*[a-z0-9])\b")
TEST_FILE_RE = re.compile(r"(?<![\w/.-])(test_[a-z0-9_]+\.py)\b")
IDENT_RE = re.compile(r"`([A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*(?:\.[a-z_][a-z0-9_]*)?|[A-Z][A-Za-z0-9]+\.[a-z_][a-z0-9_]+)(?:\(\))?`")


@lru_cache(maxsize=None)
def corpus() -> str:
    """Every tracked file outside the docs, as one text (what the names must occur in)."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", *SOURCES], capture_output=True, text=True).stdout.split()
    files += [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")]   # new, not yet tracked
    text = []
    for f in sorted(set(files) - {"tests/repo/test_docs.py"}):   # this file names the removed things on purpose
        p = REPO / f
        if p.is_file() and p.suffix not in (".json", ".safetensors", ".png"):
            try:
                text.append(p.read_text(errors="replace"))
            except OSError:
                pass
    return "\n".join(text)


def _names(doc: Path) -> dict[str, set[str]]:
    text = doc.read_text()
    return {"path": set(PATH_RE.findall(text)), "command": set(COMMAND_RE.findall(text)),
            "variable": set(VARIABLE_RE.findall(text)), "test file": set(TEST_FILE_RE.findall(text)),
            "identifier": set(IDENT_RE.findall(text))}


def _exists(kind: str, name: str) -> bool:
    if name in ALLOWED:
        return True
    if kind == "path":
        p = name.split("::")[0].rstrip(".")
        return (REPO / p).exists() or any(REPO.glob(p)) or p.startswith("results/")
    if kind == "test file":
        return any((REPO / "tests").rglob(name))
    if kind == "identifier":
        head = name.split(".")[0]
        attr = name.split(".")[1] if "." in name else None
        if head in EXTERNAL:
            return True
        src = corpus()
        if not re.search(rf"\b{re.escape(head)}\b", src):
            return False
        return attr is None or re.search(rf"\b(def|self\.|\.){re.escape(attr)}\b|\bdef {re.escape(attr)}\b", src) is not None
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", corpus()) is not None


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_name_in_the_doc_exists(doc):
    missing = [f"{kind} {name}" for kind, names in _names(doc).items() for name in sorted(names)
               if not _exists(kind, name)]
    assert not missing, f"{doc.relative_to(REPO)} names what the repo does not have: {missing}"


def test_the_checker_catches_removed_names(tmp_path):
    """The names the issue found stale are caught (the test must not pass on anything). `dflash-health`
    still occurs in the service role's task that removes the retired helper, so it counts as named."""
    for kind, name in (("command", "dflash-no-such-tool"), ("identifier", "EventWaiter"),
                       ("variable", "dflash_service_extra_args"), ("test file", "test_health_script.py"),
                       ("identifier", "Trainer.no_such_method"), ("path", "trainer/no_such_module.py")):
        assert not _exists(kind, name), name
    for kind, name in (("command", "dflash-status"), ("variable", "dflash_service_trainer_flags"),
                       ("test file", "test_faults.py"), ("path", "tests/faults/report.py")):
        assert _exists(kind, name), name


def test_reliability_results_block_lists_the_fault_suites_cases():
    r = subprocess.run([sys.executable, str(REPO / "tests" / "faults" / "report.py"), "--check",
                        str(REPO / "docs" / "reliability.md")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# Values, not only names (issue 42): a flag value or a list of choices the docs show in code (`--transport
# pair|world`, `--fp8 tensorwise`) must be one the command accepts. The archive is a dated record of past
# runs (its flags are those of their day), so it is left out.
CURRENT_DOCS = [d for d in DOCS if d.name != "performance-archive.md"]
CLIS = ("trainer.lab.bench.run", "trainer.serving.evaluate", "trainer.serving.regenerate", "trainer.serving.export", "trainer.data.prepare",
        "trainer.tools.tiny", "trainer.status.cli", "trainer.tools.streamcheck_cli",
        "trainer.lab.opreplay")
VALUE_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)[ =]([a-z0-9_][a-z0-9_.+,|-]*)")


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


@lru_cache(maxsize=None)
def flag_choices() -> dict[str, set[str]]:
    """Every flag with a fixed set of values, from the parsers themselves: dflash-train's from `TrainConfig`
    (`build_parser`), each other command's caught at its `parse_args`, and the bench's `--variants` (its
    `VARIANTS`, combined with ',' and '+'). A flag two commands share gets the union."""
    import argparse
    import importlib

    from trainer.config.options import build_parser
    parsers = [build_parser()]
    real = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    deferred = {n: sys.modules[n] for n in ("torchao",) if n in sys.modules}   # a main() defers it: put it back

    def catch(self, *a, **k):
        raise _Parser(self)
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = catch
    try:
        for name in CLIS:
            try:
                importlib.import_module(name).main(["--help"])
            except _Parser as got:
                parsers.append(got.parser)
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real
        for n in ("torchao",):
            sys.modules.pop(n, None)
            if n in deferred:
                sys.modules[n] = deferred[n]
    out: dict[str, set[str]] = {}
    for p in parsers:
        for action in p._actions:
            if action.choices and not isinstance(action.choices, dict):     # dict: subcommands
                for opt in action.option_strings:
                    out.setdefault(opt, set()).update(str(c) for c in action.choices)
    from trainer.lab.bench.run import VARIANTS
    out["--variants"] = set(VARIANTS)
    return out


def _code(text: str) -> list[str]:
    """The doc's code: inline spans and the lines of fenced blocks."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return spans + [ln for block in re.findall(r"```.*?\n(.*?)```", text, flags=re.S) for ln in block.splitlines()]


def _bad_values(text: str) -> list[str]:
    choices, bad = flag_choices(), []
    for snippet in _code(text):
        for flag, value in VALUE_RE.findall(snippet):
            if flag not in choices:
                continue
            parts = re.split(r"[,+]", value) if flag == "--variants" else value.split("|")
            bad += [f"{flag} {value}" for v in parts if v and v not in choices[flag]]
    return bad


@pytest.mark.parametrize("doc", CURRENT_DOCS, ids=[str(d.relative_to(REPO)) for d in CURRENT_DOCS])
def test_flag_values_in_the_doc_are_accepted_by_the_code(doc):
    bad = sorted(set(_bad_values(doc.read_text())))
    assert not bad, f"{doc.relative_to(REPO)} shows values the code does not accept: {bad}"


def test_the_value_check_catches_the_stale_ones():
    """The values issue 42 found stale fail here; today's pass."""
    assert _bad_values("`--transport auto|peer|pinned`") == ["--transport auto|peer|pinned"] * 3
    assert _bad_values("```\npython -m trainer.lab.bench --variants pinned+flash\n```") == ["--variants pinned+flash"]
    assert _bad_values("`--transport pair|world`, `--fp8 tensorwise`, `--kv-fp8 on`, `--variants base,fp8`") == []


SECTION_RE = re.compile(r"((?:docs/)[\w.-]+\.md|README\.md)`?,?\s+\"([^\"\n]{2,80})\"")


def test_every_cited_doc_section_exists():
    """`docs/x.md, "Section"` anywhere in the repo (docs, code comments, tests) names a heading of that doc."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True).stdout.split()
    files += [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")]
    missing = []
    for f in sorted(set(files)):
        p = REPO / f
        if f.startswith("results/") or f == "tests/repo/test_docs.py" or p.suffix not in (".md", ".py", ".sh", ".yml", ".j2", "") or not p.is_file():
            continue
        for doc, section in SECTION_RE.findall(p.read_text(errors="replace")):
            target = REPO / doc
            heads = [h.lstrip("#").strip().replace("`", "") for h in target.read_text().splitlines()
                     if re.match(r"#{1,6} ", h)] if target.is_file() else []
            if not any(section.replace("`", "") in h for h in heads):
                missing.append(f"{f}: {doc}, \"{section}\"")
    assert not missing, missing


def test_the_torch_the_package_asks_for_is_the_torch_the_role_and_the_suite_install():
    """pyproject's torch floor, the role's pin and setup-host's torch name one release (was torch>=2.4)."""
    floor = re.search(r'"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    pin = re.search(r"^torch==([\d.]+)", (REPO / "roles/dflash_trainer/files/constraints.txt").read_text(), re.M).group(1)
    host = re.search(r"^TORCH_VERSION=([\d.]+)", (REPO / "tests/setup-host.sh").read_text(), re.M).group(1)
    assert pin == host and pin.startswith(floor + "."), (floor, pin, host)


# Dotted Python names (issue 55): nine lowercase module names went stale in the renames, because the checks
# above see paths and CamelCase only. A name counts as ours when its head is `trainer` or the name of a
# trainer module or wing, today's or one that git history shows was one (`fast`, `warmup`): those of an old
# module fail. The rest must resolve in today's source, read with ast (nothing is imported): submodules, then
# a module's top-level names (defs, classes, assignments, imports), then a class's members and `self.`
# attributes. `report.paused_s` names an attribute of the module's object (a Reporter); any class of the
# module may hold it. A wing's head with a lowercase non-module attribute (`config.layer_types`,
# `model.visual`) is left alone: those are Hugging Face objects far more often than our packages.
NOT_OURS = {"dist": "torch.distributed's usual alias (the old trainer/dist.py is gone)"}
FILE_SUFFIXES = {"py", "json", "jsonl", "md", "yml", "yaml", "sh", "txt", "gz", "log", "j2", "toml", "cfg",
                 "service", "pt", "bin", "safetensors", "html", "csv", "png", "ini", "conf", "tar", "pid", "npy"}
DOTTED_RE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
PY_FILE_RE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*\.py)\b")
# Files of other projects the docs and comments cite by name.
EXTERNAL_FILES = {"flex_decoding.py": "torch's FlexAttention decoding kernel",
                  "modeling_qwen3.py": "transformers' Qwen3", "modeling_qwen3_5.py": "transformers' Qwen3.5",
                  "cumsum.py": "fla's gate cumsum", "setup.py": "a Python package's", "conftest.py": "pytest's"}


@lru_cache(maxsize=None)
def _modules() -> dict[str, list[Path]]:
    """Today's trainer modules and wings by their last name (a wing by its __init__.py)."""
    out: dict[str, list[Path]] = {}
    for p in sorted((REPO / "trainer").rglob("*.py")):
        if p.name == "__init__.py":
            out.setdefault(p.parent.name, []).append(p)
        elif p.name != "__main__.py":
            out.setdefault(p.stem, []).append(p)
    return out


@lru_cache(maxsize=None)
def _old_modules() -> frozenset[str]:
    """Every trainer module or wing name git history has seen (a renamed module's old name among them)."""
    files = subprocess.run(["git", "-C", str(REPO), "log", "--name-only", "--format=", "--", "trainer"],
                           capture_output=True, text=True).stdout.split()
    names = {Path(f).stem for f in files if f.endswith(".py")} | {Path(f).parent.name for f in files if f.endswith("/__init__.py")}
    return frozenset(names - {"__init__", "__main__"})


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _defined(body: list) -> dict[str, ast.AST | None]:
    """The names a block defines, through if/try/with (a guarded import defines its name too)."""
    out: dict[str, ast.AST | None] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out.update({e.id: None for e in ast.walk(target) if isinstance(e, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            for block in (node.body, node.orelse if hasattr(node, "orelse") else [], getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                out.update(_defined(block))
    return out


def _members(cls: ast.ClassDef) -> dict[str, ast.AST | None]:
    out = _defined(cls.body)
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.setdefault(node.attr, None)
    return out


def _resolves(path: Path, parts: list[str], wing_head: bool = False) -> bool:
    if not parts:
        return True
    if path.name == "__init__.py":
        pkg, head = path.parent, parts[0]
        if (pkg / head / "__init__.py").is_file():
            return _resolves(pkg / head / "__init__.py", parts[1:])
        if (pkg / f"{head}.py").is_file():
            return _resolves(pkg / f"{head}.py", parts[1:])
    tree = _tree(path)
    scope = _defined(tree.body)
    if parts[0] not in scope:
        # an attribute of the module's objects (`report.paused_s`, `feed.position`)
        return len(parts) == 1 and any(parts[0] in _members(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef))
    for name in parts:
        if name not in scope:
            return False
        if not isinstance(scope[name], ast.ClassDef):
            return True          # a function's, an import's or a value's attributes are not followed
        scope = _members(scope[name])
    return True


@lru_cache(maxsize=None)
def _logger_names() -> frozenset[str]:
    """The loggers trainer/ names (`trainer.checkpoint` in a journal line is a logger, not a module)."""
    return frozenset(re.findall(r"getLogger\(\s*[\"']([\w.]+)[\"']", "\n".join(
        p.read_text() for p in (REPO / "trainer").rglob("*.py"))))


def _python_name_exists(name: str) -> bool | None:
    """True or False for a dotted name of ours; None for one that is not ours (`torch.compile`, a file name)."""
    parts = name.split(".")
    head, rest = parts[0], parts[1:]
    if rest[-1] in FILE_SUFFIXES or head in NOT_OURS:
        return None
    if name in _logger_names():
        return True
    if head == "trainer":
        return _resolves(REPO / "trainer" / "__init__.py", rest)
    modules = _modules()
    if head in modules:
        paths = modules[head]
        if all(p.name == "__init__.py" for p in paths):                 # a wing: config.x, model.x
            sub = [p for p in paths if (p.parent / rest[0] / "__init__.py").is_file() or (p.parent / f"{rest[0]}.py").is_file()]
            if not sub and not rest[0][0].isupper():
                return None
        return any(_resolves(p, rest) for p in paths)
    if head in _old_modules():
        return False
    return None


@lru_cache(maxsize=None)
def _repo_file_names() -> frozenset[str]:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True).stdout.split()      # a new file counts before its commit
    return frozenset(Path(f).name for f in files)


def _stale_python_names(text: str) -> list[str]:
    bad = [n for n in sorted(set(DOTTED_RE.findall(text))) if _python_name_exists(n) is False]
    return bad + [n for n in sorted(set(PY_FILE_RE.findall(text))) if n not in _repo_file_names() and n not in EXTERNAL_FILES]


def _prose(path: Path) -> list[tuple[int, str]]:
    """A Python file's comments and docstrings (every string that stands alone as a statement), by line."""
    text = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    out += [(n.lineno, n.value.value) for n in ast.walk(_tree(path))
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
    return out


@pytest.mark.parametrize("doc", CURRENT_DOCS, ids=[str(d.relative_to(REPO)) for d in CURRENT_DOCS])
def test_every_dotted_python_name_in_the_doc_resolves(doc):
    stale = _stale_python_names(doc.read_text())
    assert not stale, f"{doc.relative_to(REPO)} names Python that today's source does not have: {stale}"


def test_every_dotted_python_name_in_trainer_docstrings_and_comments_resolves():
    stale = [f"{path.relative_to(REPO)}:{line}: {name}" for path in sorted((REPO / "trainer").rglob("*.py"))
             for line, text in _prose(path) for name in _stale_python_names(text)]
    assert not stale, f"trainer/ names Python that today's source does not have: {stale}"


def test_the_python_name_check_catches_stale_names():
    """Made-up and renamed names fail; today's names, other projects' and file names pass."""
    for name in ("drafter.no_such_function", "fast.no_new_graphs", "trainer.engine.checkpoint.no_such_name",
                 "trainer.no_such_wing.x", "warmup.run", "model.PackedMetaOld", "checkpoint.Checkpointer.no_such_method",
                 "warmup.py", "ckpt_format.py"):
        assert _stale_python_names(f"see `{name}` and") == [name], name
    fine = ("trainer.engine.checkpoint.Checkpointer", "drafter_stage.build_drafter", "trainer.lab.bench",
            "compiling.no_new_graphs", "report.paused_s", "checkpoint.Checkpointer.save", "torch.compile",
            "config.layer_types", "dist.send", "status.json", "train_state.py", "flex_decoding.py",
            "trainer.checkpoint")
    assert _stale_python_names(" ".join(f"`{n}`," for n in fine)) == []


def test_the_performance_archive_index_links_every_section():
    """docs/performance-archive.md opens with an index by topic and date: each link names a section the
    notebook has (GitHub's heading anchors), and each top-level section is linked from a row, so that a
    section appended at the end gets its row too."""
    text = (REPO / "docs" / "performance-archive.md").read_text()
    body, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("## ") and line != "## " + INDEX_HEADING:
            body.append(line[3:])
    slug = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-"): h for h in body}
    index = text.split("## " + INDEX_HEADING, 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", index)
    assert sorted(set(links) - set(slug)) == [], "index links to no section"
    assert sorted(slug[s] for s in set(slug) - set(links)) == [], "sections without a row in the index"


INDEX_HEADING = "Index (by topic; the dates are those of the sections' runs and writing)"
