"""Complex numbers: polar, view_as_complex, view_as_real, _conj, complex arithmetic.

``view_as_complex(x [*s, 2]) -> [*s]`` and ``view_as_real(z [*s]) -> [*s, 2]`` reinterpret the
(real, imag) pairs: every dim of ``s`` shards alike on both sides, the pair dim stays whole. Both
are real-linear, as are the conjugations, so Partial(sum) passes through them. ``polar`` and
``complex`` are elementwise (pointwise rows, polar nonlinear). Complex ``mul``/``add``/``clone``
are the pointwise family's rows: their strategies do not depend on the dtype (complex
multiplication is linear in each factor), and the verifier compares real and imaginary parts.
A complex rotary embedding (``view_as_complex(x) * polar(1, freqs)`` then ``view_as_real``) and
its backward (``view_as_real`` of the gradient, ``mul`` by ``_conj`` of the factor) thus shard on
batch, sequence and heads.
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from .common import P, pointwise_strategies, replicate_all
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten

# conj(a + b) = conj(a) + conj(b): linear in their one input (pointwise, Partial through)
CONJUGATIONS = [aten._conj.default, aten.resolve_conj.default, aten.resolve_neg.default, aten._neg_view.default]


def pair_view_strategies(call: OpCall) -> list[Strategy1D]:
    """view_as_complex / view_as_real: dim d of the batch shape ``s`` on both sides (the pair dim,
    last of the real side, whole); Partial(sum) passes (the views are linear)."""
    x = call.ins[0]
    batch = min(x.ndim, call.out.ndim)  # the dims of s: the complex side's dims
    out = [replicate_all(call)]
    out += [Strategy1D((Shard(d),), (Shard(d),)) for d in range(batch)]
    return out + [Strategy1D((P,), (P,))]


def _pointwise(linear):
    def strategies(call: OpCall) -> list[Strategy1D]:
        return pointwise_strategies(call, linear)

    strategies.__name__ = f"complex_pointwise[{linear or 'nonlinear'}]"
    return strategies


ROWS = (
    Rule([aten.view_as_complex.default, aten.view_as_real.default], pair_view_strategies, blockwise=True),
    Rule(CONJUGATIONS, _pointwise("all"), blockwise=True),
    # complex(real, imag) is linear in both together; polar(abs, angle) is not
    Rule(aten.complex.default, _pointwise("all"), blockwise=True),
    Rule(aten.polar.default, _pointwise(None), blockwise=True),
)
