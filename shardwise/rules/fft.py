"""FFTs: shard the dims they do not transform.

``_fft_r2c``, ``_fft_c2r`` and ``_fft_c2c`` transform the dims listed in their ``dim`` arg, each
slice along them on its own: any other dim shards alike on input and output, and the local call
is the op with its args as given (the transformed dims are whole on every rank, so ``c2r``'s
last-dim size and the normalisation, which depends on the transformed sizes only, stay exact), on
contiguous inputs, and an empty result for an empty chunk (MKL refuses a zero-size batch). An FFT is
linear over the reals, so Partial(sum) passes through. A transformed dim is never sharded (each
output element needs the whole dim: that would be a distributed FFT).
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, replicate_all
from .pool import local as empty_safe_local
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten

FFTS = [aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default]


def fft_strategies(call: OpCall) -> list[Strategy1D]:
    x = call.ins[0]
    transformed = {d % x.ndim for d in call.arg(1, "dim")} if x.ndim else set()
    out = [replicate_all(call)]
    out += [Strategy1D((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in transformed]
    return out + [Strategy1D((P,), (P,))]


ROWS = (Rule(FFTS, fft_strategies, empty_safe_local, blockwise=True),)
