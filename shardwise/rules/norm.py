"""Layer norm and RMS norm: independent along the leading (non-normalized) dims.

Forward: input, output and the saved statistics (shape [*leading, 1, ...]) are sharded on
any leading dim; weight/bias stay Replicate. Backward: grad_out, input and the statistics
sharded alike give grad_input sharded and grad_weight/grad_bias as Partial('sum') (they sum
over the leading dims). The backward is linear in grad_out, so a Partial grad_out with the
rest replicated gives Partial outputs. Sharding a normalized dim would need the statistics
across ranks: only Replicate there. Outputs masked off by output_mask are None.
"""
from __future__ import annotations

import torch

from ..core.calls import pure
from ..core.layout import Partial, R, Shard
from .common import replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
P = Partial("sum")

# op -> (position of normalized_shape, number of leading tensor inputs sharded like input).
# The remaining tensor inputs (weight, bias) are always Replicate.
FORWARD = {
    aten.native_layer_norm.default: (1, 1),  # input
    aten._fused_rms_norm.default: (1, 1),  # input
}
BACKWARD = {
    aten.native_layer_norm_backward.default: (2, 4),  # grad_out, input, mean, rstd
    aten._fused_rms_norm_backward.default: (2, 3),  # grad_out, input, rstd
}


def _leading(call: OpCall, pos: int) -> int:
    """Number of leading (non-normalized) dims of the input."""
    return call.ins[0].ndim - len(call.arg(pos, "normalized_shape"))


def _ins(call: OpCall, n_follow: int, p) -> tuple:
    return tuple(p if i < n_follow else R for i in range(len(call.ins)))


def _outs(call: OpCall, first, rest) -> tuple:
    return tuple(None if o is None else (first if i == 0 else rest) for i, o in enumerate(call.outs))


def forward_strategies(pos: int, n_follow: int):
    """Strategies of a norm forward whose normalized_shape is arg ``pos``."""

    def norm_forward(call: OpCall) -> list[Strategy1D]:
        out = [replicate_all(call)]
        for d in range(_leading(call, pos)):
            out.append(Strategy1D(_outs(call, Shard(d), Shard(d)), _ins(call, n_follow, Shard(d))))
        return out

    return norm_forward


def backward_strategies(pos: int, n_follow: int):
    """Strategies of a norm backward: grad_input first, then the weight/bias grads."""

    def norm_backward(call: OpCall) -> list[Strategy1D]:
        out = [replicate_all(call)]
        for d in range(_leading(call, pos)):
            out.append(Strategy1D(_outs(call, Shard(d), P), _ins(call, n_follow, Shard(d))))
        linear = tuple(P if i == 0 else R for i in range(len(call.ins)))  # grad_out Partial only
        out.append(Strategy1D(_outs(call, P, P), linear))
        return out

    return norm_backward


@pure
def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    """``native_layer_norm_backward`` with ``mean`` and ``rstd`` made contiguous: its CPU kernel
    reads them as contiguous rows without checking, so a strided view of them (a local chunk
    of a non-leading dim) gives wrong grad_input and grad_weight. On one device they always
    come straight from the forward kernel, contiguous."""
    return aten.native_layer_norm_backward.default(grad_out, input, normalized_shape, mean.contiguous(),
                                                   rstd.contiguous(), weight, bias, output_mask)


def _layer_norm_backward_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(layer_norm_backward, ctx.call.args, ctx.call.kwargs)


LOCAL = {aten.native_layer_norm_backward.default: _layer_norm_backward_local}


ROWS = (*(Rule(op, forward_strategies(pos, n), blockwise=True) for op, (pos, n) in FORWARD.items()),
        *(Rule(op, backward_strategies(pos, n), LOCAL.get(op), blockwise=True)
          for op, (pos, n) in BACKWARD.items()))
