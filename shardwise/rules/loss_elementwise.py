"""Elementwise losses: huber_loss, smooth_l1_loss, soft_margin_loss, binary_cross_entropy (with and
without weight), forward and backward.

Each is ``f(self, target[, weight])`` per element, then reduced: 'none' keeps the elements, 'sum'
adds them, 'mean' divides the sum by the element count. Strategies (one mesh dim):

- 'none': pointwise (any dim sharded, the operands following by broadcasting).
- 'sum' / 'mean': any dim sharded -> Partial('sum'). 'mean' is the local SUM divided by the GLOBAL
  element count (static), never an average of local means: exact for uneven shards (invariant 4).
- binary_cross_entropy is linear in its weight: weight Partial, the rest Replicate -> Partial.
- backward: grad_input is grad_output times a per-element factor (divided by the count for
  'mean'): sharded like the forward ('none': grad_output follows; else it is a replicated scalar,
  and 'mean' runs the op with 'sum' divided by the global count); linear in grad_output (and in
  bce's weight): a Partial one in, Partial out.
"""
from __future__ import annotations

import math

import torch

from .common import P, R, aligned_dim, pointwise_strategies, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D
from ..core.layout import Shard

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2

# op -> position of its reduction arg (the tensors come first: self, target, [weight];
# backward: grad_output, self, target, [weight])
FORWARD = {aten.huber_loss.default: 2, aten.smooth_l1_loss.default: 2, aten.soft_margin_loss.default: 2,
           aten.binary_cross_entropy.default: 3}
BACKWARD = {aten.huber_loss_backward.default: 3, aten.smooth_l1_loss_backward.default: 3,
            aten.soft_margin_loss_backward.default: 3, aten.binary_cross_entropy_backward.default: 4}
BCE = (aten.binary_cross_entropy.default, aten.binary_cross_entropy_backward.default)


def _reduction(call: OpCall) -> int:
    pos = FORWARD.get(call.op, BACKWARD.get(call.op))
    return call.arg(pos, "reduction", MEAN)


def _elements(call: OpCall, first: int) -> tuple:
    """The shape of the per-element loss: the operands from ``first`` on, broadcast."""
    return tuple(torch.broadcast_shapes(*(t.shape for t in call.ins[first:])))


def _aligned(shape: tuple, d: int, tensors) -> tuple:
    return tuple(R if (k := aligned_dim(len(shape), t.shape, shape, d)) is None else Shard(k) for t in tensors)


def _weighted(call: OpCall) -> bool:
    return call.op in BCE and len(call.ins) == (3 if call.op is BCE[0] else 4)


def forward_strategies(call: OpCall) -> list[Strategy1D]:
    n = len(call.ins)
    linear_w = [Strategy1D((P,), (R,) * (n - 1) + (P,))] if _weighted(call) else []
    if _reduction(call) == NONE:
        return pointwise_strategies(call) + linear_w
    shape = _elements(call, 0)
    out = [replicate_all(call)]
    for d in range(len(shape)):  # every element is summed: a sharded dim gives partial sums
        ins = _aligned(shape, d, call.ins)
        if any(isinstance(p, Shard) for p in ins):
            out.append(Strategy1D((P,), ins))
    return out + linear_w


def backward_strategies(call: OpCall) -> list[Strategy1D]:
    red, shape, n = _reduction(call), call.outs[0].shape, len(call.ins)
    out = [replicate_all(call)]
    for d in range(len(shape)):
        ins = _aligned(shape, d, call.ins)
        ins = ins if red == NONE else (R,) + ins[1:]  # a reduced loss's grad_output is a scalar
        if any(isinstance(p, Shard) for p in ins):
            out.append(Strategy1D((Shard(d),), ins))
    out.append(Strategy1D((P,), (P,) + (R,) * (n - 1)))  # linear in grad_output
    if _weighted(call):
        out.append(Strategy1D((P,), (R,) * (n - 1) + (P,)))  # and in the weight
    return out


def summed_over_global_count(op, numel: int, *args, **kwargs):
    """'mean' on a shard: the op with reduction 'sum' (its reduction arg already set so) divided by
    the GLOBAL element count: a Partial('sum') part, whatever the chunk sizes."""
    return op(*args, **kwargs) / numel


def _global_mean(ctx: LocalCtx, first: int, numel: int) -> LocalCall:
    """The local call: the op itself, or for a sharded 'mean' its sum over the global count."""
    call = ctx.call
    pos = FORWARD.get(call.op, BACKWARD.get(call.op))
    sharded = any(isinstance(p, Shard) for pls in ctx.strategy.ins[first:] for p in pls)
    if call.arg(pos, "reduction", MEAN) != MEAN or not sharded:
        return LocalCall(call.op, call.args, call.kwargs)
    args, kwargs = list(call.args), dict(call.kwargs)
    if pos < len(args):
        args[pos] = SUM
    else:
        kwargs["reduction"] = SUM
    return LocalCall(summed_over_global_count, (call.op, numel, *args), kwargs)


def forward_local(ctx: LocalCtx) -> LocalCall:
    return _global_mean(ctx, 0, math.prod(_elements(ctx.call, 0)))


def backward_local(ctx: LocalCtx) -> LocalCall:
    # the kernels divide by the input's element count (the output's)
    return _global_mean(ctx, 1, math.prod(ctx.call.outs[0].shape))


ROWS = (Rule(list(FORWARD), forward_strategies, forward_local, blockwise=True),
        Rule(list(BACKWARD), backward_strategies, backward_local, blockwise=True))
