"""One row per planned node and per redistributed graph output: what the summary prints and
the plan report (tools/report/) draws. A row names the node, its op, the module it ran in
(``transformer.h.0.attn.c_attn``), the user's source line, forward or backward, its
placements and the collectives that bring its inputs into them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..trace.provenance import module_path


def fmt_placements(pls) -> str:
    return "None" if pls is None else "[" + ",".join(short_placement(p) for p in pls) + "]"


def short_placement(p) -> str:
    r = repr(p)
    return {"Replicate()": "R", "Partial()": "P"}.get(r, r.replace("Shard", "S").replace("Partial", "P"))


def short_op(op) -> str:
    """``aten.addmm.default`` -> ``addmm``; ``aten.add.Tensor`` -> ``add.Tensor``; others whole."""
    s = str(op)
    if s.startswith("aten."):
        s = s[len("aten."):]
    return s[: -len(".default")] if s.endswith(".default") else s


def short_source(source: str | None) -> str:
    """``/path/to/model.py:87 in forward: code`` -> ``model.py:87`` (the full line is in the report)."""
    if not source:
        return ""
    if source.startswith("(gradient accumulation"):
        return "(grad accumulation)"
    if ":" not in source:
        return source[:30]
    head = source.split(" in ", 1)[0]
    path, _, line = head.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if line.isdigit() else head[:30]


@dataclass
class Row:
    name: str
    op: str
    module: str
    source: str  # the full source line ("" when unknown)
    phase: str  # "forward" | "backward" | "output"
    ins: list = field(default_factory=list)  # placements per tensor input
    outs: list = field(default_factory=list)  # placements per output
    steps: list = field(default_factory=list)  # RedistSteps bringing the inputs into place (no slices)
    times: list = field(default_factory=list)  # their seconds as the program runs them (Plan.edge_seconds)
    out_shapes: list = field(default_factory=list)  # global shapes of the outputs
    fallback: bool = False

    @property
    def collectives(self) -> list:
        return [s for s in self.steps if s.is_collective]

    @property
    def comm_bytes(self) -> int:
        return sum(s.bytes for s in self.collectives)


def _phase(node) -> str:
    return "backward" if node is not None and node.meta.get("autograd_backward") else "forward"


def node_rows(plan) -> list[Row]:
    """Every planned node in graph order, each with the collectives its inputs need (a value
    redistributed once for several consumers is counted at its first consumer)."""
    graph_nodes = {n.name: n for n in plan.prop.gm.graph.nodes}
    by_consumer: dict = {}
    for (consumer, _src, steps), times in zip(plan.edges, plan.edge_seconds):
        by_consumer.setdefault(consumer, []).extend((s, t) for s, t in zip(steps, times) if s.kind != "slice")
    rows = []
    for name, np_ in plan.prop.nodes.items():
        node = graph_nodes.get(name)
        rows.append(Row(
            name=name, op=short_op(np_.call.op), module=(module_path(node) if node is not None else None) or "",
            source=np_.source or "", phase=_phase(node), ins=list(np_.strategy.ins), outs=list(np_.strategy.outs),
            steps=[s for s, _ in by_consumer.get(name, [])], times=[t for _, t in by_consumer.get(name, [])],
            fallback=np_.fallback,
            out_shapes=[None if o is None else tuple(o.shape) for o in np_.out_layouts]))
    return rows


def output_rows(plan) -> list[Row]:
    """One row per graph output that is redistributed (a gradient reduced, the loss gathered),
    named by its role where the trace is known (``grad blocks.0.qkv.weight``, ``loss``). The
    rows are the plan's output edges: a value the program already moved for another consumer
    is not counted again."""
    gm_out = next((n for n in plan.prop.gm.graph.nodes if n.op == "output"), None)
    if gm_out is None:
        return []
    outs = gm_out.args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    roles = getattr(getattr(plan, "traced", None), "outputs", None) or []
    index = {}
    for i, (o, steps) in enumerate(zip(outs, plan.prop.output_steps)):
        if steps and hasattr(o, "name"):
            index.setdefault((o.name, steps[-1].dst.placements), i)
    rows = []
    for (consumer, src, steps), times in zip(plan.edges, plan.edge_seconds):
        if consumer != "output":
            continue
        i = index.get((src, steps[-1].dst.placements))
        role = roles[i] if i is not None and i < len(roles) else None
        label = (f"output {src}" if role is None else role.kind if role.name is None else f"{role.kind} {role.name}")
        node = outs[i] if i is not None else None
        kept = [(s, t) for s, t in zip(steps, times) if s.kind != "slice"]
        rows.append(Row(name=label, op=f"<- {src}", module=(module_path(node) if node is not None else None) or "",
                        source="", phase="output", ins=[steps[0].src.placements], outs=[steps[-1].dst.placements],
                        steps=[s for s, _ in kept], times=[t for _, t in kept],
                        out_shapes=[tuple(steps[-1].dst.shape)]))
    return rows


__all__ = ["Row", "node_rows", "output_rows", "fmt_placements", "short_placement", "short_op", "short_source"]
