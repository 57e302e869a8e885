"""Token shards on disk, the in-memory dataset, length-bucketed token-budget batching.

Shard format (docs/contracts.md, "Data"): ``<dir>/shard-00000.parquet ...`` with columns
``input_ids: list<int32>`` and ``loss_mask: list<int8>`` (1 = assistant/completion token), plus
``<dir>/index.json``::

    {"format": "dflash-shards-v1", "num_sequences", "num_tokens", "num_supervised_tokens",
     "shards": [{"file", "num_sequences", "num_tokens", "sha256"}], "tokenizer", "hash"}

``hash`` is the sha256 of the canonical JSON of the shard list (file, counts, sha256 of each shard
file), so it changes whenever any shard's bytes change.

Every problem with a data directory raises :class:`DataError` (a ``ValueError``) whose message names
the exact file (or directory) at fault.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from trainer.fsutil import atomic_write_text

FORMAT = "dflash-shards-v1"
INDEX_NAME = "index.json"
SHARD_PATTERN = "shard-{:05d}.parquet"
_SHARD_RE = re.compile(r"^shard-\d{5,}\.parquet$")
DEFAULT_SHARD_SIZE = 10000  # sequences per shard

__all__ = [
    "DataError",
    "write_shards",
    "write_shard",
    "write_index",
    "check_record",
    "load_dataset",
    "check_data_dir",
    "read_index",
    "Dataset",
    "BatchPlanner",
    "Batch",
    "collate",
    "DataPosition",
]


class DataError(ValueError):
    """A data directory, index or shard is missing or malformed. The message names the file."""


# --------------------------------------------------------------------------------------------
# Writing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _overall_hash(shards: Sequence[dict]) -> str:
    canon = [
        {
            "file": s["file"],
            "num_sequences": int(s["num_sequences"]),
            "num_tokens": int(s["num_tokens"]),
            "sha256": s["sha256"],
        }
        for s in shards
    ]
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _existing_data_files(out_dir: Path) -> list[Path]:
    if not out_dir.is_dir():
        return []
    return sorted(
        p for p in out_dir.iterdir() if p.name == INDEX_NAME or _SHARD_RE.match(p.name)
    )


def write_shard(path: str | os.PathLike, ids: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> dict:
    """Write one parquet shard atomically (temp file, fsync, rename) and return its index entry
    ``{"file", "num_sequences", "num_tokens", "sha256"}`` plus ``num_supervised_tokens``. ``ids`` and
    ``masks`` are already checked, equally long, non-empty 1-D arrays."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    schema = pa.schema(
        [("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))]
    )
    lengths = np.array([len(a) for a in ids], dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids_flat = np.concatenate(ids).astype(np.int32, copy=False)
    mask_flat = (np.concatenate(masks) != 0).astype(np.int8, copy=False)
    table = pa.Table.from_arrays(
        [
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids_flat)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask_flat)),
        ],
        schema=schema,
    )
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {
        "file": path.name,
        "num_sequences": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
        "sha256": sha256_file(path),
        "num_supervised_tokens": int(np.count_nonzero(mask_flat)),
    }


