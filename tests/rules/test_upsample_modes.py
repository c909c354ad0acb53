"""Upsampling by nearest-exact and anti-aliased bilinear / bicubic (rules/pool.py rows) checked
numerically on meshes (2,), (3,), (2, 2): batch (5) and channels (3) shard (uneven), Partial
passes through (the ops are linear), the spatial dims stay whole; the backwards get their
rank's input_size.

Run: python -m pytest tests/rules/test_upsample_modes.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
X1, X2, X3 = torch.randn(5, 3, 7), torch.randn(5, 3, 5, 4), torch.randn(3, 5, 3, 4, 2)
# name -> (forward overload packet, input, output_size, extra args); aa: one dim shrinks (the filter widens)
CASES = {"nearest_exact1d": (aten._upsample_nearest_exact1d, X1, [11], ()),
         "nearest_exact2d": (aten._upsample_nearest_exact2d, X2, [7, 9], ()),
         "nearest_exact3d": (aten._upsample_nearest_exact3d, X3, [5, 6, 3], ()),
         "bilinear2d_aa": (aten._upsample_bilinear2d_aa, X2, [3, 7], (False,)),
         "bicubic2d_aa": (aten._upsample_bicubic2d_aa, X2, [8, 2], (True,))}
LEAD = [((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,))]


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_backward(name):
    op, x, size, extra = CASES[name]
    check(op.default, x, size, *extra, expect=LEAD, absent=[((S(2),), (S(2),))])
    g = torch.randn(op.default(x, size, *extra).shape)
    bwd = getattr(aten, op.__name__ + "_backward").default
    check(bwd, g, size, list(x.shape), *extra, expect=LEAD)


def test_vec_overloads_with_scale_factors():
    check(aten._upsample_nearest_exact2d.vec, X2, None, [1.5, 2.25], expect=LEAD)
    check(aten._upsample_bicubic2d_aa.vec, X2, None, False, [0.6, 1.5], expect=LEAD)
