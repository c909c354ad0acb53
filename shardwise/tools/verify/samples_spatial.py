"""Hand samples (uneven sizes: 5 images, 3 channels) for the spatial ops OpInfo reaches only by other
overloads or not at all: max unpooling with the indices of an overlapping max pool (repeated
positions), im2col / col2im, upsampling by nearest-exact and anti-aliased modes (forward, .vec and
backward) (rules/unpool.py, im2col.py, pool.py)."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _unpool() -> dict:
    y2, i2 = aten.max_pool2d_with_indices.default(_r(5, 3, 7, 6), [3, 2], [2, 2])  # rows overlap: indices repeat
    y3, i3 = aten.max_pool3d_with_indices.default(_r(3, 5, 4, 5, 3), [2, 2, 2], [2, 1, 2])
    return {aten.max_unpool2d.default: [(y2, i2, [7, 6]), (y2[0], i2[0], [7, 6])],
            aten.max_unpool3d.default: [(y3, i3, [4, 5, 3], [2, 1, 2], [0, 0, 0])]}


def _im2col() -> dict:
    # (kernel, dilation, padding, stride)
    windows = (([2, 3], [1, 1], [1, 0], [2, 1]), ([2, 2], [1, 2], [0, 1], [1, 1]))
    cols = aten.im2col.default(_r(5, 3, 7, 6), *windows[0])  # [5, 18, 12]
    cols3 = aten.im2col.default(_r(3, 7, 6), *windows[1])  # [12, 24]
    return {aten.im2col.default: [(_r(5, 3, 7, 6), *windows[0]), (_r(3, 7, 6), *windows[1])],
            aten.col2im.default: [(_r(*cols.shape), [7, 6], *windows[0]), (_r(*cols3.shape), [7, 6], *windows[1])]}


def _upsample() -> dict:
    x1, x2, x3 = _r(5, 3, 7), _r(5, 3, 5, 4), _r(3, 5, 3, 4, 2)
    out = {
        aten._upsample_nearest_exact1d.default: [(x1, [11]), (x1, [4], 0.6)],
        aten._upsample_nearest_exact2d.default: [(x2, [7, 9])],
        aten._upsample_nearest_exact3d.default: [(x3, [5, 6, 3])],
        aten._upsample_nearest_exact1d.vec: [(x1, None, [1.5])],
        aten._upsample_nearest_exact2d.vec: [(x2, [7, 9], None)],
        aten._upsample_nearest_exact3d.vec: [(x3, None, [2.0, 1.5, 2.0])],
        aten._upsample_bilinear2d_aa.default: [(x2, [3, 7], False), (x2, [8, 2], True)],  # down on a dim: aa
        aten._upsample_bilinear2d_aa.vec: [(x2, [3, 7], False, None)],
        aten._upsample_bicubic2d_aa.default: [(x2, [3, 7], False), (x2, [8, 2], True)],
        aten._upsample_bicubic2d_aa.vec: [(x2, None, True, [0.6, 1.5])],
    }
    for fwd, extra in ((aten._upsample_nearest_exact1d, ()), (aten._upsample_nearest_exact2d, ()),
                       (aten._upsample_nearest_exact3d, ()), (aten._upsample_bilinear2d_aa, (False,)),
                       (aten._upsample_bicubic2d_aa, (True,))):
        x, size, *_ = out[fwd.default][0]
        y = fwd.default(x, size, *extra)
        bwd = getattr(aten, fwd.__name__ + "_backward").default
        out[bwd] = [(_r(*y.shape), size, list(x.shape), *extra)]
    return out


def spatial_samples() -> dict:
    return {**_unpool(), **_im2col(), **_upsample()}
