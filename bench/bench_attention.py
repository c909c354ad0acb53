"""shardwise.attention against aten's SDPA on one device: forward+backward time and peak memory.

    python bench/bench_attention.py [--seqs 512 1024 2048] [--runs 5]

Prints per shape (batch 2, 8 heads, head dim 64; causal and not) the median forward+backward
time of each, their ratio, the peak memory of one step of each and its ratio, and whether the
results agree; exits 1 on a mismatch. Also part of ``shardwise bench``; the implementation is
shardwise/ops/attention/benchmark.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shardwise.ops.attention.benchmark import DEFAULT_SEQS, main  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=list(DEFAULT_SEQS), help="sequence lengths")
    p.add_argument("--runs", type=int, default=5, help="timed runs per side (median), default 5")
    a = p.parse_args()
    sys.exit(main(seqs=tuple(a.seqs), runs=a.runs))
