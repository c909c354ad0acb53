"""Max unpooling (rules/unpool.py) checked numerically on meshes (2,), (3,), (2, 2): leading dims
(5 images, 3 channels: uneven) shard with the indices, the unpooled dims stay whole, no Partial.

Run: python -m pytest tests/rules/test_unpool.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard


def _pooled(x, kernel, stride):
    pool = aten.max_pool2d_with_indices.default if x.ndim <= 4 else aten.max_pool3d_with_indices.default
    return pool(x, kernel, stride)


def test_max_unpool2d_overlapping_windows():
    """Rows pooled by 3 with stride 2: windows overlap, so indices repeat; batch and channel shards."""
    y, idx = _pooled(torch.randn(5, 3, 7, 6), [3, 2], [2, 2])
    lead = [((S(d), S(d)), (S(d),)) for d in (0, 1)]
    check(aten.max_unpool2d.default, y, idx, [7, 6], expect=lead,
          absent=[((S(2), S(2)), (S(2),)), ((S(3), S(3)), (S(3),)), ((P, R), (P,))])


def test_max_unpool2d_unbatched():
    """(C, H, W), as F.max_unpool1d makes it (a trailing unit dim): channels shard."""
    y, idx = _pooled(torch.randn(5, 9, 1), [2, 1], [2, 1])
    check(aten.max_unpool2d.default, y, idx, [9, 1], expect=[((S(0), S(0)), (S(0),))],
          absent=[((S(1), S(1)), (S(1),))])


def test_max_unpool3d():
    y, idx = _pooled(torch.randn(3, 5, 4, 5, 3), [2, 2, 2], [2, 1, 2])
    check(aten.max_unpool3d.default, y, idx, [4, 5, 3], [2, 1, 2], [0, 0, 0],
          expect=[((S(d), S(d)), (S(d),)) for d in (0, 1)], absent=[((S(2), S(2)), (S(2),))])
