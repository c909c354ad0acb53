"""The integer program behind search/solve.py, and the objective it minimises.

Columns:
- x[v, s] binary: node v takes strategy s; sum_s x[v, s] = 1. Cost: s's compute time.
- per consumer edge (v, i) of value w (an fx node; getitem aliases output k of its
  producer): y[e, q, p] >= 0 couples how w arrives (q) with what v takes (p):
  sum_p y = a[w, q] (the x of the producer's strategies whose output is q) and
  sum_q y = b[e, p] (the x of v's strategies whose input i is p). Where one side is fixed
  (a placeholder, a graph output), the other side's x stand in for y.
- a move (w, q, p), q != p, costs the redistribution's time once however many consumers
  share it (the program emits each (producer, placements) redistribution once): on its
  only coupling column, or on m >= every coupling column that uses it.
- an all_gather the program coalesces per FSDP unit (search/paths.coalesced_gather) pays its
  bandwidth and its share of the call's one latency (1 / the tensors its group may gather):
  exact when a unit is gathered whole, as FSDP gathers it, or not at all. A solution that
  gathers a group in part is valued with the whole call's latency (Program.value: plan_cost's
  figure), and where the latencies left unpriced are 1% of the plan or more the search's last
  round gives such groups a call column g >= each member's move column, paying that latency, and
  solves again (Program.price_calls, Search._price_calls). A call column for every group from the
  start would price every plan exactly, but its fractional LP relaxation makes every round a MIP.

This per-edge coupling (the local polytope of a pairwise labelling problem) is what makes
the LP relaxation tight: with the textbook m >= a + b - 1, fractional x zero every move and
HiGHS cannot close the gap on a 2-layer Llama within a minute; here the root LP is
usually integral. Unreachable (q, p) pairs get no coupling column, so they are forbidden.
"""
from __future__ import annotations

import operator
import time
import warnings
import weakref
from collections import Counter
from itertools import chain

import numpy as np
import torch
import torch.fx as fx

from ..core.cost import BUCKETED
from ..core.errors import ShardingError
from ..core.layout import Layout, Partial, Replicate, Shard
from ..trace import node_call, tensor_arg_nodes
from ..trace.precision import MASTER_DTYPE, REDUCE_AFTER
from .flops import node_time
from .params import grad_placements, optimizer_seconds
from .paths import coalesced_gather, edges, gather_call_latency, move_key, reduces
from .steptime import step_time

_NODE_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # planner -> (cost model, {key: s})
EPS = 1e-16  # seconds per tie-breaker unit: below one flop at 100 Tflop/s, far below any collective
HIGHS_DETERMINISTIC = {"threads": 1, "random_seed": 0}
# The feasibility-jump heuristic looks for a first incumbent before the root LP; here the root LP
# is nearly always integral, so it only costs time.
HIGHS_OPTIONS = {**HIGHS_DETERMINISTIC, "mip_heuristic_run_feasibility_jump": False}
# The mixed-integer program (a round whose LP is fractional) without HiGHS's presolve: its presolved
# model spends seconds in root cuts that the original closes in one (fuzz seed 127's first round: 3.0 s
# -> 0.9 s, the same optimum; of fuzz seeds 1000-1059 on 8 ranks, the two that reach the MIP end at the
# same cost, seed 1034 in 4.0 s instead of 5.3). The LP keeps presolve (Model.solve says why).
MIP_PRESOLVE = False
INTEGRAL_TOL = 1e-6  # an LP value this close to 0 or 1 is taken as integral (HiGHS's feasibility tolerance is 1e-7)
SCALE = 1e12  # objective in picoseconds: EPS is then 1e-4, far above HiGHS's 1e-7..1e-6 tolerances
# The MIP (a round whose LP is fractional) stops once its plan is within this fraction of the best
# bound instead of proving it optimal: a hundredth of the 1% a round must save (search/solve.py
# MIN_GAIN). The tie-breakers (EPS, ~1e-13 of a plan) lie far inside any useful gap: where the MIP
# stops on it they are not proven, and the plan may keep a step or a Partial output the exact optimum
# would not (equal modelled time). The LP, which settles nearly every round, is exact and honours them.
MIP_GAP = 1e-4


# -- the objective ----------------------------------------------------------------------------
def node_cost(planner, call, st) -> float:
    """Compute time on the busiest rank plus the collectives the op runs itself (search/flops.py
    node_time); a tie-breaker per Partial output (settle reductions). Kept per planner and cost
    model by the call's key and the strategy: a repeated layer's nodes ask for the same ones."""
    memo = _NODE_COSTS.get(planner)
    if memo is None or memo[0] is not planner.cost:
        memo = _NODE_COSTS[planner] = (planner.cost, {})
    key = (call.key, st)
    got = memo[1].get(key)
    if got is None:
        got = memo[1][key] = _node_cost(planner, call, st)
    return got


