"""trainer.data: shards + index, DataError cases, BatchPlanner, collate."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.data.dataset import (
    BatchPlanner,
    DataError,
    Dataset,
    _overall_hash,
    check_data_dir,
    collate,
    load_dataset,
    sha256_file,
    write_shards,
)


def make_records(n=50, seed=0, lo=1, hi=120, vocab=1000):
    rng = np.random.default_rng(seed)
    recs = []
    for L in rng.integers(lo, hi, size=n):
        ids = rng.integers(0, vocab, size=L)
        mask = (rng.random(L) < 0.5).astype(np.int8)
        recs.append((ids, mask))
    return recs


@pytest.fixture
def shard_dir(tmp_path):
    d = tmp_path / "data"
    recs = make_records()
    write_shards(recs, d, shard_size=16, tokenizer_name="tok")
    return d, recs


def _rewrite_index_sha(d, i):
    """After changing shard i on purpose, make the index agree with it (to reach later checks)."""
    index = json.loads((d / "index.json").read_text())
    index["shards"][i]["sha256"] = sha256_file(d / index["shards"][i]["file"])
    index["hash"] = _overall_hash(index["shards"])
    (d / "index.json").write_text(json.dumps(index))


# ------------------------------------------------------------------ shards / index


def test_roundtrip_and_index(shard_dir):
    d, recs = shard_dir
    index = json.loads((d / "index.json").read_text())
    assert index["format"] == "dflash-shards-v1"
    assert index["num_sequences"] == len(recs) == 50
    assert index["num_tokens"] == sum(len(a) for a, _ in recs)
    assert index["num_supervised_tokens"] == sum(int(m.sum()) for _, m in recs)
    assert index["tokenizer"] == "tok"
    assert [s["file"] for s in index["shards"]] == [f"shard-{i:05d}.parquet" for i in range(4)]
    assert [s["num_sequences"] for s in index["shards"]] == [16, 16, 16, 2]
    for s in index["shards"]:
        assert s["sha256"] == sha256_file(d / s["file"])
    assert index["hash"] == _overall_hash(index["shards"])

    # Inspectable with standard tools, with the contract's column types.
    t = pq.read_table(d / "shard-00000.parquet")
    assert t.schema.field("input_ids").type == pa.list_(pa.int32())
    assert t.schema.field("loss_mask").type == pa.list_(pa.int8())

    ds = load_dataset(d)
    assert len(ds) == 50 and ds.hash == index["hash"]
    assert ds.num_tokens == index["num_tokens"]
    assert list(ds.lengths) == [len(a) for a, _ in recs]
    for i, (a, m) in enumerate(recs):
        ids, mask = ds[i]
        assert ids.dtype == np.int64 and mask.dtype == bool
        np.testing.assert_array_equal(ids, a)
        np.testing.assert_array_equal(mask, m != 0)
    assert check_data_dir(d)["hash"] == index["hash"]


def test_hash_depends_on_content(tmp_path):
    recs = make_records(10)
    h1 = write_shards(recs, tmp_path / "a")["hash"]
    h2 = write_shards(recs, tmp_path / "b")["hash"]
    recs[3][0][0] += 1
    h3 = write_shards(recs, tmp_path / "c")["hash"]
    assert h1 == h2 != h3


def test_write_refuses_existing_and_bad_records(tmp_path, shard_dir):
    d, recs = shard_dir
    with pytest.raises(DataError, match="already holds"):
        write_shards(recs, d)
    idx = write_shards(recs[:3], d, overwrite=True)
    assert idx["num_sequences"] == 3 and len(load_dataset(d)) == 3
    assert sorted(p.name for p in d.iterdir()) == ["index.json", "shard-00000.parquet"]
    with pytest.raises(DataError, match="loss_mask"):
        write_shards([([1, 2, 3], [1, 0])], tmp_path / "x")
    with pytest.raises(DataError, match="no tokens"):
        write_shards([([], [])], tmp_path / "y")
    with pytest.raises(DataError, match="no records"):
        write_shards([], tmp_path / "z")


def test_error_data_dir_missing(tmp_path):
    d = tmp_path / "nope"
    for fn in (load_dataset, check_data_dir):
        with pytest.raises(DataError, match="does not exist") as e:
            fn(d)
        assert str(d) in str(e.value)


def test_error_no_shards(tmp_path):
    for fn in (load_dataset, check_data_dir):
        with pytest.raises(DataError, match="no shards") as e:
            fn(tmp_path)
        assert str(tmp_path) in str(e.value)


def test_error_index_missing(shard_dir):
    d, _ = shard_dir
    (d / "index.json").unlink()
    with pytest.raises(DataError, match="index.json missing") as e:
        check_data_dir(d)
    assert str(d / "index.json") in str(e.value)


def test_error_index_unreadable(shard_dir):
    d, _ = shard_dir
    (d / "index.json").write_text("{not json")
    with pytest.raises(DataError, match="unreadable") as e:
        load_dataset(d)
    assert str(d / "index.json") in str(e.value)
    (d / "index.json").write_text(json.dumps({"format": "dflash-shards-v1", "shards": []}))
    with pytest.raises(DataError, match="no shards listed") as e:
        check_data_dir(d)
    assert str(d / "index.json") in str(e.value)


def test_error_index_edited(shard_dir):
    d, _ = shard_dir
    index = json.loads((d / "index.json").read_text())
    index["shards"][1]["sha256"] = "0" * 64
    (d / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="overall hash") as e:
        check_data_dir(d)
    assert str(d / "index.json") in str(e.value)


def test_error_shard_missing(shard_dir):
    d, _ = shard_dir
    (d / "shard-00002.parquet").unlink()
    for fn in (load_dataset, check_data_dir):
        with pytest.raises(DataError, match="missing") as e:
            fn(d)
        assert str(d / "shard-00002.parquet") in str(e.value)


def test_error_sha_mismatch(shard_dir):
    d, _ = shard_dir
    other = make_records(16, seed=7)
    write_shards(other, d / "other")
    (d / "shard-00001.parquet").write_bytes((d / "other" / "shard-00000.parquet").read_bytes())
    check_data_dir(d)  # cheap check does not hash
    with pytest.raises(DataError, match="sha256 mismatch") as e:
        load_dataset(d)
    assert str(d / "shard-00001.parquet") in str(e.value)
    assert len(load_dataset(d, verify=False)) == 50


def test_error_not_parquet(shard_dir):
    d, _ = shard_dir
    (d / "shard-00003.parquet").write_bytes(b"this is not parquet at all")
    _rewrite_index_sha(d, 3)
    with pytest.raises(DataError, match="not a readable parquet") as e:
        load_dataset(d)
    assert str(d / "shard-00003.parquet") in str(e.value)


def test_error_wrong_columns(shard_dir):
    d, _ = shard_dir
    t = pa.table({"tokens": pa.array([[1, 2]], type=pa.list_(pa.int32()))})
    pq.write_table(t, d / "shard-00003.parquet")
    _rewrite_index_sha(d, 3)
    with pytest.raises(DataError, match="expected columns") as e:
        load_dataset(d)
    assert str(d / "shard-00003.parquet") in str(e.value)


def test_error_length_mismatch(shard_dir):
    d, _ = shard_dir
    t = pa.table(
        {
            "input_ids": pa.array([[1, 2, 3], [4, 5]], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([[0, 1, 1], [1]], type=pa.list_(pa.int8())),
        }
    )
    pq.write_table(t, d / "shard-00003.parquet")
    _rewrite_index_sha(d, 3)
    with pytest.raises(DataError, match="row 1 has 2 input_ids but 1 loss_mask") as e:
        load_dataset(d)
    assert str(d / "shard-00003.parquet") in str(e.value)
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------ planner


def test_planner_budget_batch_size_truncation():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 700, size=600)
    p = BatchPlanner(lengths, token_budget=2048, max_seq_len=512, max_batch_size=12, seed=3)
    assert p.num_truncated == int((lengths > 512).sum()) > 0
    assert p.num_dropped == 0
    b0 = p.epoch_batches(0)
    assert len(b0) == len(p)
    for b in b0:
        eff = np.minimum(lengths[b], 512)
        assert len(b) <= 12
        assert len(b) * eff.max() <= 2048
    flat = sorted(i for b in b0 for i in b)
    assert flat == list(range(600))  # every sample exactly once

    pd = BatchPlanner(lengths, 2048, 512, 12, seed=3, drop_long=True)
    assert pd.num_dropped == int((lengths > 512).sum()) and pd.num_truncated == 0
    flat = sorted(i for b in pd.epoch_batches(0) for i in b)
    assert flat == sorted(np.nonzero(lengths <= 512)[0].tolist())

    with pytest.raises(ValueError, match="token_budget"):
        BatchPlanner(lengths, token_budget=256, max_seq_len=512, max_batch_size=4)


def test_planner_bounds_the_distinct_batch_shapes_of_any_number_of_epochs():
    """max_batch_shapes is an upper bound on the [B, S] shapes every epoch's batches can have (per-shape
    caches stop growing there), and padding to a multiple shrinks it."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(20, 700, size=500)
    p = BatchPlanner(lengths, token_budget=2048, max_seq_len=512, max_batch_size=12, seed=0)
    eff = np.minimum(lengths, 512)
    bounds = {}
    for pm in (1, 8, 64):
        seen = {(len(b), -(-int(eff[b].max()) // pm) * pm) for ep in range(60) for b in p.epoch_batches(ep)}
        bounds[pm] = p.max_batch_shapes(pm)
        assert len(seen) <= bounds[pm], (pm, len(seen), bounds[pm])
    assert bounds[64] < bounds[8] < bounds[1]
    # tight case: ten sequences of one length, three per batch -> batches of 3, 3, 3 and 1
    t = BatchPlanner([100] * 10, token_budget=300, max_seq_len=100, max_batch_size=3)
    assert {(len(b), 128) for b in t.epoch_batches(0)} == {(3, 128), (1, 128)}
    assert t.max_batch_shapes(64) == 2 and t.max_batch_shapes(1) == 2


def test_planner_deterministic_per_seed_epoch():
    lengths = np.random.default_rng(2).integers(1, 300, size=400)
    a = BatchPlanner(lengths, 1024, 256, 16, seed=5)
    b = BatchPlanner(lengths, 1024, 256, 16, seed=5)
    c = BatchPlanner(lengths, 1024, 256, 16, seed=6)
    assert a.epoch_batches(0) == b.epoch_batches(0)
    assert a.epoch_batches(3) == b.epoch_batches(3)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    assert a.epoch_batches(0) != c.epoch_batches(0)
    neg = BatchPlanner(lengths, 1024, 256, 16, seed=-1)
    assert neg.epoch_batches(0) == BatchPlanner(lengths, 1024, 256, 16, seed=-1).epoch_batches(0)
    for e in range(3):  # full coverage every epoch, constant batch count
        bs = a.epoch_batches(e)
        assert len(bs) == len(a)
        assert sorted(i for x in bs for i in x) == list(range(400))
    # one batch at a time (dispatch and collate), epochs asked out of order: the same batches
    assert [b.batch(e, i) for e in (2, 0, 1) for i in range(len(b))] == [x for e in (2, 0, 1) for x in a.epoch_batches(e)]
    # buckets: batches group similar lengths (much less padding than random grouping)
    bs = a.epoch_batches(0)
    pad = sum(len(x) * min(lengths[x].max(), 256) for x in bs) / np.minimum(lengths, 256).sum()
    assert pad < 1.3


def test_collate():
    recs = [([5, 6, 7], [0, 1, 1]), ([1] * 10, [1] * 10), ([9, 8], [0, 0])]
    ds = Dataset.from_records(recs)
    b = collate(ds, [0, 1, 2], max_seq_len=6)
    assert b.input_ids.dtype == torch.long and b.loss_mask.dtype == torch.bool
    assert tuple(b.input_ids.shape) == (3, 6) and b.seq_len == 6 and b.batch_size == 3
    assert b.input_ids[0].tolist() == [5, 6, 7, 0, 0, 0]
    assert b.loss_mask[0].tolist() == [False, True, True, False, False, False]
    assert b.loss_mask[1].tolist() == [True] * 6  # truncated to max_seq_len
    assert b.lengths.tolist() == [3, 6, 2] and b.lengths.dtype == torch.long
    assert b.num_tokens == 11 and b.num_loss_tokens == 8 and b.sample_ids == [0, 1, 2]
    b2 = collate(ds, [2, 0], max_seq_len=6)
    assert tuple(b2.input_ids.shape) == (2, 3)  # S = longest in the batch
    b3 = collate(ds, [2, 0], max_seq_len=6, pad_multiple=4)  # S rounded up: a bounded set of shapes
    assert tuple(b3.input_ids.shape) == (2, 4) and b3.lengths.tolist() == [2, 3]
    assert b3.num_tokens == 5
    assert not b3.loss_mask[:, 3].any()
    with pytest.raises(ValueError, match="pad_multiple"):
        collate(ds, [0], max_seq_len=6, pad_multiple=0)


def test_planned_batches_honour_the_truncation():
    recs = make_records(80, seed=3, hi=60)
    ds = Dataset.from_records(recs)
    p = BatchPlanner(ds.lengths, token_budget=256, max_seq_len=48, max_batch_size=8, seed=11)
    for e in range(2):
        for idx in p.epoch_batches(e):
            b = collate(ds, idx, p.max_seq_len)
            assert b.seq_len <= 48 and b.batch_size * b.seq_len <= 256


def test_anchors_are_counted_per_document_as_speculators_1071_defines():
    """speculators #1071: --max-anchors is per packed document, not per row: every document gets
    min(max_anchors, its candidates) anchors, a uniform sample of its own supervised positions, whatever
    else shares its micro-batch. A batch row here holds one document (collate pads, it never packs), so
    a document's anchors are those it gets planned alone, and a short one keeps every candidate."""
    from trainer.ops.plan import anchor_candidates, plan_micro_batch

    recs = make_records(n=6, seed=3, lo=30, hi=120)
    kw = dict(seed=7, block_size=4, max_anchors=10, mask_token_id=999, gamma=4.0, soft_labels=False,
              chunk_rows=10**6, flex=False)

    def anchors_of(ids_list):
        ds = Dataset.from_records([recs[i] for i in ids_list])
        b = collate(ds, list(range(len(ids_list))), 10**4)
        plan = plan_micro_batch(b.input_ids.numpy(), b.loss_mask.numpy(), b.lengths.numpy(), ids_list, 0, **kw)
        (c,) = plan.chunks
        starts = c.q_anchor[::4]
        return {i: sorted(set(starts[c.q_seq[::4] == local].tolist())) for local, i in enumerate(ids_list)}

    together = anchors_of(list(range(6)))
    for i in range(6):
        cand = anchor_candidates(recs[i][1])
        assert len(together[i]) == min(10, len(cand))
        assert set(together[i]) <= set(cand.tolist())
        assert anchors_of([i])[i] == together[i]
    assert any(len(anchor_candidates(recs[i][1])) < 10 for i in range(6))   # a short document is in the case
