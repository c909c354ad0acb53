"""``memory_budget=`` (bytes per rank) as rows of the ILP (search/ilp.py, search/solve.py).

    rows = MemoryRows(budget, gm, params, training, optimizer_state, placeholder_placements)
    prog = Program(..., memory=rows)      # one row per time point in rows.points

A row bounds, at one point of the step, what a rank holds there as a linear function of the
program's columns:

- every parameter's local bytes times (1 + gradient + optimizer state) for a step (AdamW's two
  moments: the cost model's ``optimizer_state``, 2.0 by default), 1 for forward only; a free
  parameter's (search/params.py) through its candidate columns, a placed one as a constant;
- the other program arguments (inputs, targets, buffers) as constants;
- every value live at that point (produced at or before it, read at or after it; a view or
  getitem extends the life of what it aliases and adds no bytes): its producer's local output
  bytes under each strategy, on that strategy's column.

- every redistributed copy (a gathered parameter, a resharded activation) from its first
  reader to its last, on the column that makes it.

The plan's own estimate (lower/memory.py: a fake run of the per-rank program) differs in
details (prefetched gathers start earlier, collective buffers, kernels' temporaries). The
solve closes the gap by cuts: it estimates the chosen plan, and while the estimate exceeds the
budget it adds a row at the estimate's peak and moves every row's bound by what the estimate
holds there beyond the row for that plan (either way), then solves again (search/solve.py).
"""
from __future__ import annotations

import functools
import operator

import numpy as np
import torch
import torch.fx as fx

from ..core.errors import MemoryBudgetError
from ..core.layout import Layout, Replicate
from ..trace import is_view, node_call, tensor_arg_nodes
from ..trace.precision import MASTER_DTYPE

ROW_UNIT = 2.0**20  # bytes: a memory row is written in MiB (add_rows)

