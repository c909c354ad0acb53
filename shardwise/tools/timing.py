"""Planning time against depth: GPT-2 small's shapes (h 768, 12 heads, seq 1024, vocab 50257,
batch 8) on a (2, 4) ("dp", "tp") mesh with every parameter placed by the ILP
(``param_placements="auto"``, ``planner="ilp"``), built on the meta device (nothing allocated).

    python -m shardwise.tools.timing [2 4 8 12 24]     # also printed by `shardwise bench`

Per depth: CPU seconds of this process (a loaded machine slows the wall clock, not this) for
``parallelize`` whole (trace and plan, from the model to the plan), the ILP's share (search/solve.py:
propagation's incumbent, the rounds, the final pass), the largest program it solved (columns)
and the wall seconds. Each plan starts cold: the process's redistribution searches and block
restatements are forgotten first, and the first plan of a process (torch and transformers
initialising) is not counted (``warm``). Identical layers share columns (search/layers.py), so
the program stays the same size, and are traced once (trace/stamp.py: five blocks traced, the rest
stamped); what still grows is the per-node work of the passes and the ILP's bookkeeping.
"""
from __future__ import annotations

import json
import subprocess
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


def _cold() -> None:
    """Forget what earlier plans in this process found (as tests/fuzz/plantime.py does)."""
    from ..rules import registry
    from ..search import params, paths

    paths._SPACES.clear()
    registry._BLOCKED.clear()
    params._candidates.cache_clear()


def _model(n_layer: int) -> tuple:
    """(model, positional example inputs) of ``gpt2_small(n_layer)``."""
    import inspect

    model, kw = gpt2_small(n_layer)
    params = list(inspect.signature(model.forward).parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in kw)
    return model, tuple(kw[p.name] if p.name in kw else p.default for p in params[: last + 1])


def plan_time(n_layer: int, mesh_shape=(2, 4), names=("dp", "tp"), **kwargs) -> dict:
    """Plan GPT-2 small's shapes with ``n_layer`` layers, cold: {layers, cpu_s, ilp_cpu_s, seconds
    (wall), columns, cost_us (the plan's modelled step), status, stats_cpu_s (what ``Plan.stats()``
    adds: the rank classes' programs lowered, their memory estimated)}."""
    import shardwise as sw

    model, inputs = _model(n_layer)
    _cold()
    t0, c0 = time.perf_counter(), time.process_time()
    pm = sw.parallelize(model, sw.Mesh(mesh_shape, names), inputs, planner="ilp", **kwargs)
    cpu, seconds = time.process_time() - c0, time.perf_counter() - t0
    c1 = time.process_time()
    pm.plan.stats()
    stats = time.process_time() - c1
    report = pm.plan.prop.solve_report
    return {"layers": n_layer, "cpu_s": cpu, "ilp_cpu_s": report.cpu_s, "seconds": seconds,
            "columns": report.variables, "cost_us": report.cost_s * 1e6, "status": report.status.split(":")[0],
            "stats_cpu_s": stats}


def warm() -> None:
    """Plan one layer by propagation, uncounted: the first plan of a process initialises torch and
    transformers (the ILP's program for one layer would take longer and initialise nothing more)."""
    import shardwise as sw

    model, inputs = _model(1)
    sw.parallelize(model, sw.Mesh((2, 4), ("dp", "tp")), inputs)


HEADER = ("planning GPT-2 small shapes on (2, 4) dp x tp, param_placements='auto', planner='ilp' "
          "(CPU seconds, cold caches):\n"
          f"{'layers':>6} {'CPU s':>7} {'ILP CPU s':>9} {'trace+rest':>10} {'wall s':>7} {'columns':>8} "
          f"{'+stats() CPU s':>14}  status")


def format_row(r: dict) -> str:
    return (f"{r['layers']:>6} {r['cpu_s']:>7.2f} {r['ilp_cpu_s']:>9.2f} {r['cpu_s'] - r['ilp_cpu_s']:>10.2f} "
            f"{r['seconds']:>7.1f} {r['columns']:>8} {r['stats_cpu_s']:>14.2f}  {r['status'].split(' (')[0]}")


def format_rows(rows: list) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def main(depths=DEPTHS, as_json: bool = False) -> int:
    """Print a row per depth: the table, or (``--json``) one JSON object per line, as ``fresh`` reads."""
    warm()
    if not as_json:
        print(HEADER, flush=True)
    for n in depths:
        row = plan_time(n)
        print(json.dumps(row) if as_json else format_row(row), flush=True)
    return 0


def fresh(depths, timeout_s: float = 600.0) -> list[dict]:
    """``plan_time`` of each depth in order, measured in a new interpreter (``python -m
    shardwise.tools.timing --json``), the process a user's script or ``shardwise bench`` plans in.
    The tests measure there, not in their own process: inside pytest, make_fx runs the same calls
    slower per call the deeper the model, across torch's tracing as a whole (fake tensors,
    proxies, stack extraction), which no shardwise code accounts for."""
    out = subprocess.run([sys.executable, "-m", "shardwise.tools.timing", "--json", *map(str, depths)],
                         capture_output=True, text=True, timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"python -m shardwise.tools.timing failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser(prog="python -m shardwise.tools.timing",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("depths", nargs="*", type=int, default=list(DEPTHS), help=f"layer counts (default {DEPTHS})")
    p.add_argument("--json", action="store_true", help="one JSON object per depth (what ``fresh`` reads)")
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = _parse(sys.argv[1:])
    sys.exit(main(tuple(ns.depths), as_json=ns.json))
