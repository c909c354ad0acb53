"""Max unpooling (``max_unpool2d``, ``max_unpool3d``; ``F.max_unpool1d`` goes through the 2-d op).

The output is zeros with each input value written at its index, a flat position inside its
(batch, channel) plane of the OUTPUT. An index can point anywhere in the plane, so the spatial
dims stay whole (a shard of them would need every other rank's values); the leading dims
(batch, channels) shard on input, indices and output alike, the indices unchanged.

No Partial, though the op is linear: where overlapping pool windows picked the same element,
the indices repeat and the kernel keeps one of the values written there (which one is not
specified: the CUDA kernel races). The values are equal on one device, but their Partial parts
are not, and a rank that keeps another window's part than its peers makes the sum wrong.
The backward is a gather (``max_pool_double_backward``), which has its own rules.
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import replicate_all
from .pool import local as empty_safe_local  # an empty chunk gives zeros of its planned shape
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten

# op -> its trailing (unpooled) spatial dims, which stay whole
UNPOOL = {aten.max_unpool2d.default: 2, aten.max_unpool3d.default: 3}


def unpool_strategies(call: OpCall) -> list[Strategy1D]:
    """self, indices and the output on the same leading dim."""
    x = call.ins[0]
    lead = x.ndim - UNPOOL[call.op]
    return [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d), Shard(d))) for d in range(lead)]


ROWS = (Rule(list(UNPOOL), unpool_strategies, empty_safe_local, blockwise=False),)
