"""Softmax family: independent along every dim but the softmax dim.

Every tensor (input, output, grads) is sharded alike on any other dim. The backward ops are
linear in grad_output (grad_in = y * (g - sum(g * y)) and g - exp(y) * sum(g)), so a
Partial('sum') grad_output with the saved output replicated gives a Partial('sum') grad.
Sharding the softmax dim itself would need the row max and sum across ranks: not offered.
"""
from __future__ import annotations

import torch

from ..core.layout import Partial, R, Shard
from .common import replicate_all
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten
P = Partial("sum")

FORWARD = [aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default]
BACKWARD = [aten._softmax_backward_data.default, aten._log_softmax_backward_data.default]


def all_but_dim_strategies(call: OpCall, dim: int) -> list[Strategy1D]:
    """Shard every tensor input and output on the same dim ``d``, for each d != ``dim``.

    For ops that treat each slice along ``dim`` on its own (softmax, sort, cumsum, topk):
    inputs and outputs share their dims except the size along ``dim``.
    """
    out = [replicate_all(call)]
    ndim = call.ins[0].ndim
    if ndim == 0:
        return out
    dim %= ndim
    for d in range(ndim):
        if d != dim:
            outs = tuple(None if o is None else Shard(d) for o in call.outs)
            out.append(Strategy1D(outs, tuple(Shard(d) for _ in call.ins)))
    return out


def softmax_strategies(call: OpCall) -> list[Strategy1D]:
    return all_but_dim_strategies(call, call.arg(1, "dim"))


def softmax_backward_strategies(call: OpCall) -> list[Strategy1D]:
    linear = Strategy1D((P,), (P, R))  # grad_output Partial, saved output Replicate
    return all_but_dim_strategies(call, call.arg(2, "dim")) + [linear]


ROWS = (Rule(FORWARD, softmax_strategies, blockwise=True),
        Rule(BACKWARD, softmax_backward_strategies, blockwise=True))