def weights(planner) -> tuple:
    """(per run of the graph, per graph output's move): Planner.objective_weights, or (1, 1)."""
    return getattr(planner, "objective_weights", None) or (1.0, 1.0)


def _node_cost(planner, call, st) -> float:
    partials = sum(isinstance(p, Partial) for o in st.outs if o is not None for p in o)
    rule = planner.registry.get(call.op) if call.op in planner.registry else None
    return node_time(planner.cost, call, st, planner.mesh, rule) * weights(planner)[0] + EPS * partials


def move_cost(steps, planner=None, output: bool = False) -> float:
    """Redistribution time; a tie-breaker per step (do not slice a replicated value for nothing).
    ``output``: the move of a graph output (a gradient) that no node reads. The program
    coalesces those all_reduces / reduce_scatters into buckets of ``planner.bucket_bytes``
    (lower/buckets.py), one launch per bucket, so each pays its bandwidth term and the latency
    only in proportion to the bucket it fills (not one full latency per gradient tensor, which
    would price data parallelism of a model with many small parameters far above its cost)."""
    bucket = planner.bucket_bytes if output else None
    w = weights(planner)[1 if output else 0] if planner is not None else 1.0
    return sum(_bucketed(s, planner, bucket) for s in steps) * w + EPS * len(steps)


def _bucketed(step, planner, bucket) -> float:
    return planner.cost.bucketed_time(step, planner.mesh, bucket) if bucket else step.time


def plan_cost(planner, prop) -> float:
    """The ILP's objective (seconds) on any Propagation: the modelled step (steptime.py: every
    unique redistribution as the program emits it, an op's own collectives, every node's compute
    on its busiest rank) plus the tie-breakers (EPS per redistribution step between nodes, per
    Partial output), as the program's columns price them."""
    ties = sum(len(steps) for dst, src, steps in edges(prop) if dst != src)
    ties += sum(isinstance(p, Partial) for np_ in prop.nodes.values() for o in np_.strategy.outs if o is not None
                for p in o)
    return step_time(prop, planner.cost, planner.bucket_bytes, getattr(planner, "objective_weights", None)).total_s \
        + EPS * ties


# -- the program ------------------------------------------------------------------------------
class Model:
    """Columns in [0, 1] (cost, integrality) and sparse rows lo <= sum coef * col <= hi."""

    def __init__(self):
        self.cost, self.integer, self.rows = [], [], []
        self.unbounded: list = []  # columns with no upper bound (the overlap columns: seconds)
        self.offset = 0.0  # seconds every choice pays (moves between fixed layouts)

    def var(self, cost: float, integer: bool = False, bounded: bool = True) -> int:
        self.cost.append(cost * SCALE)
        self.integer.append(integer)
        if not bounded:
            self.unbounded.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def row(self, terms: dict, lo: float, hi: float) -> None:
        self.rows.append((terms, lo, hi))

    def solve(self, time_limit: float, disp: bool = False, bound: float | None = None):
        """scipy's OptimizeResult of the program: its LP relaxation when that is integral (then
        optimal for the program too: the same bound, met), else the mixed-integer program.
        The rounds of an n-d mesh are nearly always integral at the LP, which solves faster than
        the MIP. Presolve stays on: without it the simplex is faster still but ends on another of
        several optimal vertices, and later rounds then find other, costlier local optima; with
        it, the MIP's plans. The MIP itself runs without presolve (MIP_PRESOLVE), to MIP_GAP, and
        prunes what costs more than ``bound`` (the objective of a plan known to be feasible: the
        round's incumbent, at first propagation's plan): scipy's milp takes no starting solution,
        so the incumbent enters as HiGHS's objective cutoff. Nothing within it: status 2."""
        from scipy.sparse import coo_array

        terms, lo, hi = zip(*self.rows) if self.rows else ((), (), ())
        r = np.repeat(np.arange(len(terms)), [len(t) for t in terms])
        c = np.fromiter(chain.from_iterable(terms), dtype=np.int64, count=len(r))
        v = np.fromiter(chain.from_iterable(t.values() for t in terms), dtype=float, count=len(r))
        a = coo_array((v, (r, c)), shape=(len(self.rows), len(self.cost))).tocsr()
        lo, hi = np.array(lo, dtype=float), np.array(hi, dtype=float)
        cost, integer = np.array(self.cost), np.array(self.integer, dtype=bool)
        upper = np.ones(len(cost))
        upper[self.unbounded] = np.inf
        deadline = time.perf_counter() + time_limit
        res = _highs(cost, np.zeros(len(cost), dtype=int), a, lo, hi, time_limit, disp, upper)
        if res.status == 0 and res.x is not None:
            ints = res.x[integer]
            if np.all(np.abs(ints - np.round(ints)) <= INTEGRAL_TOL):
                res.x[integer] = np.round(ints)
                return res
        return _highs(cost, integer.astype(int), a, lo, hi, max(deadline - time.perf_counter(), 0.1), disp, upper,
                      presolve=MIP_PRESOLVE, gap=MIP_GAP, bound=bound)


