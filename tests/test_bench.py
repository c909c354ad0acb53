"""Smoke test of the benchmark against DTensor / DDP (tiny sizes; slow: it spawns gloo processes).

    python -m pytest tests/test_bench.py -m slow -q
"""
import math

import pytest

from shardwise.tools.bench import CONFIGS, format_report, ok, run_benchmark

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.timeout(300)]

TINY = {"mlp": {"d_model": 8, "hidden": 16, "batch": 4}, "block": {"d_model": 16, "heads": 2, "seq": 4, "batch": 2}}


def test_benchmark_runs_and_matches_one_device():
    rows = run_benchmark(nproc=2, steps=2, warmup=1, sizes=TINY)
    assert [r["config"] for r in rows] == list(CONFIGS)
    for r in rows:
        assert math.isfinite(r["peer_s"]) and r["peer_s"] > 0, r
        assert math.isfinite(r["shardwise_s"]) and r["shardwise_s"] > 0, r
        assert r["loss_match"] is True, r
        assert r["grads_match"] is True, r
        assert r["peer_collectives"] and r["shardwise_collectives"], r
    assert ok(rows)
    report = format_report(rows)
    assert "sw/peer" in report and "MISMATCH" not in report
