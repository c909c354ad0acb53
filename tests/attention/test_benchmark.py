"""Smoke test of the attention benchmark (tiny shapes; the real run is bench/bench_attention.py).

    python -m pytest tests/attention/test_benchmark.py
"""
import math

from shardwise.ops.attention import benchmark


def test_attention_benchmark_runs_and_agrees_with_aten():
    rows = benchmark.run_benchmark(seqs=(16, 24), runs=1, batch=1, heads=2, head_dim=8)
    assert [(r["seq"], r["causal"]) for r in rows] == [(16, False), (16, True), (24, False), (24, True)]
    for r in rows:
        assert r["match"] is True, r
        assert math.isfinite(r["time_ratio"]) and r["aten_s"] > 0 and r["shardwise_s"] > 0, r
        assert r["aten_peak"] > 0 and r["shardwise_peak"] > 0, r
    assert benchmark.ok(rows)
    report = benchmark.format_report(rows)
    assert "time sw/aten" in report and "load average" in report and "MISMATCH" not in report


def test_peak_bytes_counts_what_is_live_at_once():
    import torch

    def two_then_one():
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(1000, dtype=torch.float32)
        del a, b
        return torch.empty(500, dtype=torch.float32)

    assert benchmark.peak_bytes(two_then_one) == 8000
