"""Edge padding (rules/padding.py) checked numerically on meshes (2,), (3,), (2, 2): leading dims
(uneven) shard, the padded dims stay whole, Partial passes through; the backwards take a Partial
grad_output with the input (read for its shape only) Replicate or Partial.

Run: python -m pytest tests/rules/test_padding.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
CASES = {"replication1d": (aten.replication_pad1d, (3, 5, 7), [3, 1]),
         "replication1d_unbatched": (aten.replication_pad1d, (5, 7), [0, 2]),
         "replication2d": (aten.replication_pad2d, (3, 5, 4, 7), [1, 2, 3, 1]),
         "reflection1d": (aten.reflection_pad1d, (3, 5, 7), [2, 3])}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pad_forward(name):
    op, shape, pad = CASES[name]
    lead = len(shape) - len(pad) // 2
    expect = [((S(d),), (S(d),)) for d in range(lead)] + [((P,), (P,))]
    check(op.default, torch.randn(shape), pad, expect=expect, absent=[((S(lead),), (S(lead),))])


@pytest.mark.parametrize("name", sorted(CASES))
def test_pad_backward(name):
    op, shape, pad = CASES[name]
    x = torch.randn(shape)
    g = torch.randn(op.default(x, pad).shape)
    bwd = getattr(aten, op.__name__ + "_backward").default
    lead = len(shape) - len(pad) // 2
    expect = [((S(d), S(d)), (S(d),)) for d in range(lead)] + [((P, R), (P,)), ((P, P), (P,)), ((R, P), (R,))]
    check(bwd, g, x, pad, expect=expect)
