"""Lowering: a plan becomes one torch.fx GraphModule per rank.

The program holds local aten ops with their rank-local args (from each rule's local
call) and the collectives of every redistribution as explicit calls with their shapes.
A value that several consumers need in the same layout is redistributed once. In debug
mode every local result is checked against its planned local shape, naming the node. With
``bucket_bytes`` the independent all_reduces (gradients) are then coalesced into flat async
buckets, launched early and waited for late (lower/buckets.py; a gradient's reduction that
starts with a gather runs where the gradient is made instead: _reduce_where_made), and all_gathers of program
arguments (FSDP-style parameters) are coalesced per layer and started one layer ahead
(lower/prefetch.py).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from ..core.collector import collecting_once
from ..core.cost import BUCKETED
from ..search.paths import move_key
from ..search.propagate import Propagation
from ..core.calls import map_leaves
from ..rules.registry import LocalCtx, TensorMeta
from ..trace import tensor_arg_nodes
from ..trace.precision import MASTER_DTYPE
from ..trace.provenance import fsdp_unit
from .buckets import bucket_program
from .guards import shape_guard
from .prefetch import CAST_OF, prefetch_program
from .redistribute import step_call


ORIGIN, ORIGIN_OUTPUT = "sw_origin", "<output>"


class ProgramBuilder:
    def __init__(self, prop: Propagation, rank: int, debug: bool = True, bucket_bytes: int | None = None):
        self.prop, self.rank, self.debug, self.bucket_bytes = prop, rank, debug, bucket_bytes
        self.mesh = prop.mesh
        self.graph = fx.Graph()
        self.env: dict = {}
        self.moved: dict = {}  # (producer, placements) -> node already redistributed
        self._current = None  # the graph node whose program nodes are being made (_origin)

    def move(self, src: fx.Node, layout, steps, backward: bool = False, consumer: fx.Node | None = None) -> fx.Node:
        """Emit the redistribution ``steps`` of ``src`` (cached per destination placements). A
        program argument that needs a collective (an FSDP-style parameter's all_gather) is
        moved once for forward and once again for ``backward`` consumers, as FSDP reshards
        after forward: the forward copy is freed after its last forward read. Each such move
        is tagged with its first ``consumer``'s layer and the phase, the unit whose gathers
        the prefetch pass coalesces into one call."""
        if not steps:
            return self.env[src.name]
        key = move_key(src, steps, backward)
        if key not in self.moved:
            x = self.env[src.name]
            unit = fsdp_unit(src)  # a gradient's block: its reduce_scatter bucket closes there (lower/buckets.py)
            for step in steps:
                fn, args = step_call(step, self.mesh, self.rank)
                x = self.graph.call_function(fn, (x, *args))
                x.meta["sw_step"] = step  # what moves (layouts, sizes): read by the bucketing pass
                x.meta["sw_src_unit"] = unit
            if src.op == "placeholder" and consumer is not None:
                x.meta["sw_unit"] = (fsdp_unit(consumer), backward)
            self.moved[key] = x
        return self.moved[key]

    def call(self, node: fx.Node) -> fx.Node:
        np_ = self.prop.nodes[node.name]
        srcs = tensor_arg_nodes(node)
        back = bool(node.meta.get("autograd_backward"))
        local_ins = iter([self.move(s, lay, st, back, node)
                          for s, lay, st in zip(srcs, np_.in_layouts, np_.in_steps, strict=True)])
        ctx = LocalCtx(np_.call, np_.strategy, self.mesh, self.rank)
        lc = np_.rule.local_call(ctx)
        args, kwargs = map_leaves(lambda a: next(local_ins) if isinstance(a, TensorMeta) else a, (lc.args, lc.kwargs))
        out = self.graph.call_function(lc.fn, tuple(args), dict(kwargs))
        if not self.debug:
            out.name = node.name
            return out
        out.name = f"{node.name}_unchecked"
        shapes = tuple(None if o is None else tuple(o.local_shape(self.mesh, self.rank)) for o in np_.out_layouts)
        guarded = self.graph.call_function(shape_guard, (out, shapes, node.name))
        guarded.name = node.name
        return guarded

    def build(self) -> fx.GraphModule:
        root, graph = self.build_graph()
        if self.bucket_bytes is not None:
            _reduce_where_made(graph)
            graph = prefetch_program(bucket_program(graph, self.mesh, self.rank, self.bucket_bytes), self.mesh,
                                     self.rank)
        # lazy: its Python is generated when first run or read; the memory estimate and the figures
        # only walk the graph (the code of a 24-block program is a fifth of what its estimate costs)
        with _use_lazy_graph_module(True):
            return _make_graph_module(root, graph, class_name=f"Rank{self.rank}Program")

    def build_graph(self) -> tuple:
        """(root module holding the graph's constants, the program's fx.Graph): no buckets, and no
        Python made from it (a pipeline cuts it into pieces first: lower/stages.py)."""
        gm = self.prop.gm
        root = torch.nn.Module()
        masters = []  # parameters the program takes as masters and computes with in another dtype
        for node in gm.graph.nodes:
            self._origin(node.name if node.op != "output" else ORIGIN_OUTPUT)
            if node.op == "placeholder":
                # name=: Graph.placeholder would snake-case the name (LayerNorm -> layer_norm), and
                # the plan's layouts and param_placeholders are keyed by the traced name
                self.env[node.name] = self.graph.create_node("placeholder", node.name, name=node.name)
                if MASTER_DTYPE in node.meta:
                    masters.append(node)
                continue
            if masters:
                self.cast_masters(masters)
                masters = []
            if node.op == "get_attr":
                setattr(root, node.target, getattr(gm, node.target))
                self.env[node.name] = self.graph.get_attr(node.target)
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                self.env[node.name] = self.graph.call_function(operator.getitem, (self.env[src.name], idx))
            elif node.op == "call_function":
                self.env[node.name] = self.call(node)
            elif node.op == "output":
                self.output(node)
        self._origin(None)
        return root, self.graph

    def _origin(self, name: str | None) -> None:
        """Tag the program nodes made since the last call with the graph node they were made for
        (``meta[ORIGIN]``: its name; ORIGIN_OUTPUT for the moves of the graph's outputs): a
        redistribution belongs to the consumer it was made for. Pipelines cut programs by it."""
        for n in reversed(self.graph.nodes):
            if ORIGIN in n.meta:
                break
            n.meta[ORIGIN] = self._current
        self._current = name

    def cast_masters(self, nodes: list) -> None:
        """Each master's local shard cast to the dtype the step was traced in (trace/precision.py),
        first thing, so every collective that moves a parameter moves the cast copy."""
        for node in nodes:
            dtype = node.meta["val"].dtype
            cast = self.graph.call_function(torch.ops.aten._to_copy.default, (self.env[node.name],), {"dtype": dtype})
            cast.name = f"{node.name}_{str(dtype).replace('torch.', '')}"
            cast.meta[CAST_OF] = node.name
            self.env[node.name] = cast

    def output(self, node: fx.Node):
        outs = node.args[0]
        single = not isinstance(outs, (list, tuple))
        outs = [outs] if single else list(outs)
        res = []
        for o, steps, lay in zip(outs, self.prop.output_steps, self.prop.output_layouts):
            res.append(self.move(o, lay, steps) if isinstance(o, fx.Node) else o)
        self.graph.output(res[0] if single else tuple(res))


def _reduce_where_made(graph: fx.Graph) -> None:
    """Move each output's redistribution whose first collective the bucket pass cannot launch
    asynchronously (not an all_reduce or reduce_scatter: FSDP x Megatron's all_gather(tp) ->
    reduce_scatter(dp) -> slice(tp) of a gradient sharded twice on one dim) to right after its
    value is made, as FSDP2 finishes a unit's reduction in its post-backward: left at the end,
    every block's unreduced gradient would live to the end of backward, and a deep model's
    program would not repeat per block (tools/cluster/stamp.py copies a block's segments). The
    price: the gathered gradient is a transient in backward now (a 6-block tiny Llama under
    fsdp x tp with recomputation: liveness peak +3.8%; the 8B calculator's fsdp+tp figures
    unchanged to 0.1 GiB). The step time prices such a move as blocking wherever it runs
    (search/steptime.edge_phases)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for last in out.all_input_nodes:
        chain = []
        x = last
        while "sw_step" in x.meta and len(x.users) == 1 and isinstance(x.args[0], fx.Node):
            chain.append(x)
            x = x.args[0]
        first = next((n.meta["sw_step"] for n in reversed(chain) if n.meta["sw_step"].is_collective), None)
        if first is None or first.kind in BUCKETED or x.op == "placeholder":
            continue  # the bucket pass launches it as backward makes the value, the chain's later steps after
        for n in reversed(chain):  # the chain's first step first, each after the one before
            x.append(n)
            x = n


@collecting_once  # its allocations would set off the collector's passes over the whole plan
def build_program(prop: Propagation, rank: int, debug: bool = True, bucket_bytes: int | None = None) -> fx.GraphModule:
    """Rank ``rank``'s program; ``bucket_bytes``: the buckets' cap (None: no buckets, no prefetch)."""
    return ProgramBuilder(prop, rank, debug, bucket_bytes).build()


def program_source(program: fx.GraphModule, rank: int) -> str:
    return f"# stage: lower (per-rank program, rank {rank})\n" + program.code.strip() + "\n"
