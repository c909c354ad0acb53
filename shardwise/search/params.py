"""Parameter placements the ILP chooses (``param_placements="auto"``, or a parameter left unnamed).

    free = free_params(traced, mesh, specs, auto)          # {placeholder: candidate placements}
    grads = grad_outputs(traced, free)                     # {graph output index: placeholder}

Each free parameter's placement is a variable of the integer program (search/ilp.py), chosen
together with every node's strategy. The candidates, per mesh dim, are Replicate and Shard(d)
for every tensor dim d the mesh dim can split (at least one element per rank, nested shards
included). Whether a sharded parameter is used sharded (tensor parallelism: its consumers
take the shard) or gathered before use (fully sharded data parallelism: an all_gather before
the consumer, its gradient reduce_scattered back into the shard) is decided by the consumers'
strategies and the redistributions on its edges, so the same candidate serves both. The
gradient of a free parameter must end in the parameter's placement: the program couples that
graph output with the same columns.
"""
from __future__ import annotations

import functools
import itertools

import torch

from ..core.errors import ShardingError
from ..core.layout import Layout, Partial, R, Shard
from ..core.mesh import Mesh
from ..trace import GRAD, PARAM, Traced
from ..trace.precision import MASTER_DTYPE


def candidates(shape: tuple, mesh: Mesh, groups=()) -> list[tuple]:
    """Every placement tuple of a tensor of ``shape`` built from Replicate and Shard(d), where each
    sharded tensor dim holds at least one element per rank of the mesh dims splitting it, and
    Shard(d, groups=g) for each g of ``groups`` (a fused projection such as GPT-2's [q|k|v]:
    every rank then holds whole heads of each part; a grouped dim is split by one mesh dim only).
    Replicate everywhere comes first (propagation's choice, the incumbent). Kept per (shape, mesh,
    groups): a repeated layer's parameters ask again."""
    return list(_candidates(tuple(shape), mesh, tuple(groups)))


@functools.lru_cache(maxsize=1024)
def _candidates(shape: tuple, mesh: Mesh, groups=()) -> tuple:
    """``candidates``' work, once per (shape, mesh, groups)."""
    one = [Shard(d) for d in range(len(shape))]
    one += [Shard(d, groups=g) for g in groups for d in range(len(shape)) if shape[d] % g == 0]
    out = []
    for combo in itertools.product(*([[R] + one] * mesh.ndim)):
        split, grouped = {}, {}
        for size, p in zip(mesh.shape, combo):
            if isinstance(p, Shard):
                split[p.dim] = split.get(p.dim, 1) * size * p.groups
                grouped[p.dim] = grouped.get(p.dim, 0) + (p.groups > 1)
        nested_group = any(g and split[d] and sum(isinstance(p, Shard) and p.dim == d for p in combo) > 1
                           for d, g in grouped.items())
        if all(shape[d] >= n for d, n in split.items()) and not nested_group and _lays_out(shape, combo, mesh):
            out.append(tuple(combo))
    return tuple(out)


def _lays_out(shape: tuple, placements: tuple, mesh: Mesh) -> bool:
    """The layout gives every rank a local shape (the checks user placements get, module/spec.py)."""
    try:
        layout = Layout(shape, torch.float32, placements)
        return all(layout.local_shape(mesh, r) is not None for r in range(mesh.size))
    except ShardingError:
        return False


def split_groups(gm) -> tuple:
    """Part counts of the equal splits in the graph (``qkv.split(h, dim=-1)``: 3): the groups a
    fused projection's weight may be sharded in."""
    seen = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target) in ("aten.split.Tensor", "aten.split_with_sizes.default",
                                                        "aten.chunk.default"):
            vals = n.meta.get("val")
            if isinstance(vals, (list, tuple)) and len(vals) > 1 and len({tuple(v.shape) for v in vals}) == 1:
                seen.add(len(vals))
    return tuple(sorted(seen))


