"""Core ATen ops that no model in the zoo reaches but torch's core op set holds: elementwise
functions, edge padding, grid sampling and pairwise distances.

- Elementwise (trigonometric, logarithms in other bases, bitwise/logical xor, fmod and
  remainder of tensors, ``div`` with a rounding mode by a number): any dim, as pointwise ops.
- ``reflection_pad{1,2,3}d`` / ``replication_pad{2,3}d``: a padded dim reads its edge rows,
  so only the leading (batch, channel) dims shard (an empty chunk gives an empty result); their
  backwards (grad_output, input) likewise.
- ``avg_pool1d`` / ``adaptive_avg_pool1d``: batch and channels (the pooled dim stays whole).
- ``grid_sampler_2d(input [N, C, H, W], grid [N, Ho, Wo, 2])``: the batch shards on both, the
  channels on the input alone (the grid is shared); the sampled positions are data, so H/W
  stay whole. Its backward likewise; over channels the grid's gradient is a sum of parts (Partial).
- ``_cdist_forward(x1 [*b1, P, M], x2 [*b2, R, M]) -> [*B, P, R]`` (B: b1 and b2 broadcast, which
  may differ in length): a batch dim of the output with the inputs that hold it whole (an input
  broadcast along it is replicated), P rows of x1 or R rows of x2 (the other replicated); the
  feature dim M stays whole (a p-norm is not a sum of parts).
- ``_cdist_backward(grad, x1, x2, p, cdist) -> grad_x1``: the same dims; over R, and over a
  batch dim x1 is broadcast along, grad_x1 is a sum of parts (Partial).
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, R, pointwise_strategies, replicate_all
from .pool import local as empty_safe_local  # an empty chunk gives an empty result, not a kernel error
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten

ELEMENTWISE = [
    aten.acos.default, aten.acosh.default, aten.asin.default, aten.asinh.default, aten.atan.default,
    aten.atanh.default, aten.cosh.default, aten.sinh.default, aten.tan.default, aten.log10.default,
    aten.log2.default, aten.logical_xor.default, aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar,
    aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.fmod.Tensor, aten.remainder.Tensor,
    aten.div.Scalar_mode,
]
# edge pads and 1-d pools -> number of trailing (padded / pooled) dims, which stay whole (no halo here)
TRAILING = {aten.avg_pool1d.default: 1, aten.adaptive_avg_pool1d.default: 1, aten.reflection_pad1d.default: 1,
            aten.reflection_pad2d.default: 2, aten.reflection_pad3d.default: 3, aten.replication_pad2d.default: 2,
            aten.replication_pad3d.default: 3}


# edge pads' backwards (grad_output, input, padding) -> their forward
PAD_BACKWARD = {aten.reflection_pad1d_backward.default: aten.reflection_pad1d.default,
                aten.reflection_pad2d_backward.default: aten.reflection_pad2d.default,
                aten.reflection_pad3d_backward.default: aten.reflection_pad3d.default,
                aten.replication_pad2d_backward.default: aten.replication_pad2d.default,
                aten.replication_pad3d_backward.default: aten.replication_pad3d.default}


def leading_dims_strategies(call: OpCall) -> list[Strategy1D]:
    """The leading dims (batch, channels) shard."""
    x = call.ins[0]
    return [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d),)) for d in range(x.ndim - TRAILING[call.op])]


def pad_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """grad_output and input on the same leading dim; grad_input follows."""
    x = call.ins[1]
    lead = x.ndim - TRAILING[PAD_BACKWARD[call.op]]
    return [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d), Shard(d))) for d in range(lead)]


def grid_sampler_strategies(call: OpCall) -> list[Strategy1D]:
    return [replicate_all(call), Strategy1D((Shard(0),), (Shard(0), Shard(0))),
            Strategy1D((Shard(1),), (Shard(1), replicate_all(call).ins[1]))]


def _batch_dim(x, d: int, batch: tuple):
    """The dim of ``x`` that holds output batch dim ``d`` whole, or None (missing or broadcast)."""
    j = d - (len(batch) - (x.ndim - 2))
    return j if j >= 0 and x.shape[j] == batch[d] else None


def cdist_strategies(call: OpCall) -> list[Strategy1D]:
    x1, x2 = call.ins
    batch = tuple(call.outs[0].shape[:-2])
    out = [replicate_all(call)]
    for d in range(len(batch)):
        j1, j2 = _batch_dim(x1, d, batch), _batch_dim(x2, d, batch)
        out.append(Strategy1D((Shard(d),), (R if j1 is None else Shard(j1), R if j2 is None else Shard(j2))))
    out += [Strategy1D((Shard(len(batch)),), (Shard(x1.ndim - 2), R)),
            Strategy1D((Shard(len(batch) + 1),), (R, Shard(x2.ndim - 2)))]
    return out


def cdist_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """ins: grad, x1, x2, cdist (grad and cdist shaped as the forward's output); out: grad_x1."""
    _, x1, x2, _ = call.ins
    batch = tuple(call.ins[0].shape[:-2])
    out = [replicate_all(call)]
    for d in range(len(batch)):
        j1, j2 = _batch_dim(x1, d, batch), _batch_dim(x2, d, batch)
        x2_p = R if j2 is None else Shard(j2)
        out.append(Strategy1D((P,) if j1 is None else (Shard(j1),),
                              (Shard(d), R if j1 is None else Shard(j1), x2_p, Shard(d))))
    rows, cols = Shard(len(batch)), Shard(len(batch) + 1)
    out += [Strategy1D((Shard(x1.ndim - 2),), (rows, Shard(x1.ndim - 2), R, rows)),
            Strategy1D((P,), (cols, R, Shard(x2.ndim - 2), cols))]
    return out


def grid_sampler_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """ins: grad_output [N, C, Ho, Wo], input [N, C, H, W], grid [N, Ho, Wo, 2]; outs: grad_input,
    grad_grid (None where output_mask leaves it out)."""
    def outs(*ps):
        return tuple(None if o is None else p for o, p in zip(call.outs, ps))

    return [replicate_all(call), Strategy1D(outs(Shard(0), Shard(0)), (Shard(0), Shard(0), Shard(0))),
            Strategy1D(outs(Shard(1), P), (Shard(1), Shard(1), R))]


ROWS = (Rule(ELEMENTWISE, pointwise_strategies, blockwise=False),
        Rule(list(TRAILING), leading_dims_strategies, empty_safe_local, blockwise=False),
        Rule(list(PAD_BACKWARD), pad_backward_strategies, empty_safe_local, blockwise=False),
        Rule(aten.grid_sampler_2d.default, grid_sampler_strategies, blockwise=False),
        Rule(aten.grid_sampler_2d_backward.default, grid_sampler_backward_strategies, empty_safe_local,
             blockwise=False),
        Rule(aten._cdist_forward.default, cdist_strategies, empty_safe_local, blockwise=False),
        Rule(aten._cdist_backward.default, cdist_backward_strategies, empty_safe_local, blockwise=False))
