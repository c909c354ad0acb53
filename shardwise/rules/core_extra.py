"""Core ATen ops that no model in the zoo reaches but torch's core op set holds: elementwise
functions, edge padding, grid sampling and pairwise distances.

- Elementwise (trigonometric, logarithms in other bases, bitwise/logical xor, fmod and
  remainder of tensors, ``div`` with a rounding mode by a number): any dim, as pointwise ops.
- ``reflection_pad{1,2,3}d`` / ``replication_pad{2,3}d``: a padded dim reads its edge rows,
  so only the leading (batch, channel) dims shard (an empty chunk gives an empty result).
- ``avg_pool1d`` / ``adaptive_avg_pool1d``: batch and channels (the pooled dim stays whole).
- ``grid_sampler_2d(input [N, C, H, W], grid [N, Ho, Wo, 2])``: the batch shards on both, the
  channels on the input alone (the grid is shared); the sampled positions are data, so H/W
  stay whole.
- ``_cdist_forward(x1 [.., P, M], x2 [.., R, M])``: batch dims on both, P rows of x1 or R rows
  of x2 (the other replicated); the feature dim M stays whole (a p-norm is not a sum of parts).
"""
from __future__ import annotations

import torch

from ..layout import Shard
from .common import pointwise_strategies, replicate_all
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


def leading_dims_strategies(call: OpCall) -> list[Strategy1D]:
    """The leading dims (batch, channels) shard."""
    x = call.ins[0]
    return [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d),)) for d in range(x.ndim - TRAILING[call.op])]


def grid_sampler_strategies(call: OpCall) -> list[Strategy1D]:
    return [replicate_all(call), Strategy1D((Shard(0),), (Shard(0), Shard(0))),
            Strategy1D((Shard(1),), (Shard(1), replicate_all(call).ins[1]))]


def cdist_strategies(call: OpCall) -> list[Strategy1D]:
    x1, x2 = call.ins
    out = [replicate_all(call)]
    r = replicate_all(call).ins[0]
    batch = x1.ndim - 2
    out += [Strategy1D((Shard(d),), (Shard(d), Shard(d))) for d in range(batch) if x1.shape[d] == x2.shape[d]]
    out += [Strategy1D((Shard(batch),), (Shard(batch), r)), Strategy1D((Shard(batch + 1),), (r, Shard(batch)))]
    return out


ROWS = (Rule(ELEMENTWISE, pointwise_strategies, blockwise=False),
        Rule(list(TRAILING), leading_dims_strategies, empty_safe_local, blockwise=False),
        Rule(aten.grid_sampler_2d.default, grid_sampler_strategies, blockwise=False),
        Rule(aten._cdist_forward.default, cdist_strategies, blockwise=False))
