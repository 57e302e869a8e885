"""The docs name only things that exist (issue 28): a removed command, role variable, test file or
code identifier named in README.md or docs/*.md fails here, naming the doc and the name.

What counts as a name, in backticks or bare: `dflash-*` commands and units, `dflash_*` variables,
paths into the repo (trainer/..., tests/..., roles/..., docs/..., ...), test files, and CamelCase or
dotted code identifiers (`EventWaiter`, `Trainer.shutdown`). A name exists when it occurs in the repo
outside the docs (code, roles, templates, tests, inventories); a path when the file or directory does.
The fault suite's results block of docs/reliability.md must list exactly the suite's cases.
"""

import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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
    files += [str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")]   # new, not yet tracked
    text = []
    for f in sorted(set(files) - {"tests/test_docs.py"}):   # this file names the removed things on purpose
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
