"""Weight normalisation (torch.nn.utils.weight_norm / parametrizations.weight_norm on CPU):
``_weight_norm_interface(v, g, dim) -> (w, norm)``, ``w = g * v / norm`` with ``norm`` the 2-norm of
``v`` over every dim but ``dim`` (``g`` and ``norm``: size 1 except on ``dim``), and its backward.

Each slice along ``dim`` is normalised alone, so ``dim`` shards everything alike; the other dims
are reduced by the norm and stay whole. The backward is linear in ``grad_w``: Partial in, Partial out. The CPU kernels read their inputs
as contiguous (a piece of a sharded last dim is a strided view): the local calls make them so.
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten


def _dim(call: OpCall, i: int, ndim: int) -> int:
    return call.arg(i, "dim", 0) % max(ndim, 1)


def weight_norm_strategies(call: OpCall) -> list[Strategy1D]:
    v = call.ins[0]
    out = [replicate_all(call)]
    if v.ndim:
        s = Shard(_dim(call, 2, v.ndim))
        out.append(Strategy1D((s, s), (s, s)))
    return out


def weight_norm_backward_strategies(call: OpCall) -> list[Strategy1D]:
    # ins: grad_w, saved_v, saved_g, saved_norms -> (grad_v, grad_g)
    v = call.ins[1]
    out = [replicate_all(call), Strategy1D((P, P), (P, R, R, R))]
    if v.ndim:
        s = Shard(_dim(call, 4, v.ndim))
        out.append(Strategy1D((s, s), (s, s, s, s)))
    return out


def on_contiguous(op, *args):
    """``op`` on contiguous copies of its tensor arguments (views of a sharded dim are strided)."""
    return op(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))


def contiguous_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    names = [a.name for a in call.op._schema.arguments]
    return LocalCall(on_contiguous, (call.op, *(call.arg(i, n) for i, n in enumerate(names))), {})


ROWS = (Rule(aten._weight_norm_interface.default, weight_norm_strategies, contiguous_local, blockwise=True),
        Rule(aten._weight_norm_interface_backward.default, weight_norm_backward_strategies, contiguous_local,
             blockwise=True))
