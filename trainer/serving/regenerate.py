"""dflash-regenerate: the target writes the completions, so the drafter learns the text it will verify.

    dflash-regenerate --target-model DIR (--data-dir DIR | --input FILE.jsonl ...) --output-dir DIR
                      [--device cpu|cuda:N | --devices cuda:0,cuda:1] [--batch-size 32]
                      [--max-new-tokens 1024] [--temperature 0] [--seed 0] [--samples-per-prompt 1]
                      [--shard-size 10000]
                      [--max-records N] [--decoder auto|generate|captured] [--fuse auto|on|off]
                      [--decode-attention auto|sdpa|triton] [--kv-fp8 on|off]

Prompts: with --data-dir (shards as dflash-prepare writes them) each record's tokens before its first
supervised token, as dflash-eval takes them (`evaluate.heldout_prompts`); with --input, JSONL that
dflash-prepare accepts, rendered by dflash-prepare's own code (chat template), the same prompt then, or
prompt-only JSONL (messages without an assistant turn, or a "prompt" alone): the turns rendered with the
template's generation prompt. Records without a prompt (supervised from the first token) are skipped. Only the first assistant turn
is regenerated: later turns answered a reply the target did not write.

The target generates each prompt's completion with transformers' `generate` (left padding, attention mask,
KV cache), greedy by default (--temperature T > 0 samples from softmax(logits / T), no top-k or top-p, seeded
per shard; --samples-per-prompt N > 1 writes N sampled completions of each prompt, as N records side by side),
until one of its EOS ids (kept, and supervised, like the end-of-turn token of dflash-prepare) or
--max-new-tokens. On GPUs (--decoder auto) the same tokens come from dflash's own decode loop instead
(captured/regenerate_decoder.py: one preallocated KV cache, the decode step captured as CUDA graphs, its small
ops compiled with --fuse, its attention a split-KV Triton kernel with --decode-attention); use a large
--batch-size there (256 on an 8B target, 128 on a 27B one); --devices runs one worker process per device,
each taking the next unfinished shard. Output: dflash-prepare's shard format (trainer/data/dataset.py) with
the loss mask on the generated tokens only, and index.json's "regenerated" key recording what wrote it.

Resumable: output shard k holds the prompts k*S..(k+1)*S-1; each is written atomically and then
recorded in OUTDIR/regenerate.json (the configuration and the finished shards). A rerun with the same
configuration after a crash or kill -9 keeps the finished shards (their sha256 checked) and generates
the rest; the result is the same bytes as an uninterrupted run (same devices). A different
configuration in the same OUTDIR is refused, and so is an OUTDIR that holds anything else.

Exit codes: 0 written (or already complete), 2 bad input (one line on stderr naming it).
Python: `regenerate(RegenerateConfig(target_model=..., output_dir=..., data_dir=..., ...)) -> dict` (the
options are the command line's fields); `regenerate(data_dir, target_model, out_dir, batch_size=..., ...)` too.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from trainer.config.options import ConfigError, check_ranges, opt, parse_options
from trainer.data.dataset import (
    DEFAULT_SHARD_SIZE,
    INDEX_NAME,
    SHARD_PATTERN,
    DataError,
    load_dataset,
    read_index,
    sha256_file,
    write_index,
    write_shard,
)
from trainer.fsutil import atomic_write_text

PROG = "dflash-regenerate"
MANIFEST_NAME = "regenerate.json"
MANIFEST_FORMAT = "dflash-regenerate-v1"
LOCK_NAME = ".regenerate.lock"


class RegenerateError(ValueError):
    """Bad input or a conflicting output directory; the message names it."""


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Prompts


def prompts_from_records(dataset) -> list[np.ndarray]:
    """Every record's prompt (tokens before its first supervised token), as dflash-eval takes them."""
    from trainer.serving.evaluate import heldout_prompts

    return heldout_prompts(dataset, len(dataset))


