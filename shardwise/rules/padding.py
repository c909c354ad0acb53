"""Edge padding (``reflection_pad{1,2,3}d``, ``replication_pad{1,2,3}d``) and its backwards: a
padded dim reads its edge rows, so only the leading (batch, channel) dims shard (an empty chunk
gives an empty result); the backwards (grad_output, input) likewise. No halo exchange here.
Padding copies values, so it is linear: Partial in, Partial out; the backwards are linear in
grad_output and read the input only for its shape (so it may be Partial too)."""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, R, replicate_all
from .pool import local as empty_safe_local  # an empty chunk gives an empty result, not a kernel error
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten

# edge pads -> number of trailing (padded) dims, which stay whole
PADS = {aten.reflection_pad1d.default: 1, aten.replication_pad1d.default: 1,
            aten.reflection_pad2d.default: 2, aten.reflection_pad3d.default: 3, aten.replication_pad2d.default: 2,
            aten.replication_pad3d.default: 3}

# edge pads' backwards (grad_output, input, padding) -> their forward
PAD_BACKWARD = {aten.reflection_pad1d_backward.default: aten.reflection_pad1d.default,
                aten.replication_pad1d_backward.default: aten.replication_pad1d.default,
                aten.reflection_pad2d_backward.default: aten.reflection_pad2d.default,
                aten.reflection_pad3d_backward.default: aten.reflection_pad3d.default,
                aten.replication_pad2d_backward.default: aten.replication_pad2d.default,
                aten.replication_pad3d_backward.default: aten.replication_pad3d.default}


def leading_dims_strategies(call: OpCall) -> list[Strategy1D]:
    """The leading dims (batch, channels) shard; Partial passes through."""
    x = call.ins[0]
    return [replicate_all(call), Strategy1D((P,), (P,))] + [Strategy1D((Shard(d),), (Shard(d),))
                                                            for d in range(x.ndim - PADS[call.op])]


def pad_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """grad_output and input on the same leading dim; grad_input follows. A Partial grad_output
    gives a Partial grad_input, the input (its shape read only) Replicate or Partial."""
    x = call.ins[1]
    lead = x.ndim - PADS[PAD_BACKWARD[call.op]]
    partial = [Strategy1D((P,), (P, R)), Strategy1D((P,), (P, P)), Strategy1D((R,), (R, P))]
    return [replicate_all(call)] + partial + [Strategy1D((Shard(d),), (Shard(d), Shard(d))) for d in range(lead)]


ROWS = (Rule(list(PADS), leading_dims_strategies, empty_safe_local, blockwise=False),
        Rule(list(PAD_BACKWARD), pad_backward_strategies, empty_safe_local, blockwise=False))
