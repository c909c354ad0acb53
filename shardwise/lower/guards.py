"""The debug shape guard a program runs after each planned node (parallelize(debug=True)):
invariant 2's check that every local result has its planned local shape, naming the node."""
from __future__ import annotations

import torch

from ..core.calls import flatten_outputs
from ..core.errors import ShardingError


def shape_guard(value, shapes, node: str):
    """Debug guard: the local result of ``node`` must have the planned local shapes."""
    got = flatten_outputs(value)
    for i, (v, want) in enumerate(zip(got, shapes)):
        if want is not None and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(want):
            raise ShardingError(
                f"node '{node}' output {i}: local result has shape {tuple(v.shape)} but the plan expects "
                f"{tuple(want)}; the rule for this op produced a wrong local shape",
                fix="check the op's rule with shardwise.verify_rule, or report it",
            )
    return value