def load_prompts(data_dir, inputs: Sequence[Path], target: Path, log) -> tuple[list[np.ndarray], dict, int]:
    """(prompts, source description for the configuration, number of records) from a shard dir or
    JSONL files."""
    if data_dir is not None:
        try:
            ds = load_dataset(data_dir)   # reads and checks the index once; ds.index is it
        except DataError as e:
            raise RegenerateError(f"--data-dir {data_dir}: {e}") from None
        source = {"data_dir": str(Path(data_dir).absolute()), "hash": ds.index["hash"]}
        return prompts_from_records(ds), source, len(ds)
    # JSONL: dflash-prepare's parser and chat-template rendering, records kept in memory
    from transformers import AutoTokenizer

    from trainer.data.prepare import Encoder, PrepareError, iter_prompts

    for p in inputs:
        if not p.is_file():
            raise RegenerateError(f"--input {p}: no such file")
    try:
        tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a missing tokenizer
        raise RegenerateError(f"--target-model {target}: cannot load tokenizer: {e}") from None
    try:
        prompts = list(iter_prompts(Encoder(tok), list(inputs), log=log))
    except PrepareError as e:
        raise RegenerateError(str(e)) from None
    source = {"inputs": [{"path": str(p.absolute()), "sha256": sha256_file(p)} for p in inputs]}
    return prompts, source, len(prompts)


# --------------------------------------------------------------------------------------------
# Generation (one device, one model replica)


STATIC_PAD = 64   # --static-cache: prompt widths rounded up to this (few distinct compiled shapes)
DECODERS = ("generate", "captured")
DECODE_ATTENTIONS = ("sdpa", "triton")   # the captured decoder's decode attention (--decode-attention)


@dataclass(frozen=True)
class GenerationSettings:
    """A device's TargetGenerator(target, device, **asdict(settings)), switches resolved (resolve_switches)."""
    max_new_tokens: int
    temperature: float
    batch_size: int
    static_cache: bool = False
    decoder: str = "generate"
    fuse: bool = False
    decode_attention: str = "sdpa"
    kv_fp8: bool = False


