"""Ops of Mixture-of-Experts routing (Hugging Face's grouped experts): counting tokens per
expert. (``floor_divide``, mapping sorted pair positions back to tokens as ``perm // top_k``, is
pointwise: rules/pointwise.py.)

- ``histc``: a histogram over a fixed range counts each element once, so any shard of the
  input gives a partial histogram whose sum over ranks is the whole one (counts are whole
  numbers, exact in float32 below 2**24 elements). With ``min == max`` torch takes the range
  from the data, which differs per shard: then only the replicated strategy is offered.
"""
from __future__ import annotations

import torch

from .common import P, replicate_all
from .registry import OpCall, Rule, Strategy1D
from ..core.layout import Shard

aten = torch.ops.aten


def histc_strategies(call: OpCall) -> list[Strategy1D]:
    out = [replicate_all(call)]
    lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
    if lo == hi:  # range read from the data: a shard's range is not the whole tensor's
        return out
    return out + [Strategy1D((P,), (Shard(d),)) for d in range(call.ins[0].ndim)]


ROWS = (Rule(aten.histc.default, histc_strategies, blockwise=False),)
