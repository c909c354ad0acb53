"""Refinement: revisit every node once its consumers have chosen (iterated conditional modes).

Propagation picks each node's strategy from its inputs alone, so it cannot see that an
output it leaves Partial will be all-reduced by one consumer and gathered by another.
Here each node re-chooses, in graph order, the strategy that minimises the time of its
input AND output edges given what its producers and consumers now hold; every change
lowers the total, and a few sweeps settle. The edges' steps are then recomputed.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from .propagate import RESHARDING, _new_shards, _tensor_arg_nodes

SWEEPS = 4


def _consumers(gm: fx.GraphModule) -> dict:
    """producer name -> [(consumer name, input position, producer output index)]."""
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        for pos, a in enumerate(_tensor_arg_nodes(n)):
            if a.op == "call_function" and a.target is operator.getitem:
                out.setdefault(a.args[0].name, []).append((n.name, pos, a.args[1]))
            else:
                out.setdefault(a.name, []).append((n.name, pos, 0))
    return out


def _output_needs(gm: fx.GraphModule, output_placements: list) -> dict:
    """producer name -> [(required placements, producer output index)] for graph outputs."""
    (node,) = gm.graph.find_nodes(op="output")
    outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    need: dict = {}
    for o, pl in zip(outs, output_placements):
        if isinstance(o, fx.Node) and pl is not None:
            src, idx = (o.args[0], o.args[1]) if o.target is operator.getitem else (o, 0)
            need.setdefault(src.name, []).append((tuple(pl), idx))
    return need


def refine(planner, prop, output_placements: list, sweeps: int = SWEEPS) -> None:
    gm = prop.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    users, needs = _consumers(gm), _output_needs(gm, output_placements)
    for _ in range(sweeps):
        changed = False
        for name, np_ in prop.nodes.items():
            node = nodes[name]
            wanted = {(prop.nodes[c].strategy.ins[pos], idx) for c, pos, idx in users.get(name, ())}
            wanted |= set(needs.get(name, ()))
            best = _best(planner, node, np_, prop, wanted)
            if best != np_.strategy:
                _set(prop, node, np_, best)
                changed = True
        if not changed:
            break
    _finish(planner, prop, nodes, output_placements)


def _best(planner, node, np_, prop, wanted: set):
    ins = planner._input_layouts(node, prop)
    best, best_key = np_.strategy, None
    for st in planner.strategies(np_.call, np_.rule):
        steps = [planner.steps(lay, pl) for lay, pl in zip(ins, st.ins, strict=True)]
        outs = st.out_layouts(np_.call)
        out_steps = [planner.steps(outs[idx], pl) for pl, idx in wanted if outs[idx] is not None]
        reshard = sum(s.kind in RESHARDING for ss in steps for s in ss)
        time = sum(s.time for ss in steps + out_steps for s in ss)
        work = sum(o.max_local_numel(planner.mesh) for o in outs if o is not None)
        key = (reshard, round(time, 15), sum(map(len, steps + out_steps)), _new_shards(st), work)
        if best_key is None or key < best_key:
            best, best_key = st, key
    return best


def _set(prop, node, np_, st):
    np_.strategy = st
    np_.out_layouts = st.out_layouts(np_.call)
    prop.layouts[node.name] = np_.out_layouts
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem:
            prop.layouts[u.name] = [np_.out_layouts[u.args[1]]]


def _finish(planner, prop, nodes, output_placements):
    """Recompute every edge's steps from the final choices."""
    for name, np_ in prop.nodes.items():
        np_.in_layouts = planner._input_layouts(nodes[name], prop)
        np_.in_steps = [planner.steps(lay, pl) for lay, pl in zip(np_.in_layouts, np_.strategy.ins, strict=True)]
    prop.output_steps, prop.output_layouts = [], []
    (out,) = prop.gm.graph.find_nodes(op="output")
    planner._outputs(out, prop, output_placements)