def write_index(
    out_dir: str | os.PathLike,
    shards: Sequence[dict],
    tokenizer_name: str | None = None,
    extra: dict | None = None,
) -> dict:
    """Write ``out_dir/index.json`` (atomically) for shard entries as :func:`write_shard` returns
    them; ``extra`` keys (e.g. what generated the data) are added to the index. Returns the index."""
    if not shards:
        raise DataError(f"{out_dir}: no records to write")
    entries = [{k: s[k] for k in ("file", "num_sequences", "num_tokens", "sha256")} for s in shards]
    index = {
        "format": FORMAT,
        "num_sequences": sum(s["num_sequences"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_supervised_tokens": sum(s["num_supervised_tokens"] for s in shards),
        "shards": entries,
        "tokenizer": tokenizer_name,
        "hash": _overall_hash(entries),
        **(extra or {}),
    }
    atomic_write_text(Path(out_dir) / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return index


def check_record(n: int, rec, where) -> tuple[np.ndarray, np.ndarray]:
    """Record ``n`` as (int32 ids, int8 mask); raises :class:`DataError` naming ``where``."""
    try:
        ids, mask = rec
    except (TypeError, ValueError):
        raise DataError(f"{where}: record {n} is not an (input_ids, loss_mask) pair") from None
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    mask = np.asarray(mask).reshape(-1)
    if len(ids) == 0:
        raise DataError(f"{where}: record {n} has no tokens")
    if len(ids) != len(mask):
        raise DataError(
            f"{where}: record {n}: input_ids has {len(ids)} tokens but loss_mask {len(mask)}"
        )
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise DataError(f"{where}: record {n}: token id out of int32 range")
    return ids.astype(np.int32), (mask != 0).astype(np.int8)


def write_shards(
    records: Iterable[tuple[Sequence[int], Sequence[int]]],
    out_dir: str | os.PathLike,
    shard_size: int = DEFAULT_SHARD_SIZE,
    tokenizer_name: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Write ``(input_ids, loss_mask)`` records as parquet shards plus ``index.json``.

    Records are consumed lazily; at most ``shard_size`` sequences are held in memory. Returns the
    index dict (also written to ``out_dir/index.json``). Raises :class:`DataError` when ``out_dir``
    already holds shards or an index (unless ``overwrite``, which removes them first), when a record
    is empty or its two lists differ in length, or when there are no records at all.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = _existing_data_files(out)
    if existing:
        if not overwrite:
            raise DataError(
                f"{existing[0]}: output directory {out} already holds shards or an index "
                "(refusing to overwrite)"
            )
        for p in existing:
            p.unlink()

    shards: list[dict] = []
    buf_ids: list[np.ndarray] = []
    buf_mask: list[np.ndarray] = []

    def flush() -> None:
        if buf_ids:
            shards.append(write_shard(out / SHARD_PATTERN.format(len(shards)), buf_ids, buf_mask))
            buf_ids.clear()
            buf_mask.clear()

    for n, rec in enumerate(records):
        ids, mask = check_record(n, rec, out)
        buf_ids.append(ids)
        buf_mask.append(mask)
        if len(buf_ids) >= shard_size:
            flush()
    flush()
    return write_index(out, shards, tokenizer_name)


# --------------------------------------------------------------------------------------------
# Reading


def read_index(data_dir: str | os.PathLike) -> dict:
    """Read and structurally validate ``data_dir/index.json`` (no shard is opened)."""
    d = Path(data_dir)
    if not d.exists():
        raise DataError(f"{d}: data directory does not exist")
    if not d.is_dir():
        raise DataError(f"{d}: data directory is not a directory")
    ipath = d / INDEX_NAME
    if not ipath.is_file():
        if any(_SHARD_RE.match(p.name) for p in d.iterdir()):
            raise DataError(f"{ipath}: index.json missing (shards present but no index)")
        raise DataError(
            f"{d}: no shards (expected shard-*.parquet and index.json; run dflash-prepare)"
        )
    try:
        index = json.loads(ipath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{ipath}: unreadable index: {e}") from None
    if not isinstance(index, dict):
        raise DataError(f"{ipath}: index is not a JSON object")
    if index.get("format") != FORMAT:
        raise DataError(f"{ipath}: unknown format {index.get('format')!r} (expected {FORMAT!r})")
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise DataError(f"{ipath}: 'shards' is missing or not a list")
    if not shards:
        raise DataError(f"{ipath}: no shards listed")
    for i, s in enumerate(shards):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and _SHARD_RE.match(s["file"]) is not None
            and isinstance(s.get("num_sequences"), int)
            and isinstance(s.get("num_tokens"), int)
            and isinstance(s.get("sha256"), str)
        )
        if not ok:
            raise DataError(f"{ipath}: shard entry {i} is malformed: {s!r}")
    if index.get("hash") != _overall_hash(shards):
        raise DataError(f"{ipath}: overall hash does not match the shard list (index edited?)")
    if index.get("num_sequences") != sum(s["num_sequences"] for s in shards):
        raise DataError(f"{ipath}: num_sequences does not match the sum over shards")
    return index


def check_data_dir(data_dir: str | os.PathLike) -> dict:
    """Cheap validation (for --check-config): the directory exists, ``index.json`` is readable and
    every shard it lists is present and non-empty. Reads no shard. Returns the index."""
    d = Path(data_dir)
    index = read_index(d)
    for s in index["shards"]:
        p = d / s["file"]
        if not p.is_file():
            raise DataError(f"{p}: shard listed in {d / INDEX_NAME} is missing")
        if p.stat().st_size == 0:
            raise DataError(f"{p}: shard is empty")
    return index


def _read_shard(path: Path, entry: dict, verify: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (flat int32 ids, flat int8 mask, int64 lengths) for one shard."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"{path}: shard listed in index.json is missing")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read shard: {e}") from None
    if verify:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != entry["sha256"]:
            raise DataError(
                f"{path}: sha256 mismatch (index says {entry['sha256'][:12]}..., "
                f"file is {digest[:12]}...)"
            )
    try:
        table = pq.read_table(pa.BufferReader(raw))
    except Exception as e:  # pyarrow raises several types for non-parquet input
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    cols = set(table.column_names)
    if not {"input_ids", "loss_mask"} <= cols:
        raise DataError(
            f"{path}: malformed shard: expected columns input_ids and loss_mask, "
            f"found {sorted(cols)}"
        )
    out = []
    for name in ("input_ids", "loss_mask"):
        col = table.column(name)
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or not (
            pa.types.is_integer(col.type.value_type)
        ):
            raise DataError(f"{path}: malformed shard: column {name} has type {col.type}")
        if col.null_count:
            raise DataError(f"{path}: malformed shard: column {name} has null rows")
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = pc.list_flatten(arr)
        if flat.null_count:
            raise DataError(f"{path}: malformed shard: column {name} has null values")
        out.append((flat.to_numpy(zero_copy_only=False), lengths))
    (ids, id_len), (mask, mask_len) = out
    if not np.array_equal(id_len, mask_len):
        bad = int(np.nonzero(id_len != mask_len)[0][0])
        raise DataError(
            f"{path}: malformed shard: row {bad} has {id_len[bad]} input_ids but "
            f"{mask_len[bad]} loss_mask values"
        )
    if len(id_len) != entry["num_sequences"]:
        raise DataError(
            f"{path}: shard has {len(id_len)} sequences but index.json says {entry['num_sequences']}"
        )
    if len(id_len) and id_len.min() == 0:
        raise DataError(f"{path}: malformed shard: row {int(np.argmin(id_len))} is empty")
    if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise DataError(f"{path}: malformed shard: token id out of range")
    return ids.astype(np.int32, copy=False), (mask != 0).astype(np.int8), id_len


class Dataset:
    """All sequences in memory: one flat int32 token array, one int8 mask array and offsets."""

    def __init__(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        lengths: np.ndarray,
        index: dict | None = None,
        data_dir: str | None = None,
    ):
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.mask = np.ascontiguousarray(mask, dtype=np.int8)
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        if self.offsets[-1] != len(self.tokens) or len(self.tokens) != len(self.mask):
            raise ValueError("tokens/mask/lengths are inconsistent")
        self.index = index or {}
        self.data_dir = data_dir

    @classmethod
    def from_records(cls, records: Iterable[tuple[Sequence[int], Sequence[int]]]) -> "Dataset":
        ids, masks, lens = [], [], []
        for a, m in records:
            a = np.asarray(a, dtype=np.int32).reshape(-1)
            m = np.asarray(m).reshape(-1)
            if len(a) != len(m) or len(a) == 0:
                raise ValueError("each record needs equally long, non-empty input_ids/loss_mask")
            ids.append(a)
            masks.append((m != 0).astype(np.int8))
            lens.append(len(a))
        if not ids:
            return cls(np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros(0, np.int64))
        return cls(np.concatenate(ids), np.concatenate(masks), np.array(lens, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.lengths)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b].astype(np.int64), self.mask[a:b].astype(bool)

    @property
    def num_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def num_supervised_tokens(self) -> int:
        return int(np.count_nonzero(self.mask))

    @property
    def hash(self) -> str | None:
        return self.index.get("hash")

    def __repr__(self) -> str:
        return (
            f"Dataset({len(self)} sequences, {self.num_tokens} tokens, "
            f"{self.num_supervised_tokens} supervised, dir={self.data_dir!r})"
        )


def load_dataset(data_dir: str | os.PathLike, verify: bool = True) -> Dataset:
    """Load every shard listed in ``data_dir/index.json`` (one shard at a time) into memory.

    With ``verify`` (default) each shard's sha256 is checked against the index.
    """
    d = Path(data_dir)
    index = read_index(d)
    ids_parts, mask_parts, len_parts = [], [], []
    for entry in index["shards"]:
        ids, mask, lens = _read_shard(d / entry["file"], entry, verify)
        ids_parts.append(ids)
        mask_parts.append(mask)
        len_parts.append(lens)
    return Dataset(
        np.concatenate(ids_parts),
        np.concatenate(mask_parts),
        np.concatenate(len_parts),
        index=index,
        data_dir=str(d),
    )


# --------------------------------------------------------------------------------------------
# Batching


def _bucket_bounds(max_seq_len: int, ratio: float, granularity: int = 8) -> np.ndarray:
    """Increasing bucket upper bounds (multiples of ``granularity``), the last is max_seq_len."""
    bounds = []
    b = granularity
    while b < max_seq_len:
        bounds.append(b)
        nxt = int(math.ceil(b * ratio / granularity) * granularity)
        b = max(b + granularity, nxt)
    bounds.append(max_seq_len)
    return np.array(bounds, dtype=np.int64)


class BatchPlanner:
    """Length-bucketed batches under a padded-token budget, shuffled deterministically per epoch.

    - Sequences longer than ``max_seq_len`` are truncated to it (``num_truncated``) or, with
      ``drop_long``, left out (``num_dropped``).
    - Sequences fall into length buckets (upper bounds grow by ``bucket_ratio``, multiples of 8,
      the last one is ``max_seq_len``). A bucket with upper bound U holds batches of at most
      ``min(max_batch_size, token_budget // U)`` sequences, so every batch satisfies
      ``batch_size * longest_in_batch <= token_budget`` and the number of batches per epoch is the
      same for every epoch (``len(planner)``).
    - ``epoch_batches(epoch)``: per bucket a permutation, cut into batches, then a permutation of
      all batches; the RNG is seeded from ``(seed, epoch)`` only. Every kept sample appears exactly
      once per epoch.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        token_budget: int,
        max_seq_len: int,
        max_batch_size: int,
        seed: int = 0,
        drop_long: bool = False,
        bucket_ratio: float = 1.1,
    ):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if token_budget < max_seq_len:
            raise ValueError(
                f"token_budget ({token_budget}) must be >= max_seq_len ({max_seq_len})"
            )
        if bucket_ratio <= 1.0:
            raise ValueError(f"bucket_ratio must be > 1, got {bucket_ratio}")
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self.raw_lengths = lengths
        self.token_budget = int(token_budget)
        self.max_seq_len = int(max_seq_len)
        self.max_batch_size = int(max_batch_size)
        self.seed = int(seed)
        self.drop_long = bool(drop_long)

        long = lengths > max_seq_len
        if drop_long:
            self.num_dropped = int(long.sum())
            self.num_truncated = 0
            kept = np.nonzero(~long)[0]
        else:
            self.num_dropped = 0
            self.num_truncated = int(long.sum())
            kept = np.arange(len(lengths))
        self.kept_indices = kept
        self.lengths = np.minimum(lengths, max_seq_len)  # effective length of every sample

        bounds = _bucket_bounds(self.max_seq_len, bucket_ratio)
        eff = self.lengths[kept]
        bucket_of = np.searchsorted(bounds, eff, side="left")
        self._buckets: list[tuple[int, np.ndarray]] = []  # (capacity, sample indices ascending)
        for b in np.unique(bucket_of):
            members = kept[bucket_of == b]
            cap = max(1, min(self.max_batch_size, self.token_budget // int(bounds[b])))
            self._buckets.append((cap, members))
        self._num_batches = sum(int(math.ceil(len(m) / cap)) for cap, m in self._buckets)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # epoch -> _plan(epoch)

    @property
    def num_samples(self) -> int:
        return int(len(self.kept_indices))

    @property
    def num_batches(self) -> int:
        return self._num_batches

    def __len__(self) -> int:
        return self._num_batches

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``epoch``'s batches as one array of sample indices and the batches' offsets into it. The cache
        holds the epochs next to the last one asked for too: near an epoch's end the prefetch thread
        asks for the next epoch while the main thread is still in this one. It is replaced as a whole,
        never edited, and read once per call (the other thread may replace it in between)."""
        cache = self._cache
        hit = cache.get(epoch)
        if hit is not None:
            return hit
        rng = np.random.default_rng(
            [self.seed & 0xFFFFFFFF, (self.seed >> 32) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF]
        )
        parts: list[np.ndarray] = []
        for cap, members in self._buckets:
            perm = members[rng.permutation(len(members))]
            parts.extend(perm[i : i + cap] for i in range(0, len(perm), cap))
        order = rng.permutation(len(parts))
        parts = [parts[i] for i in order]
        flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(b) for b in parts], out=offsets[1:])
        plan = (flat, offsets)
        self._cache = {**{e: v for e, v in cache.items() if abs(e - epoch) == 1}, epoch: plan}
        return plan

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches (lists of sample indices) of ``epoch``, in training order."""
        flat, offsets = self._plan(epoch)
        return [b.tolist() for b in np.split(flat, offsets[1:-1])] if len(offsets) > 1 else []

    def batch(self, epoch: int, index: int) -> list[int]:
        """Batch ``index`` of ``epoch``: ``epoch_batches(epoch)[index]`` without building the epoch's list
        (a micro-batch's dispatch and collate ask for one batch; an epoch can hold 10K of them)."""
        flat, offsets = self._plan(epoch)
        return flat[offsets[index] : offsets[index + 1]].tolist()

    def max_batch_shapes(self, pad_multiple: int = 1) -> int:
        """Upper bound on the distinct [B, S] batch shapes over any number of epochs, with each batch
        padded to its longest sequence rounded up to ``pad_multiple``. A bucket's batches all hold
        ``cap`` sequences except one of ``len % cap`` per epoch; S is a member's padded length. Per-shape
        caches (cuDNN's attention plans, each holding host memory: results/INDEX.md,
        h200x2-1.7b-shape-cache-probe.json) stop growing at this many entries."""
        total = 0
        for cap, members in self._buckets:
            padded = -(-self.lengths[members] // pad_multiple) * pad_multiple
            sizes = {min(cap, len(members))} | ({len(members) % cap} if len(members) % cap else set())
            total += len(np.unique(padded)) * len(sizes)
        return total

    def stats(self) -> dict:
        return {
            "num_sequences": int(len(self.raw_lengths)),
            "num_kept": self.num_samples,
            "num_truncated": self.num_truncated,
            "num_dropped": self.num_dropped,
            "num_batches_per_epoch": self._num_batches,
            "num_buckets": len(self._buckets),
        }


@dataclasses.dataclass
class Batch:
    """A right-padded batch. ``input_ids``/``loss_mask`` are [B, S] with
    S = longest sequence in the batch; ``lengths`` is [B]; padding is token 0, mask False."""

    input_ids: "torch.Tensor"  # noqa: F821  LongTensor [B, S]
    loss_mask: "torch.Tensor"  # noqa: F821  BoolTensor [B, S]
    lengths: "torch.Tensor"  # noqa: F821  LongTensor [B]
    sample_ids: list[int]
    num_tokens: int  # real (unpadded) tokens
    num_loss_tokens: int  # supervised tokens

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def collate(dataset: Dataset, indices: Sequence[int], max_seq_len: int, pad_multiple: int = 1) -> Batch:
    """Stack samples ``indices`` of ``dataset`` into a right-padded :class:`Batch`, each truncated
    to its first ``max_seq_len`` tokens. The padded length is rounded up to a multiple of
    ``pad_multiple``: without it nearly every batch has its own [B, S] shape, and per-shape caches
    (cuDNN attention plans are kept per thread and per shape, unbounded) grow with the run."""
    import torch

    if len(indices) == 0:
        raise ValueError("collate needs at least one index")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    starts = dataset.offsets[np.asarray(indices, dtype=np.int64)]
    lens = np.minimum(dataset.lengths[np.asarray(indices, dtype=np.int64)], max_seq_len)
    B, S = len(indices), -(-int(lens.max()) // pad_multiple) * pad_multiple
    ids = np.zeros((B, S), dtype=np.int64)
    mask = np.zeros((B, S), dtype=bool)
    for r, (a, n) in enumerate(zip(starts, lens)):
        ids[r, :n] = dataset.tokens[a : a + n]
        mask[r, :n] = dataset.mask[a : a + n] != 0
    lengths = torch.from_numpy(lens.astype(np.int64))
    return Batch(
        input_ids=torch.from_numpy(ids),
        loss_mask=torch.from_numpy(mask),
        lengths=lengths,
        sample_ids=[int(i) for i in indices],
        num_tokens=int(lens.sum()),
        num_loss_tokens=int(mask.sum()),
    )


@dataclasses.dataclass(frozen=True, order=True)
class DataPosition:
    """Where the data stream stands: batch ``batch_index`` of epoch ``epoch`` is the next one to
    train on (stored in a checkpoint)."""

    epoch: int = 0
    batch_index: int = 0

    def to_dict(self) -> dict:
        return {"epoch": int(self.epoch), "batch_index": int(self.batch_index)}
