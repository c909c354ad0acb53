"""Floating-point work and bytes moved of one node under one strategy, per rank.

Estimates, not counts: matmul-like ops take ``2 * M * N * K`` from the LOCAL shapes (so a
strategy that splits the contraction dim does half the work per rank), attention (every
sdpa variant and shardwise.attention) ``4 * L * S * E`` per (batch, head) (``Q K^T`` and
``P V`` over all S keys, dense: a causal mask is not subtracted; backward twice that), a
convolution ``2 * output * (C_in / groups) * kernel`` (transposed: ``2 * input * (C_out /
groups) * kernel``), convolution_backward that once per gradient asked for (input, weight)
plus one flop per bias-gradient element; a view (trace.is_view_op: t, view, expand, ...) none;
every other op one flop per local output element.
``bytes_moved``: local inputs plus outputs read and written (views move nothing).
``node_time`` turns both into time with the cost model (shardwise/core/cost.py); ``plan_costs``
sums them over a Propagation's nodes per rank (what the modelled step and the Plan report).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..core.layout import Layout
from ..core.mesh import Mesh
from ..rules.registry import OpCall, Strategy, TensorMeta
from ..trace import attention as attention_variants
from ..trace import is_view_op
from .classes import plan_classes

aten = torch.ops.aten

# op -> index (in OpCall.ins) of the operand whose last dim is contracted.
_CONTRACT_LAST = {aten.mm.default: 0, aten.bmm.default: 0, aten.mv.default: 0, aten.dot.default: 0,
                  aten.addmm.default: 1, aten.baddbmm.default: 1, aten.addmv.default: 1, aten.linear.default: 0}


@lru_cache(maxsize=1)
def _attention_ops() -> dict:
    """op -> (arg position of q, arg position of k, work relative to a forward)."""
    ops = {**dict.fromkeys(attention_variants.FORWARDS, (0, 1, 1.0)),
           **dict.fromkeys(attention_variants.BACKWARDS, (1, 2, 2.0)),
           aten.scaled_dot_product_attention.default: (0, 1, 1.0),
           aten._scaled_dot_product_attention_math.default: (0, 1, 1.0)}
    shardwise_ops = getattr(torch.ops, "shardwise", None)
    if shardwise_ops is not None and hasattr(shardwise_ops, "attention"):
        ops[shardwise_ops.attention.default] = (0, 1, 1.0)
        ops[shardwise_ops.attention_backward.default] = (2, 3, 2.0)
    return ops


def local_shapes(layout: Layout, mesh: Mesh) -> tuple:
    """Per rank, the local shape of ``layout`` (the planner asks for the same layouts often)."""
    return _local_shapes(layout, mesh.shape)


@lru_cache(maxsize=1 << 16)
def _local_shapes(layout: Layout, mesh_shape: tuple) -> tuple:
    """Keyed on the mesh's shape (plain values), never on a Mesh object."""
    mesh = Mesh(mesh_shape)
    return tuple(layout.local_shape(mesh, r) for r in range(mesh.size))


def _in_index(call: OpCall, argpos: int) -> int:
    """Index in ``call.ins`` of the tensor at positional arg ``argpos``."""
    return sum(isinstance(a, TensorMeta) for a in call.args[:argpos])


def flops(call: OpCall, st: Strategy, mesh: Mesh) -> float:
    """Estimated flops of ``call`` under ``st`` on the busiest rank."""
    return max(flops_by_rank(call, st, mesh, _ranks(call, st, mesh)), default=0.0)


def _ranks(call: OpCall, st: Strategy, mesh: Mesh):
    """Rank 0 alone when every layout of the node is uniform (each rank holds the same local
    shapes, so each does the same work and moves the same bytes), else every rank: the busiest
    rank's figures without visiting every rank of a large even mesh."""
    try:
        lays = [lay for lay in st.in_layouts(call) + st.out_layouts(call) if lay is not None]
        return (0,) if all(lay.uniform(mesh) for lay in lays) else range(mesh.size)
    except ValueError:
        return range(mesh.size)