def optimizer_seconds(cost, val, placements: tuple, mesh: Mesh, master_dtype=None) -> float:
    """The optimizer step's time on the busiest rank for one parameter (``val``: its placeholder's
    tensor) laid out as ``placements``: memory-bound, it reads the master shard, its gradient and
    the optimizer state and writes the master and the state (AdamW: (3 + 2 x 2) x 4 = 28 bytes a
    float32 element, ``cost.optimizer_state`` state bytes per parameter byte) at the cost model's
    memory bandwidth. A sharded parameter's step is its shard's, so sharding makes it cheaper.
    0 where the cost model has no memory bandwidth (flops only). ``master_dtype``: the masters'
    dtype under mixed precision (trace/precision.MASTER_DTYPE; default: ``val``'s)."""
    if cost.memory_bandwidth is None:
        return 0.0
    itemsize = torch.empty((), dtype=master_dtype or val.dtype).element_size()
    numel = Layout(tuple(val.shape), val.dtype, tuple(placements)).max_local_numel(mesh)
    return numel * itemsize * (3 + 2 * cost.optimizer_state) / (cost.memory_bandwidth * cost.memory_efficiency)


def optimizer_time(prop, names, cost) -> float:
    """The optimizer step's seconds (``optimizer_seconds``) of the parameter placeholders ``names``
    as the Propagation ``prop`` lays them out (the ILP's objective adds it for the parameters it
    places: search/ilp.py, search/solve.py)."""
    nodes = {n.name: n for n in prop.gm.graph.nodes if n.op == "placeholder"}
    total = 0.0
    for name in names:
        node = nodes.get(name)
        if node is None or name not in prop.layouts:
            continue
        total += optimizer_seconds(cost, node.meta["val"], prop.layouts[name][0].placements, prop.mesh,
                                   node.meta.get(MASTER_DTYPE))
    return total


def free_params(traced: Traced, mesh: Mesh, fixed: set) -> dict:
    """{placeholder name: candidates} for every trainable parameter not in ``fixed`` (the names
    the user placed, or placed by an earlier plan) that the step differentiates."""
    differentiated = {r.name for r in traced.outputs if r.kind == GRAD}
    groups = split_groups(traced.gm)
    out = {}
    for node, role in zip(traced.placeholder_nodes(), traced.placeholders):
        if role.kind == PARAM and role.name not in fixed and role.name in differentiated:
            out[node.name] = candidates(tuple(node.meta["val"].shape), mesh, groups)
    return out


def grad_outputs(traced: Traced, free: dict) -> dict:
    """{graph output index: placeholder name} for the gradients of the free parameters."""
    by_param = {role.name: node.name for node, role in zip(traced.placeholder_nodes(), traced.placeholders)
                if node.name in free}
    return {i: by_param[r.name] for i, r in enumerate(traced.outputs) if r.kind == GRAD and r.name in by_param}


def grad_placements(placements: tuple, partial_dim: int | None) -> tuple:
    """A free parameter's gradient's output placements: its parameter's, except on
    ``partial_dim`` (Planner.grad_partial_dim: a pipeline's microbatch dim), where the step's
    gradient stays a partial sum for the runner to add up."""
    if partial_dim is None:
        return tuple(placements)
    out = list(placements)
    out[partial_dim] = Partial()
    return tuple(out)


def with_choices(placeholder_placements: dict, output_placements: list, chosen: dict, grads: dict,
                 partial_dim: int | None = None):
    """Placeholder and output placements with the chosen parameter placements filled in."""
    ph = {**placeholder_placements, **chosen}
    outs = list(output_placements)
    for i, name in grads.items():
        if name in chosen:
            outs[i] = grad_placements(chosen[name], partial_dim)
    return ph, outs


__all__ = ["candidates", "split_groups", "optimizer_seconds", "optimizer_time", "free_params", "grad_outputs", "grad_placements", "with_choices"]
