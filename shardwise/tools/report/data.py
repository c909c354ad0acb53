"""A plan as plain data (JSON-ready): what ``shardwise plan --json`` prints and what the HTML
report draws. Built from the same rows as ``Plan.summary()`` (lower/rows.py), so the three
views never disagree.
"""
from __future__ import annotations

from collections import Counter

from ...core.layout import PLACEMENT_TYPES
from ...lower.explain import layer_rows, param_reasons
from ...lower.rows import Row, fmt_placements, node_rows, output_rows
from .pipeline import pipeline_data

SCHEMA = "shardwise.search/1"


def _step(step, seconds: float, plan) -> dict:
    mesh = plan.mesh
    return {"kind": step.kind, "mesh_dim": step.mesh_dim, "mesh_dim_name": mesh.names[step.mesh_dim],
            "bytes": int(step.bytes), "time_s": seconds, "repr": repr(step)}


def _row(row: Row, plan) -> dict:
    return {"name": row.name, "op": row.op, "module": row.module, "source": row.source, "phase": row.phase,
            "ins": [fmt_placements(p) for p in row.ins], "outs": [fmt_placements(p) for p in row.outs],
            "placement": fmt_placements(row.outs[0]) if row.outs else "None",
            "out_shapes": [None if s is None else list(s) for s in row.out_shapes],
            "collectives": [_step(s, t, plan) for s, t in zip(row.steps, row.times) if s.is_collective],
            "fallback": row.fallback}


def _by_module(rows: list[dict]) -> list[dict]:
    """Per module (layer), in order of first appearance: its nodes' placements and communication."""
    out: dict = {}
    for r in rows:
        m = out.setdefault(r["module"] or "(top level)", {"module": r["module"] or "(top level)", "nodes": 0,
                                                          "comm_bytes": 0, "bytes_by_kind": Counter(),
                                                          "placements": Counter()})
        m["nodes"] += 1
        m["placements"][r["placement"]] += 1
        for c in r["collectives"]:
            m["comm_bytes"] += c["bytes"]
            m["bytes_by_kind"][c["kind"]] += c["bytes"]
    return [{**m, "bytes_by_kind": dict(m["bytes_by_kind"]), "placements": dict(m["placements"])}
            for m in out.values()]


def _by_kind(rows: list[dict]) -> dict:
    kinds: dict = {}
    for r in rows:
        for c in r["collectives"]:
            k = kinds.setdefault(c["kind"], {"count": 0, "bytes": 0, "time_s": 0.0})
            k["count"] += 1
            k["bytes"] += c["bytes"]
            k["time_s"] += c["time_s"]
    return kinds


def _params(plan) -> list[dict]:
    lay, why = plan.prop.layouts, {name: w for name, _, w in param_reasons(plan)}
    return [{"name": pname, "shape": list(lay[ph][0].shape), "placements": fmt_placements(lay[ph][0].placements),
             "why": why.get(pname, "")} for ph, pname in plan.param_placeholders.items() if ph in lay]


def _memory_per_rank(plan) -> list[dict]:
    """Parameters exactly per rank, the gradients its program has made by its peak (its rank
    class's estimate: none where the peak is in the loss's backward); peak activations as the plan
    estimates them (the busiest rank's, beside the gradients made by then: plan.memory())."""
    mesh, lay = plan.mesh, plan.prop.layouts
    act = plan.memory()["peak_activations"]
    out = []
    uniform = [lay[ph][0] for ph in plan.param_placeholders if ph in lay and lay[ph][0].uniform(mesh)]
    fixed = sum(x.local_numel(mesh, 0) * x.itemsize for x in uniform)  # the same on every rank
    rest = [lay[ph][0] for ph in plan.param_placeholders if ph in lay and not lay[ph][0].uniform(mesh)]
    for r in range(mesh.size):
        params = fixed + sum(x.local_numel(mesh, r) * x.itemsize for x in rest)
        train = plan.stage == "step"
        grads = plan.memory_estimate(r).peak_gradients if train else 0
        out.append({"rank": r, "parameters": params, "gradients": grads,
                    "optimizer_state": plan.cost.optimizer_bytes(params) if train else 0, "activations": act})
    return out


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and not isinstance(x, PLACEMENT_TYPES):  # a placement is a tuple: named
        return [_json_safe(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


def plan_data(plan, title: str | None = None, measured=None) -> dict:
    """Everything the reports show, as JSON-ready data. A pipeline plan (lower/pipeline.py) is shown
    by its microbatch plan plus ``"pipeline"``: its schedule, modelled or (``measured``,
    ``pm.pipeline_timeline()``) measured (report/pipeline.py)."""
    if hasattr(plan, "schedule"):
        data = plan_data(plan.plan, title)
        data["reserved_memory_bytes"] = None  # the schedule's, not one microbatch program's: not modelled
        data["pipeline"] = _json_safe(pipeline_data(plan, measured))
        data["stats"] = _json_safe({**data["stats"], **{k: v for k, v in plan.stats().items()
                                                         if k != "microbatch_plan"}})
        return data
    mesh = plan.mesh
    rows = [_row(r, plan) for r in node_rows(plan)]
    outputs = [_row(r, plan) for r in output_rows(plan)]
    return {
        "schema": SCHEMA, "title": title or "shardwise plan", "stage": plan.stage,
        "mesh": {"shape": list(mesh.shape), "names": list(mesh.names), "size": mesh.size},
        "planner": None if plan.prop.solve_report is None else str(plan.prop.solve_report),
        "stats": _json_safe(plan.stats()),
        "memory_per_rank": _memory_per_rank(plan),
        # what PyTorch's CUDA caching allocator would hold for the busiest rank (lower/allocator.py)
        "reserved_memory_bytes": {mode: r.reserved for mode, r in plan.reserved_memory().items()},
        "params": _params(plan),
        "nodes": rows, "outputs": outputs,
        "by_module": _by_module(rows + outputs),
        "by_kind": _by_kind(rows + outputs),
        "layers": [_json_safe(vars(lc)) for lc in layer_rows(plan)],
        "param_reasons": [{"name": n, "placements": pl, "why": why} for n, pl, why in param_reasons(plan)],
    }