class TargetGenerator:
    """The target on one device; `complete(prompts, seed)` returns each prompt's generated tokens."""

    def __init__(self, target_model: str, device: str, max_new_tokens: int, temperature: float,
                 batch_size: int, static_cache: bool = False, decoder: str = "generate", fuse: bool = False,
                 decode_attention: str = "sdpa", kv_fp8: bool = False):
        import torch

        from trainer.model.target import load_target
        from trainer.serving.evaluate import stop_token_ids

        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # a path, or a model already on `device` (the benchmark's random-init target)
        self.model = (target_model if isinstance(target_model, torch.nn.Module)
                      else load_target(target_model, self.device, dtype))
        self.stop_ids = stop_token_ids(self.model)
        gc, cfg = self.model.generation_config, self.model.config
        pad = gc.pad_token_id if gc.pad_token_id is not None else cfg.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.stop_ids or [0])[0])
        self.max_new_tokens, self.temperature, self.batch_size = max_new_tokens, temperature, batch_size
        # static KV cache: transformers compiles the decode step on GPUs (fixed shapes, CUDA graphs);
        # prompt widths are padded to a multiple of STATIC_PAD so a run sees few cache shapes
        self.static_cache = static_cache
        # decoder "captured": dflash's own loop (trainer/serving/captured/regenerate_decoder.py: one preallocated KV cache, the decode
        # step captured as CUDA graphs on GPUs); "generate": transformers' generate, as before
        if decoder not in DECODERS:
            raise RegenerateError(f"--decoder: one of {', '.join(DECODERS)}, got {decoder!r}")
        if decoder == "captured":   # a hybrid target the captured decoder cannot hold: one line, then generate
            from trainer.model.families import check_hybrid_transformers
            from trainer.serving.captured.linear_states import hybrid_unsupported
            check_hybrid_transformers(self.model)   # a transformers too old for it: no fallback, one line
            from trainer.model.target import decoder as decoder_stack
            why = hybrid_unsupported(decoder_stack(self.model))
            if why:
                _log_stderr(f"{PROG}: the captured decoder cannot run this target ({why}); using --decoder generate")
                decoder, fuse = "generate", False
        self.decoder = decoder
        # fuse: the captured decode step's norms, rotary and SiLU gate compiled (fused_ops.fused_small_ops)
        self.fuse = bool(fuse)
        # decode_attention: the captured decode step's attention, "sdpa" or "triton" (trainer/ops/decode_attn.py)
        if decode_attention not in DECODE_ATTENTIONS:
            raise RegenerateError(f"--decode-attention: one of {', '.join(DECODE_ATTENTIONS)}, got {decode_attention!r}")
        self.decode_attention = decode_attention
        # kv_fp8: the captured decoder's KV cache in fp8 e4m3 (read by the triton attention only)
        if kv_fp8 and decode_attention != "triton":
            raise RegenerateError("--kv-fp8 on: needs --decode-attention triton")
        self.kv_fp8 = bool(kv_fp8)
        self._fast = None

    def _fast_decoder(self):
        from trainer.serving.captured.regenerate_decoder import DecoderOptions, GraphDecoder

        if self._fast is None or self._fast.stop_ids != list(self.stop_ids):
            opts = DecoderOptions(fuse=self.fuse, decode_kernel=self.decode_attention, kv_fp8=self.kv_fp8, state_inplace=True)
            self._fast = GraphDecoder(self.model, self.device, self.batch_size, self.max_new_tokens, self.temperature,
                                      self.stop_ids, self.pad_id, opts)
            # state_inplace: a hybrid's recurrent states written in place by FLA's kernel (nothing changes
            # where FLA is absent or the target is dense): the same tokens as the copy on every row, and the
            # faster step (results/INDEX.md, h200-qwen3.6-27b-regenerate-step-variants)
        return self._fast

    def _batch(self, prompts: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        width = max(len(p) for p in prompts)
        if self.static_cache:
            width = -(-width // STATIC_PAD) * STATIC_PAD
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding: every row's last prompt token is at the end
            ids[r, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
            attn[r, width - len(p):] = 1
        # knobs set explicitly: a chat model's generation_config.json (sampling on, top-k, top-p,
        # repetition penalty) fills whatever is left unset, and must not change what greedy decoding
        # or plain sampling at --temperature produce (what dflash-eval and serving verify against)
        if self.temperature > 0:
            knobs = dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0, min_p=0.0)
        else:
            knobs = dict(do_sample=False)
        if self.static_cache:
            knobs["cache_implementation"] = "static"
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                max_new_tokens=self.max_new_tokens, num_beams=1, repetition_penalty=1.0, **knobs,
                eos_token_id=self.stop_ids or None, pad_token_id=self.pad_id)
        new = out[:, width:].cpu().numpy()
        stops = np.isin(new, self.stop_ids) if self.stop_ids else np.zeros(new.shape, bool)
        result = []
        for r in range(len(prompts)):
            hit = np.nonzero(stops[r])[0]
            n = int(hit[0]) + 1 if len(hit) else new.shape[1]  # the stop token is kept
            result.append(new[r, :n].astype(np.int64))
        return result

    def complete(self, prompts: list[np.ndarray], seed: int, on_batch=None) -> list[np.ndarray]:
        """Batches of similar prompt length (fewer padded positions), results in input order."""
        import torch

        if self.device.type == "cuda":  # this device's generator only: other threads own the others
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        out: list = [None] * len(prompts)
        fast = self._fast_decoder() if self.decoder == "captured" else None
        for s in range(0, len(order), self.batch_size):
            members = order[s:s + self.batch_size]
            if fast is not None:   # sampling noise keyed by (shard seed, prompt index): batch-independent
                comps = fast.generate([prompts[i] for i in members],
                                      [(seed * 1_000_003 + i) % (1 << 62) for i in members])
            else:
                comps = self._batch([prompts[i] for i in members])
            for i, comp in zip(members, comps):
                out[i] = comp
            if on_batch is not None:
                on_batch(len(members), sum(len(out[i]) for i in members))
        return out


# --------------------------------------------------------------------------------------------
# The output directory: manifest, finished shards, index


def _check_out_dir(out: Path, config: dict, src: str) -> dict:
    """The manifest to continue from (a fresh one for an empty or new directory)."""
    fresh = {"format": MANIFEST_FORMAT, "config": config, "done": {}, "complete": False}
    if out.exists() and not out.is_dir():
        raise RegenerateError(f"--output-dir {out}: exists and is not a directory")
    if not out.is_dir() or not any(p.name != LOCK_NAME for p in out.iterdir()):
        return fresh
    mpath = out / MANIFEST_NAME
    if not mpath.is_file():
        raise RegenerateError(f"--output-dir {out}: not empty and holds no {MANIFEST_NAME} "
                              "(not a dflash-regenerate output; refusing to overwrite)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        assert manifest.get("format") == MANIFEST_FORMAT and isinstance(manifest.get("done"), dict)
    except (OSError, ValueError, AssertionError, AttributeError):
        raise RegenerateError(f"--output-dir {out}: {mpath} is unreadable or not a "
                              f"{MANIFEST_FORMAT} manifest") from None
    old = manifest.get("config", {})
    if old != config:
        keys = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
        raise RegenerateError(
            f"--output-dir {out}: holds data regenerated with another configuration than this run "
            f"from {src} ({', '.join(keys)} differ); use a new output directory")
    return manifest


def lock_output_dir(out: Path) -> int:
    """An exclusive lock on ``out`` for this process (released by the kernel if it dies)."""
    import fcntl

    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RegenerateError(f"--output-dir {out}: another dflash-regenerate is writing it") from None
    return fd


def _finished(out: Path, manifest: dict, k: int) -> dict | None:
    """Shard k's entry when the manifest lists it and the file on disk has its sha256."""
    entry = manifest["done"].get(str(k))
    if entry is None:
        return None
    path = out / entry["file"]
    if path.is_file() and sha256_file(path) == entry["sha256"]:
        return entry
    return None


class _Progress:
    """One stderr line at most every `every` seconds: records done/total, generated tokens, tok/s."""

    def __init__(self, total: int, log, every: float = 5.0):
        self.total, self.log, self.every = total, log, every
        self.records = self.tokens = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, records: int, tokens: int, force: bool = False, note: str = "") -> None:
        with self.lock:
            self.records += records
            self.tokens += tokens
            now = time.monotonic()
            if force or now - self.last >= self.every:
                self.last = now
                rate = self.tokens / max(now - self.t0, 1e-9)
                self.log(f"{PROG}: {self.records}/{self.total} records, {self.tokens} tokens "
                         f"generated, {rate:.0f} tok/s{note}")


# --------------------------------------------------------------------------------------------
# Driver


def _target_record(target) -> dict:
    """index.json's "target" key, as dflash-prepare writes it (trainer/model/identity.py): the tokenizer the
    shards were made with, so the trainer and dflash-eval can check the data against their target. A
    target whose identity cannot be read records nothing (the run itself already loaded it)."""
    from trainer.model.identity import RECORD_KEY, record_for_data
    try:
        return {RECORD_KEY: record_for_data(target)}
    except (OSError, ValueError):
        return {}


ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", *ON_OFF)
IN, GEN = "prompts and output", "generation"


@dataclass
class RegenerateConfig:
    """dflash-regenerate's options (the command line is generated from these fields: trainer/config/options.py).
    The switches keep their command-line spelling (auto/on/off); :func:`resolve_switches` decides them."""
    target_model: str = opt(help="local HF model dir (writes the completions)", group=IN)
    output_dir: str = opt(help="where the shards, index.json and regenerate.json go", group=IN)
    data_dir: str = opt("", "prepared shards (dflash-prepare); prompts = tokens before the first supervised one "
                            "(give this or --input)", group=IN)
    input: list[str] = opt(help="JSONL as dflash-prepare takes it (repeatable; give this or --data-dir)", group=IN,
                           kind="append", metavar="FILE", default_factory=list)
    device: str = opt("cpu", "cpu or cuda:N", group=GEN, metavar="DEVICE")
    devices: str = opt("", "several devices, e.g. cuda:0,cuda:1 (one replica each; replaces --device)", group=GEN,
                       metavar="DEVICE,...")
    batch_size: int = opt(32, "prompts per generate call", group=GEN, ge=1)
    max_new_tokens: int = opt(1024, "tokens generated per prompt at most", group=GEN, ge=1)
    temperature: float = opt(0.0, "0 = greedy", group=GEN, ge=0)
    seed: int = opt(0, "sampling seed (temperature > 0)", group=GEN)
    samples_per_prompt: int = opt(1, "completions per prompt, each a record (> 1: --temperature > 0)", group=GEN, ge=1)
    shard_size: int = opt(DEFAULT_SHARD_SIZE, "sequences per shard", group=GEN, ge=1)
    max_records: int = opt(0, "first N prompts only (0 = all)", group=GEN, ge=0)
    static_cache: str = opt("auto", "static KV cache, its decode step compiled by transformers on GPUs (auto: on "
                                    "when every device is a GPU)", group=GEN, choices=AUTO_ON_OFF)
    decoder: str = opt("auto", "captured: dflash's own decode loop (a preallocated KV cache, CUDA graphs); generate: "
                               "transformers' (auto: captured when every device is a GPU)", group=GEN, choices=("auto", *DECODERS))
    fuse: str = opt("auto", "the captured decode step's small ops compiled (auto: on with the captured decoder on GPUs)",
                    group=GEN, choices=AUTO_ON_OFF)
    decode_attention: str = opt("auto", "the captured decode step's attention: sdpa, or triton, a split-KV "
                                        "kernel (auto: triton on GPUs with Triton)", group=GEN, choices=("auto", *DECODE_ATTENTIONS))
    kv_fp8: str = opt("off", "the captured KV cache in fp8 e4m3 (half the memory; changes the numerics, so it is "
                             "recorded; needs --decode-attention triton)", group=GEN, choices=ON_OFF)
    json: bool = opt(False, "print the statistics as JSON on stdout", group=GEN)

    def device_list(self) -> list[str]:
        return [d for d in self.devices.split(",") if d.strip()] or [self.device]

    @classmethod
    def of(cls, data_dir, target_model, out_dir, *, inputs=(), devices=None, static_cache=None, decoder=None,
           fuse=None, decode_attention=None, kv_fp8=False, **rest) -> "RegenerateConfig":
        """The config of the keyword call regenerate(data_dir, target_model, out_dir, ...): None = auto,
        True/False = on/off, lists for inputs and devices."""
        switch = {None: "auto", True: "on", False: "off"}
        return cls(target_model=str(target_model), output_dir=str(out_dir),
                   data_dir="" if data_dir is None else str(data_dir), input=[str(p) for p in inputs],
                   devices=",".join(devices or ()), static_cache=switch[static_cache],
                   decoder=decoder or "auto", fuse=switch[fuse], decode_attention=decode_attention or "auto",
                   kv_fp8=switch[bool(kv_fp8)], **rest)


def resolve_switches(cfg: RegenerateConfig, devs: list[str], target_config: dict,
                     target: Path) -> tuple[bool, str, bool, str, bool]:
    """(static_cache, decoder, fuse, decode_attention, kv_fp8) with each auto decided for these devices, and
    the combinations that cannot run refused (RegenerateError naming the flag).
    static_cache auto: on when every device is a GPU (docs/performance-archive.md measures it).
    decoder auto: "captured" (captured/regenerate_decoder.py, CUDA graphs) when every device is a GPU, else
    "generate".
    fuse auto: the captured decoder's small ops compiled when every device is a GPU (a faster decode step:
    results/INDEX.md, h200-8b-regenerate-fused.json); bf16 rounding only, not recorded.
    decode_attention auto: "triton" (the split-KV kernel, trainer/ops/decode_attn.py; results/INDEX.md,
    h200-8b-regenerate-triton.json) with the captured decoder when every device is a GPU and Triton is
    installed, else "sdpa"; "triton" on a CPU runs the kernel's torch reference. Not recorded either.
    kv_fp8 on: the KV cache in fp8 e4m3 (needs decode_attention "triton"); it changes the numerics, so it is
    recorded ("kv_cache": "fp8") and a resume must use it too."""
    gpus = all(d.startswith("cuda") for d in devs)
    static_cache = gpus if cfg.static_cache == "auto" else cfg.static_cache == "on"
    decoder = ("captured" if gpus else "generate") if cfg.decoder == "auto" else cfg.decoder
    if decoder == "captured":   # a hybrid on a transformers older than our cache API: one line, nothing loaded
        from trainer.model.families import HybridTransformersTooOld, check_hybrid_transformers
        try:
            check_hybrid_transformers(target_config, f"--target-model {target}")
        except HybridTransformersTooOld as e:
            raise RegenerateError(f"{e}; or --decoder generate (transformers' own loop)") from None
    fuse = (decoder == "captured" and gpus) if cfg.fuse == "auto" else cfg.fuse == "on"
    if fuse and decoder != "captured":
        raise RegenerateError(f"--fuse on: needs --decoder captured, got --decoder {decoder}")
    if cfg.decode_attention == "auto":
        import importlib.util
        decode_attention = ("triton" if decoder == "captured" and gpus and importlib.util.find_spec("triton")
                            else "sdpa")
    else:
        decode_attention = cfg.decode_attention
    if decode_attention != "sdpa" and decoder != "captured":
        raise RegenerateError(f"--decode-attention {decode_attention}: needs --decoder captured, "
                              f"got --decoder {decoder}")
    kv_fp8 = cfg.kv_fp8 == "on"
    if kv_fp8 and decode_attention != "triton":
        raise RegenerateError(f"--kv-fp8 on: needs --decode-attention triton, got {decode_attention}")
    return static_cache, decoder, fuse, decode_attention, kv_fp8


def _run_record(cfg: RegenerateConfig, target: Path, source, num_records: int, settings: GenerationSettings) -> dict:
    """What regenerate.json records of a run: a resume with a different record is refused (_check_out_dir)."""
    config = {"target_model": str(target.absolute()), "source": source, "num_records": num_records,
              "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature), "seed": int(cfg.seed),
              "batch_size": int(cfg.batch_size), "shard_size": int(cfg.shard_size),
              "static_cache": bool(settings.static_cache), "decoder": settings.decoder}
    if settings.kv_fp8:   # changes the tokens beyond rounding: a resume must use the same cache
        config["kv_cache"] = "fp8"
    if cfg.samples_per_prompt > 1:   # recorded only when used: outputs written before the option resume unchanged
        config["samples_per_prompt"] = int(cfg.samples_per_prompt)
    return config


def regenerate(
    cfg: RegenerateConfig | str | os.PathLike | None,
    target_model: str | os.PathLike | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    log: Callable[[str], None] = _log_stderr,
    progress_every: float = 5.0,
    **options,
) -> dict:
    """Regenerate the completions of ``cfg.data_dir`` (shards) or ``cfg.input`` (JSONL) with the target into
    ``cfg.output_dir``; resumes a partial output dir of the same configuration. ``cfg`` is a
    :class:`RegenerateConfig` (what dflash-regenerate parses); the older call
    ``regenerate(data_dir, target_model, out_dir, batch_size=..., static_cache=None|True|False, ...)`` still
    works (:meth:`RegenerateConfig.of`). Returns statistics:
    records, shards, shards_skipped, shards_generated, tokens_generated, prompt_tokens, seconds
    (generation only), tokens_per_s, load_seconds, stopped_at_eos, index_hash, out_dir.
    The ``auto`` switches are resolved by :func:`resolve_switches`. Several devices: one worker process per device, each taking the next shard.
    Raises :class:`RegenerateError` on bad input (nothing is generated then)."""
    from trainer.config.preflight import check_model_dir

    if not isinstance(cfg, RegenerateConfig):
        cfg = RegenerateConfig.of(cfg, target_model, out_dir, **options)
    elif target_model is not None or out_dir is not None or options:
        raise TypeError("regenerate(cfg): the options are the config's fields")
    data_dir = cfg.data_dir or None
    target = Path(cfg.target_model)
    out = Path(cfg.output_dir)
    inputs = [Path(p) for p in cfg.input]
    if (data_dir is None) == (not inputs):
        raise RegenerateError("give exactly one of --data-dir and --input")
    src = str(data_dir) if data_dir is not None else ", ".join(map(str, inputs))
    try:
        target_config = check_model_dir(str(target))
        if data_dir is not None:   # the prompts were tokenized by the target's tokenizer (trainer/model/identity.py)
            from trainer.model.identity import check_data_dir_tokenizer
            check_data_dir_tokenizer(data_dir, target, "--data-dir")
    except (ConfigError, ValueError) as e:   # identity.TargetMismatch is a ValueError
        raise RegenerateError(str(e)) from None
    devs = cfg.device_list()
    for d in devs:
        _check_device(d)
    try:
        check_ranges(cfg)   # the ranges and choices RegenerateConfig declares
    except ConfigError as e:
        raise RegenerateError(str(e)) from None
    batch_size, max_new_tokens, temperature, seed = cfg.batch_size, cfg.max_new_tokens, cfg.temperature, cfg.seed
    shard_size, max_records = cfg.shard_size, cfg.max_records
    if cfg.samples_per_prompt > 1 and temperature <= 0:
        raise RegenerateError(f"--samples-per-prompt {cfg.samples_per_prompt}: needs --temperature > 0 (greedy "
                              "decoding writes the same completion every time)")
    if data_dir is not None and out.absolute() == Path(data_dir).absolute():
        raise RegenerateError(f"--output-dir {out}: is the --data-dir itself")
    # the prompts before anything loads the target: a bad record is named at once
    prompts, source, num_records = load_prompts(data_dir, inputs, target, log)
    if not prompts:
        raise RegenerateError(f"{src}: no record has a prompt (tokens before its first supervised one)")
    settings = GenerationSettings(max_new_tokens, temperature, batch_size,
                                  *resolve_switches(cfg, devs, target_config, target))
    if num_records > len(prompts):
        log(f"{PROG}: {src}: {num_records - len(prompts)} of {num_records} records have no prompt "
            "(supervised from their first token), skipped")
    if max_records:
        prompts = prompts[:max_records]
    if cfg.samples_per_prompt > 1:
        # each copy its own row: the captured decoder's noise is keyed by the row's index, generate draws
        # each row from the shard's generator, so the copies differ
        prompts = [p for p in prompts for _ in range(cfg.samples_per_prompt)]
    config = _run_record(cfg, target, source, len(prompts), settings)
    manifest = _check_out_dir(out, config, src)
    num_shards = -(-len(prompts) // shard_size)
    if manifest["complete"] and (out / INDEX_NAME).is_file() and all(
            _finished(out, manifest, k) for k in range(num_shards)):
        index = read_index(out)
        log(f"{PROG}: {out} is already complete ({index['num_sequences']} sequences); nothing to do")
        return _stats(out, index, prompts, num_shards, num_shards, 0, 0.0, 0.0, 0)

    out.mkdir(parents=True, exist_ok=True)
    lock_fd = lock_output_dir(out)
    try:
        manifest = _check_out_dir(out, config, src)  # again: no other run writes it now
        manifest["complete"] = False
        for p in out.iterdir():  # temp files of a killed run
            if p.name.startswith(".") and ".tmp" in p.name:
                p.unlink()
        atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")

        todo = [k for k in range(num_shards) if _finished(out, manifest, k) is None]
        skipped = num_shards - len(todo)
        if skipped:
            log(f"{PROG}: resuming {out}: {skipped} of {num_shards} shard(s) already finished, kept")
        progress = _Progress(sum(min(shard_size, len(prompts) - k * shard_size) for k in todo), log,
                             progress_every)
        lock = threading.Lock()
        eos_hits = [0]

        def record(k: int, entry: dict, eos: int) -> None:
            with lock:
                eos_hits[0] += eos
                manifest["done"][str(k)] = entry
                atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
            progress.add(0, 0, force=True, note=f" (shard {k + 1}/{num_shards} written)")

        if len(devs) == 1 or not todo:
            t_load = time.monotonic()
            gens = [TargetGenerator(str(target), devs[0], **asdict(settings))] if todo else []
            load_s = time.monotonic() - t_load

            def run_shard(gen: TargetGenerator, k: int) -> None:
                record(k, *_generate_shard(gen, out, prompts, shard_size, seed, k, progress.add))

            t0 = time.monotonic()
            _run_on_devices(gens, todo, run_shard)
            secs = time.monotonic() - t0
        else:
            load_s, secs = _run_in_processes(devs, str(target), settings, out, prompts, shard_size, seed,
                                             todo, record, progress.add)

        entries = [manifest["done"][str(k)] for k in range(num_shards)]
        extra = {"regenerated": {k: v for k, v in config.items() if k != "num_records"}}
        extra.update(_target_record(target))
        index = write_index(out, entries, tokenizer_name=str(target), extra=extra)
        manifest["complete"] = True
        atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
        stats = _stats(out, index, prompts, num_shards, skipped, progress.tokens, secs, load_s,
                       eos_hits[0])
        log(f"{PROG}: wrote {out}: {index['num_sequences']} sequences, {index['num_tokens']} tokens "
            f"({index['num_supervised_tokens']} generated and supervised), {num_shards} shard(s), "
            f"{skipped} kept from before; {stats['tokens_generated']} tokens in {secs:.1f}s "
            f"({stats['tokens_per_s']:.0f} tok/s) on {', '.join(devs)}; hash {index['hash'][:16]}")
        return stats
    finally:
        os.close(lock_fd)


def _generate_shard(gen: TargetGenerator, out: Path, prompts, shard_size: int, seed: int, k: int,
                    on_batch) -> tuple[dict, int]:
    """Shard k generated on `gen` and written atomically: (its index entry, rows stopped at an EOS)."""
    chunk = prompts[k * shard_size:(k + 1) * shard_size]
    comps = gen.complete(chunk, seed=seed * 1_000_003 + k, on_batch=on_batch)
    ids = [np.concatenate([p, c]) for p, c in zip(chunk, comps)]
    masks = [np.concatenate([np.zeros(len(p), np.int8), np.ones(len(c), np.int8)])
             for p, c in zip(chunk, comps)]
    entry = write_shard(out / SHARD_PATTERN.format(k), ids, masks)
    return entry, sum(1 for c in comps if len(c) and int(c[-1]) in gen.stop_ids)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a kill -9 of the run takes its workers)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _device_worker(device: str, target: str, settings: GenerationSettings, out: str, shard_size: int, seed: int,
                   inbox, outbox) -> None:
    """One device's process: load the target, then generate and write each shard the parent sends."""
    _die_with_parent()
    import traceback

    try:
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(device)   # this process's one GPU (graph captures use the current device)
        gen = TargetGenerator(target, device, **asdict(settings))
        outbox.put(("ready", device))
        while True:
            item = inbox.get()
            if item is None:
                return
            k, chunk = item
            entry, eos = _generate_shard(gen, Path(out), _ShardView(k, shard_size, chunk), shard_size, seed, k,
                                         lambda n, t: outbox.put(("batch", n, t)))
            outbox.put(("shard", device, k, entry, eos))
    except BaseException:  # noqa: BLE001  reported to the parent, which raises it
        outbox.put(("error", device, traceback.format_exc()))


class _ShardView:
    """The slice [k*S, (k+1)*S) of the whole prompt list, holding only that shard's prompts."""

    def __init__(self, k: int, shard_size: int, chunk: list):
        self.start, self.chunk = k * shard_size, chunk

    def __getitem__(self, sl: slice) -> list:
        assert sl.start == self.start
        return self.chunk


def _run_in_processes(devs: list[str], target: str, settings: GenerationSettings, out: Path, prompts, shard_size: int,
                      seed: int, todo: list[int], record, on_batch) -> tuple[float, float]:
    """One spawned process per device (its own replica, CUDA context and graphs, no shared GIL); each
    is handed the next unfinished shard when it reports the last one written. The parent alone writes
    the manifest. The first error stops the others and is raised here. Returns (load s, generation s)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in devs]
    procs = [ctx.Process(target=_device_worker, name=f"regen-{d}", daemon=True,
                         args=(d, target, settings, str(out), shard_size, seed, inboxes[i], outbox))
             for i, d in enumerate(devs)]
    pending = list(todo)
    index = {d: i for i, d in enumerate(devs)}

    def feed(i: int) -> int:
        """The next shard to device i, or its stop; returns how many devices stopped (0 or 1)."""
        if pending:
            k = pending.pop(0)
            inboxes[i].put((k, prompts[k * shard_size:(k + 1) * shard_size]))
            return 0
        inboxes[i].put(None)
        return 1

    t_load = time.monotonic()
    for p in procs:
        p.start()
    ready, working, t0, load_s = 0, len(devs), None, 0.0
    try:
        while working:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{PROG}: worker {dead[0].name} died (exit code {dead[0].exitcode})")
                continue
            kind = msg[0]
            if kind == "batch":
                on_batch(msg[1], msg[2])
            elif kind == "ready":
                ready += 1
                if t0 is None:          # generation starts with the first replica ready
                    t0 = time.monotonic()
                if ready == len(devs):
                    load_s = time.monotonic() - t_load
                working -= feed(index[msg[1]])
            elif kind == "shard":
                _, d, k, entry, eos = msg
                record(k, entry, eos)
                working -= feed(index[d])
            else:
                raise RuntimeError(f"{PROG}: the worker on {msg[1]} failed:\n{msg[2]}")
    finally:
        for q in inboxes:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return load_s, time.monotonic() - (t0 if t0 is not None else t_load)


def _run_on_devices(gens: list[TargetGenerator], todo: list[int], run_shard) -> None:
    """Shards in order on one device; with several, one thread per device (each owning its replica)
    takes the next shard from a queue. The first error stops the others and is raised here."""
    if len(gens) == 1:
        for k in todo:
            run_shard(gens[0], k)
        return
    work: queue.Queue = queue.Queue()
    for k in todo:
        work.put(k)
    errors: list[BaseException] = []

    def worker(gen: TargetGenerator) -> None:
        while not errors:
            try:
                k = work.get_nowait()
            except queue.Empty:
                return
            try:
                run_shard(gen, k)
            except BaseException as e:  # noqa: BLE001  re-raised in the main thread
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(g,), name=f"regen-{g.device}") for g in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _check_device(name: str) -> None:
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise RegenerateError(f"--device {name}: not a device (cpu or cuda:N)") from None
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index or 0) >= torch.cuda.device_count()):
        raise RegenerateError(f"--device {name}: no such CUDA device on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise RegenerateError(f"--device {name}: only cpu and cuda:N are supported")


def _stats(out, index, prompts, num_shards, skipped, tokens, secs, load_s, eos_hits) -> dict:
    return {
        "out_dir": str(out),
        "records": index["num_sequences"],
        "shards": num_shards,
        "shards_skipped": skipped,
        "shards_generated": num_shards - skipped,
        "tokens_generated": int(tokens),
        "prompt_tokens": int(sum(len(p) for p in prompts)),
        "supervised_tokens": index["num_supervised_tokens"],
        "seconds": round(secs, 3),
        "tokens_per_s": tokens / secs if secs > 0 else 0.0,
        "load_seconds": round(load_s, 3),
        "stopped_at_eos": int(eos_hits),
        "index_hash": index["hash"],
    }


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_options(RegenerateConfig, argv, PROG, __doc__.split("\n\n")[0])
        stats = regenerate(args)
    except (ConfigError, RegenerateError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    from trainer.optional import defer
    defer()   # a program (python -m): torchao only when asked for (trainer/optional.py)
    sys.exit(main())
