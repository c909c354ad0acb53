"""Figures independent of the rank count: a Llama 3.1 8B shape (transformers' LlamaConfig with the
published dimensions, meta device, batch 64 x 2048) planned with ``param_placements="auto"`` on
(dp, tp) meshes, then ``stats()`` and ``summary()``; CPU seconds of each, one thread.

    python -m bench.bench_scale [2x2 8x8 ...] [--layers N] [--budget GiB] [--model NAME --batch B --seq S]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shardwise from a script run too

import shardwise as sw  # noqa: E402
from shardwise.tools.cluster import models  # noqa: E402


def run(shape: tuple, layers: int, batch: int = 64, seq: int = 2048, budget: float | None = None,
        name: str = "llama3-8b", keep: list | None = None) -> dict:
    """Plan, stats() and summary() of ``name``'s shape at ``layers`` blocks on a (dp, tp) mesh of
    ``shape``: CPU seconds of each; ``keep``: a list the ParallelModule is appended to."""
    cfg = models.config(name)
    model, inputs = models.build(cfg, layers, batch=batch, seq=seq)
    mesh = sw.Mesh(shape, ("dp", "tp")[: len(shape)])
    t0 = time.process_time()
    pm = sw.parallelize(model, mesh, inputs, input_placements={0: {"dp": sw.Shard(0)}, 1: {"dp": sw.Shard(0)}},
                        param_placements="auto",
                        memory_budget=None if budget is None else int(budget * 2**30))
    t1 = time.process_time()
    stats = pm.plan.stats()
    t2 = time.process_time()
    text = pm.plan.summary()
    t3 = time.process_time()
    if keep is not None:
        keep.append(pm)
    return {"mesh": "x".join(map(str, shape)), "layers": layers, "plan_s": t1 - t0, "stats_s": t2 - t1,
            "summary_s": t3 - t2, "total_s": t3 - t0, "classes": len(pm.plan.rank_classes),
            "peak_GiB": stats["peak_memory_bytes"] / 2**30, "summary_lines": text.count("\n")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("meshes", nargs="*", default=["2x2", "8x8"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget", type=float, default=None, help="memory budget per rank, GiB")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for m in a.meshes:
        r = run(tuple(int(x) for x in m.split("x")), a.layers, a.batch, a.seq, budget=a.budget, name=a.model)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
