"""Edge padding (``reflection_pad{1,2,3}d``, ``replication_pad{2,3}d``) and its backwards: a
padded dim reads its edge rows, so only the leading (batch, channel) dims shard (an empty chunk
gives an empty result); the backwards (grad_output, input) likewise. No halo exchange here."""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import replicate_all
from .pool import local as empty_safe_local  # an empty chunk gives an empty result, not a kernel error
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten

# edge pads -> number of trailing (padded) dims, which stay whole
PADS = {aten.reflection_pad1d.default: 1,
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
    return [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d),)) for d in range(x.ndim - PADS[call.op])]


def pad_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """grad_output and input on the same leading dim; grad_input follows."""
    x = call.ins[1]
    lead = x.ndim - PADS[PAD_BACKWARD[call.op]]
    return [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d), Shard(d))) for d in range(lead)]


ROWS = (Rule(list(PADS), leading_dims_strategies, empty_safe_local, blockwise=False),
        Rule(list(PAD_BACKWARD), pad_backward_strategies, empty_safe_local, blockwise=False))
