"""Host overhead of ``pm.step``: microseconds per program op beyond a plain replay of the same
calls (what pm.step runs for the rank's unguarded program, its Replay (run/replay.py), called
directly on ready arguments: the same aten ops and collectives), on the torch backend (gloo
processes), data parallel. The fx program's own code (one OpOverload call per op) is timed
beside it ("fx code us").

    python bench/bench_host.py [--nproc 2] [--steps 200] [--profile]

Per model each rank interleaves ``pm.step`` and the replay step by step (a barrier before
each), median over ``steps``, max over ranks; times are this process's CPU time
(time.process_time, one intra-op thread), so other jobs on a loaded machine do not count
(with ``--nproc 1`` there is no communication to wait for; with more, waits are not counted). ``--profile``: rank 0's cProfile of pm.step
(the top functions by own time), to see where the host time goes.

What the fixed cost is made of: Python run from cold caches. After a collective (here the
barrier) the first calls are several times slower than warm ones (on this machine one ``narrow``
took 12 us right after a barrier, 1.9 us warm), so a step's host time follows how many objects
and code paths it touches more than how fast each is; pm.step's steady path (module/steady.py)
touches few.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* from a script run too

MODELS = ("mlp", "gpt2")


def _model(name: str):
    from bench.bench_buckets import SIZES, _LM, _gpt2

    if name == "mlp":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        x, y = torch.randn(8, 16), torch.randn(8, 8)
        return model, (x,), (y,), lambda out, t: ((out - t) ** 2).mean()
    model, ids = _gpt2(SIZES["tiny"])
    return _LM(model), (ids, ids), (), None


def _case(name: str, steps: int, profile: bool) -> dict:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.run.execute import Executable
    from shardwise.run.collectives import using, using_generator

    world, rank = dist.get_world_size(), dist.get_rank()
    model, inputs, targets, loss_fn = _model(name)
    spec = {i: [sw.Shard(0)] for i in range(len(inputs))}
    pm = sw.parallelize(model, sw.Mesh((world,), ("dp",)), inputs, input_placements=spec, loss_fn=loss_fn,
                        example_targets=targets or None, backend="torch")
    for _ in range(3):
        pm.step(*inputs, *targets)
        pm.zero_grad()
    # the replay: the same program call pm.step makes (its Replay, run/replay.py), on arguments
    # prepared once; and the fx program's own code on them, op by op through each OpOverload
    program = pm.plan.program_module(rank, guards=False)
    replay = pm._executable(pm.plan).runnable(rank)
    args = Executable(pm.plan).flat_locals(pm.shards, rank, inputs, targets)
    ops = sum(1 for n in program.graph.nodes if n.op == "call_function")
    step_t, replay_t, fx_t = [], [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.process_time()
        pm.step(*inputs, *targets)
        step_t.append(time.process_time() - t0)
        pm.zero_grad()
        for fn, times in ((replay, replay_t), (program, fx_t)):
            dist.barrier()
            t0 = time.process_time()
            with using(pm.backend.comm, process_wide=True), using_generator(None, process_wide=True), torch.no_grad():
                out = fn(*args)
            times.append(time.process_time() - t0)
            del out
    row = {"model": name, "ops": ops, "step_us": statistics.median(step_t) * 1e6,
           "replay_us": statistics.median(replay_t) * 1e6, "fx_us": statistics.median(fx_t) * 1e6}
    if profile and rank == 0:
        row["profile"] = _profile(pm, inputs, targets)
    elif profile:
        _profile(pm, inputs, targets)
    return row


def _profile(pm, inputs, targets, steps: int = 50) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        pm.step(*inputs, *targets)
        pm.zero_grad()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def _body(rank: int, steps: int, profile: bool) -> list:
    torch.set_num_threads(1)
    return [_case(m, steps, profile) for m in MODELS]


def run(nproc: int = 2, steps: int = 200, profile: bool = False) -> list:
    """Rows {model, ops, step_us, replay_us, host_us_per_op} (max over ranks)."""
    from shardwise.run.launch import spawn

    per_rank = spawn(_body, nproc, steps, profile, timeout=600.0)
    rows = []
    for i, first in enumerate(per_rank[0]):
        same = [r[i] for r in per_rank]
        row = dict(first)
        row["step_us"] = max(r["step_us"] for r in same)
        row["replay_us"] = max(r["replay_us"] for r in same)
        row["fx_us"] = max(r["fx_us"] for r in same)
        row["host_us_per_op"] = (row["step_us"] - row["replay_us"]) / row["ops"]
        rows.append(row)
    return rows


def format_rows(rows) -> str:
    lines = [f"{'model':6} {'ops':>5} {'step us':>9} {'replay us':>10} {'host us/op':>11} {'fx code us':>11}"]
    for r in rows:
        lines.append(f"{r['model']:6} {r['ops']:5d} {r['step_us']:9.1f} {r['replay_us']:10.1f} "
                     f"{r['host_us_per_op']:11.2f} {r['fx_us']:11.1f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    rows = run(a.nproc, a.steps, a.profile)
    print(format_rows(rows))
    for r in rows:
        if "profile" in r:
            print(f"\n# {r['model']}: cProfile of pm.step on rank 0, by own time\n{r['profile']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
