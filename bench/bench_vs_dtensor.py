"""shardwise against torch's DTensor (tensor parallel) and DDP (data parallel), in the same processes.

    python bench/bench_vs_dtensor.py [--nproc 2] [--steps 10] [--warmup 3]

Prints per configuration the time per training step of the peer and of shardwise, their ratio,
the collectives of each, shardwise's bytes sent and estimated peak memory per rank, and whether
both losses (and gradients) equal the single-device run; exits 1 on a mismatch. The same as
``shardwise bench``; the implementation is shardwise/tools/bench.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shardwise.tools.bench import main  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo processes (ranks), default 2")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median), default 10")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, default 3")
    a = p.parse_args()
    sys.exit(main(nproc=a.nproc, steps=a.steps, warmup=a.warmup))
