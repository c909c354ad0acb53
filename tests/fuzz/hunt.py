"""Long fuzzing run that keeps going past failures and logs each one's reproducer.

    python -m tests.fuzz.hunt --examples 100000 --seed 0 --mesh-ndim 2 --out /tmp/fuzz

Programs come from ``random.Random(seed + i)`` (example i is rebuilt with ``--seed S+i
--examples 1``); failures are grouped by the first line of their error (one file per group
with the first reproducer, and a summary line per failure in ``failures.txt``).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time

from .choose import Chooser
from .generate import generate, mesh_shape
from .runner import check, float64_agrees


def signature(msg: str) -> str:
    """The failure's first line with numbers and names blurred, to group repeats."""
    first = msg.splitlines()[0] if msg else ""
    return re.sub(r"\b[vpwxy]\d+\b|\d+(\.\d+)?(e-?\d+)?", "#", first)[:200]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mesh-ndim", type=int, default=2)
    ap.add_argument("--max-ops", type=int, default=6)
    ap.add_argument("--out", default="/tmp/shardwise-fuzz")
    ap.add_argument("--slow", type=float, default=10.0, help="log examples whose plan + run takes longer (s)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    groups: dict = {}
    bar = "-" * 30
    t0, fails, slow = time.time(), 0, 0
    log = open(os.path.join(args.out, "failures.txt"), "a")
    for i in range(args.examples):
        seed = args.seed + i
        c = Chooser(seed)
        source = generate(c, mesh_shape(c, args.mesh_ndim), seed, args.max_ops).source()
        try:
            for planner, s in check(source).items():
                if s > args.slow:
                    slow += 1
                    with open(os.path.join(args.out, "slow.txt"), "a") as f:
                        f.write(f"seed {seed} {planner} {s:.1f} s {source.split('MESH = ')[1].splitlines()[0]}\n")
        except AssertionError as e:
            fails += 1
            msg = str(e)
            planner = "ilp" if "planner='ilp'" in msg else "propagate"
            sig = ("float32 noise (float64 agrees): " if float64_agrees(source, planner) else "") + signature(msg)
            key = hashlib.sha1(sig.encode()).hexdigest()[:10]
            if key not in groups:
                groups[key] = sig
                with open(os.path.join(args.out, f"{key}.py"), "w") as f:
                    f.write(f"# seed {seed}\n# {msg.splitlines()[0][:500]}\n" + msg.split(bar + "\n", 1)[-1].rsplit(bar, 1)[0])
            log.write(f"seed {seed} group {key}: {sig}\n")
            log.flush()
        if (i + 1) % 50 == 0 or i + 1 == args.examples:
            print(f"{i + 1} examples, {fails} failures in {len(groups)} groups, {slow} slower than {args.slow} s, "
                  f"{time.time() - t0:.0f} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
