"""The target a drafter was trained on: one definition, recorded in every checkpoint and export, and
checked wherever a drafter meets a target (docs/contracts.md "Target identity").

A drafter reads the hidden states of particular layers of one particular model through that model's
tokenizer; against another target its weights mean nothing, even when every shape fits. What it
depends on is :class:`TargetIdentity`:

    model_type, hidden_size, num_hidden_layers, vocab_size   the target's config.json (text_config first)
    target_layer_ids, mask_token_id                          what the drafter taps and feeds its blocks
    tokenizer    sha256 of what maps text to ids (tokenizer.json's model, added tokens, normalizer and
                 pre-tokenizer; else the slow tokenizer's vocabulary files); None without tokenizer files
    config       sha256 of config.json, canonical, without the keys that name a copy rather than the
                 model (_name_or_path, transformers_version, _commit_hash)
    name, revision   where known (config's _name_or_path; a Hugging Face cache path's repo and snapshot):
                 recorded for people, never compared (a staged copy of the same model has another path)

Standard library only: preflight.py's cheap checks (--check-config) use it without importing torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the key under which meta.json (checkpoints) and export.json (exports) hold the identity
RECORD_KEY = "target"
# the flag that lets a run, an eval or an export go on against a target that differs
ALLOW_FLAG = "--allow-target-change"
# config.json keys that name a copy of the model, not the model
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")
# files of a slow tokenizer (no tokenizer.json), hashed whole
_SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "added_tokens.json")
MASK_TOKEN_NAMES = ("<|mask|>", "<|MASK|>", "<mask>")
_HF_CACHE_RE = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/([0-9a-f]{7,64})")


class TargetMismatch(ValueError):
    """A drafter and a target that do not belong together; the message is one line naming what differs."""


@dataclass
class TargetIdentity:
    model_type: str | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    vocab_size: int | None = None
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    tokenizer: str | None = None
    config: str | None = None
    name: str | None = None
    revision: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "TargetIdentity":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})

    def describe(self) -> str:
        """'qwen3 Qwen/Qwen3-8B@abc123 (36 layers, hidden 4096, vocab 151936)' for messages and logs."""
        who = (self.name or "?") + (f"@{self.revision[:12]}" if self.revision else "")
        return (f"{self.model_type or '?'} {who} ({self.num_hidden_layers} layers, hidden {self.hidden_size}, "
                f"vocab {self.vocab_size})")


# ------------------------------------------------------------------------------ reading a target


def text_config(config: dict) -> dict:
    """The language model's part of a config.json (multimodal models nest it under text_config)."""
    return config.get("text_config") or config


def tap_layers(num_target_layers: int, num_taps: int) -> list[int]:
    """Evenly spread taps: round(1 + i * (L - 4) / (K - 1)); Qwen3-8B (36 layers, 5) -> [1, 9, 17, 25, 33].
    The rule trainer/model/drafter.py's tap_layers applies (tests/model/test_identity.py holds the two together)."""
    if num_taps < 1:
        raise ValueError("need at least one tap")
    if num_taps == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        return sorted({min(num_target_layers - 1, round(i * (num_target_layers - 1) / (num_taps - 1)))
                       for i in range(num_taps)})
    return [int(round(1 + i * (num_target_layers - 4) / (num_taps - 1))) for i in range(num_taps)]


