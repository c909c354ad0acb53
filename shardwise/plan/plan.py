"""Plan: one strategy per node, the redistribution on every edge, and cost figures.

``summary()`` prints the per-node table with collectives and bytes, totals and per-rank
memory; ``stats()`` returns the same figures as a dict; ``program(rank)`` prints the
lowered per-rank program as Python.
"""
from __future__ import annotations

from collections import Counter
from functools import cached_property

import torch.fx as fx

from ..lower.program import build_program, program_source
from ..trace import tensor_arg_nodes
from ..lower.redistribute import _fmt_bytes


def _fmt_pl(pls) -> str:
    return "None" if pls is None else "[" + ",".join(_short(p) for p in pls) + "]"


def _short(p) -> str:
    r = repr(p)
    return {"Replicate()": "R", "Partial()": "P"}.get(r, r.replace("Shard", "S").replace("Partial", "P"))


class Plan:
    def __init__(self, prop, param_placeholders: dict, debug: bool = True, stage: str = "step"):
        self.prop = prop
        self.mesh = prop.mesh
        self.param_placeholders = dict(param_placeholders)  # placeholder name -> parameter name
        self.debug = debug
        self.stage = stage
        self._programs: dict = {}

    # -- programs -----------------------------------------------------------------------
    def program_module(self, rank: int) -> fx.GraphModule:
        if rank not in self._programs:
            self._programs[rank] = build_program(self.prop, rank, self.debug)
        return self._programs[rank]

    def program(self, rank: int = 0) -> str:
        """The per-rank program as Python source."""
        return program_source(self.program_module(rank), rank)

    # -- figures ------------------------------------------------------------------------
    @cached_property
    def edges(self) -> list:
        """Unique redistributions (producer, destination placements) -> steps; the program emits each once."""
        seen, out = set(), []
        graph_nodes = {n.name: n for n in self.prop.gm.graph.nodes}
        for name, np_ in self.prop.nodes.items():
            for src, steps in zip(tensor_arg_nodes(graph_nodes[name]), np_.in_steps):
                if steps and (src.name, steps[-1].dst.placements) not in seen:
                    seen.add((src.name, steps[-1].dst.placements))
                    out.append((name, src.name, steps))
        outs = graph_nodes["output"].args[0] if "output" in graph_nodes else ()
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        for o, steps in zip(outs, self.prop.output_steps):
            if steps and isinstance(o, fx.Node) and (o.name, steps[-1].dst.placements) not in seen:
                seen.add((o.name, steps[-1].dst.placements))
                out.append(("output", o.name, steps))
        return out

    def collective_steps(self) -> list:
        return [s for _, _, steps in self.edges for s in steps if s.is_collective]

    def memory(self) -> dict:
        """Per-rank estimates (max over ranks): parameters, gradients, peak live activations."""
        mesh = self.mesh
        lay = self.prop.layouts
        params = sum(
            max(lay[p][0].local_numel(mesh, r) for r in range(mesh.size)) * lay[p][0].itemsize
            for p in self.param_placeholders
        )
        return {"parameters": params, "gradients": params if self.stage == "step" else 0,
                "peak_activations": self._peak_activations()}

    def _peak_activations(self) -> int:
        mesh, lay = self.mesh, self.prop.layouts
        nodes = list(self.prop.gm.graph.nodes)
        last_use = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last_use[a.name] = i
        live, peak = 0, 0
        size = {}
        for i, n in enumerate(nodes):
            if n.op == "call_function" and n.name in self.prop.nodes:
                size[n.name] = sum(
                    max(o.local_numel(mesh, r) for r in range(mesh.size)) * o.itemsize
                    for o in lay[n.name] if o is not None
                )
                live += size[n.name]
                peak = max(peak, live)
            for a in n.all_input_nodes:
                if last_use.get(a.name) == i and a.name in size:
                    live -= size.pop(a.name)
        return peak

    def stats(self) -> dict:
        steps = self.collective_steps()
        mem = self.memory()
        return {
            "comm_bytes": sum(s.bytes for s in steps),
            "comm_time_s": sum(s.time for s in steps),
            "collectives": dict(Counter(s.kind for s in steps)),
            "peak_memory_bytes": mem["parameters"] + mem["gradients"] + mem["peak_activations"],
            "memory": mem,
            "nodes": len(self.prop.nodes),
        }

    def summary(self) -> str:
        lines = [f"# stage: plan ({self.stage}) on {self.mesh!r}"]
        if self.prop.solve_report is not None:
            lines.append(f"# planner: {self.prop.solve_report}")
        lines.append(f"{'node':<28} {'op':<44} {'inputs -> outputs':<40} collectives")
        by_consumer: dict = {}
        for consumer, src, steps in self.edges:
            by_consumer.setdefault(consumer, []).extend(s for s in steps)
        for name, np_ in self.prop.nodes.items():
            ins = " ".join(_fmt_pl(p) for p in np_.strategy.ins)
            outs = " ".join(_fmt_pl(p) for p in np_.strategy.outs)
            comm = ", ".join(repr(s) for s in by_consumer.get(name, []) if s.kind != "slice")
            tag = " [replicate fallback]" if np_.fallback else ""
            lines.append(f"{name:<28} {str(np_.call.op):<44} {ins + ' -> ' + outs:<40} {comm}{tag}")
        if "output" in by_consumer:
            lines.append(f"{'output':<28} {'':<44} {'':<40} " + ", ".join(map(repr, by_consumer["output"])))
        st = self.stats()
        mem = st["memory"]
        lines += [
            f"totals: {sum(st['collectives'].values())} collectives {st['collectives']}, "
            f"{_fmt_bytes(st['comm_bytes'])} sent per rank per {self.stage}, est. {st['comm_time_s'] * 1e6:.1f} us",
            f"memory per rank: parameters {_fmt_bytes(mem['parameters'])}, gradients {_fmt_bytes(mem['gradients'])}, "
            f"peak activations {_fmt_bytes(mem['peak_activations'])}",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
