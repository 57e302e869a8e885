"""The GPU benchmark runs end to end at tiny shapes on the CPU, so it cannot rot between GPU runs."""

import json

import pytest

from trainer import bench


@pytest.mark.slow
def test_bench_tiny_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--shape", "tiny", "--settings", "b16", "--steps", "2", "--dataset-tokens", "20000",
                     "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "async/min(stage)" in table and "async/sync" in table
    res = json.loads(out.read_text())["results"][0]
    for part in ("target", "drafter", "sync", "async"):
        assert res[part]["tok_s"] > 0, res[part]
    assert res["drafter"]["block_rows_per_token"] > 0
    assert res["async"]["memory"]["host_rss_bytes"] > 0 and "wait_fraction" in res["async"]
    assert res["async_over_sync"] > 0 and res["async_over_min_stage"] > 0
    # the timed steps' allocator/RSS counters are recorded per step
    assert [m["step"] for m in res["async"]["memory_per_step"]] == [1, 2]
    # and how many distinct [B, S] batch shapes the target has been fed so far (per-shape caches)
    seen = [m["batch shapes seen"] for m in res["async"]["memory_per_step"]]
    assert 1 <= seen[0] <= seen[1]


@pytest.mark.slow
def test_shape_cache_probe_sees_a_per_shape_leak_and_only_in_the_first_pass(tmp_path, monkeypatch, capsys):
    """--shape-cache-probe must measure what it claims: a cache that keeps 2 MB per new input shape
    (as cuDNN's SDPA graph cache keeps its plans) shows in the first pass and not in the second."""
    from trainer import target
    real = target.decoder
    cache = {}

    def leaky_decoder(model):
        dec = real(model)

        def call(input_ids, **kw):
            cache.setdefault(tuple(input_ids.shape), b"\x01" * (2 << 20))  # touched, so resident
            return dec(input_ids=input_ids, **kw)
        return call

    monkeypatch.setattr(target, "decoder", leaky_decoder)
    out = tmp_path / "probe.json"
    assert bench.main(["--shape", "tiny", "--shape-cache-probe", "10", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["shape_cache_probe"]
    assert [(r["backend"], r["pass"], r["shapes"]) for r in rows] == [
        ("auto", "new shapes", 10), ("auto", "same shapes again", 10)]
    first, again = rows
    assert first["rss_growth_after_trim_bytes"] >= 15e6, first     # 10 new shapes x 2 MB
    assert again["rss_growth_after_trim_bytes"] < 5e6, again
    assert len(cache) == 11  # the 10 shapes and the probe's first-call shape
    assert "KB/shape" in capsys.readouterr().out


def test_flop_counts_scale_as_expected():
    import numpy as np
    eight = bench.model_flops_target(np.array([4096]), "8b", 36)
    # ~2 x 6.95B non-embedding parameters per token plus causal attention
    assert 2 * 6.9e9 * 4096 < eight < 2 * 7.0e9 * 4096 * 1.2


@pytest.mark.slow
def test_python_heap_flat_over_200_steps(tmp_path, monkeypatch):
    """Nothing the pipeline keeps per step may pile up on the Python heap (work items, events, logs):
    traced heap at the peak of the last 100 steps within 256 KB of the first 100 (220 tiny steps)."""
    import tracemalloc

    from trainer.train import Trainer

    orig = Trainer._memory

    def memory(self):
        d = orig(self)
        d["py_heap"] = tracemalloc.get_traced_memory()[0]
        return d

    monkeypatch.setattr(Trainer, "_memory", memory)
    out = tmp_path / "bench.json"
    tracemalloc.start()
    try:
        rc = bench.main(["--shape", "tiny", "--settings", "b16", "--steps", "220", "--dataset-tokens", "100000",
                         "--parts", "async", "--set", "grad_accum=1", "--work", str(tmp_path / "work"),
                         "--out", str(out)])
    finally:
        tracemalloc.stop()
    assert rc == 0
    res = json.loads(out.read_text())["results"][0]["async"]
    flat = res["memory_flatness"]
    assert flat["steps"] == 200 and flat["window"] == 100  # logs keep the first and last 100 steps
    assert abs(flat["py_heap"]["growth_bytes"]) < 256 * 1024, flat["py_heap"]
