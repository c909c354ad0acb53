"""Pooling, upsampling and pixel (un)shuffle rules checked numerically on meshes (2,), (3,),
(2, 2) with uneven leading dims (5 images, 3 channels), forward and backward.

Run: python -m pytest tests/rules/test_pool.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard


def rnd(*shape):
    return torch.randn(shape)


X2, X3 = rnd(5, 3, 7, 6), rnd(3, 5, 4, 5, 3)
LEAD = [((S(0),), (S(0),)), ((S(1),), (S(1),))]

FORWARD = {
    "max2d": (aten.max_pool2d_with_indices.default, (X2, [3, 2], [2, 2], [1, 1], [1, 1], True), False),
    "max3d": (aten.max_pool3d_with_indices.default, (X3, [2, 2, 2], [2, 1, 2]), False),
    "adaptive_max2d": (aten.adaptive_max_pool2d.default, (X2, [2, 4]), False),
    "avg2d": (aten.avg_pool2d.default, (X2, [3, 3], [2, 2], [1, 1], False, False), True),
    "avg3d": (aten.avg_pool3d.default, (X3, [2, 2, 2], [2, 2, 2], [1, 0, 1], True, True, 3), True),
    "adaptive_avg2d": (aten._adaptive_avg_pool2d.default, (X2, [3, 4]), True),
    "adaptive_avg3d": (aten._adaptive_avg_pool3d.default, (X3, [2, 3, 2]), True),
    "nearest2d": (aten.upsample_nearest2d.default, (X2, [14, 9]), True),
    "bilinear2d": (aten.upsample_bilinear2d.default, (X2, [9, 13], True), True),
    "bicubic2d": (aten.upsample_bicubic2d.default, (X2, [9, 13], False), True),
    "linear1d": (aten.upsample_linear1d.default, (rnd(5, 3, 7), [15], False), True),
    "trilinear3d": (aten.upsample_trilinear3d.default, (X3, [5, 7, 4], False), True),
}


def _expect(args, linear):
    n_out = 2 if "max" in str(args) else 1
    out = [((S(d),), (S(d),) * n_out) for d in (0, 1)]
    return out + ([((P,), (P,))] if linear else [])


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_forward(name):
    op, args, linear = FORWARD[name]
    n_out = 2 if "max" in name else 1
    expect = [((S(d),), (S(d),) * n_out) for d in (0, 1)] + ([((P,), (P,))] if linear else [])
    spatial = [((S(2),), (S(2),) * n_out)]  # max pools shard rows too (see the spatial tests below)
    check(op, *args, expect=expect + (spatial if name in ("max2d", "max3d") else []),
          absent=[] if name in ("max2d", "max3d") else spatial)


def _backward_case(name):
    op, args, _ = FORWARD[name]
    out = op(*args)
    if "max" in name:
        y, idx = out
        g = rnd(*y.shape)
        if name == "adaptive_max2d":
            return aten.adaptive_max_pool2d_backward.default, (g, args[0], idx)
        bwd = aten.max_pool2d_with_indices_backward.default if name == "max2d" else \
            aten.max_pool3d_with_indices_backward.default
        k, s = args[1], args[2]
        pad = args[3] if len(args) > 3 else [0] * len(k)
        dil = args[4] if len(args) > 4 else [1] * len(k)
        ceil = args[5] if len(args) > 5 else False
        return bwd, (g, args[0], k, s, pad, dil, ceil, idx)
    g = rnd(*out.shape)
    if name.startswith("avg"):
        bwd = aten.avg_pool2d_backward.default if name == "avg2d" else aten.avg_pool3d_backward.default
        rest = list(args[1:]) + [None] * (7 - len(args))
        return bwd, (g, args[0], *rest[:6])
    if name.startswith("adaptive_avg"):
        bwd = aten._adaptive_avg_pool2d_backward.default if name.endswith("2d") else \
            aten._adaptive_avg_pool3d_backward.default
        return bwd, (g, args[0])
    bwd = getattr(aten, op.__name__.split(".")[0] + "_backward").default
    return bwd, (g, args[1], list(args[0].shape), *args[2:])


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_backward(name):
    op, args = _backward_case(name)
    n_in = 3 if "max" in name else (1 if name[0] in "nblt" else 2)
    expect = [((S(d),) * n_in, (S(d),)) for d in (0, 1)] + [((P,) + (R,) * (n_in - 1), (P,))]
    check(op, *args, expect=expect)


def test_pixel_shuffle():
    """12 = 3 x 2 x 2 channels: blocks of r*r = 4 on 2 and 3 ranks (uneven: 2 + 1 blocks)."""
    x = rnd(5, 12, 3, 2)
    check(aten.pixel_shuffle.default, x, 2, expect=[((S(0),), (S(0),)), ((S(1, unit=4),), (S(1),)), ((P,), (P,))])
    y = rnd(5, 3, 6, 4)
    check(aten.pixel_unshuffle.default, y, 2, expect=[((S(1),), (S(1, unit=4),)), ((P,), (P,))])


# -- spatial shards: halo exchanges (rules/pool_spatial.py) ----------------------------------------
X_TALL = rnd(3, 2, 9, 7)  # 9 rows on 2 and 3 ranks: 5 + 4, 3 + 3 + 3


def _spatial(n_out, d):
    return ((S(d),), (S(d),) * n_out)


def test_max_pool_spatial_global_indices():
    """Rows and columns sharded: windows across chunk boundaries, ceil_mode, -inf padding; the
    indices are positions in the global plane (compared with one device's, as integers)."""
    args = (X_TALL, [3, 2], [2, 2], [1, 1], [1, 1], True)
    check(aten.max_pool2d_with_indices.default, *args, expect=[_spatial(2, 2), _spatial(2, 3)])
    out, idx = aten.max_pool2d_with_indices.default(*args)
    check(aten.max_pool2d_with_indices_backward.default, rnd(*out.shape), X_TALL, *args[1:], idx,
          expect=[((S(2),) * 3, (S(2),)), ((S(3),) * 3, (S(3),))])


def test_max_pool3d_spatial():
    x = rnd(2, 2, 5, 6, 7)
    args = (x, [2, 2, 3], [2, 1, 2], [1, 0, 1], [1, 1, 1], False)
    check(aten.max_pool3d_with_indices.default, *args, expect=[_spatial(2, d) for d in (2, 3, 4)])
    out, idx = aten.max_pool3d_with_indices.default(*args)
    check(aten.max_pool3d_with_indices_backward.default, rnd(*out.shape), *args, idx,
          expect=[((S(d),) * 3, (S(d),)) for d in (2, 3, 4)])


def test_avg_pool_spatial_only_where_exact():
    """Zero padding counted in the divisor (or none on that dim), no ceil_mode: spatial shards;
    otherwise the explicit padding would change the divisor, so none."""
    args = (X_TALL, [3, 3], [2, 1], [1, 1], False, True, None)
    check(aten.avg_pool2d.default, *args, expect=[_spatial(1, 2), _spatial(1, 3)])
    y = aten.avg_pool2d.default(*args)
    check(aten.avg_pool2d_backward.default, rnd(*y.shape), *args, expect=[((S(2), S(2)), (S(2),))])
    excl = (X_TALL, [3, 3], [2, 1], [1, 0], False, False, None)  # pad excluded on rows, none on columns
    check(aten.avg_pool2d.default, *excl, expect=[_spatial(1, 3)], absent=[_spatial(1, 2)])
    check(aten.avg_pool2d.default, X_TALL, [2, 2], [2, 2], [0, 0], True, True, None, absent=[_spatial(1, 2)])