def _highs(cost, integrality, a, lo, hi, time_limit: float, disp: bool, upper=1.0, presolve: bool = True,
           gap: float = 0.0, bound: float | None = None):
    """scipy.optimize.milp with the module's HiGHS options (an LP where ``integrality`` is all 0)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    # One thread and a fixed seed: the same program gives the same plan in every run (HiGHS is
    # deterministic then, unless the time limit stops it); scipy passes both on (and HiGHS's
    # objective_bound) with a warning.
    options = {"time_limit": time_limit, "mip_rel_gap": gap, "disp": disp, "presolve": presolve, **HIGHS_OPTIONS}
    if bound is not None:
        options["objective_bound"] = bound
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
        return milp(cost, integrality=integrality, bounds=Bounds(0, upper), constraints=LinearConstraint(a, lo, hi),
                    options=options)


class Program:
    """Walks the graph once, adding the columns and rows of the module docstring.

    ``incumbent`` ({node: Strategy}) is always a candidate, so the optimum is never costlier
    than it; with ``near`` only strategies that differ from it on at most one mesh dim are
    (a neighbourhood that keeps n-d meshes tractable), and with ``dim`` also only on that mesh dim
    (a third of the columns on a 2-d mesh: search/solve.py's rounds take the dims in turn)."""

    def __init__(self, planner, incumbent: dict | None = None, near: bool = False, memo: "Memo | None" = None,
                 free: dict | None = None, grads: dict | None = None, memory=None, aliases: dict | None = None,
                 recompute=None, dim: int | None = None):
        self.planner, self.mesh = planner, planner.mesh
        self.incumbent, self.near, self.dim = incumbent or {}, near, dim
        self.free, self.grads = free or {}, grads or {}  # search/params.py: free parameters, their gradients
        self.params: dict = {}  # free placeholder name -> (x columns, candidate placements)
        self.memory = memory  # search/budget.py MemoryRows: the memory_budget rows, or None
        self.recompute = recompute  # search/recompute.py RecomputeChoice: save or recompute each block, or None
        self.aliases = aliases or {}  # search/layers.py: node of a repeated layer -> its template's node
        self.templates = set(self.aliases.values())
        self.edge_count: dict = {}  # (value, consumer, input) after aliasing -> how many real edges it stands for
        self.copies: dict = {}  # template node -> its followers, whose compute its columns also pay
        self.use_edges: dict = {}  # move (Memo.moves: (value, q, p)) -> the edge keys whose columns move it
        self.memo = memo or Memo(planner)
        self.model = Model()
        self.values: dict = {}  # fx node name -> (fake tensor, {placements: (x columns, constant)})
        self.calls: dict = {}  # call node name -> its OpCall
        self.outs: dict = {}  # call node name -> per output: {placements: (x columns, 0)} or None
        self.nodes: dict = {}  # call node name -> (x columns, strategies)
        self.uses: dict = {}  # move, q != p -> per consumer edge: the columns that move it
        # move -> the nodes that read that copy (search/budget.py); a move no node reads is a
        # graph output's (bucketed)
        self.move_consumers: dict = {}
        self.move_col: dict = {}  # move -> the column that is 1 when the program makes that copy
        self.always: dict = {}  # moves that happen whatever is chosen (no column needed); a dict, so
        # the offset is summed in graph order in every process (a set's order follows str hashes)
        self.graph_nodes: dict = {}  # fx node name -> node (a consumer's phase, a producer's op)
        self.order, self.gathers = {}, {}  # node name -> position; move -> its coalesced gather's group
        self.members: Counter = Counter()  # coalesced gather's group -> the tensors it may gather
        self.call_groups: set = set()  # coalesced gathers priced by a call column (price_calls)

    def build(self, gm: fx.GraphModule, placeholder_placements: dict, output_placements: list) -> "Program":
        self.graph_nodes = {n.name: n for n in gm.graph.nodes}
        for node in gm.graph.nodes:
            if node.name in self.aliases and node.op != "output":
                self._follower(node)
            elif node.op == "placeholder" and node.name in self.free:
                self._free_param(node)
            elif node.op in ("placeholder", "get_attr"):
                val = node.meta["val"]
                pl = tuple(placeholder_placements.get(node.name) or (Replicate(),) * self.mesh.ndim)
                ok = isinstance(val, torch.Tensor)
                self.values[node.name] = (val, {self.memo.layout(val, pl).placements: ([], 1)}) if ok else None
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                sup = self.outs[src.name][idx]
                self.values[node.name] = None if sup is None else (node.meta["val"], sup)
            elif node.op == "call_function":
                self._node(node)
            elif node.op == "output":
                self._outputs(node, output_placements)
        self._charge_copies()
        self._charge_moves()
        if self.recompute is not None:
            self.recompute.add(self)
        if self.memory is not None:
            self.memory.add_rows(self)
        return self

    def _free_param(self, node: fx.Node) -> None:
        """One column per candidate placement of a free parameter (search/params.py), exactly one taken."""
        val, cands = node.meta["val"], self.free[node.name]
        # each candidate pays its optimizer step (search/params.py: memory-bound, cheaper sharded)
        cols = [self.model.var(self._optimizer_s(node, pl), integer=True) for pl in cands]
        self.model.row(dict.fromkeys(cols, 1.0), 1.0, 1.0)
        self.params[node.name] = (cols, cands)
        self.values[node.name] = (val, {self.memo.layout(val, pl).placements: ([c], 0) for c, pl in zip(cols, cands)})

    def _optimizer_s(self, node: fx.Node, placements: tuple) -> float:
        if getattr(self.planner, "objective_weights", None):  # a pipeline's microbatch plan: see solve.py
            return 0.0
        return optimizer_seconds(self.planner.cost, node.meta["val"], placements, self.mesh,
                                 node.meta.get(MASTER_DTYPE))

    def param_choices(self, x) -> dict:
        """{free placeholder name: the placements chosen}."""
        return {name: cands[int(np.argmax(x[cols]))] for name, (cols, cands) in self.params.items()}

    def objective(self, fun: float) -> float:
        """The program's objective value in seconds, as plan_cost prices the plan."""
        return fun / SCALE + self.model.offset

    def choices(self, x) -> dict:
        return {name: sts[int(np.argmax(x[cols]))] for name, (cols, sts) in self.nodes.items()}

    def _node(self, node: fx.Node) -> None:
        args = self.memo.args(node)
        call, sts = self.memo.offer(node, self.incumbent.get(node.name), [tuple(self.values[a.name][1]) for a in args],
                                    lambda: self._offer(node, args), self.dim)
        cols = [self.model.var(self.memo.node_cost(node.name, call, st), integer=True) for st in sts]
        self.model.row(dict.fromkeys(cols, 1.0), 1.0, 1.0)
        self.nodes[node.name] = (cols, sts)
        for i, a in enumerate(args):
            self._edge_once(a.name, _group(cols, [st.ins[i] for st in sts]), node.name, i)
        self.outs[node.name] = [None if o is None else _group(cols, [st.outs[k] for st in sts])
                                for k, o in enumerate(call.outs)]
        if len(call.outs) == 1 and call.outs[0] is not None:
            self.values[node.name] = (node.meta["val"], self.outs[node.name][0])
        self.calls[node.name] = call

    def _follower(self, node: fx.Node) -> None:
        """A node of a repeated layer (search/layers.py): its template's columns, its compute
        charged once more on them, its edges built once per distinct (aliased) pair."""
        t = self.aliases[node.name]
        if node.op == "placeholder":  # a parameter of a repeated layer: the template's placement
            self.values[node.name] = self.values[t]
            if t in self.params:
                self.params[node.name] = self.params[t]
                for c, pl in zip(*self.params[t]):  # the follower's optimizer step, on the template's columns
                    self.model.cost[c] += self._optimizer_s(node, pl) * SCALE
            return
        if node.target is operator.getitem:
            self.values[node.name] = self.values[t]
            return
        cols, sts = self.nodes[t]
        self.copies[t] = self.copies.get(t, 0) + 1
        self.nodes[node.name] = (cols, sts)
        self.outs[node.name] = self.outs[t]
        if t in self.values:
            self.values[node.name] = self.values[t]
        for i, a in enumerate(self.memo.args(node)):  # the demand is grouped only for a new edge
            self._edge_once(a.name, lambda i=i: _group(cols, [st.ins[i] for st in sts]), node.name, i)

    def _charge_copies(self) -> None:
        """A template's columns pay its followers' compute too (each column once, not per follower)."""
        for t, k in self.copies.items():
            cols, sts = self.nodes[t]
            for c, st in zip(cols, sts):
                self.model.cost[c] += k * self.memo.node_cost(t, self.calls[t], st) * SCALE

    def _edge_once(self, src: str, demand, consumer: str, i, output: bool = False) -> None:
        """``_edge`` for the first real edge of each (aliased value, aliased consumer, input);
        ``demand`` may be a function that makes it (a follower's edge is mostly a repeat)."""
        key = (self.aliases.get(src, src), self.aliases.get(consumer, consumer), i)
        n = self.edge_count[key] = self.edge_count.get(key, 0) + 1
        if n == 1:
            self._edge(key[0], demand() if callable(demand) else demand, output, consumer=key[1], edge=key)

    def _offer(self, node: fx.Node, args: list) -> tuple:
        """(OpCall, the strategies offered to ``node`` this round): its candidates for the layouts its
        inputs may arrive as, those it can take (``_arrives``) within one mesh dim of the incumbent
        (``near``), the incumbent always. A pure function of the node, its incumbent and its inputs'
        supplies, so Memo.offer keeps it across rounds."""
        call = node_call(node)
        rule, _ = self.planner.rule_for(node)
        arriving = [self.memo.layout(val, q) for a in args for val, sup in [self.values[a.name]] for q in sup]
        inc = self.incumbent.get(node.name)
        seen = [[{q[m] for q in self.values[a.name][1]} for m in range(self.mesh.ndim)] for a in args]
        sts = [st for st in self.planner.candidates(call, rule, arriving)
               if st == inc or ((not self.near or _one_dim_off(st, inc, self.dim)) and self._arrives(st, seen))]
        if inc is not None and inc not in sts:
            sts.append(inc)
        if not sts:
            raise ShardingError(f"node {node.name!r} ({call.op}) has no strategy left to choose from",
                                fix="relax the attention= choice or the strategy filter")
        return call, sts

    def _arrives(self, st, seen: list) -> bool:
        """Take a Partial, unit or grouped input only where the producer can hand it over on
        that mesh dim. Otherwise every linear op offers partial-in/partial-out strategies
        (making a replicated value partial is local and free) and every blockwise op its
        block restatements for each block seen upstream: a program several times larger,
        for plans that only postpone a reduction or move into a block layout first.
        A Partial input beside an input sharded on that mesh dim is kept: the bias of a
        row-parallel addmm (Megatron's), made partial locally, added once into the partial sum.
        ``seen[i][m]``: the placements input i may arrive in on mesh dim m."""
        for i, on_dims in enumerate(seen):
            for m, p in enumerate(st.ins[i]):
                special = isinstance(p, Partial) or (isinstance(p, Shard) and p.block != (1, 1))
                if special and p not in on_dims[m] and not _beside_shard(st, m, p):
                    return False
        return True

    def _outputs(self, node: fx.Node, output_placements: list) -> None:
        outs = node.args[0]
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for i, (o, pl) in enumerate(zip(outs, output_placements, strict=True)):  # propagation checked them
            if isinstance(o, fx.Node) and self.values.get(o.name) is not None and self.grads.get(i) in self.params:
                g = self.grads[i]  # a free parameter's gradient: in its placement (params.grad_placements)
                dim = getattr(self.planner, "grad_partial_dim", None)
                demand = self.values[g][1] if dim is None else {
                    self.memo.layout(self.values[o.name][0], grad_placements(q, dim)).placements: cols
                    for q, cols in self.values[g][1].items()}
                self._edge_once(o.name, demand, "output", self.aliases.get(g, g), output=True)
            elif isinstance(o, fx.Node) and self.values.get(o.name) is not None:
                val = self.values[o.name][0]
                pl = self.memo.layout(val, tuple(pl) if pl is not None else (Replicate(),) * self.mesh.ndim)
                self._edge_once(o.name, {pl.placements: ([], 1)}, "output", pl.placements, output=True)

    def _edge(self, src: str, demand: dict, output: bool = False, consumer: str | None = None,
              edge: tuple | None = None) -> None:
        """Couple how value ``src`` arrives with what one consumer (or graph output) takes."""
        val, supply = self.values[src]
        fixed = any(c for _, c in supply.values()) or any(c for _, c in demand.values())
        back = not output and bool(self.graph_nodes[consumer].meta.get("autograd_backward"))
        pairs = self.memo.reachable(src, val, supply, demand)
        if not output and self.graph_nodes[consumer].meta.get(REDUCE_AFTER):  # reduced after it (precision.py)
            pairs = [(q, p, move) for q, p, move in pairs if not reduces(q, p)]
        y = []  # (q, p, the columns whose sum is 1 exactly when src arrives as q and goes to p)
        templated = src in self.templates
        for q, p, move in pairs:
            (acols, aconst), (bcols, bconst) = supply[q], demand[p]
            cols = (bcols if aconst else acols) if fixed else [self.model.var(0.0)]
            y.append((q, p, cols))
            if move is None:
                continue
            if back:  # FSDP's re-gather: the program moves a program argument again for backward
                move = self.memo.backward_key(move, self.graph_nodes[src], val)
            if templated:  # _copies counts a repeated layer's value's moves by their edges
                self.use_edges.setdefault(move, []).append(edge)
            if aconst and bconst:
                self.always[move] = None  # e.g. a placeholder that is also a graph output
            else:
                self.uses.setdefault(move, []).append(cols)
            if not output:  # a node reads it: priced as a node's input
                self.move_consumers.setdefault(move, []).append(consumer)
        marginal = ({}, {})  # per side: placements -> the coupling columns that sum to its columns
        if not fixed:
            for q, p, ys in y:
                marginal[0].setdefault(q, []).extend(ys)
                marginal[1].setdefault(p, []).extend(ys)
        for side, at in ((supply, 0), (demand, 1)):
            for key, (cols, _) in side.items():
                if fixed:  # the coupling is the free side itself: forbid what cannot be coupled
                    if cols and not any(k[at] == key for k in y):
                        self.model.row(dict.fromkeys(cols, 1.0), -np.inf, 0.0)
                    continue
                terms = dict.fromkeys(marginal[at].get(key, ()), 1.0)
                terms.update({c: -1.0 for c in cols})
                self.model.row(terms, 0.0, 0.0)

    def _copies(self, key: int) -> int:
        """How many real moves (one per copy of a repeated layer's value) ``key`` stands for."""
        if self.memo.moves[key][0] not in self.templates:
            return 1
        return max(self.edge_count.get(e, 1) for e in self.use_edges.get(key, [None]))

    def _gather_group(self, key: int) -> tuple | None:
        """(coalesced_gather's group, copies) of a move a node reads, else None; its unit is its
        first consumer's in graph order, as the program's."""
        move = self.memo.moves[key]
        if key not in self.move_consumers or self.graph_nodes[move[0]].op != "placeholder":
            return None  # only a program argument's gather is coalesced (paths.coalesced_gather)
        first = min(self.move_consumers[key], key=self.order.__getitem__)
        steps = self.memo.steps(self.values[move[0]][0], move[1], move[2])
        group = coalesced_gather(self.graph_nodes[move[0]], steps, self.graph_nodes[first], len(move) > 3,
                                 self.planner.bucket_bytes)
        return group and (*group, self._copies(key))

    def _latency(self, group: tuple) -> float:
        """One all_gather call's latency on the group's mesh dim, times the copies it stands for."""
        return group[-1] * gather_call_latency(self.planner.cost, self.mesh, group[2]) * weights(self.planner)[0]

    def _move_cost(self, key: int) -> float:
        """One move's time, times the copies of a repeated layer's value it stands for; a
        coalesced gather's with its share of the call's latency (module docstring)."""
        val = self.values[self.memo.moves[key][0]][0]
        cost = self._copies(key) * self.memo.move_cost(key, val, key not in self.move_consumers)
        group = self.gathers.get(key)
        return cost - self._latency(group) * (1 - 1 / self.members[group]) if group else cost

    def _charge_moves(self) -> None:
        """Each move once: on its only coupling column, or on a shared m >= every use. With a cost
        model that overlaps (steptime.py), a move the program overlaps with a phase's compute goes
        into that phase's overlap row instead of the objective (``_overlap_rows``)."""
        self.order = {name: i for i, name in enumerate(self.graph_nodes)}
        self.gathers = {key: g for key in (*self.always, *self.uses) if (g := self._gather_group(key))}
        moves = self.memo.moves
        self.members = Counter(g for _, g in {(moves[key][0], g) for key, g in self.gathers.items()})
        overlap = bool(getattr(self.planner.cost, "overlap", False))
        self.phase_terms, self.phase_const = {"fwd": {}, "bwd": {}}, {"fwd": 0.0, "bwd": 0.0}
        self.model.offset = 0.0
        for key in self.always:
            phase = overlap and self._phase(key)
            if phase:
                self.phase_const[phase] += self._move_cost(key)
            else:
                self.model.offset += self._move_cost(key)
        for key, uses in self.uses.items():
            if key in self.always:
                continue
            cost = self._move_cost(key)
            phase = overlap and self._phase(key)
            if len(uses) == 1 and len(uses[0]) == 1:  # moves exactly when that column is 1
                col = self.move_col[key] = uses[0][0]
            else:
                col = self.move_col[key] = self.model.var(0.0)
                for cols in uses:
                    self.model.row({col: 1.0, **{c: -1.0 for c in cols}}, 0.0, np.inf)
            if phase:
                terms = self.phase_terms[phase]
                terms[col] = terms.get(col, 0.0) + cost
            else:
                self.model.cost[col] += cost * SCALE
        if overlap:
            self._overlap_rows()

    def _phase(self, key: int) -> str | None:
        """"fwd" / "bwd" for a move the program overlaps with that phase's compute, else None
        (steptime.edge_phases: a gradient's reduction in an async bucket, a prefetched gather)."""
        if key not in self.move_consumers:
            src, q, p = self.memo.moves[key][:3]
            steps = self.memo.steps(self.values[src][0], q, p)
            bucketed = self.planner.bucket_bytes is not None and all(
                s.kind in BUCKETED for s in steps if s.is_collective)
            return "bwd" if bucketed else None
        group = self.gathers.get(key)
        return None if group is None else ("bwd" if group[1] else "fwd")

    def _overlap_rows(self) -> None:
        """Per phase, a column z >= (overlappable communication - that phase's compute), z >= 0,
        paid in the objective: max(0, comm - compute) of steptime.StepTime, linear."""
        cost, mesh = self.planner.cost, self.mesh
        compute: dict = {}
        for name, (cols, sts) in self.nodes.items():  # a follower's entry is its template's columns
            phase = "bwd" if self.graph_nodes[name].meta.get("autograd_backward") else "fwd"
            call = self.calls[self.aliases.get(name, name)]
            for c, st in zip(cols, sts):
                key = (phase, c)
                compute[key] = compute.get(key, 0.0) + self.memo.compute(name, call, st, cost, mesh)
        self.overlap_rows = {}
        for phase in ("fwd", "bwd"):
            terms = dict(self.phase_terms[phase])
            if not terms and not self.phase_const[phase]:
                continue
            for (ph, c), t in compute.items():
                if ph == phase:
                    terms[c] = terms.get(c, 0.0) - t
            z = self.model.var(1.0, bounded=False)
            terms[z] = -1.0
            self.overlap_rows[phase] = len(self.model.rows)
            self.model.row(terms, -np.inf, -self.phase_const[phase])

    def value(self, res) -> float:
        """Solution ``res``'s cost in seconds as plan_cost prices it (module docstring)."""
        return self.objective(res.fun) + self.unpriced(res.x)

    def unpriced(self, x) -> float:
        """Seconds the objective leaves out for solution ``x``: the rest of one call's latency for
        each coalesced gather it makes in part."""
        return sum(self._latency(g) * (1 - n / self.members[g]) for g, n in self._partial(x).items())

    def price_calls(self, x) -> bool:
        """Give each coalesced gather that solution ``x`` makes in part a call column; True when
        any was added (module docstring)."""
        partial = self._partial(x)
        for group in partial:
            self.call_groups.add(group)
            self._call_column(group)
        return bool(partial)

    def _partial(self, x) -> dict:
        """{group: members moved} of the share-priced coalesced gathers ``x`` makes in part."""
        taken: Counter = Counter()
        for key, group in self.gathers.items():
            if group not in self.call_groups and (key in self.always or x[self.move_col[key]] > 0.5):
                taken[group] += 1
        return {g: n for g, n in taken.items() if n != self.members[g]}

    def _call_column(self, group: tuple) -> None:
        """The group's members drop their latency share; g >= each member's move column pays it."""
        latency = self._latency(group)
        row = getattr(self, "overlap_rows", {}).get("bwd" if group[1] else "fwd")
        share, g = latency / self.members[group], self.model.var(0.0 if row is not None else latency)
        if row is not None:  # an overlapped gather: its call's latency in the phase's overlap row
            self.model.rows[row][0][g] = latency
        for key in [k for k, kg in self.gathers.items() if kg == group]:
            if key in self.always:
                if row is not None:
                    terms, lo, hi = self.model.rows[row]
                    self.model.rows[row] = (terms, lo, hi + share)
                else:
                    self.model.offset -= share
                self.model.row({g: 1.0}, 1.0, np.inf)
            else:
                if row is not None:
                    terms = self.model.rows[row][0]
                    terms[self.move_col[key]] = terms.get(self.move_col[key], 0.0) - share
                else:
                    self.model.cost[self.move_col[key]] -= share * SCALE
                self.model.row({g: 1.0, self.move_col[key]: -1.0}, 0.0, np.inf)


class Memo:
    """What holds across the rounds of one solve: layouts, redistributions, node costs."""

    def __init__(self, planner):
        self.planner = planner
        self._layouts: dict = {}
        self._steps: dict = {}
        self._costs: dict = {}
        self._offers: dict = {}  # (node, incumbent, supplies) -> (OpCall, strategies offered)
        self._reachable: dict = {}  # (value, supplied, demanded placements) -> reachable (q, p) pairs
        self._move_costs: dict = {}  # (move, output) -> move_cost
        # a move is an int (an int hashes in C; a program files each in several dicts per round):
        # moves[i] is (src, q, p), or (src, q, p, "backward") for a backward re-gather
        self.moves: list = []
        self._move_ids: dict = {}  # moves[i] -> i
        self._backward_keys: dict = {}  # move -> the move its backward consumers read
        self._args: dict = {}  # node name -> its tensor argument nodes
        self._metas: dict = {}  # id(value) -> (value, (shape, dtype)); the value kept, so ids stay unique

    def _meta(self, val) -> tuple:
        """(shape, dtype) of a graph value, converted once per value (a FakeTensor's shape is not cheap)."""
        got = self._metas.get(id(val))
        if got is None or got[0] is not val:
            got = self._metas[id(val)] = (val, (tuple(val.shape), val.dtype))
        return got[1]

    def layout(self, val, q: tuple) -> Layout:
        key = (self._meta(val), q)
        if key not in self._layouts:
            self._layouts[key] = Layout(val.shape, val.dtype, q)
        return self._layouts[key]

    def steps(self, val, q: tuple, p: tuple):
        """Steps from q to p (None: unreachable)."""
        key = (self._meta(val), q, p)
        got = self._steps.get(key, _UNSEEN)
        if got is _UNSEEN:
            try:
                got = self.planner.steps(self.layout(val, q), p)
            except ShardingError:  # e.g. a unit shard nested in a chunk of partial blocks
                got = None
            self._steps[key] = got
        return got

    def offer(self, node: fx.Node, inc, supplies: list, make, dim: int | None = None) -> tuple:
        """(OpCall, strategies) of Program._offer (``make``), kept per (node, incumbent strategy,
        its inputs' supplied placements, the mesh dim a round varies): a later round rebuilds the
        program, but most nodes keep their incumbent and inputs, and the candidates and their
        filters cost more than the rest."""
        key = (node.name, inc, tuple(supplies), dim)
        got = self._offers.get(key)
        if got is None:
            got = self._offers[key] = make()
        return got

    def reachable(self, src: str, val, supply: dict, demand: dict) -> tuple:
        """The (q, p) pairs of ``supply`` x ``demand`` (placements, in their order) that a
        redistribution connects (q == p included), kept per (value, supply, demand) across rounds.
        Each comes with its move (``_move``: (src, q, p) as an int; None where q == p)."""
        key = (src, tuple(supply), tuple(demand))
        got = self._reachable.get(key)
        if got is None:
            got = self._reachable[key] = tuple((q, p, None if q == p else self._move((src, q, p)))
                                               for q in supply for p in demand
                                               if q == p or self.steps(val, q, p) is not None)
        return got

    def _move(self, move: tuple) -> int:
        i = self._move_ids.get(move)
        if i is None:
            i = self._move_ids[move] = len(self.moves)
            self.moves.append(move)
        return i

    def backward_key(self, move: int, src: fx.Node, val) -> int:
        """The key a backward consumer's move files under: ``move`` + ("backward",) where the
        program makes that move again for backward (search/paths.move_key: a program argument
        moved by a collective, FSDP's reshard after forward), so it is charged again; else ``move``."""
        got = self._backward_keys.get(move)
        if got is None:
            fwd = self.moves[move]
            phase = move_key(src, self.steps(val, fwd[1], fwd[2]), backward=True)[2:]
            got = self._backward_keys[move] = self._move(fwd + phase) if phase else move
        return got

    def move_cost(self, move: int, val, output: bool) -> float:
        """move_cost of the redistribution ``move`` ((src, q, p)) of ``val``, memoised."""
        key = (move, output)
        got = self._move_costs.get(key)
        if got is None:
            _, q, p = self.moves[move][:3]
            got = self._move_costs[key] = move_cost(self.steps(val, q, p), self.planner, output)
        return got

    def args(self, node: fx.Node) -> list:
        """tensor_arg_nodes(node), once per node (a pytree walk; every round asks again)."""
        got = self._args.get(node.name)
        if got is None:
            got = self._args[node.name] = tensor_arg_nodes(node)
        return got

    def compute(self, name: str, call, st, cost, mesh) -> float:
        """flops.node_time of ``call`` under ``st`` without the op's own collectives (compute only)."""
        key = ("compute", call.key, st)
        got = self._costs.get(key)
        if got is None:
            got = self._costs[key] = node_time(cost, call, st, mesh) * weights(self.planner)[0]
        return got

    def node_cost(self, name: str, call, st) -> float:
        got = self._costs.get((name, st))
        if got is None:
            got = self._costs[name, st] = node_cost(self.planner, call, st)
        return got


_UNSEEN = object()


def _group(cols: list, placements: list) -> dict:
    """{placements: (columns of the strategies that use them, 0)}."""
    out: dict = {}
    for c, p in zip(cols, placements):
        out.setdefault(p, ([], 0))[0].append(c)
    return out


def _beside_shard(st, m: int, p) -> bool:
    """``p`` is a Partial input on mesh dim ``m`` of a strategy that contracts a shard there."""
    return isinstance(p, Partial) and any(isinstance(q[m], Shard) for q in st.ins if q is not None)


def _one_dim_off(st, inc, dim: int | None = None) -> bool:
    """``st`` differs from ``inc`` on at most one mesh dim (any input or output); on ``dim`` only, if given."""
    if inc is None:
        return True
    off = -1 if dim is None else dim  # the one mesh dim seen to differ so far (or the one allowed)
    for xs, ys in ((st.ins, inc.ins), (st.outs, inc.outs)):
        for a, b in zip(xs, ys):
            if a is b or a is None or b is None or a == b:
                continue
            for m, pa in enumerate(a):
                if pa != b[m] and m != off:
                    if off >= 0:
                        return False
                    off = m
    return True
