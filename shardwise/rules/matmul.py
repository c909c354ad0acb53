"""Matmul-like ops: rules as einsum strings (data), plus a bias that follows the output.

For the ``add*`` family (``beta * bias + alpha * (a @ b)``) the bias broadcasts to the
output: it takes the output's Shard dim where it has that dim (else Replicate), and is
Partial whenever the output is Partial (each rank adds its part of the bias, so the sum
over ranks is ``beta * bias + alpha * a @ b`` exactly). alpha and beta are plain scalars,
unchanged by sharding.
"""
from __future__ import annotations

import torch

from .common import P, R, aligned_dim, einsum_strategies
from .registry import OpCall, Rule, Strategy1D
from ..core.layout import Partial, Shard

aten = torch.ops.aten

# op -> einsum of its matrix operands (all tensor inputs, in order).
PLAIN = {
    aten.mm.default: "mk,kn->mn",
    aten.bmm.default: "bmk,bkn->bmn",
    aten.mv.default: "mk,k->m",
    aten.dot.default: "k,k->",
}
# op -> einsum of the matrix operands that follow a leading bias tensor (beta * bias + alpha * a @ b).
WITH_BIAS = {
    aten.addmm.default: "mk,kn->mn",
    aten.baddbmm.default: "bmk,bkn->bmn",
    aten.addmv.default: "mk,k->m",
    aten.addbmm.default: "bmk,bkn->mn",
    aten.addr.default: "m,n->mn",  # an outer product: nothing contracted, Partial only from a Partial vector
}


def _bias_placement(call: OpCall, out_p):
    """The bias follows the output: sharded where it has the output dim, Partial with it."""
    bias, out = call.ins[0], call.outs[0]
    if isinstance(out_p, Partial):
        return P
    if isinstance(out_p, Shard):
        k = aligned_dim(out.ndim, bias.shape, out.shape, out_p.dim)
        return R if k is None else Shard(k)
    return R


def einsum_rule(spec: str):
    def strategies(call: OpCall) -> list[Strategy1D]:
        return einsum_strategies(spec, call)

    strategies.__name__ = f"einsum[{spec}]"
    return strategies


def biased_einsum_rule(spec: str):
    def strategies(call: OpCall) -> list[Strategy1D]:
        out = []
        for s in einsum_strategies(spec, call, n_tensors=2):
            mats = s.ins[-2:]  # replicate_all lists every input; the einsum ones list the two matrices
            out.append(Strategy1D(s.outs, (_bias_placement(call, s.outs[0]),) + tuple(mats)))
        return out

    strategies.__name__ = f"bias+einsum[{spec}]"
    return strategies


ROWS = (*(Rule(op, einsum_rule(spec), blockwise=True) for op, spec in PLAIN.items()),
        *(Rule(op, biased_einsum_rule(spec), blockwise=True) for op, spec in WITH_BIAS.items()))
