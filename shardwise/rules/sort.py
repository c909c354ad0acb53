"""Sort and topk: independent along every dim but the sorted one.

Values and indices are sharded alike on any other dim; the indices count along the sorted
dim, which is never sharded, so they need no global offset.
"""
from __future__ import annotations

import torch

from .registry import KW_ONLY, OpCall, Rule, Strategy1D
from .softmax import all_but_dim_strategies

aten = torch.ops.aten

# op -> (position, name) of its dim arg (sort.stable's dim is keyword-only).
SORT_DIM = {
    aten.sort.default: (1, "dim"),
    aten.sort.stable: (KW_ONLY, "dim"),
    aten.topk.default: (2, "dim"),
}


def sort_strategies(call: OpCall) -> list[Strategy1D]:
    return all_but_dim_strategies(call, call.arg(*SORT_DIM[call.op], -1))


ROWS = (Rule(list(SORT_DIM), sort_strategies, blockwise=False),)
