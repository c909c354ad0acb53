"""Planning time of fuzz programs (issue 9: no fuzzer program over 10 s to plan on 8 ranks).

    python -m tests.fuzz.plantime --seeds 0 200 --max-ops 8      # plan only, no run; slowest last

A program is ``generate(Chooser(seed), mesh, seed, max_ops)`` on a mesh given outright (the
hunt draws its mesh from the seed; here every seed is put on an 8-rank mesh). The time is
process CPU seconds (a loaded machine slows the wall clock, not this) to trace the step, plan
it and lower every rank's program, with the process's redistribution searches and block restatements
forgotten first, so each figure is a first plan.
"""
from __future__ import annotations

import argparse
import sys
import time

import shardwise as sw
from shardwise.search import paths
from shardwise.rules import registry

from .choose import Chooser
from .generate import generate
from .runner import load

MESHES_8 = ((2, 2, 2), (8,), (2, 4), (4, 2))


def source(seed: int, mesh: tuple, max_ops: int = 8) -> str:
    return generate(Chooser(seed), mesh, seed, max_ops).source()


def sweep_mesh(seed: int) -> tuple:
    """The 8-rank mesh a sweep puts ``seed`` on: (2, 2, 2), where planning costs most, for half."""
    return MESHES_8[0] if seed % 2 == 0 else MESHES_8[1 + (seed // 2) % 3]


def plan_seconds(src: str, planner: str) -> tuple:
    """(CPU seconds, ParallelModule): parallelize with the example targets (the step is planned
    there), then every rank's program built."""
    ns = load(src)
    inputs, targets = ns["make_data"]()
    paths._SPACES.clear()
    registry._BLOCKED.clear()
    t = time.process_time()
    pm = sw.parallelize(ns["Program"](), ns["MESH"], tuple(inputs), input_placements=ns["INPUT_PLACEMENTS"],
                        param_placements=ns["PARAM_PLACEMENTS"], target_placements=ns["TARGET_PLACEMENTS"],
                        loss_fn=ns["loss_fn"], planner=planner, cost_model=ns["COST_MODEL"],
                        example_targets=tuple(targets))
    for rank in range(ns["MESH"].size):
        pm.plan.program_module(rank)
    return time.process_time() - t, pm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 200), metavar=("FIRST", "END"))
    ap.add_argument("--max-ops", type=int, default=8)
    ap.add_argument("--planners", default="propagate,ilp")
    args = ap.parse_args(argv)
    plan_seconds(source(0, (2,), 2), "propagate")  # the first trace initialises torch: not planning
    rows = []
    for seed in range(*args.seeds):
        mesh = sweep_mesh(seed)
        for planner in args.planners.split(","):
            s, pm = plan_seconds(source(seed, mesh, args.max_ops), planner)
            rows.append((s, seed, mesh, planner, len(pm.plan.prop.nodes)))
            print(f"seed {seed} {mesh} {planner}: {s:.2f} s ({rows[-1][-1]} nodes)", flush=True)
    print("slowest:")
    for s, seed, mesh, planner, n in sorted(rows)[-10:]:
        print(f"  seed {seed} {mesh} {planner}: {s:.2f} s ({n} nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
