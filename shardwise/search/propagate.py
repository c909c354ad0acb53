"""Propagation planner: from the user's placements, a strategy for every node.

Nodes are visited in graph order. Each node takes the strategy its rule offers that
costs least to reach from its inputs' current layouts: first by the number of
resharding collectives (see RESHARDING), then by estimated communication time
(alpha-beta, search/paths.py), then by the number of redistribution steps
(so replicated values are not sliced without need), then by estimated compute. Sharding
therefore spreads from where the user put it; nothing assumes where the batch, sequence
or head dim sits. Graph outputs are then moved to the layouts they must end in
(parameter gradients in their parameter's layout, the loss and forward outputs
replicated), which is where data parallelism's gradient reduction appears.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import combinations, zip_longest
from typing import Callable

import torch
import torch.fx as fx

from ..core.cost import CostModel, sent_bytes
from ..core.errors import ConfigError, ShardingError
from ..core.layout import Layout, Partial, R, Replicate, Shard, normalize_placements
from ..core.mesh import Mesh
from .fsdp import fsdp_dims, gather_first
from .paths import plan_redistribute, reduces
from .steptime import step_time
from ..rules.common import replicate_all
from ..rules.random import replicated_local
from ..rules.registry import OpCall, Registry, Rule, Strategy, blocks_of, expand, with_blocks
from ..trace import is_view, node_call, source_line, tensor_arg_nodes
from ..trace.normalize import COPIES
from ..trace.precision import REDUCE_AFTER
from ..trace.recompute import RECOMPUTE_OF

aten = torch.ops.aten

# Collectives that turn a partial sum into a shard. On a mesh dim where no other input
# arrives sharded, locally a reduce-scatter is cheaper than an all-reduce, but the new sharding
# spreads downstream and is usually undone later at a higher price (greedy myopia), so
# propagation takes it last; where another input arrives sharded there and stays, it meets that shard.
# A parameter's split undone on a mesh dim no data is sharded on counts as one too (_unsplit).
RESHARDING = ("reduce_scatter",)


@dataclass
class NodePlan:
    """The decision for one call_function node."""

    name: str
    call: OpCall
    rule: Rule
    strategy: Strategy
    in_layouts: list  # what the inputs arrive as
    in_steps: list  # per tensor input: redistribution steps to strategy.ins[i]
    out_layouts: list  # per flattened output (None: not a tensor)
    source: str = ""
    fallback: bool = False

    @property
    def comm_steps(self) -> list:
        return [s for steps in self.in_steps for s in steps if s.is_collective]


@dataclass
class Propagation:
    mesh: Mesh
    gm: fx.GraphModule
    layouts: dict = field(default_factory=dict)  # node name -> list of output layouts
    nodes: dict = field(default_factory=dict)  # node name -> NodePlan
    output_steps: list = field(default_factory=list)  # per graph output: steps to its final layout
    output_layouts: list = field(default_factory=list)
    solve_report: object = None  # search/solve.py SolveReport when the ILP chose the strategies
    param_choices: dict = field(default_factory=dict)  # free parameter placeholder -> placements the ILP chose
    cost: CostModel | None = None  # the cost model the planner priced it with
    # search/classes.py's RankClasses of this plan, made once on first use (plan_classes)
    rank_classes: object = field(default=None, repr=False, compare=False)
    # what lowering made of this plan, shared by every lower/plan.Plan of it (a budget cut's
    # estimate and the plan kept): {(rank, bucket_bytes): unguarded program, (rank class,
    # bucket_bytes, parameters): MemoryEstimate}; a program depends on nothing else
    lowered: dict = field(default_factory=dict, repr=False, compare=False)
    recomputed: frozenset = frozenset()  # blocks the ILP chose to recompute (search/recompute.py)


class Planner:
    def __init__(self, mesh: Mesh, registry: Registry, cost: CostModel | None = None, fallback_ops: tuple | set = (),
                 strategy_filter: Callable | None = None, bucket_bytes: int | None = None):
        self.mesh = mesh
        self.registry = registry
        self.cost = cost or CostModel()
        self.fallback_ops = set(fallback_ops)
        self.strategy_filter = strategy_filter  # (call, Strategy) -> bool: a user's choice among strategies
        self.bucket_bytes = bucket_bytes  # the program's gradient buckets (lower/buckets.py), as priced
        self._choices = None  # {node name: Strategy} forced by run(choices=...)
        # a mesh dim whose step gradients stay partial sums, whatever their parameters' placement:
        # a pipeline's microbatch dim, summed by its runner (module/pipeline.py; search/params.py)
        self.grad_partial_dim = None
        # (per run of the graph, per graph output's move) in the objective (search/steptime.step_time):
        # a pipeline's microbatch plan runs once per microbatch, its outputs are moved once a step
        self.objective_weights = None
        self._redist: dict = {}
        self._expanded: dict = {}
        self._statics: dict = {}  # (call key, Strategy) -> (static key part, output layouts)
        self._decided: dict = {}  # choose's key -> (strategy, steps per input, output layouts)
        self._reduces: dict = {}  # (layout, mesh dim) -> _reduce_time

    # -- cached building blocks ---------------------------------------------------------
    def steps(self, layout: Layout, dst: tuple) -> list:
        if layout.placements == dst:
            return []
        key = (layout, dst)
        if key not in self._redist:
            self._redist[key] = plan_redistribute(layout, dst, self.mesh, self.cost)
        return self._redist[key]

    def rule_for(self, node: fx.Node) -> tuple[Rule, bool]:
        op = node.target
        if op in self.registry:
            return self.registry.get(op), False
        if op in self.fallback_ops or str(op) in self.fallback_ops:
            return Rule(op, lambda call: [replicate_all(call)], replicated_local, name="replicate_fallback",
                        blockwise=False), True
        return self.registry.get(op, node=node.name, source=source_line(node)), False

    def strategies(self, call: OpCall, rule: Rule) -> list[Strategy]:
        key = _call_key(call)
        if key not in self._expanded:
            sts = expand(call, rule, self.mesh)
            if self.strategy_filter is not None:
                sts = [st for st in sts if self.strategy_filter(call, st)]
            self._expanded[key] = sts
        return self._expanded[key]

    def unit_variants(self, call: OpCall, rule: Rule, ins: list) -> list[Strategy]:
        """Strategies restated for inputs that arrive as unit or grouped shards (Shard(d, unit=u)
        from a flatten, Shard(d, groups=g) from a fused projection or a merge): on that mesh
        dim every plain shard of the strategy is cut the same way. Rules compute local args from
        layouts, so they honour the cut; kept only where the rule's own checks pass and the
        local op yields the planned local shapes on every rank."""
        units = blocks_of(ins)
        if not units:
            return []
        key = _call_key(call) + (tuple(sorted(units)),)
        if key not in self._expanded:
            cuts = [((m, b),) for m, b in sorted(units)]
            cuts += [pair for pair in combinations(sorted(units), 2) if pair[0][0] != pair[1][0]]  # two mesh dims
            self._expanded[key] = list(dict.fromkeys(
                v for cut in cuts for st in self.strategies(call, rule)
                if (v := with_blocks(call, rule, st, cut, self.mesh)) is not None))
        return self._expanded[key]

    def candidates(self, call: OpCall, rule: Rule, ins: list) -> list[Strategy]:
        """The rule's strategies plus their restatements for the unit or grouped shards found in
        ``ins`` (any layouts the inputs may arrive as: the ILP passes every candidate's)."""
        return list(dict.fromkeys(self.strategies(call, rule) + self.unit_variants(call, rule, ins)))

    # -- the pass ---------------------------------------------------------------------
    def run(self, gm: fx.GraphModule, placeholder_placements: dict, output_placements: list,
            params: dict | tuple = (), choices: dict | None = None) -> Propagation:
        """One strategy per node in graph order. ``choices`` ({node name: Strategy}, e.g. from
        the ILP in search/solve.py) fixes each node's strategy; the pass then only derives the
        redistributions (and their reuse) exactly as for its own choices. Parameters sharded
        on a mesh dim that shards the data are planned both gathered before use (FSDP) and
        used sharded; the cheaper plan is kept (search/fsdp.py)."""
        plain = self._run(gm, placeholder_placements, output_placements, params, choices, {})
        gather = fsdp_dims(gm, placeholder_placements, params) if choices is None else {}
        if not gather:
            return plain
        fsdp = self._run(gm, placeholder_placements, output_placements, params, None, gather)
        cheaper = (step_time(fsdp, self.cost, self.bucket_bytes, self.objective_weights).total_s
                   <= step_time(plain, self.cost, self.bucket_bytes, self.objective_weights).total_s)
        return fsdp if cheaper else plain

    def _run(self, gm, placeholder_placements, output_placements, params, choices, gather) -> Propagation:
        prop = Propagation(self.mesh, gm, cost=self.cost)  # Plan prices figures with the planner's cost model
        self._choices = choices
        self._gather = gather  # {parameter placeholder: mesh dims it is gathered on before use}
        self._moved: dict = {}  # producer -> placements it was already redistributed to: free to reuse
        self._param_derived = _param_derived(gm, set(params))
        self._to_outputs = _to_outputs(gm)
        self._data_dims = _data_dims(placeholder_placements, params)
        self._position, self._last_read = _reads(gm)
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                val = node.meta["val"]
                pl = placeholder_placements.get(node.name) or (R,) * self.mesh.ndim
                prop.layouts[node.name] = [Layout(val.shape, val.dtype, pl) if isinstance(val, torch.Tensor) else None]
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                prop.layouts[node.name] = [prop.layouts[src.name][idx]]
            elif node.op == "call_function":
                np_ = self.choose(node, prop)
                prop.nodes[node.name] = np_
                prop.layouts[node.name] = np_.out_layouts
            elif node.op == "output":
                self._outputs(node, prop, output_placements)
        return prop

    def choose(self, node: fx.Node, prop: Propagation) -> NodePlan:
        """The strategy with the least key (resharding collectives, communication time, steps,
        then the static part: new shards, partial outputs, work), the first among equals; the
        first three are priced once per distinct input placements, the static part only for the
        strategies tied at the least: the same choice as pricing every strategy. Memoised by what
        it depends on (the call, its inputs' layouts, copies made, parameter-derived, gathered
        first), so a repeated layer's nodes take their first occurrence's decision."""
        call = node_call(node)
        rule, fallback = self.rule_for(node)
        srcs = [a.name for a in tensor_arg_nodes(node)]
        ins = [prop.layouts[src][0] for src in srcs]
        choice = None if self._choices is None else self._choices[node.name]
        if choice is None and node.meta.get(RECOMPUTE_OF) in prop.nodes:  # a recomputed copy: its
            choice = prop.nodes[node.meta[RECOMPUTE_OF]].strategy  # original's computation, bit for bit
        ckey = _call_key(call)
        after, to_output = bool(node.meta.get(REDUCE_AFTER)), node.name in self._to_outputs
        read_later = tuple(self._last_read.get(s, -1) > self._position[node.name] for s in srcs)
        key = (ckey, tuple(ins), choice, getattr(choice, "tags", None), tuple(
            (frozenset(self._moved.get(s, ())), s in self._param_derived, self._gather.get(s)) for s in srcs), after,
            to_output, read_later)
        if key not in self._decided:
            sts = [choice] if choice is not None else self.candidates(call, rule, ins)
            if after:  # mixed precision's gradient cast: reduce after it, in its dtype (trace/precision.py)
                sts = [st for st in sts if not any(reduces(lay.placements, pl) for lay, pl in zip(ins, st.ins))] or sts
            if self._gather:
                sts = gather_first(sts, srcs, ins, self._gather)
            options = dict.fromkeys(st.ins for st in sts)
            for every in (False, True):  # again with every option when a partial input owes: moving may pay
                priced = self._price_all(srcs, ins, options, every)
                keys = {st: self._owed(ckey, call, st, ins, priced[st.ins][0], to_output, read_later) for st in sts
                        if st.ins in priced}
                least = min(keys.values())
                if least == (0, 0.0, 0) or len(priced) == len(options):
                    break
            best = min((st for st, k in keys.items() if k == least), key=lambda st: self._static(ckey, call, st)[0])
            self._decided[key] = best, priced[best.ins][1], self._static(ckey, call, best)[1]
        best, best_steps, best_outs = self._decided[key]
        for src, pl in [(src, pl) for src, pl, ss in zip(srcs, best.ins, best_steps) if ss]:
            self._moved.setdefault(src, set()).add(pl)
        return NodePlan(node.name, call, rule, best, ins, best_steps, best_outs, source_line(node), fallback)

    def _price_all(self, srcs: list, ins: list, options: dict, every: bool = False) -> dict:
        """{input placements: (key, steps)} of every option that can tie at the least key. Options
        whose every input stays put or reuses a copy already made are priced first (no search);
        when one of them moves nothing at all (key (0, 0, 0), the least there is), an option with
        an input that must really move (new steps, so a key above it) is not searched for, unless
        ``every`` (what a strategy owes for a partial input, ``_owed``, left no key at (0, 0, 0):
        then moving may pay)."""
        here = tuple(lay.placements for lay in ins)
        moved = self._moved
        known = [pl for pl in options
                 if all(p == h or p in moved.get(s, ()) for s, p, h in zip(srcs, pl, here, strict=True))]
        priced = {pl: self._price_ins(srcs, ins, pl) for pl in known}
        if every or not priced or min(key for key, _ in priced.values()) != (0, 0.0, 0):
            priced.update((pl, self._price_ins(srcs, ins, pl)) for pl in options if pl not in priced)
            return priced
        for pl in options:
            if pl not in priced and all(p == h or p in moved.get(s, ()) or self._same(lay, p)
                                        for s, p, h, lay in zip(srcs, pl, here, ins, strict=True)):
                priced[pl] = self._price_ins(srcs, ins, pl)
        return priced

    def _same(self, layout: Layout, dst: tuple) -> bool:
        """True when ``dst`` names ``layout``'s placements in other words (no step moves it)."""
        a, b = self._normal(layout.placements, layout.ndim), self._normal(dst, layout.ndim)
        return a is None or b is None or a == b  # None: not valid, so price it and let the search say

    def _normal(self, placements: tuple, ndim: int):
        """``normalize_placements`` or None where the placements are not valid."""
        try:
            return normalize_placements(placements, self.mesh, ndim, "placements")
        except ShardingError:
            return None

    def _price_ins(self, srcs: list, ins: list, placements: tuple) -> tuple:
        """((resharding collectives, communication time, steps), steps per input) of moving the
        inputs ``ins`` (produced by ``srcs``) to ``placements``."""
        steps = [self.steps(lay, pl) for lay, pl in zip(ins, placements, strict=True)]
        comm = sum(self._price(src, pl, ss) for src, pl, ss in zip(srcs, placements, steps))
        n_steps = sum(len(ss) for src, pl, ss in zip(srcs, placements, steps) if pl not in self._moved.get(src, ()))
        reshard = sum(s.kind in RESHARDING and not any(
            isinstance(o.placements[s.mesh_dim], Shard) and pl[s.mesh_dim] == o.placements[s.mesh_dim]
            for j, (o, pl) in enumerate(zip(ins, placements)) if j != i) for i, ss in enumerate(steps) for s in ss)
        reshard += sum(_unsplit(lay, pl, self._data_dims) for src, lay, pl in zip(srcs, ins, placements)
                       if src in self._param_derived)
        return (reshard, round(comm, 15), n_steps), steps

    def _owed(self, ckey: tuple, call: OpCall, st: Strategy, ins: list, key: tuple, output: bool = False,
              read_later: tuple = ()) -> tuple:
        """``key`` with what a strategy adds to the reductions its inputs already owe. An input
        that arrives partial is reduced either now (its steps) or later, carried in a partial
        output; a node-by-node choice sees only the first, so carrying looks free even when the
        partial output is larger: the gradient of a row-parallel product carried into the
        [b, s, 4h] activations' backward (gathering the saved shards to meet it) owes four times
        the reduction of doing it where it is [b, s, h]. So per mesh dim where an input arrives
        partial, the growth of the partial sums a strategy leaves is added to its time. Carrying
        saves an input's reduction only where no later node reads that input (``read_later``, per
        input): where one does, reducing now serves them all from one copy, and carrying here
        leaves them the same choice while adding this node's reduction to theirs. A row-parallel
        projection's output gradient is read by its input's product, its weight's and its bias's
        sum: carried through the first, it gathered the weight and the saved input for the
        second, and reduce-scattered both the weight gradient and the attention's input gradient
        (Hugging Face GPT-2 under Megatron's placements, batch 4 x 128: 1.09x Megatron's floor).

        A partial sum made on a mesh dim from inputs sharded there owes, likewise, its growth over
        the whole inputs it contracts, by global sizes (so other mesh dims' shards do not tip a
        choice between strategies that make the same sum), where it is more than 4x them: a
        row-parallel LM head turns hidden states [b, s, h] split on "tp" into partial logits
        [b, s, vocab], whose reduction (14 ms a step on a modelled Llama 3.1 8B) dwarfs gathering
        the hidden states. Megatron's row-parallel projections ([b, s, h] or [b, s, 4h] in,
        [b, s, h] out) and a bias gradient's sum over the batch owe nothing. Nor does an MLP's up
        projection from a feature-split input ([b, s, h] -> [b, s, 3.25-4h]): charging it made
        propagation gather that input, which its backward then keeps whole, and the 405B
        pipeline candidates' memory grew 39 -> 97 GiB (fsdp+tp) for 19% less time. Nothing on a
        pipeline's microbatch dim (``grad_partial_dim``), arriving partial or made so: its runner sums
        the partial gradients once, after the last microbatch, and a reduction there mid-graph would
        need every microbatch at once (a wrapped GPT-2's position-embedding gradient, [1, s, h] in,
        [positions, h] out, was all-reduced over the microbatches to avoid the growth). Nor for a
        value that only views carry to the graph's outputs (``output``: a weight's gradient over
        the batch): its reduction is the gradients' bucketed one, which overlaps
        backward, and the other way to make it (gathering its inputs to compute a shard of it,
        then gathering that at the output: six blocking calls for a data-parallel MLP, measured
        1.7x slower than the all_reduce on gloo) is charged only at the output, past this choice."""
        dims = {m for lay in ins for m, p in enumerate(lay.placements) if isinstance(p, Partial)}
        static, outs = self._static(ckey, call, st)
        if not dims and not static[1]:  # nothing partial in or out (static[1]: partial outputs)
            return key
        outs = [o for o in outs if o is not None]
        more = 0.0
        for m in dims | {m for o in outs for m, p in enumerate(o.placements) if isinstance(p, Partial)}:
            if m == self.grad_partial_dim:  # summed by the runner at the step's end, never mid-graph
                continue
            made = [o for o in outs if isinstance(o.placements[m], Partial)]
            partial = [(lay, later) for lay, later in zip_longest(ins, read_later)
                       if isinstance(lay.placements[m], Partial)]
            if partial:  # carrying saves an input's reduction only where no later node reads that input
                more += max(0.0, sum(self._reduce_time(o, m) for o in made)
                            - sum(self._reduce_time(lay, m) for lay, later in partial if not later))
            elif made and not output:
                summed = sum(lay.numel for lay in ins if isinstance(lay.placements[m], Shard))
                grown = sum(o.numel for o in made) - summed
                if grown > 3 * summed:
                    more += self._reduce_seconds(grown, made[0].itemsize, m)
        return key if not more else (key[0], round(key[1] + more, 15), key[2])

    def _reduce_time(self, layout: Layout, m: int) -> float:
        """Bandwidth seconds of reducing ``layout``'s partial sum on mesh dim ``m``, in place: one
        all_reduce of the largest local buffer (what the search finds, priced without searching:
        each candidate's outputs are new layouts, and a path search apiece adds much to the
        planning time); the latency left out, as a gradient's is shared in its bucket and a later
        reduction may be one call."""
        key = (layout, m)
        if key not in self._reduces:
            self._reduces[key] = self._reduce_seconds(layout.max_local_numel(self.mesh), layout.itemsize, m)
        return self._reduces[key]

    def _reduce_seconds(self, numel: int, itemsize: int, m: int) -> float:
        return sent_bytes("all_reduce", self.mesh.shape[m], numel, itemsize) / self.cost.bandwidth_of(m, self.mesh)

    def _static(self, ckey: tuple, call: OpCall, st: Strategy) -> tuple:
        """The part of ``choose``'s key that does not depend on the inputs' layouts, with the
        output layouts: (new shards, partial outputs, work on the busiest rank), memoised."""
        key = (ckey, st)
        if key not in self._statics:
            outs = st.out_layouts(call)
            work = sum(o.max_local_numel(self.mesh) for o in outs if o is not None)
            self._statics[key] = ((_new_shards(st), _partials(outs), work), outs)
        return self._statics[key]

    def _price(self, src: str, placements: tuple, steps: list) -> float:
        """Estimated time of moving ``src`` to ``placements``: free when an earlier node already
        moved it there (the program reuses that copy). Gathering a parameter (or a view of one)
        counts twice: its gradient will then come out partial and need a reduce-scatter too,
        which a node-by-node choice does not see."""
        if placements in self._moved.get(src, ()):
            return 0.0
        t = sum(s.time for s in steps)
        if src in self._param_derived and any(s.kind == "all_gather" for s in steps):
            t *= 2
        return t

    def _outputs(self, node: fx.Node, prop: Propagation, output_placements: list):
        outs = node.args[0]
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if len(outs) != len(output_placements):
            raise ConfigError(f"graph has {len(outs)} outputs but {len(output_placements)} placements were given",
                              fix="give one placement list per output of the traced step (loss, each gradient, "
                                  "each returned tensor); None for an output means Replicate")
        for o, pl in zip(outs, output_placements):
            lay = prop.layouts[o.name][0] if isinstance(o, fx.Node) else None
            if lay is None:
                prop.output_steps.append([])
                prop.output_layouts.append(None)
                continue
            pl = tuple(pl) if pl is not None else (R,) * self.mesh.ndim
            prop.output_steps.append(self.steps(lay, pl))
            prop.output_layouts.append(lay.with_placements(pl))




def _param_derived(gm: fx.GraphModule, params: set) -> set:
    """Parameter placeholders and values that are just a view, copy or cast of one."""
    out = set(params)
    for n in gm.graph.nodes:
        if is_view(n) or n.op == "call_function" and n.target in COPIES:
            srcs = tensor_arg_nodes(n)
            if len(srcs) == 1 and srcs[0].name in out:
                out.add(n.name)
    return out


def _to_outputs(gm: fx.GraphModule) -> set:
    """Calls whose value only views carry to the graph's outputs (read by nothing else): a
    parameter's gradient as backward makes it, before the transposes and reshapes to its shape."""
    out: set = set()
    for n in reversed(gm.graph.nodes):
        if n.op == "call_function" and n.users and all(
                u.op == "output" or (u.name in out and is_view(u)) for u in n.users):
            out.add(n.name)
    return out


def _reads(gm: fx.GraphModule) -> tuple[dict, dict]:
    """({node name: its position in the graph}, {node name: the position of its last reader}):
    a value whose last reader comes after a node is still needed, as it is, once that node is done."""
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return position, {n.name: max(position[u.name] for u in n.users) for n in gm.graph.nodes if n.users}


def _data_dims(placeholder_placements: dict, params) -> frozenset:
    """Mesh dims some input that is not a parameter (the batch, the sequence) is sharded on."""
    params = set(params)
    return frozenset(m for name, pl in placeholder_placements.items() if name not in params and pl
                     for m, p in enumerate(pl) if isinstance(p, Shard))


def _unsplit(layout: Layout, dst: tuple, data: frozenset) -> int:
    """Mesh dims no data is sharded on where ``dst`` changes how a parameter (or a view of one)
    is split there: it arrives sharded and ``dst`` does not keep that shard (gathers it whole or
    moves it to another tensor dim), or it arrives whole and ``dst`` slices it; the user's split
    of the parameter there undone or a new one made, counted with the resharding collectives.
    There the parameter's split is what splits the compute (Megatron's on "tp"); on a data dim,
    FSDP gathers it by design (search/fsdp.py). With FSDP's shard nested under Megatron's, the
    gather on "dp" that keeps a column-parallel weight's "tp" split ends in an all_to_all on "tp"
    (or, on a small mesh, gathers "tp" too and slices), so by time alone propagation moved the
    weight to its other dim there or kept it whole: the projection then contracted over hidden
    features sliced on "tp" into partial sums, or ran whole on every "tp" rank, and attention
    after it too. A slice is free and shrinks the gather on "dp" before it, so by time alone the
    FSDP embedding table (whole on "tp") was sliced on its hidden features there, and every
    block ran its residual stream and norms (their weights sliced too) split on "tp", gathered
    there before each projection: 9% slower a step (tests/cluster/test_stamp.py's 3-block Llama
    on (2, 2)), near enough to using the parameters sharded (search/fsdp.py) that which of the
    two plans was cheaper changed with the depth."""
    return sum(m not in data and (isinstance(a, Shard) and not (isinstance(b, Shard) and b.dim == a.dim)
                                  or isinstance(a, Replicate) and isinstance(b, Shard))
               for m, (a, b) in enumerate(zip(layout.placements, dst)))


def _call_key(call: OpCall) -> tuple:
    """What a node's strategies depend on: op, args (tensors as global shape and dtype), outputs."""
    return call.op, repr(call.args), repr(sorted(call.kwargs.items())), call.outs


def _partials(outs) -> int:
    """Partial outputs: a reduction someone still owes. Between equal plans, settle early."""
    return sum(isinstance(p, Partial) for o in outs if o is not None for p in o.placements)


def _new_shards(st: Strategy) -> int:
    """Mesh dims where an output is sharded though every input is replicated there: a free
    slice now, but a sharding nobody asked for that later nodes would have to undo."""
    n = 0
    for m in range(len(st.outs[0]) if st.outs and st.outs[0] is not None else 0):
        if all(isinstance(p[m], Replicate) for p in st.ins):
            n += sum(isinstance(o[m], Shard) for o in st.outs if o is not None)
    return n
