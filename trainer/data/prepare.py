"""dflash-prepare: tokenise chat / prompt-completion JSONL with the target's tokenizer into shards.

    dflash-prepare --target-model DIR --input FILE.jsonl [--input ...] --output-dir DIR
                   [--max-seq-len N] [--shard-size N] [--force]

Each non-empty input line is a JSON object, either
    {"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}
or
    {"prompt": "...", "completion": "..."}   (optionally "system": "...")
The conversation is rendered with the target's own chat template and tokenised with its own
tokenizer (local files only). The loss mask covers assistant tokens only: for every assistant turn
its content and its end-of-turn token (e.g. ``<|im_end|>``), nothing of the template around it.

How assistant tokens are found: the character span of turn i is the difference between the
template rendered up to turn i (with the generation prompt) and rendered through turn i, when that
is a prefix of the full rendering; otherwise (templates that render earlier turns differently,
e.g. dropping reasoning) the turn's content is located in the full rendering. Character spans map
to tokens through the fast tokenizer's offsets; tokens after the last end-of-turn token of a span
(the template's trailing newline) are not supervised.

Exit codes: 0 written, 2 bad input (the message names the file and line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from trainer.data.dataset import _SHARD_RE, INDEX_NAME, DataError, write_shards

PROG = "dflash-prepare"
END_TOKEN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
ENCODE_BATCH = 256


class PrepareError(ValueError):
    """Bad input; the message names the file (and line)."""


# --------------------------------------------------------------------------------------------
# Parsing


def parse_line(obj, prompt_only: bool = False) -> tuple[list[dict], bool]:
    """Validate one JSON object; return (messages, from_prompt_completion). prompt_only: a record without
    an answer (messages with no assistant turn, or a 'prompt' alone) is accepted, as dflash-regenerate,
    which writes the answers, takes it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{j}] is not an object")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role:
                raise ValueError(f"messages[{j}] has no 'role' string")
            if not isinstance(content, str):
                raise ValueError(f"messages[{j}] has no 'content' string")
            out.append({"role": role, "content": content})
        if not prompt_only and not any(m["role"] == "assistant" for m in out):
            raise ValueError("no assistant message (nothing to train on)")
        return out, False
    if prompt_only and isinstance(obj.get("prompt"), str) and "completion" not in obj:
        system = [{"role": "system", "content": obj["system"]}] if isinstance(obj.get("system"), str) else []
        return system + [{"role": "user", "content": obj["prompt"]}], True
    if "prompt" in obj or "completion" in obj:
        p, c = obj.get("prompt"), obj.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise ValueError("'prompt' and 'completion' must both be strings")
        if not c:
            raise ValueError("'completion' is empty")
        out = []
        if isinstance(obj.get("system"), str):
            out.append({"role": "system", "content": obj["system"]})
        out += [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        return out, True
    raise ValueError("expected a 'messages' list or 'prompt' and 'completion' strings")


# --------------------------------------------------------------------------------------------
# Rendering and masking


class Encoder:
    """Renders conversations with the target's chat template and computes the assistant mask."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "is_fast", False):
            raise PrepareError("the target's tokenizer is not a fast tokenizer (offsets needed)")
        self.tok = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        ends = set()
        if tokenizer.eos_token_id is not None:
            ends.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        for t in END_TOKEN_CANDIDATES:
            if t in vocab:
                ends.add(int(vocab[t]))
        self.end_ids = ends
        self.end_strings = [t for t in END_TOKEN_CANDIDATES if t in vocab]
        if tokenizer.eos_token and tokenizer.eos_token not in self.end_strings:
            self.end_strings.append(tokenizer.eos_token)

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render(self, messages: list[dict], raw: bool) -> tuple[str, list[tuple[int, int]]]:
        """Return (text, assistant character spans)."""
        if not self.has_template:
            if not raw:
                raise ValueError("the target's tokenizer has no chat template; 'messages' needs one")
            # No template: prompt + completion (+ eos) as plain text.
            prompt = "".join(m["content"] for m in messages if m["role"] != "assistant")
            comp = messages[-1]["content"] + (self.tok.eos_token or "")
            return prompt + comp, [(len(prompt), len(prompt) + len(comp))]
        full = self._render(messages, False)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            span = None
            if i > 0:
                try:
                    prefix = self._render(messages[:i], True)
                    through = self._render(messages[: i + 1], False)
                except Exception:
                    prefix = through = None
                if (
                    prefix is not None
                    and len(prefix) >= cursor
                    and through.startswith(prefix)
                    and full.startswith(through)
                    and len(through) > len(prefix)
                ):
                    span = (len(prefix), len(through))
            if span is None:
                span = self._locate(full, m["content"], cursor, i)
            spans.append(span)
            cursor = span[1]
        return full, spans

    def prompt_text(self, messages: list[dict], raw: bool) -> str:
        """The text a record without an answer asks the target to continue: its turns rendered with the chat
        template's generation prompt (no template: the prompts' text, as `render` writes it)."""
        if not self.has_template:
            if not raw:
                raise ValueError("the target's tokenizer has no chat template; 'messages' needs one")
            return "".join(m["content"] for m in messages)
        return self._render(messages, True)

    def _locate(self, full: str, content: str, cursor: int, i: int) -> tuple[int, int]:
        if not content:
            raise ValueError(f"messages[{i}]: empty assistant content cannot be located")
        pos = full.find(content, cursor)
        if pos < 0:
            raise ValueError(
                f"messages[{i}]: assistant content not found in the rendered chat template"
            )
        end = pos + len(content)
        # Include the end-of-turn marker that follows (whitespace allowed in between).
        rest = full[end:]
        stripped = len(rest) - len(rest.lstrip())
        for s in self.end_strings:
            if rest[stripped:].startswith(s):
                end = end + stripped + len(s)
                break
        return pos, end

    def encode(self, items: list[tuple[str, list[tuple[int, int]]]]) -> list[tuple[list, list]]:
        texts = [t for t, _ in items]
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for (text, spans), ids, offs in zip(items, enc["input_ids"], enc["offset_mapping"]):
            ids = np.asarray(ids, dtype=np.int64)
            offs = np.asarray(offs, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=np.int8)
            for a, b in spans:
                sel = np.nonzero((offs[:, 0] < b) & (offs[:, 1] > a))[0]
                if len(sel) == 0:
                    continue
                lo, hi = int(sel[0]), int(sel[-1]) + 1
                is_end = np.isin(ids[lo:hi], list(self.end_ids))
                if is_end.any():
                    hi = lo + int(np.nonzero(is_end)[0][-1]) + 1
                mask[lo:hi] = 1
            out.append((ids, mask))
        return out


# --------------------------------------------------------------------------------------------
# Driver


class Stats:
    def __init__(self):
        self.lines = 0
        self.sequences = 0
        self.tokens = 0
        self.supervised = 0
        self.truncated = 0
        self.skipped_empty = 0


def iter_records(
    encoder: Encoder,
    inputs: list[Path],
    max_seq_len: int,
    stats: Stats,
    log=print,
    progress_every: float = 5.0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    last = time.monotonic()
    for path in inputs:
        pending: list[tuple[str, list]] = []

        def flush():
            for ids, mask in encoder.encode(pending):
                if max_seq_len and len(ids) > max_seq_len:
                    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                    stats.truncated += 1
                if not mask.any():
                    stats.skipped_empty += 1
                    continue
                stats.sequences += 1
                stats.tokens += len(ids)
                stats.supervised += int(mask.sum())
                yield ids, mask
            pending.clear()

        lineno = 0
        for lineno, obj in read_objects(path):
            stats.lines += 1
            with record_errors(path, lineno):
                messages, raw = parse_line(obj)
                pending.append(encoder.render(messages, raw))
            if len(pending) >= ENCODE_BATCH:
                yield from flush()
            now = time.monotonic()
            if now - last >= progress_every:
                last = now
                log(f"{PROG}: {path}:{lineno}: {stats.sequences} sequences, "
                    f"{stats.tokens} tokens so far")
        yield from flush()
        log(f"{PROG}: read {path} ({lineno} lines)")


def read_objects(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line; PrepareError naming the file and line."""
    try:
        f = open(path, "r", encoding="utf-8")
    except OSError as e:
        raise PrepareError(f"{path}: cannot open: {e.strerror or e}") from None
    with f:
        lineno = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                raise PrepareError(f"{path}:{lineno + 1}: not UTF-8 text: {e.reason}") from None
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None