def _shapes(layout: Layout, mesh: Mesh, ranks) -> tuple:
    if isinstance(ranks, range) and len(ranks) == mesh.size:
        return local_shapes(layout, mesh)
    return tuple(layout.local_shape(mesh, r) for r in ranks)


def flops_by_rank(call: OpCall, st: Strategy, mesh: Mesh, ranks=None) -> tuple:
    """Estimated flops of ``call`` under ``st`` on each rank of ``ranks`` (default: every rank;
    module docstring)."""
    ranks = range(mesh.size) if ranks is None else ranks
    if is_view_op(call.op):
        return (0.0,) * len(ranks)
    ins = st.in_layouts(call)
    outs = [o for o in st.out_layouts(call) if o is not None]
    out_numel = [sum(math.prod(s) for s in col) for col in zip(*(_shapes(o, mesh, ranks) for o in outs))] \
        if outs else [0] * len(ranks)
    if call.op in _CONTRACT_LAST and ins:
        k = _shapes(ins[_CONTRACT_LAST[call.op]], mesh, ranks)
        return tuple(2.0 * n * (k[i][-1] if k[i] else 1) for i, n in enumerate(out_numel))
    attn = _attention_ops().get(call.op)
    if attn is not None and len(call.args) > attn[1] and isinstance(call.args[attn[0]], TensorMeta):
        q = _shapes(ins[_in_index(call, attn[0])], mesh, ranks)
        seq_k = call.args[attn[1]].shape[-2]  # every strategy sees all keys (gathered or rotated)
        share = causal_share(call, attn)
        return tuple(4.0 * attn[2] * share * math.prod(s) * seq_k for s in q)
    if call.op in (aten.convolution.default, aten.convolution_backward.default):
        return _conv_flops(call, ins, out_numel, mesh, ranks)
    if str(call.op).startswith("shardwise.moe_experts"):  # (and its backward) rules/moe_experts.py
        from ..rules.moe_experts import experts_flops

        by_rank = experts_flops(call, st, mesh)
        return tuple(by_rank[r] for r in ranks)
    return tuple(float(n) for n in out_numel)


def causal_share(call: OpCall, attn=None) -> float:
    """The share of the query x key scores an attention node computes: 1 without a causal mask;
    with one (torch's top-left aligned tril), the pairs on or below the diagonal of the global
    [L, S] score matrix, as fused kernels skip the masked blocks. Every rank is given that
    average share (a rank holding late queries of a sequence-sharded causal attention does more)."""
    attn = attn or _attention_ops().get(call.op)
    names = [a.name for a in call.op._schema.arguments] if hasattr(call.op, "_schema") else []
    if attn is None or "is_causal" not in names or not call.arg(names.index("is_causal"), "is_causal", False):
        return 1.0
    q, k = call.args[attn[0]], call.args[attn[1]]
    big_l, big_s = q.shape[-2], k.shape[-2]
    if not big_l or not big_s:
        return 1.0
    full = min(big_l, big_s)  # rows i < S see i + 1 keys, later rows all S
    pairs = full * (full + 1) // 2 + (big_l - full) * big_s
    return pairs / (big_l * big_s)


def op_class(call: OpCall) -> str:
    """How a node runs on a device (the cost model's achieved rate, core/cost.py): "view" (no
    kernel), "matmul" (contractions, convolutions, grouped experts), "attention", or "other"
    (elementwise, reductions, copies: bound by memory bandwidth)."""
    if is_view_op(call.op):
        return "view"
    if call.op in _attention_ops():
        return "attention"
    if (call.op in _CONTRACT_LAST or call.op in (aten.convolution.default, aten.convolution_backward.default)
            or str(call.op).startswith("shardwise.moe_experts")):
        return "matmul"
    return "other"


