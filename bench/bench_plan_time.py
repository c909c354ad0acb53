"""Planning time against depth: GPT-2 small's shapes (h 768, 12 heads, seq 1024, vocab 50257) on
(2, 4) dp x tp with ``param_placements="auto"`` and ``planner="ilp"``, 2 to 24 layers, in CPU
seconds (cold, after an uncounted warm-up plan), with the ILP's share and the program's columns.
The work is shardwise/tools/timing.py's (also printed by ``shardwise bench``).

    python -m bench.bench_plan_time [2 4 8 12 24]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shardwise from a script run too

from shardwise.tools.timing import DEPTHS, main  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)  # CPU seconds of one thread's work: comparable on a loaded machine
    sys.exit(main(tuple(int(a) for a in sys.argv[1:]) or DEPTHS))
