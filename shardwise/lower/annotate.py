"""Annotate a printed per-rank program: every line that computes a planned node ends in a
comment with the node's local shapes on that rank, its output placements and the module it
came from, so the program reads as the model it runs rather than as anonymous aten calls;
a collective says which mesh dim it runs over.

    y = torch.ops.aten.addmm.default(b, x, t);  b = x = t = None  # (4, 48) [S(0),S(1,groups=3)] blocks.0.attn.qkv
"""
from __future__ import annotations

import re

from .rows import fmt_placements
from ..trace.provenance import module_path

_ASSIGN = re.compile(r"^\s*(\w+) = ")
# a collective call of lower/comm.py: its first two arguments are the value and the mesh dim
_COLLECTIVE = re.compile(r"= \w*?(all_gather|reduce_scatter|all_reduce|all_to_all)\(\w+, (\d+)[,)]")


def _node_note(plan, name: str, rank: int, graph_nodes: dict) -> str | None:
    np_ = plan.prop.nodes.get(name)
    if np_ is None:
        return None
    shapes = " ".join("-" if o is None else str(tuple(o.local_shape(plan.mesh, rank))) for o in np_.out_layouts)
    outs = " ".join(fmt_placements(p) for p in np_.strategy.outs)
    node = graph_nodes.get(name)
    where = (module_path(node) if node is not None else None) or ""
    return f"{shapes} {outs} {where}".rstrip()


def annotate_program(source: str, plan, rank: int) -> str:
    """``source`` (a program printed by lower/program.program_source) with one comment per
    planned node's line: local shapes, placements, module path."""
    graph_nodes = {n.name: n for n in plan.prop.gm.graph.nodes}
    out = []
    for line in source.splitlines():
        m = _ASSIGN.match(line)
        note = _node_note(plan, m.group(1), rank, graph_nodes) if m else None
        c = None if note else _COLLECTIVE.search(line)
        if c and int(c.group(2)) < plan.mesh.ndim:
            note = f"over mesh dim {plan.mesh.names[int(c.group(2))]!r}"
        out.append(f"{line}  # {note}" if note else line)
    if plan.debug:
        out.insert(1, "# shape guards left out: plan.program(rank, guards=True) shows them")
    return "\n".join(out) + "\n"
