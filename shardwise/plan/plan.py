"""Plan: one strategy per node, the redistribution on every edge, and cost figures.

``summary()`` prints the per-node table (module path, placements, source line, collectives
with bytes; one row per redistributed graph output), totals and per-rank memory; ``stats()``
returns the same figures as a dict; ``program(rank)`` prints the lowered per-rank program as
Python, each line annotated with its local shapes, placements and module (shape guards only
with ``guards=True``). ``shardwise plan`` / shardwise/report draw the same rows as HTML.
"""
from __future__ import annotations

from collections import Counter
from functools import cached_property

import torch.fx as fx

from ..lower.buckets import DEFAULT_BUCKET_BYTES, bucket_all_reduce, bucket_reduce_scatter
from ..lower.prefetch import start_all_gather
from ..lower.program import build_program, program_source
from ..trace import tensor_arg_nodes
from ..lower.redistribute import _fmt_bytes
from .rows import fmt_placements as _fmt_pl, node_rows, output_rows, short_source
from .annotate import annotate_program


class Plan:
    def __init__(self, prop, param_placeholders: dict, debug: bool = True, stage: str = "step",
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES):
        self.prop = prop
        self.bucket_bytes = bucket_bytes  # all_reduce buckets' cap (lower/buckets.py); None: no buckets
        self.mesh = prop.mesh
        self.param_placeholders = dict(param_placeholders)  # placeholder name -> parameter name
        self.debug = debug
        self.stage = stage
        self._programs: dict = {}

    # -- programs -----------------------------------------------------------------------
    def program_module(self, rank: int) -> fx.GraphModule:
        if rank not in self._programs:
            self._programs[rank] = build_program(self.prop, rank, self.debug, self.bucket_bytes)
        return self._programs[rank]

    def program(self, rank: int = 0, guards: bool = False, annotate: bool = True) -> str:
        """The per-rank program as Python source: each line that computes a planned node ends in
        a comment with its local shapes, placements and module path. ``guards``: show the
        debug shape checks the program runs (left out by default: they are not the model)."""
        if guards and self.debug:
            gm = self.program_module(rank)
        else:
            gm = self._unguarded(rank)
        src = program_source(gm, rank)
        return annotate_program(src, self, rank) if annotate else src

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
            if np_.rule.comm is not None:  # collectives the local call runs itself (a halo exchange)
                inner = np_.rule.comm(np_.call, np_.strategy, self.mesh)
                if inner:
                    out.append((name, name, inner))
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

    def collective_calls(self, rank: int = 0) -> dict:
        """{kind: calls} that rank ``rank``'s program makes per run: a bucket of all_reduces (of
        reduce_scatters) is one ``"all_reduce"`` (``"reduce_scatter"``) call; collectives a
        local call runs itself are not seen here."""
        calls = Counter()
        for n in self._unguarded(rank).graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is bucket_all_reduce:
                calls["all_reduce"] += 1
            elif n.target is bucket_reduce_scatter:
                calls["reduce_scatter"] += 1
            elif n.target is start_all_gather:  # a prefetched all_gather (lower/prefetch.py)
                calls["all_gather"] += 1
            elif "sw_step" in n.meta and n.meta["sw_step"].is_collective:
                calls[n.meta["sw_step"].kind] += 1
        return dict(calls)

    def _unguarded(self, rank: int) -> fx.GraphModule:
        key = ("unguarded", rank)
        if key not in self._programs:
            self._programs[key] = build_program(self.prop, rank, False, self.bucket_bytes)
        return self._programs[key]

    def stats(self) -> dict:
        """Figures per rank per run. ``collectives``: {kind: count} of planned collectives, one
        per redistributed tensor (a bucket counts as its members, so the count does not depend
        on ``bucket_bytes``); ``comm_bytes``: what each rank sends for them (a bucket sends
        exactly its members' bytes); ``collective_calls``: {kind: calls} rank 0's program makes,
        a bucket being one call (fewer than ``collectives`` when gradients are bucketed)."""
        steps = self.collective_steps()
        mem = self.memory()
        return {
            "comm_bytes": sum(s.bytes for s in steps),
            "comm_time_s": sum(s.time for s in steps),
            "collectives": dict(Counter(s.kind for s in steps)),
            "collective_calls": self.collective_calls(0),
            "peak_memory_bytes": mem["parameters"] + mem["gradients"] + mem["peak_activations"],
            "memory": mem,
            "nodes": len(self.prop.nodes),
        }

    def summary(self) -> str:
        """The plan as a table: one row per node (op, module, placements, source, collectives)
        and one per redistributed graph output, then totals and memory per rank."""
        lines = [f"# stage: plan ({self.stage}) on {self.mesh!r}"]
        if self.prop.solve_report is not None:
            lines.append(f"# planner: {self.prop.solve_report}")
        table = [("node", "op", "module", "inputs -> outputs", "source", "collectives")]
        for r in node_rows(self) + output_rows(self):
            comm = ", ".join(map(repr, r.steps))
            ins = " ".join(_fmt_pl(p) for p in r.ins)
            outs = " ".join(_fmt_pl(p) for p in r.outs)
            table.append((r.name, r.op, r.module, f"{ins} -> {outs}", short_source(r.source),
                          comm + (" [replicate fallback]" if r.fallback else "")))
        lines += _columns(table)
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


def _columns(table: list, cap: int = 44) -> list:
    """Left-aligned columns as wide as their widest cell (at most ``cap``; the last column free)."""
    widths = [min(cap, max(len(row[c]) for row in table)) for c in range(len(table[0]) - 1)]
    return [(" ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " " + row[-1]).rstrip() for row in table]
