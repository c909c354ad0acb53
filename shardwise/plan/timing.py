"""Planning time against depth: GPT-2 small's shapes (h 768, 12 heads, seq 1024, vocab 50257,
batch 8) on a (2, 4) ("dp", "tp") mesh with every parameter placed by the ILP
(``param_placements="auto"``, ``planner="ilp"``), built on the meta device (nothing allocated).

    python -m shardwise.plan.timing [2 4 8 12 24]     # also printed by `shardwise bench`

Per depth: seconds to trace and plan (``parallelize`` whole, from the model to the plan), the
ILP's share, and the largest program it solved (columns). Identical layers share columns
(plan/layers.py), so the program stays the same size; tracing and propagation (the incumbent)
still grow with depth.
"""
from __future__ import annotations

import sys
import time

DEPTHS = (2, 4, 8, 12, 24)


def gpt2_small(n_layer: int, batch: int = 8, seq: int = 1024):
    """(model on the meta device, example inputs) with GPT-2 small's shapes and ``n_layer`` layers."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257, n_positions=seq, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def plan_time(n_layer: int, mesh_shape=(2, 4), names=("dp", "tp"), **kwargs) -> dict:
    """Plan GPT-2 small's shapes with ``n_layer`` layers: {layers, seconds, ilp_seconds, columns, status}."""
    import inspect

    import shardwise as sw

    model, kw = gpt2_small(n_layer)
    params = list(inspect.signature(model.forward).parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in kw)
    inputs = tuple(kw[p.name] if p.name in kw else p.default for p in params[: last + 1])
    t0 = time.perf_counter()
    pm = sw.parallelize(model, sw.Mesh(mesh_shape, names), inputs, planner="ilp", **kwargs)
    seconds = time.perf_counter() - t0
    report = pm.plan.prop.solve_report
    return {"layers": n_layer, "seconds": seconds, "ilp_seconds": report.seconds, "columns": report.variables,
            "status": report.status.split(":")[0]}


def format_rows(rows: list) -> str:
    lines = ["planning GPT-2 small shapes on (2, 4) dp x tp, param_placements='auto', planner='ilp':",
             f"{'layers':>6} {'total s':>8} {'ilp s':>7} {'columns':>8}  status"]
    lines += [f"{r['layers']:>6} {r['seconds']:>8.1f} {r['ilp_seconds']:>7.1f} {r['columns']:>8}  {r['status']}"
              for r in rows]
    return "\n".join(lines)


def main(depths=DEPTHS) -> int:
    rows = []
    for n in depths:
        rows.append(plan_time(n))
        print(format_rows(rows[-1:]).splitlines()[-1] if len(rows) > 1 else format_rows(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(tuple(int(a) for a in sys.argv[1:]) or DEPTHS))
