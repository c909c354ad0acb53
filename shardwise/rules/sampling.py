"""Grid sampling: ``grid_sampler_2d(input [N, C, H, W], grid [N, Ho, Wo, 2])``: the batch shards on
both, the channels on the input alone (the grid is shared); the sampled positions are data, so
H/W stay whole. Its backward likewise; over channels the grid's gradient is a sum of parts (Partial)."""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, R, replicate_all
from .pool import local as empty_safe_local  # an empty chunk gives an empty result, not a kernel error
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten


def grid_sampler_strategies(call: OpCall) -> list[Strategy1D]:
    return [replicate_all(call), Strategy1D((Shard(0),), (Shard(0), Shard(0))),
            Strategy1D((Shard(1),), (Shard(1), replicate_all(call).ins[1]))]


def grid_sampler_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """ins: grad_output [N, C, Ho, Wo], input [N, C, H, W], grid [N, Ho, Wo, 2]; outs: grad_input,
    grad_grid (None where output_mask leaves it out)."""
    def outs(*ps):
        return tuple(None if o is None else p for o, p in zip(call.outs, ps))

    return [replicate_all(call), Strategy1D(outs(Shard(0), Shard(0)), (Shard(0), Shard(0), Shard(0))),
            Strategy1D(outs(Shard(1), P), (Shard(1), Shard(1), R))]


ROWS = (Rule(aten.grid_sampler_2d.default, grid_sampler_strategies, blockwise=False),
        Rule(aten.grid_sampler_2d_backward.default, grid_sampler_backward_strategies, empty_safe_local,
             blockwise=False))
