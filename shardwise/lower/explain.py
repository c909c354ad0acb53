"""What a plan costs and why: shardwise/core/cost.py's model applied to one Plan.

    costs = plan.costs               # Costs: flops and compute seconds per node and per rank (search/flops.py)
    layer_rows(plan)                 # per layer: communication, compute, memory (Plan.summary)
    param_reasons(plan)              # per parameter: placements and why (given / planner / default)
    compare(plan_a, plan_b)          # Plan.compare: what differs and what each costs

Every figure is on one rank per step (or forward): communication is the same on every rank
(bytes of the largest group's chunk), compute is per rank and the busiest rank's is shown.
The modelled step is communication plus compute on the busiest rank, nothing overlapped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.units import fmt_bytes, fmt_seconds
from ..core.layout import Replicate
from ..trace import KEEP_GATHERED
from .rows import fmt_placements, node_rows, output_rows, short_op
from ..trace.precision import MASTER_DTYPE
from ..trace.provenance import layer_of


@dataclass
class LayerCost:
    layer: str
    comm_bytes: int = 0
    comm_s: float = 0.0
    compute_s: float = 0.0  # summed over the layer's nodes, each on its busiest rank
    flops: float = 0.0
    state_bytes: int = 0  # parameters + gradients + optimizer state held for the layer (busiest rank)
    peak_live_bytes: int = 0  # the most bytes live while one of its nodes runs (lower/memory.py, busiest rank)


def layer_rows(plan) -> list[LayerCost]:
    """Per layer (layer_of the rows' module), in order of first appearance."""
    costs, layers, of_node = plan.costs, {}, {}
    for row in node_rows(plan) + output_rows(plan):
        lc = layers.setdefault(layer_of(row.module), LayerCost(layer_of(row.module)))
        lc.comm_bytes += row.comm_bytes
        lc.comm_s += sum(row.times)
        lc.compute_s += costs.node_compute.get(row.name, 0.0)
        lc.flops += costs.node_flops.get(row.name, 0.0)
        of_node[row.name] = lc
    for name, live in plan.memory_estimate(plan.memory()["rank"]).curve:
        if name in of_node:
            of_node[name].peak_live_bytes = max(of_node[name].peak_live_bytes, live)
    for ph, pname in plan.param_placeholders.items():
        module = pname.rsplit(".", 1)[0] if "." in pname else ""
        lc = layers.setdefault(layer_of(module), LayerCost(layer_of(module)))
        lc.state_bytes += _state_bytes(plan, ph)
    return list(layers.values())


def _state_bytes(plan, ph: str) -> int:
    """A parameter's bytes per rank with its gradient and optimizer state; under mixed precision
    its compute copy and its master, the gradient and state in the master's dtype."""
    lay = plan.prop.layouts[ph][0]
    b = lay.max_local_numel(plan.mesh) * lay.itemsize
    master = next(iter(plan.prop.gm.graph.find_nodes(op="placeholder", target=ph)), None)
    dtype = None if master is None else master.meta.get(MASTER_DTYPE)
    m = b if dtype is None else lay.max_local_numel(plan.mesh) * torch.empty((), dtype=dtype).element_size()
    copy = 0 if dtype is None else b
    return copy + m + (m + plan.cost.optimizer_bytes(m) if plan.stage == "step" else 0)


def gathered_sources(plan) -> set:
    """Names of the values some move of ``plan`` all-gathers (an FSDP-style parameter, among others)."""
    return {src for _, src, steps in plan.edges if any(s.kind == "all_gather" for s in steps)}


def param_reasons(plan) -> list[tuple]:
    """(parameter, placements, why) for every parameter: given in param_placements, chosen by
    the planner (this plan's ILP, or an earlier plan's: unnamed parameters start replicated),
    or the default (Replicate: not named, and no planner chose); a parameter the step gathers
    and keeps for backward (reshard_after_forward) says so."""
    given = getattr(plan, "given_params", None) or set()
    chosen = getattr(plan.prop, "param_choices", None) or {}
    kept = {n.name for n in plan.prop.gm.graph.find_nodes(op="placeholder") if n.meta.get(KEEP_GATHERED)}
    gathered = gathered_sources(plan) if kept else set()
    out = []
    for ph, pname in plan.param_placeholders.items():
        pl = plan.prop.layouts[ph][0].placements
        if pname in given:
            why = "given (param_placements)"
        elif ph in chosen:
            why = "chosen by the planner"
        elif any(not isinstance(p, Replicate) for p in pl):
            why = "chosen by the planner (an earlier plan)"
        else:
            why = "default (not in param_placements: replicated)"
        if ph in kept and ph in gathered and plan.stage == "step":
            why += "; gathered once, kept for backward (reshard_after_forward)"
        out.append((pname, fmt_placements(pl), why))
    return out


# -- two plans ----------------------------------------------------------------------------------
MEMORY_PARTS = ("masters", "parameters", "gradients", "optimizer_state", "peak_activations")  # peak_memory_bytes' terms


def compare(a, b, names=("A", "B"), limit: int = 40) -> str:
    """What differs between plans ``a`` and ``b`` and what each costs, as text."""
    sa, sb = a.stats(), b.stats()
    table = [("", *names)]
    table += [("est. step time", fmt_seconds(sa["est_step_time_s"]), fmt_seconds(sb["est_step_time_s"])),
              ("  communication", fmt_seconds(sa["comm_time_s"]), fmt_seconds(sb["comm_time_s"])),
              ("  compute (busiest rank)", fmt_seconds(sa["compute_time_s"]), fmt_seconds(sb["compute_time_s"])),
              ("flops per rank", f"{sa['flops_per_rank']:.4g}", f"{sb['flops_per_rank']:.4g}"),
              ("bytes sent per rank", fmt_bytes(sa["comm_bytes"]), fmt_bytes(sb["comm_bytes"]))]
    da, db = sa["comm_bytes_by_dim"], sb["comm_bytes_by_dim"]
    table += [(f"  over {d!r}", fmt_bytes(da.get(d, 0)), fmt_bytes(db.get(d, 0))) for d in dict.fromkeys([*da, *db])]
    table += [("collectives", str(sa["collectives"]), str(sb["collectives"])),
              ("peak memory per rank", fmt_bytes(sa["peak_memory_bytes"]), fmt_bytes(sb["peak_memory_bytes"]))]
    for k in MEMORY_PARTS:
        table.append((f"  {k.replace('_', ' ')}", fmt_bytes(sa["memory"][k]), fmt_bytes(sb["memory"][k])))
    width = max(len(r[0]) for r in table)
    col = max(len(r[1]) for r in table)
    lines = [f"{r[0].ljust(width)}  {r[1].ljust(col)}  {r[2]}".rstrip() for r in table]
    lines += _node_diff(a, b, names, limit) + _param_diff(a, b, names)
    return "\n".join(lines)


def _node_diff(a, b, names, limit: int) -> list:
    na, nb = a.prop.nodes, b.prop.nodes
    if list(na) != list(nb):
        return [f"the graphs differ ({len(na)} and {len(nb)} nodes): strategies are not compared node by node"]
    diff = [n for n in na if na[n].strategy != nb[n].strategy]
    lines = [f"nodes whose strategy differs: {len(diff)} of {len(na)}"]
    for n in diff[:limit]:
        ea, eb = (_node_text(plan, n) for plan in (a, b))
        lines.append(f"  {n} ({short_op(na[n].call.op)}): {names[0]} {ea} | {names[1]} {eb}")
    if len(diff) > limit:
        lines.append(f"  ... {len(diff) - limit} more")
    return lines


def _node_text(plan, name: str) -> str:
    """``ins -> outs (bytes its collectives send, its compute)`` of one node in ``plan``: the
    moves of its inputs that no earlier node made (Plan.edges), and those it runs itself."""
    st = plan.prop.nodes[name].strategy
    moved = sum(s.bytes for dst, _, steps in plan.edges if dst == name for s in steps if s.is_collective)
    return (f"{' '.join(fmt_placements(p) for p in st.ins)} -> {' '.join(fmt_placements(p) for p in st.outs)} "
            f"(moves {fmt_bytes(moved)}, compute {fmt_seconds(plan.costs.node_compute[name])})")


def _param_diff(a, b, names) -> list:
    pa = {p: (pl, why) for p, pl, why in param_reasons(a)}
    pb = {p: (pl, why) for p, pl, why in param_reasons(b)}
    diff = [p for p in pa if p in pb and pa[p][0] != pb[p][0]]
    if not diff:
        return ["parameters: placed alike"]
    return [f"parameters placed differently: {len(diff)}"] + [
        f"  {p}: {names[0]} {pa[p][0]} ({pa[p][1]}) | {names[1]} {pb[p][0]} ({pb[p][1]})" for p in diff]