@contextlib.contextmanager
def record_errors(path: Path, lineno: int):
    """A record's bad content or failing chat template as one PrepareError naming the file and line."""
    try:
        yield
    except ValueError as e:
        raise PrepareError(f"{path}:{lineno}: {e}") from None
    except Exception as e:  # template errors (jinja raise_exception etc.)
        raise PrepareError(f"{path}:{lineno}: chat template failed: {type(e).__name__}: {e}") from None


def iter_prompts(encoder: Encoder, inputs: list[Path], log=print) -> Iterator[np.ndarray]:
    """Each record's prompt tokens, as dflash-regenerate takes them: the tokens before its first supervised
    token (as dflash-eval takes a record's prompt), or, for a record without an answer (prompt-only JSONL),
    the record rendered with the chat template's generation prompt. A record with an answer but no prompt
    tokens (supervised from its first token) is skipped."""
    for path in inputs:
        lineno = 0
        for lineno, obj in read_objects(path):
            with record_errors(path, lineno):
                messages, raw = parse_line(obj, prompt_only=True)
                if any(m["role"] == "assistant" for m in messages):
                    (ids, mask), = encoder.encode([encoder.render(messages, raw)])
                    sup = np.nonzero(mask)[0]
                    if len(sup) and sup[0] > 0:
                        yield ids[:sup[0]]
                    continue
                text = encoder.prompt_text(messages, raw)
            yield np.asarray(encoder.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        log(f"{PROG}: read {path} ({lineno} lines)")


def prepare(
    target_model: str | Path,
    inputs: Iterable[str | Path],
    output_dir: str | Path,
    max_seq_len: int = 0,
    shard_size: int = 10000,
    force: bool = False,
    log=print,
) -> dict:
    """Tokenise ``inputs`` into shards under ``output_dir``; returns the index. Raises
    :class:`PrepareError` on bad input (nothing is left behind in ``output_dir`` then)."""
    target = Path(target_model)
    inputs = [Path(p) for p in inputs]
    out = Path(output_dir)
    if not target.is_dir():
        raise PrepareError(f"--target-model {target}: not a directory")
    if not inputs:
        raise PrepareError("--input: at least one JSONL file is needed")
    for p in inputs:
        if not p.is_file():
            raise PrepareError(f"--input {p}: no such file")
    if max_seq_len < 0:
        raise PrepareError(f"--max-seq-len: must be >= 0, got {max_seq_len}")
    if shard_size < 1:
        raise PrepareError(f"--shard-size: must be >= 1, got {shard_size}")
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--output-dir {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PrepareError(f"--output-dir {out}: not empty (use --force to replace its shards)")

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except Exception as e:
        raise PrepareError(f"--target-model {target}: cannot load tokenizer: {e}") from None
    encoder = Encoder(tok)
    log(f"{PROG}: tokenizer from {target} ({len(tok)} tokens, "
        f"{'chat template' if encoder.has_template else 'NO chat template'})")

    stats = Stats()
    t0 = time.monotonic()
    created_dir = not out.exists()
    try:
        index = write_shards(
            iter_records(encoder, inputs, max_seq_len, stats, log=log),
            out,
            shard_size=shard_size,
            tokenizer_name=str(getattr(tok, "name_or_path", None) or target),
            overwrite=force,
        )
    except (PrepareError, DataError) as e:
        # Leave nothing half-written behind.
        if out.is_dir():
            for p in out.iterdir():
                if _SHARD_RE.match(p.name) or p.name == INDEX_NAME or p.name.startswith(".shard-"):
                    p.unlink()
            if created_dir and not any(out.iterdir()):
                out.rmdir()
        if isinstance(e, DataError) and stats.sequences == 0:
            raise PrepareError(
                f"--input: no sequences with assistant tokens in {', '.join(map(str, inputs))}"
            ) from None
        raise PrepareError(str(e)) from None
    index = _record_target(out, index, target)
    dt = time.monotonic() - t0
    log(f"{PROG}: wrote {out}: {index['num_sequences']} sequences, {index['num_tokens']} tokens "
        f"({index['num_supervised_tokens']} supervised), {len(index['shards'])} shard(s) in "
        f"{dt:.1f}s; truncated {stats.truncated}, skipped {stats.skipped_empty} without "
        f"assistant tokens; hash {index['hash'][:16]}")
    return index


def _record_target(out: Path, index: dict, target) -> dict:
    """index.json gains "target": the tokenizer the shards were made with (trainer/model/identity.py), which
    the trainer, dflash-eval and dflash-regenerate compare with their target's. Readers ignore the key."""
    from trainer.fsutil import atomic_write_text
    from trainer.model.identity import RECORD_KEY, record_for_data
    try:
        index = {**index, RECORD_KEY: record_for_data(target)}
    except (OSError, ValueError):
        return index   # the tokenizer loaded above; a target whose config cannot be read records nothing
    atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Tokenise chat/completion JSONL into shards.")
    ap.add_argument("--target-model", required=True, help="local HF model dir (its tokenizer)")
    ap.add_argument("--input", action="append", required=True, help="JSONL file (repeatable)")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-seq-len", type=int, default=0, help="truncate longer (0 = no limit)")
    ap.add_argument("--shard-size", type=int, default=10000, help="sequences per shard")
    ap.add_argument("--force", action="store_true", help="replace shards already in --output-dir")
    args = ap.parse_args(argv)
    try:
        prepare(
            args.target_model,
            args.input,
            args.output_dir,
            max_seq_len=args.max_seq_len,
            shard_size=args.shard_size,
            force=args.force,
        )
    except PrepareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from trainer.optional import defer
    defer()   # a program (python -m): torchao only when asked for (trainer/optional.py)
    sys.exit(main())