def _conv_flops(call: OpCall, ins: list, out_numel: list, mesh: Mesh, ranks) -> tuple:
    """Per rank: ``2 * (output, or input when transposed) * prod(weight[1:])`` per product
    (forward; backward once per input/weight gradient asked for), plus the bias gradient."""
    fwd = call.op == aten.convolution.default
    x_i, w_i = (0, 1) if fwd else (1, 2)
    transposed = call.arg(6 if fwd else 7, "transposed", False)
    big = ins[x_i] if transposed else (None if fwd else ins[0])  # backward: grad_output is the output
    big_numel = ([math.prod(s) for s in _shapes(big, mesh, ranks)] if big is not None else out_numel)
    w = _shapes(ins[w_i], mesh, ranks)
    if fwd:
        return tuple(2.0 * n * math.prod(w[r][1:]) for r, n in enumerate(big_numel))
    mask = call.arg(10, "output_mask", (True, True, True))
    grads = int(bool(mask[0])) + int(bool(mask[1]))
    bias = [math.prod(s) for s in _shapes(ins[0], mesh, ranks)] if mask[2] else [0] * len(ranks)
    return tuple(2.0 * grads * n * math.prod(w[r][1:]) + bias[r] for r, n in enumerate(big_numel))


def node_time(cost, call: OpCall, st: Strategy, mesh: Mesh, rule=None) -> float:
    """Seconds of one node under ``st`` on the busiest rank by ``cost`` (a CostModel): compute,
    plus the collectives its rule runs inside the local call (``rule=None``: compute only)."""
    kind = op_class(call)
    t = 0.0 if kind == "view" else cost.compute_time(
        flops(call, st, mesh), bytes_moved(call, st, mesh) if cost.memory_bandwidth else 0, kind)
    return t + (cost.comm_time(cost.op_comm(rule, call, st, mesh), mesh) if rule is not None else 0.0)


def bytes_moved(call: OpCall, st: Strategy, mesh: Mesh) -> float:
    """Bytes the busiest rank reads (local inputs) and writes (local outputs); views: 0."""
    return max(bytes_by_rank(call, st, mesh, _ranks(call, st, mesh)), default=0.0)


def bytes_by_rank(call: OpCall, st: Strategy, mesh: Mesh, ranks=None) -> tuple:
    """Per rank of ``ranks`` (default: every rank), the bytes of its local inputs and outputs
    (views move nothing: 0)."""
    ranks = range(mesh.size) if ranks is None else ranks
    if is_view_op(call.op):
        return (0.0,) * len(ranks)
    lays = [lay for lay in st.in_layouts(call) + st.out_layouts(call) if lay is not None]
    per = [_shapes(lay, mesh, ranks) for lay in lays]
    return tuple(float(sum(math.prod(sh[i]) * lay.itemsize for lay, sh in zip(lays, per))) for i in range(len(ranks)))


@dataclass
class Costs:
    """Compute per node (busiest rank) and per rank (summed over nodes)."""

    flops_by_rank: tuple
    compute_by_rank: tuple  # seconds
    node_flops: dict = field(default_factory=dict)  # node name -> flops on its busiest rank
    node_compute: dict = field(default_factory=dict)  # node name -> seconds on its busiest rank


def plan_costs(prop, cost) -> Costs:
    """Flops and compute seconds of ``prop``'s nodes under the cost model ``cost``: worked out on
    the first rank of each rank class (search/classes.py: ranks with the same local shapes do the
    same work) and given to every rank of its class."""
    mesh, classes = prop.mesh, plan_classes(prop)
    reps = classes.reps
    flops_tot, time_tot = [0.0] * len(reps), [0.0] * len(reps)
    out = Costs((), ())
    for name, np_ in prop.nodes.items():
        fl = flops_by_rank(np_.call, np_.strategy, mesh, reps)
        by = bytes_by_rank(np_.call, np_.strategy, mesh, reps) if cost.memory_bandwidth else (0.0,) * len(reps)
        kind = op_class(np_.call)
        ts = [0.0 if kind == "view" else cost.compute_time(f, b, kind) for f, b in zip(fl, by)]
        for i in range(len(reps)):
            flops_tot[i] += fl[i]
            time_tot[i] += ts[i]
        out.node_flops[name], out.node_compute[name] = max(fl, default=0.0), max(ts, default=0.0)
    index = {rep: i for i, rep in enumerate(reps)}
    out.flops_by_rank = tuple(flops_tot[index[classes.of(r)]] for r in range(mesh.size))
    out.compute_by_rank = tuple(time_tot[index[classes.of(r)]] for r in range(mesh.size))
    return out
