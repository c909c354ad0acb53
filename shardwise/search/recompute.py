"""activation_checkpointing="auto": save or recompute each block, decided by the ILP.

    rc = RecomputeChoice(gm)               # the blocks trace/recompute.plan_recompute could recompute
    prog = Program(..., recompute=rc)      # search/ilp.py: one binary column per block
    blocks = rc.chosen(x); prop = rc.realise(planner, choices, ...)   # the plan with those recomputed

Columns and rows (search/ilp.py's program, search/budget.py's memory rows):

- ``r[b]`` binary: block ``b`` is recomputed (one column per block, even where identical layers
  share their placement columns, search/layers.py: a budget is often met by recomputing some
  layers and not others);
- the recompute's compute: per node ``n`` that ``b`` recomputes, ``T(n) c[n] >= sum_s t(n, s)
  x[n, s] - T(n) (1 - r[b])``, ``c[n]`` in [0, 1] priced ``T(n)`` on the objective, ``T(n)`` its
  costliest strategy's time: exactly its compute time when ``r[b]`` is 1, nothing when 0 (the
  objective presses ``c`` down).
  So the objective stays the modelled step (search/steptime.py) of the plan with those blocks
  recomputed, up to what a recomputed node's own redistributions add (none under data parallel and
  FSDP: a recomputed block reads saved values and parameters, moved as in forward);
- the memory: an allocation of ``b`` that backward reads is live, between its last forward read
  and ``b``'s recompute (its first backward read), only if saved: there its bytes in a row are
  ``B(a) m[a]`` with ``B(a) m[a] >= sum_s bytes(a, s) x[a, s] - B(a) r[b]``, ``m[a]`` in [0, 1],
  ``B(a)`` its largest strategy's bytes (the budget row presses ``m`` down).

The Propagation of a solution is planned on the graph with the chosen blocks recomputed
(trace/recompute.recompute_blocks), each recomputed node taking its original's strategy.
"""
from __future__ import annotations

import operator

import numpy as np
import torch.fx as fx

from ..trace import is_view
from ..trace.recompute import RECOMPUTE_OF, plan_recompute, recompute_blocks


class RecomputeChoice:
    """The candidate blocks of graph ``gm`` (``plan_recompute(gm, "blocks")``) and their columns."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.order = {n.name: i for n, i in order.items()}
        self.blocks = {b: [n.name for n in ns] for b, ns in plan_recompute(gm, "blocks").items()}
        self.gaps: dict = {}  # allocation name -> (block, last forward read, recompute point)
        for b, names in self.blocks.items():
            nodes = [n for n in gm.graph.nodes if n.name in set(names)]
            backward = [u for n in nodes for u in n.users if u.meta.get("autograd_backward")]
            if not backward:
                continue
            at = min(order[u] for u in backward)
            for n in nodes:
                if is_view(n) or n.target is operator.getitem or not _read_in_backward(n):
                    continue
                last = max((order[u] for u in _readers(n) if not u.meta.get("autograd_backward")), default=order[n])
                if last < at:
                    self.gaps[n.name] = (b, last, at)
        self.cols: dict = {}  # block -> its column in the current program
        self._bytes: dict = {}  # allocation -> its m column in the current program

    # -- the program ---------------------------------------------------------------------------
    def add(self, prog) -> None:
        """The ``r`` and ``c`` columns of the module docstring, into ``prog`` (search/ilp.Program)."""
        model = prog.model
        self.cols = {b: model.var(0.0, integer=True) for b in self.blocks}
        self._bytes = {}
        for b, names in self.blocks.items():
            for name in names:
                if name not in prog.nodes:
                    continue
                cols, sts = prog.nodes[name]
                times = [prog.memo.node_cost(name, prog.calls.get(name) or prog.calls[prog.aliases[name]], st)
                         for st in sts]
                top = max(times, default=0.0)
                if top <= 0.0:
                    continue
                c = model.var(top)  # columns lie in [0, 1]: c in units of the costliest strategy's time
                model.row({c: 1.0, **{k: -t / top for k, t in zip(cols, times)}, self.cols[b]: -1.0}, -1.0, np.inf)

    def memory_term(self, prog, name: str, point: str, terms: dict, per_strategy: list) -> bool:
        """Put allocation ``name``'s bytes at ``point`` into ``terms`` as its ``m`` column when it is
        in its block's gap there (True), else leave it to the caller (False)."""
        gap = self.gaps.get(name)
        if gap is None or not self.cols or not gap[1] < self.order[point] < gap[2]:
            return False
        top = max((b for _, b in per_strategy), default=0.0)
        if top <= 0.0:
            return True
        if name not in self._bytes:  # m in units of its largest strategy's bytes (columns lie in [0, 1])
            m = self._bytes[name] = prog.model.var(0.0)
            prog.model.row({m: 1.0, **{c: -b / top for c, b in per_strategy}, self.cols[gap[0]]: 1.0}, 0.0, np.inf)
        terms[self._bytes[name]] = terms.get(self._bytes[name], 0.0) + top
        return True

    def saved_at(self, name: str, point: str, recomputed) -> bool:
        """False when allocation ``name`` is not held at ``point`` because its block is recomputed."""
        gap = self.gaps.get(name)
        return not (gap is not None and gap[0] in recomputed and gap[1] < self.order[point] < gap[2])

    def chosen(self, x) -> frozenset:
        return frozenset(b for b, c in self.cols.items() if x[c] > 0.5)

    # -- the plan ------------------------------------------------------------------------------
    def realise(self, planner, ph: dict, outs: list, params, choices: dict, blocks: frozenset):
        """The Propagation of ``choices`` on the graph with ``blocks`` recomputed."""
        if not blocks:
            prop = planner.run(self.gm, ph, outs, params=params, choices=choices)
        else:
            gm = _copy(self.gm)
            recompute_blocks(gm, "blocks", only=blocks)
            every = {n.name: choices[n.meta.get(RECOMPUTE_OF, n.name)] for n in gm.graph.nodes
                     if n.op == "call_function" and n.meta.get(RECOMPUTE_OF, n.name) in choices}
            prop = planner.run(gm, ph, outs, params=params, choices=every)
        prop.recomputed = blocks
        return prop


def _readers(n: fx.Node) -> list:
    """The nodes that read ``n``'s storage: its users, and through views and getitems theirs."""
    out, stack = [], [n]
    while stack:
        cur = stack.pop()
        for u in cur.users:
            out.append(u)
            if u.op == "call_function" and (is_view(u) or u.target is operator.getitem) and u.args[0] is cur:
                stack.append(u)
    return out


def _read_in_backward(n: fx.Node) -> bool:
    return any(u.meta.get("autograd_backward") for u in _readers(n))


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (same node names and metadata)."""
    graph, env = fx.Graph(), {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    new = fx.GraphModule(gm, graph)
    new.meta.update(getattr(gm, "meta", {}))
    return new
