"""``aten.repeat``: tile a tensor ``repeats[d]`` times along each dim (new leading dims first).

A dim repeated once keeps its chunks: input sharded there -> output sharded on the matching
output dim, with the same repeats. Tiling is linear: Partial in, Partial out. A tiled dim
cannot stay sharded (each tile would need the whole input dim); a replicated input is
sliced for free afterwards by the redistribution (what InstanceNorm's ``weight.repeat(N)``
needs to meet a batch-sharded, channel-merged input).
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, replicate_all
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten


def repeat_strategies(call: OpCall) -> list[Strategy1D]:
    x, repeats = call.ins[0], list(call.arg(1, "repeats"))
    extra = len(repeats) - x.ndim
    out = [replicate_all(call), Strategy1D((P,), (P,))]
    for k in range(x.ndim):
        if repeats[k + extra] == 1:
            out.append(Strategy1D((Shard(k + extra),), (Shard(k),)))
    return out


ROWS = (Rule(aten.repeat.default, repeat_strategies, blockwise=False),)
