"""FSDP on the propagate planner: gather a parameter before use, or compute on its shard.

A parameter sharded on a mesh dim that also shards the data (an input ``Shard`` on it) can be
used two ways. FSDP gathers it whole before each use (forward, and again for backward) and
keeps the data sharded, so each rank computes on its own batch and the gradient comes out
partial, reduce-scattered back into the shard. Or the consumers compute on the shard (the
product on a sharded weight: partial sums all-reduced, activations gathered), which drops the
data sharding where it meets the weight. Propagation decides node by node and cannot see that
the cheap step now (gathering a few token ids instead of an embedding table) replicates every
activation after it: so the planner runs both ways and keeps the plan whose modelled step (steptime.py) is the
cheaper.
"""
from __future__ import annotations

from ..core.layout import Replicate, Shard


def fsdp_dims(gm, placeholder_placements: dict, params) -> dict:
    """{parameter placeholder: mesh dims it is sharded on that also shard some input}; expert
    weights (read by the experts op, through views) are expert parallelism's: left out."""
    params = set(params) - _expert_weights(gm)
    data = {m for name, pl in placeholder_placements.items() if name not in params and pl
            for m, p in enumerate(pl) if isinstance(p, Shard)}
    out = {}
    for name, pl in placeholder_placements.items():
        dims = frozenset(m for m, p in enumerate(pl or ()) if isinstance(p, Shard) and m in data)
        if name in params and dims:
            out[name] = dims
    return out


def _expert_weights(gm) -> set:
    """Placeholders the grouped experts op reads (directly or through single-input views)."""
    from ..ops.moe.op import FORWARD
    from ..trace import tensor_arg_nodes

    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is FORWARD:
            for a in tensor_arg_nodes(n):
                while a.op == "call_function" and len(tensor_arg_nodes(a)) == 1:
                    a = tensor_arg_nodes(a)[0]
                if a.op == "placeholder":
                    out.add(a.name)
    return out


def gather_first(sts: list, srcs: list, ins: list, gather: dict) -> list:
    """The strategies of a node that take every such parameter whole on those mesh dims (all of
    ``sts`` if none does), unless the node can take a parameter's shard together with data
    sharded on the same mesh dim as both arrive: then it is that parameter's parallel consumer
    (expert parallelism's dispatch of tokens to the experts each rank holds), left to choose."""
    if not any(src in gather for src in srcs) or any(_takes_shard_with_data(st, srcs, ins, gather) for st in sts):
        return sts
    return [st for st in sts if all(isinstance(pl[m], Replicate) for src, pl in zip(srcs, st.ins)
                                    for m in gather.get(src, ()))] or sts


def _takes_shard_with_data(st, srcs: list, ins: list, gather: dict) -> bool:
    if any(pl != lay.placements for pl, lay in zip(st.ins, ins)):
        return False  # something moves
    return any(isinstance(lay.placements[m], Shard) and src not in gather
               for m in {m for src in srcs for m in gather.get(src, ())} for src, lay in zip(srcs, ins))