class MemoryRows:
    """The memory rows of one program; ``points``: graph node names the rows bound (cuts add
    more); ``correction``: per point, what the plan estimate holds beyond the row (cuts set it)."""

    def __init__(self, budget: float, gm: fx.GraphModule, params: dict, training: bool, optimizer_state: float,
                 placeholder_placements: dict, mesh, bucket_bytes=None, grad_indices=frozenset()):
        self.budget, self.gm, self.mesh = float(budget), gm, mesh
        self.training, self.bucket_bytes = training, bucket_bytes
        self.factor = (2.0 + optimizer_state) if training else 1.0  # parameter + gradient + optimizer state
        self.optimizer_state = optimizer_state
        self.params = set(params)  # parameter placeholder names
        self.placements = placeholder_placements
        self.points: list = []
        self.correction: dict = {}  # point -> what the estimate holds there beyond the row (the last plan's)
        self.order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        self.base, self.last = _lifetimes(gm, set(grad_indices))  # gradients: with their parameters
        self.recompute = None  # search/recompute.py RecomputeChoice (activation_checkpointing="auto")
        self._bytes: dict = {}

    # -- the rows ---------------------------------------------------------------------------
    def add_rows(self, prog, z: int | None = None) -> None:
        """One row per point: bytes <= budget; with ``z`` (a column worth ``self.scale`` bytes)
        bytes <= z instead (the program that minimises the peak, for the error message)."""
        const, param_terms = self.resident(prog)
        for point in self.points:
            terms = dict(param_terms)
            fixed = self.copies(prog, point, terms)
            for name in self.live_at(point):
                if name in prog.nodes:
                    cols, sts = prog.nodes[name]
                    call = node_call(self.node(name))
                    per = [(c, self.out_bytes(name, call, st)) for c, st in zip(cols, sts)]
                    if self.recompute is not None and self.recompute.memory_term(prog, name, point, terms, per):
                        continue  # held only if its block is saved (search/recompute.py)
                    for c, b in per:
                        terms[c] = terms.get(c, 0.0) + b
            rest = const + fixed + self.correction.get(point, 0.0)
            # in MiB: raw bytes (~1e10) beside the objective's picoseconds leave HiGHS's LP numerically
            # unsound (it called the bounded 8B (8, 8) round unbounded and fell back to a 10 s MIP); one
            # unit for every budget, so two budgets' programs differ in their bounds only
            unit = ROW_UNIT
            terms = {c: b / unit for c, b in terms.items()}
            if z is None:
                prog.model.row(terms, -np.inf, (self.budget - rest) / unit)
            else:
                prog.model.row({**terms, z: -self.scale / unit}, -np.inf, -rest / unit)

    def copies(self, prog, point: str, terms: dict) -> float:
        """Redistributed copies live at ``point`` (from their first reader to their last; a copy
        is made once and shared): their bytes go on the column that makes them (into ``terms``);
        returns the bytes of those every plan makes."""
        t, fixed = self.order[point], 0.0
        for key, readers in prog.move_consumers.items():
            at = [self.order[r] for r in readers if r in self.order]
            if not at or not min(at) <= t <= max(at):
                continue
            src, _, p = prog.memo.moves[key][:3]  # a backward re-gather's has "backward" after
            val = prog.values[src][0]
            nbytes = _local_bytes(Layout(val.shape, val.dtype, p), self.mesh)
            if key in prog.always:
                fixed += nbytes
            elif key in prog.move_col:
                terms[prog.move_col[key]] = terms.get(prog.move_col[key], 0.0) + nbytes
        return fixed

    def value(self, point: str, prop) -> float:
        """The rows' left side at ``point`` for a planned Propagation (what a cut corrects)."""
        total = 0.0
        for n in self.gm.graph.nodes:
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
                factor = self.param_factor(n) if n.name in self.params else 1.0
                total += factor * _local_bytes(prop.layouts[n.name][0], self.mesh)
        for name in self.live_at(point):
            if name in prop.nodes and (self.recompute is None or self.recompute.saved_at(name, point, prop.recomputed)):
                np_ = prop.nodes[name]
                total += self.out_bytes(name, np_.call, np_.strategy)
        readers: dict = {}  # (value, placements) -> (layout, reader indices): the copies the plan makes
        for name, np_ in prop.nodes.items():
            if name not in self.order:  # a recomputed copy (search/recompute.py): the cut's correction holds it
                continue
            for a, steps in zip(tensor_arg_nodes(self.node(name)), np_.in_steps):
                if steps:
                    key = (a.name, steps[-1].dst.placements)
                    readers.setdefault(key, (steps[-1].dst, []))[1].append(self.order[name])
        t = self.order[point]
        return total + sum(_local_bytes(lay, self.mesh) for lay, at in readers.values() if min(at) <= t <= max(at))

    @functools.cached_property
    def scale(self) -> float:
        """Bytes per unit of the minimised column (columns are bounded by 1): everything replicated."""
        total = sum(_local_bytes(Layout(n.meta["val"].shape, n.meta["val"].dtype, (Replicate(),) * self.mesh.ndim),
                                 self.mesh) for n in self.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
        return self.factor * total + 1.0

    def resident(self, prog) -> tuple:
        """(constant bytes, {column: bytes}) of the program's arguments."""
        const, terms = 0.0, {}
        for n in self.gm.graph.nodes:
            if n.op != "placeholder" or not isinstance(n.meta.get("val"), torch.Tensor):
                continue
            val = n.meta["val"]
            factor = self.param_factor(n) if n.name in self.params else 1.0
            if n.name in prog.params:
                cols, cands = prog.params[n.name]
                for c, pl in zip(cols, cands):
                    terms[c] = terms.get(c, 0.0) + factor * _local_bytes(Layout(val.shape, val.dtype, pl), self.mesh)
            else:
                pl = tuple(self.placements.get(n.name) or (Replicate(),) * self.mesh.ndim)
                const += factor * _local_bytes(Layout(val.shape, val.dtype, pl), self.mesh)
        return const, terms

    def param_factor(self, n: fx.Node) -> float:
        """Bytes a rank holds per byte of parameter placeholder ``n``'s local shard: the parameter,
        its gradient and optimizer state; under mixed precision (trace/precision.MASTER_DTYPE) the
        placeholder is the compute copy, and the master, its gradient and state are r times as
        large (r: the master's itemsize over the copy's)."""
        master = n.meta.get(MASTER_DTYPE)
        if master is None:
            return self.factor
        r = torch.empty((), dtype=master).element_size() / n.meta["val"].element_size()
        return 1.0 + r * self.factor if self.training else 1.0 + r

    def out_bytes(self, name: str, call, st) -> float:
        """Local bytes ``name``'s outputs hold under ``st`` on the busiest rank."""
        key = (name, st)
        if key not in self._bytes:
            self._bytes[key] = float(sum(_local_bytes(o, self.mesh) for o in st.out_layouts(call) if o is not None))
        return self._bytes[key]

    # -- liveness ---------------------------------------------------------------------------
    def node(self, name: str) -> fx.Node:
        if not hasattr(self, "_nodes"):
            self._nodes = {n.name: n for n in self.gm.graph.nodes}
        return self._nodes[name]

    def live_at(self, point: str) -> list:
        """Values that hold bytes at ``point``: produced at or before it, read at or after it."""
        t = self.order[point]
        return [name for name, last in self.last.items() if self.order[name] <= t <= last]

    def point_of(self, program_node: str, program_order: list) -> str | None:
        """The graph node at or before ``program_node`` in a per-rank program's order."""
        best = None
        for name in program_order:
            if name in self.order and self.node(name).op == "call_function":
                best = name
            if name == program_node:
                break
        return best


def _lifetimes(gm: fx.GraphModule, grad_indices=frozenset()) -> tuple:
    """({node: the value whose bytes it holds}, {allocating node: index of its last read})."""
    base, last = {}, {}
    nodes = list(gm.graph.nodes)
    for i, n in enumerate(nodes):
        if n.op != "call_function":
            continue
        srcs = tensor_arg_nodes(n)
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            base[n.name] = base.get(n.args[0].name, n.args[0].name)
        elif is_view(n) and srcs:
            base[n.name] = base.get(srcs[0].name, srcs[0].name)
        else:
            base[n.name] = n.name
            last[n.name] = i
    outs = next((n for n in nodes if n.op == "output"), None)
    grads = set()
    if outs is not None:
        flat = outs.args[0] if isinstance(outs.args[0], (list, tuple)) else [outs.args[0]]
        grads = {o.name for i, o in enumerate(flat) if i in grad_indices and isinstance(o, fx.Node)}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            b = base.get(a.name)
            if b in last and not (n.op == "output" and a.name in grads):  # a gradient: counted with its parameter
                last[b] = max(last[b], len(nodes) if n.op == "output" else i)
    return base, last


def _local_bytes(layout: Layout, mesh) -> float:
    return float(layout.max_local_numel(mesh) * layout.itemsize)


__all__ = ["MemoryRows", "MemoryBudgetError"]
