"""The package's layout (issue 42): trainer/ in wings along its real boundaries, read from the code's own
imports (every `import`, at module level or inside a function):

- serving (export, eval, regenerate and their generation loops) never imports the training engine or the
  tools, so what a serving user runs cannot grow a dependency on the training job;
- the lab (the team's instruments: bench, GPU scripts, probes, doc generators) is left out of the wheel, and
  nothing outside it imports it, so the production install carries only what production runs;
- no import circle between modules, and no pair of wings importing each other;
- the model wing stands on ops and the top floor alone (no flags, no process groups, no stage);
- the status wing (status.json, sd_notify, dflash-status) stands on the top floor alone, one job per module;
- the top floor holds only the entry points and the few facts every wing shares;
- tests/ is grouped the same way: one folder per wing it tests, and a few for the rest of the repo.
"""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
WINGS = {"config", "data", "distributed", "engine", "lab", "model", "ops", "serving", "status", "tools"}
TOP = {"__init__", "__main__", "cli", "errors", "fsutil", "optional", "procs"}


def modules() -> dict[str, Path]:
    out = {}
    for p in TRAINER.rglob("*.py"):
        rel = p.relative_to(TRAINER.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The trainer modules `name` imports (absolute or relative; `from pkg import mod` counts as mod)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.split(".")[0] == "trainer"}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "trainer":
                continue
            for a in n.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_the_top_floor_holds_only_entry_points_and_shared_facts():
    top = {p.stem for p in TRAINER.glob("*.py")}
    dirs = {p.name for p in TRAINER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == TOP, f"modules on the top floor: {sorted(top - TOP)} (put them in a wing: {sorted(WINGS)})"
    assert dirs == WINGS


def test_serving_never_imports_the_engine_or_the_tools():
    g = graph()
    bad = {m: sorted(d for d in deps if d.startswith(("trainer.engine", "trainer.tools", "trainer.lab")))
           for m, deps in g.items() if m.startswith("trainer.serving")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_there_is_no_import_circle():
    g = graph()
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    circles = [sorted(c) for c in sccs if len(c) > 1]
    # a package's __init__ importing nothing of its own keeps these empty
    assert not circles, circles


def wing(m: str) -> str:
    parts = m.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "top"


def wing_edges() -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(importing wing, imported wing) -> the module pairs behind that arrow."""
    edges = {}
    for a, deps in graph().items():
        for d in deps:
            if wing(a) != wing(d):
                edges.setdefault((wing(a), wing(d)), set()).add((a, d))
    return edges


def test_no_pair_of_wings_imports_each_other():
    """Wings form layers: the lab, tools and the engine on top, then serving, config, data, model, distributed,
    ops, status.
    No arrow runs back up (issue 55: the last one, model -> config for the --draft-layer-types rule and the
    slow-kernel message, went when those facts moved into the model wing)."""
    edges = wing_edges()
    # the top floor (entry points, and errors/fsutil/optional/procs that every wing may use) is not a wing
    both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b and "top" not in (a, b))
    assert both == [], {p: (edges[p], edges[p[::-1]]) for p in both}


def test_the_model_wing_stands_on_ops_and_the_top_floor_alone():
    """model/ (the drafter, the checkpoint format, what we know of targets) imports no flags (config), no
    process groups or transport (distributed), no stage or loop (engine), nor anything above them: a rank's
    stage lives in the engine beside its twin (engine/target_stage.py, engine/drafter_stage.py), and a fact
    the flags need about a model lives in the model wing, the flags importing it."""
    allowed = {"model", "ops", "top"}
    bad = sorted(pair for (a, b), pairs in wing_edges().items() if a == "model" and b not in allowed
                 for pair in pairs)
    assert not bad, bad


def test_the_status_wing_stands_on_the_top_floor_alone_one_job_per_module():
    """status/ is imported by every wing that reports (engine, distributed, config, the entry points), so it
    imports none of them; and its modules keep one job each: the schema and the notify protocol import no
    other room, the writer no health or CLI, and nothing but the CLI's own entry points imports the CLI
    (the checkpoint format once imported the CLI module for pid_alive)."""
    g = graph()
    bad = sorted((a, b) for (a, b), pairs in wing_edges().items() if a == "status" and b != "top")
    assert not bad, bad
    rooms = {m: {d for d in deps if d.startswith("trainer.status.")} for m, deps in g.items()
             if m.startswith("trainer.status.")}
    assert rooms["trainer.status.schema"] == rooms["trainer.status.notify"] == set()
    assert rooms["trainer.status.writer"] <= {"trainer.status.schema", "trainer.status.notify"}
    users = sorted(m for m, deps in g.items() if "trainer.status.cli" in deps)
    assert users == ["trainer.status.__main__"], users
    assert '_run("trainer.status.cli"' in (TRAINER / "cli.py").read_text()   # the console script, by name


def _found_packages() -> set[str]:
    """The packages pyproject's package discovery puts in the wheel."""
    import tomllib

    from setuptools import find_packages
    cfg = tomllib.loads((TRAINER.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return set(find_packages(where=str(TRAINER.parent), include=cfg["include"], exclude=cfg.get("exclude", ())))


def test_the_package_build_ships_every_wing_but_the_lab():
    """pyproject's package discovery finds every shipped subpackage (`packages = ["trainer"]` shipped the top
    floor alone, and the role's install of the trainer in the container would have lost the wings), a package
    inside a wing too; and no package of the lab."""
    found = _found_packages()
    shipped = {"trainer"} | {f"trainer.{w}" for w in WINGS - {"lab"}}
    assert shipped <= found, found
    # and every room inside a wing that is a package of its own (serving/captured/), the lab's left out
    on_disk = {".".join(p.parent.relative_to(TRAINER.parent).parts) for p in TRAINER.rglob("__init__.py")}
    lab = {p for p in on_disk if p == "trainer.lab" or p.startswith("trainer.lab.")}
    assert lab >= {"trainer.lab", "trainer.lab.bench", "trainer.lab.gpu"}, lab
    assert found == on_disk - lab, sorted(on_disk ^ found)


def test_nothing_shipped_imports_the_lab():
    """The wheel leaves trainer/lab/ out, so a shipped module that imported it (at module level or inside a
    function) would fail in the production container: every import of the lab comes from the lab."""
    bad = sorted((m, d) for m, deps in graph().items() if not m.startswith("trainer.lab")
                 for d in deps if d.startswith("trainer.lab"))
    assert not bad, bad



def test_code_says_why_not_which_ticket():
    """A comment or docstring in trainer/ gives the reason, not an issue number ("issue 29" means nothing to
    the next maintainer; the commit body is where a ticket belongs). A peer's pull request cited as a source
    (speculators' #980) is a citation, not a ticket of ours, and stays."""
    import re
    ticket = re.compile(r"\b[Ii]ssues? \d+")
    bad = [f"{p.relative_to(TRAINER.parent)}:{i}" for p in sorted(TRAINER.rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if ticket.search(line)]
    assert not bad, bad


# Guards for what has held. A module over 800 lines has more than one job; a function that keeps growing
# (streamcheck.simulate went 134, 176, 194 lines over three rounds) wants its steps named. Today's longest
# and widest are listed at their size: each may shrink, none may grow, and a new one stays under the ceiling.
MODULE_LINES = 800
FUNCTION_LINES = 100
FUNCTION_PARAMS = 12
LONG_FUNCTIONS = {   # module stem.qualified name: its lines today
    "streamcheck.simulate": 194, "regenerate_bench.main": 185, "regenerate.regenerate": 150,
    "regenerate_bench.attention_check": 142, "oprecord.install": 134, "plan.plan_micro_batch": 126,
    "eval_bench.main": 126, "fp8_parity.main": 125, "run.main": 111, "launch.launch": 101,
}
WIDE_FUNCTIONS = {   # module stem.qualified name: its parameters today (self and cls not counted)
    "decode_attn._decode_attention_split_kv": 36,   # a Triton kernel: every stride is a parameter
    "regenerate_decoder.GraphDecoder.__init__": 21, "plan.plan_micro_batch": 19, "loss.dflash_loss": 14,
    "evaluate.evaluate_checkpoint": 14, "evaluate.evaluate_state": 14, "evaluate.evaluate": 13, "options.opt": 13,
}


def functions() -> dict[str, tuple[int, int]]:
    """'module stem.qualified name' -> (lines, parameters) of every function in trainer/ (the stem, not the
    path: a move between wings keeps the key)."""
    out = {}
    for path in TRAINER.rglob("*.py"):
        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        a = child.args
                        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                        if params and params[0].arg in ("self", "cls"):
                            params = params[1:]
                        key = name if name not in out else f"{path.relative_to(TRAINER)}:{name}"
                        out[key] = (child.end_lineno - child.lineno + 1, len(params))
                    visit(child, name)
                else:   # under an `if` or `try` (a kernel defined only where Triton imports)
                    visit(child, prefix)
        visit(ast.parse(path.read_text()), path.stem)
    return out


def test_no_module_is_over_800_lines():
    big = {str(p.relative_to(TRAINER.parent)): n for p in TRAINER.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert not big, f"modules over {MODULE_LINES} lines (split them by job): {big}"


def test_the_longest_and_widest_functions_do_not_grow():
    fns = functions()
    for listed, ceiling, what in ((LONG_FUNCTIONS, FUNCTION_LINES, 0), (WIDE_FUNCTIONS, FUNCTION_PARAMS, 1)):
        gone = sorted(set(listed) - set(fns))
        assert not gone, f"listed but not found (renamed? update the list): {gone}"
        over = {k: v[what] for k, v in fns.items() if v[what] > listed.get(k, ceiling)}
        assert not over, (f"{'lines' if what == 0 else 'parameters'} over the ceiling ({ceiling}; a listed "
                          f"function: its size today): {over}")


# The tests' folders: one per wing of trainer/ it tests, and those for the rest of the repo
TEST_FOLDERS = WINGS | {"ansible", "chain", "faults", "pve", "repo"}


def test_every_test_lives_in_the_folder_of_what_it_tests():
    """tests/ is grouped as the code is: a test file at the top, or in a folder that names no wing of
    trainer/ (nor the Ansible side, the fault suite, the PVE stand-in, the whole chain or the repo), has no
    home; each folder is a package, so a test imports another's helpers by its package path."""
    tests = TRAINER.parent / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert loose == [], f"tests/ holds test files at its top; move each into its wing's folder: {loose}"
    for p in tests.rglob("test_*.py"):
        folder = p.parent.relative_to(tests).parts[0]
        if folder == "standin":
            continue
        assert folder in TEST_FOLDERS, f"{p.relative_to(tests)}: tests/{folder}/ names no wing of trainer/"
        assert (p.parent / "__init__.py").is_file(), f"tests/{folder}/ is not a package (no __init__.py)"