def config_fingerprint(config: dict) -> str:
    clean = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """sha256 of what maps text to token ids; None when the directory has no tokenizer files."""
    d = Path(model_dir)
    tj = d / "tokenizer.json"
    if tj.is_file():
        t = json.loads(tj.read_text(encoding="utf-8"))
        core = {k: t.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer")}
        return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    files = [d / f for f in _SLOW_TOKENIZER_FILES if (d / f).is_file()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _token_ids(model_dir: Path) -> dict[str, int]:
    """token text -> id from the tokenizer files (added tokens win, as in transformers)."""
    ids: dict[str, int] = {}
    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        t = json.loads(tj.read_text(encoding="utf-8"))
        vocab = (t.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids.update({k: int(v) for k, v in vocab.items()})
        ids.update({a["content"]: int(a["id"]) for a in t.get("added_tokens") or [] if "content" in a})
    else:
        vj = model_dir / "vocab.json"
        if vj.is_file():
            ids.update({k: int(v) for k, v in json.loads(vj.read_text(encoding="utf-8")).items()})
    tc = model_dir / "tokenizer_config.json"
    if tc.is_file():
        dec = json.loads(tc.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        ids.update({v["content"]: int(k) for k, v in dec.items() if isinstance(v, dict) and "content" in v})
    return ids


@dataclass
class MaskChoice:
    """The MASK token a run feeds its blocks, and where it came from (the run log's words)."""
    token_id: int
    source: str


def _content(v) -> str | None:
    """A tokenizer_config.json special-token entry: a string, or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


@dataclass
class TokenizerFacts:
    """What the MASK rule reads of a tokenizer's files: token ids, the added (special) tokens, the roles
    bos/eos/pad/unk/mask, and the chat template's text."""
    ids: dict[str, int]
    added: dict[int, tuple[str, bool]]   # id -> (text, special)
    roles: dict[str, str]                # bos_token/eos_token/pad_token/unk_token/mask_token -> text
    role_ids: set[int]                   # their ids, and config.json's bos/eos/pad ids
    chat_template: str

    @property
    def size(self) -> int:
        """Rows the tokenizer can produce: its highest id + 1 (0 without token files)."""
        return max(self.ids.values(), default=-1) + 1


def tokenizer_facts(model_dir: str | os.PathLike) -> TokenizerFacts:
    """Read from tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
    config.json, without loading a tokenizer. Missing or unreadable files count as empty."""
    d = Path(model_dir)

    def read(name: str) -> dict:
        try:
            v = json.loads((d / name).read_text(encoding="utf-8"))
            return v if isinstance(v, dict) else {}
        except (OSError, ValueError):
            return {}

    ids = {}
    try:
        ids = _token_ids(d)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    added: dict[int, tuple[str, bool]] = {}
    for a in read("tokenizer.json").get("added_tokens") or []:
        if isinstance(a, dict) and "content" in a and "id" in a:
            added[int(a["id"])] = (a["content"], bool(a.get("special", False)))
    tc = read("tokenizer_config.json")
    for k, v in (tc.get("added_tokens_decoder") or {}).items():
        if isinstance(v, dict) and "content" in v:
            added[int(k)] = (v["content"], bool(v.get("special", False)))
    roles = {}
    for src in (read("special_tokens_map.json"), tc):
        for role in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
            text = _content(src.get(role))
            if text:
                roles[role] = text
    template = tc.get("chat_template") or ""
    if isinstance(template, list):   # [{"name": ..., "template": ...}, ...]
        template = "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        try:
            template += "\n" + jinja.read_text(encoding="utf-8")
        except OSError:
            pass
    cfg = text_config(read("config.json"))
    role_ids = {ids[t] for r, t in roles.items() if r != "mask_token" and t in ids}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key)
        role_ids.update(v if isinstance(v, list) else [v] if isinstance(v, int) else [])
    return TokenizerFacts(ids, added, roles, role_ids, template if isinstance(template, str) else "")


def resolve_mask_token(model_dir: str | os.PathLike, vocab_size: int, override: int | None = None,
                       contract=None) -> MaskChoice:
    """THE MASK rule (the trainer, preflight, the identity and the resume check all call it), first match:
      1. --mask-token-id (ValueError naming the flag when outside the vocabulary);
      2. the family's published contract (trainer/model/families.py; qwen3_5 -> 248070, qwen3 -> 151669),
         where the vocabulary has that row;
      3. the tokenizer's mask token (tokenizer_config's mask_token, or a <|mask|>, <|MASK|>, <mask> token);
      4. the first embedding row past the tokenizer's tokens, where the vocabulary is larger (a row the
         tokenizer never produces: Qwen3's 151669 is that row);
      5. the highest-id added special token that is not bos/eos/pad/unk and that the chat template never
         writes (a vocabulary with no spare row, e.g. SmolLM2's <empty_output>); else such an added token
         not marked special;
      6. the last row.
    Read from the tokenizer's files without loading it."""
    if override is not None:
        if not 0 <= int(override) < vocab_size:
            raise ValueError(f"--mask-token-id: {override} is outside the vocabulary (0..{vocab_size - 1})")
        return MaskChoice(int(override), "--mask-token-id")
    tok = tokenizer_facts(model_dir)
    text_at = {i: t for t, i in tok.ids.items()}
    if contract is not None and contract.mask_token_id is not None and contract.mask_token_id < vocab_size:
        mid = contract.mask_token_id
        named = f", the tokenizer's {text_at[mid]!r}" if mid in text_at else ", a row the tokenizer never produces" \
            if mid >= tok.size > 0 else ""
        return MaskChoice(mid, f"the {contract.family} family's published contract ({contract.published}{named})")
    for name in ([tok.roles["mask_token"]] if "mask_token" in tok.roles else []) + list(MASK_TOKEN_NAMES):
        tid = tok.ids.get(name)
        if tid is not None and 0 <= tid < vocab_size:
            return MaskChoice(tid, f"the tokenizer's mask token {name!r}")
    if 0 < tok.size < vocab_size:
        return MaskChoice(tok.size, f"the first row past the tokenizer's {tok.size} tokens (never produced by it)")
    unused = {i: special for i, (text, special) in tok.added.items()
              if i < vocab_size and i not in tok.role_ids and text not in tok.roles.values()
              and text not in tok.chat_template}
    # a special one first; a tokenizer rebuilt from GGUF may have lost the flag on its code markers
    for want, kind in ((True, "added special token"), (False, "added token (not marked special)")):
        spare = [i for i, special in unused.items() if special == want]
        if spare:
            i = max(spare)
            return MaskChoice(i, f"the {kind} {tok.added[i][0]!r}: not bos/eos/pad/unk, never written by the chat "
                                 "template (the vocabulary has no mask token and no spare row)")
    return MaskChoice(vocab_size - 1, "the last row (no mask token, spare row or unused special token"
                      + (")" if tok.ids else "; no tokenizer files)"))


def resolve_mask_token_id(model_dir: str | os.PathLike, vocab_size: int, override: int | None = None,
                          contract=None) -> int:
    """resolve_mask_token's id alone."""
    return resolve_mask_token(model_dir, vocab_size, override, contract).token_id


def _name_and_revision(model_dir: Path, config: dict) -> tuple[str | None, str | None]:
    m = _HF_CACHE_RE.search(str(model_dir.resolve()))
    if m:
        return f"{m.group(1)}/{m.group(2)}", m.group(3)
    name = config.get("_name_or_path") or model_dir.resolve().name or None
    return name, config.get("_commit_hash")


_CACHE: dict[tuple, TargetIdentity] = {}


def _stamp(d: Path) -> tuple:
    out = []
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", *_SLOW_TOKENIZER_FILES):
        try:
            st = (d / f).stat()
            out.append((f, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
    return tuple(out)


def of_target(model_dir: str | os.PathLike, target_layer_ids: list[int] | None = None,
              mask_token_id: int | None = None) -> TargetIdentity:
    """The identity of the target in `model_dir` (a local HF model directory), with the drafter's taps and
    mask token when given. Reads config.json and the tokenizer files (cached per unchanged files).
    Raises OSError / ValueError when config.json is unreadable."""
    d = Path(model_dir)
    key = (str(d.resolve()), _stamp(d))
    base = _CACHE.get(key)
    if base is None:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"{d / 'config.json'} is not a JSON object")
        t = text_config(config)
        name, revision = _name_and_revision(d, config)
        try:
            tok = tokenizer_fingerprint(d)
        except (OSError, ValueError):
            tok = None
        base = TargetIdentity(model_type=t.get("model_type") or config.get("model_type"),
                              hidden_size=t.get("hidden_size"), num_hidden_layers=t.get("num_hidden_layers"),
                              vocab_size=t.get("vocab_size"), tokenizer=tok, config=config_fingerprint(config),
                              name=name, revision=revision)
        _CACHE[key] = base
    return dataclasses.replace(base, target_layer_ids=list(target_layer_ids) if target_layer_ids is not None
                               else None, mask_token_id=mask_token_id)


def of_config(config: dict) -> TargetIdentity:
    """The shape part of the identity of a target given by its config (e.g. a loaded model's
    `config.to_dict()`): no fingerprints, no name."""
    t = text_config(config)
    return TargetIdentity(model_type=t.get("model_type") or config.get("model_type"),
                          hidden_size=t.get("hidden_size"), num_hidden_layers=t.get("num_hidden_layers"),
                          vocab_size=t.get("vocab_size"))


def for_run(model_dir: str | os.PathLike, num_draft_layers: int, target_layers: list[int] | None,
            mask_token_id: int | None) -> TargetIdentity:
    """The identity a training run with these flags gives its drafter (taps and mask resolved as the
    trainer resolves them)."""
    ident = of_target(model_dir)
    layers, vocab = ident.num_hidden_layers, ident.vocab_size
    taps = list(target_layers) if target_layers else (tap_layers(layers, num_draft_layers) if layers else None)
    mask = resolve_mask_token_id(model_dir, vocab, mask_token_id) if vocab else mask_token_id
    return dataclasses.replace(ident, target_layer_ids=taps, mask_token_id=mask)


# ------------------------------------------------------------------------------ reading a drafter


def from_drafter_config(d: dict) -> TargetIdentity:
    """What any drafter config.json says of its target (the trainer's checkpoint layout or an export's HF
    layout): enough to compare shapes for checkpoints written before identities were recorded."""
    sub = d.get("dflash_config") or {}
    layers = d.get("target_num_hidden_layers") or sub.get("num_target_layers") or d.get("num_target_layers")
    return TargetIdentity(hidden_size=d.get("hidden_size"), num_hidden_layers=layers,
                          vocab_size=d.get("vocab_size"),
                          target_layer_ids=d.get("target_layer_ids") or sub.get("target_layer_ids"),
                          mask_token_id=d.get("mask_token_id", sub.get("mask_token_id")))


def for_checkpoint(model_config: dict, train_state: dict | None) -> dict | None:
    """The identity a checkpoint records (meta.json's "target"): the run's target files (the path in the
    run config of `train_state`) with the drafter's taps and mask token from `model_config`. None when
    neither says enough."""
    try:   # a checkpoint is never lost for want of its record
        drafter = from_drafter_config(dict(model_config or {}))
        target = ((train_state or {}).get("config") or {}).get("target_model")
        if target:
            try:
                return of_target(target, drafter.target_layer_ids, drafter.mask_token_id).to_dict()
            except (OSError, ValueError):
                pass
        return drafter.to_dict() if drafter.hidden_size is not None else None
    except Exception:  # noqa: BLE001
        return None


def recorded(src: str | os.PathLike) -> tuple[TargetIdentity, bool]:
    """(identity, complete) of a checkpoint step dir or an export dir: meta.json's or export.json's
    record, filled in from config.json; complete=False when only config.json spoke (an older checkpoint:
    no fingerprints to compare)."""
    d = Path(src)
    base = TargetIdentity()
    cj = d / "config.json"
    if cj.is_file():
        base = from_drafter_config(json.loads(cj.read_text(encoding="utf-8")))
    for fn in ("meta.json", "export.json"):
        p = d / fn
        if p.is_file():
            try:
                rec = json.loads(p.read_text(encoding="utf-8")).get(RECORD_KEY)
            except (OSError, ValueError, AttributeError):
                rec = None
            if isinstance(rec, dict):
                merged = {**base.to_dict(), **{k: v for k, v in rec.items() if v is not None}}
                return TargetIdentity.from_dict(merged), True
    return base, False


# ------------------------------------------------------------------------------ comparing


def differences(trained: TargetIdentity, target: TargetIdentity, what: str = "the checkpoint",
                compare_drafter: bool = True) -> list[tuple[str, bool]]:
    """What differs between the target `what` was trained on and `target`, as (phrase, fatal) pairs;
    fatal: no flag can help (the drafter's weights cannot be used with that target). A field unknown
    on either side is not compared; name and revision never are. compare_drafter: also the taps and the
    mask token (a training run resolves them; an eval or export takes the drafter's own)."""
    out: list[tuple[str, bool]] = []

    def known(field: str) -> bool:
        return getattr(trained, field) is not None and getattr(target, field) is not None

    def differ(field: str) -> bool:
        return known(field) and getattr(trained, field) != getattr(target, field)

    if differ("model_type"):
        out.append((f"target is a {target.model_type} model, {what} was trained on a {trained.model_type}", False))
    if differ("num_hidden_layers"):
        out.append((f"target has {target.num_hidden_layers} layers, {what} was trained on "
                    f"{trained.num_hidden_layers}", False))
    if differ("hidden_size"):
        out.append((f"target has hidden size {target.hidden_size}, {what} was trained on {trained.hidden_size}",
                    True))
    if differ("vocab_size"):
        out.append((f"target has a vocabulary of {target.vocab_size}, {what} was trained on {trained.vocab_size}",
                    False))
    if compare_drafter and differ("target_layer_ids"):
        fatal = len(target.target_layer_ids) != len(trained.target_layer_ids)
        out.append((f"this run taps layers {list(target.target_layer_ids)}, {what} was trained on taps "
                    f"{list(trained.target_layer_ids)}", fatal))
    if compare_drafter and differ("mask_token_id"):
        out.append((f"this run's mask token is {target.mask_token_id}, {what} was trained with "
                    f"{trained.mask_token_id}", False))
    taps = trained.target_layer_ids or []
    if target.num_hidden_layers is not None and any(not 0 <= t < target.num_hidden_layers for t in taps):
        bad = [t for t in taps if not 0 <= t < target.num_hidden_layers]
        out.append((f"{what}'s taps {bad} are outside the target's {target.num_hidden_layers} layers", True))
    if differ("tokenizer"):
        out.append((f"target's tokenizer differs from the one {what} was trained with "
                    f"(fingerprint {target.tokenizer[:12]}, trained {trained.tokenizer[:12]})", False))
    if differ("config") and not out:
        out.append((f"target's config.json differs from the one {what} was trained on "
                    f"(fingerprint {target.config[:12]}, trained {trained.config[:12]})", False))
    return out


def check(trained: TargetIdentity, target: TargetIdentity, *, flag: str, what: str = "the checkpoint",
          allow: bool = False, compare_drafter: bool = True, where: str = "") -> list[str]:
    """Raise TargetMismatch (one line, starting with `flag`) when the target differs from the one `what` was
    trained on, unless `allow` and every difference is one a drafter's weights survive. Returns the
    differences that `allow` let through (the caller logs them)."""
    diffs = differences(trained, target, what, compare_drafter)
    if not diffs:
        return []
    fatal = [p for p, f in diffs if f]
    text = "; ".join(p for p, _ in diffs)
    tail = f" ({where})" if where else ""
    if fatal:
        raise TargetMismatch(f"{flag}: {text}{tail}; the drafter cannot run on this target"
                             + (f" even with {ALLOW_FLAG}" if allow else ""))
    if not allow:
        raise TargetMismatch(f"{flag}: {text}{tail} ({ALLOW_FLAG} continues on this target anyway)")
    return [p for p, _ in diffs]


def check_data_tokenizer(index: dict, target: TargetIdentity, flag: str, data_dir: str | os.PathLike) -> None:
    """The data's recorded tokenizer (index.json's "target" key, written by dflash-prepare) is the target's.
    Data without a record (older shards, dflash-tiny) is not compared."""
    rec = index.get(RECORD_KEY) if isinstance(index, dict) else None
    theirs = rec.get("tokenizer") if isinstance(rec, dict) else None
    if theirs and target.tokenizer and theirs != target.tokenizer:
        raise TargetMismatch(f"{flag}: {data_dir} was tokenized with another tokenizer than the target's "
                             f"(fingerprint {theirs[:12]}, target {target.tokenizer[:12]}; "
                             f"{rec.get('name') or 'unknown'} vs {target.name})")


def record_for_data(model_dir: str | os.PathLike) -> dict[str, Any]:
    """What dflash-prepare records in index.json under "target": the tokenizer the data was made with."""
    ident = of_target(model_dir)
    return {"tokenizer": ident.tokenizer, "name": ident.name, "revision": ident.revision,
            "vocab_size": ident.vocab_size}


def check_drafter_on_target(src: str | os.PathLike, target: str | os.PathLike | dict, *, allow: bool = False,
                            flag: str = "--target-model", what: str = "the drafter") -> list[str]:
    """A checkpoint or export dir `src` against a target (a model directory, or a loaded model's config
    dict): raises TargetMismatch naming what differs; returns what `allow` let through. The drafter's own
    taps and mask token are used, so they are checked against the target, not against a run's flags."""
    trained, _ = recorded(src)
    current = of_config(target) if isinstance(target, dict) else of_target(target)
    return check(trained, current, flag=flag, what=what, allow=allow, compare_drafter=False)


def check_data_dir_tokenizer(data_dir: str | os.PathLike, target_model: str | os.PathLike, flag: str) -> None:
    """check_data_tokenizer on `data_dir`'s index.json (an unreadable index or target is left to the caller's
    own checks: they name it better)."""
    try:
        index = json.loads((Path(data_dir) / "index.json").read_text(encoding="utf-8"))
        target = of_target(target_model)
    except (OSError, ValueError):
        return
    check_data_tokenizer(index, target, flag, data_dir)
