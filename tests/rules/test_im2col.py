"""im2col / col2im (rules/im2col.py) checked numerically on meshes (2,), (3,), (2, 2): batch (5) and
channels (3, uneven) shard, the channels as whole blocks of kh*kw column rows, Partial passes
through, and col2im's blocks (dim L) shard into a Partial sum.

Run: python -m pytest tests/rules/test_im2col.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
# (input shape, kernel, dilation, padding, stride): batched, and unbatched with dilation
CASES = {"batched": ((5, 3, 7, 6), [2, 3], [1, 1], [1, 0], [2, 1]),
         "unbatched": ((3, 7, 6), [2, 2], [1, 2], [0, 1], [1, 1])}


@pytest.mark.parametrize("name", sorted(CASES))
def test_im2col(name):
    shape, kernel, *rest = CASES[name]
    c, k = len(shape) - 3, kernel[0] * kernel[1]
    expect = [((S(c),), (S(c, unit=k),)), ((P,), (P,))] + ([((S(0),), (S(0),))] if c else [])
    check(aten.im2col.default, torch.randn(shape), kernel, *rest, expect=expect,
          absent=[((S(c + 1),), (S(c + 1),))])


@pytest.mark.parametrize("name", sorted(CASES))
def test_col2im(name):
    shape, kernel, *rest = CASES[name]
    cols = aten.im2col.default(torch.randn(shape), kernel, *rest)
    c, k = len(shape) - 3, kernel[0] * kernel[1]
    expect = [((S(c, unit=k),), (S(c),)), ((P,), (P,)), ((S(c + 1),), (P,))] + ([((S(0),), (S(0),))] if c else [])
    check(aten.col2im.default, torch.randn(cols.shape), list(shape[-2:]), kernel, *rest, expect=expect)


def test_col2im_blocks_uneven_and_nested():
    """21 blocks: 11 + 10 on 2 ranks, 7 each on 3, nested on (2, 2) (6 + 5, 5 + 5): each rank's
    blocks placed at their offset."""
    cols = aten.im2col.default(torch.randn(2, 2, 5, 7), [3, 3], [1, 1], [1, 1], [2, 1])
    assert cols.shape[-1] == 21
    report = check(aten.col2im.default, torch.randn(cols.shape), [5, 7], [3, 3], [1, 1], [1, 1], [2, 1],
                   expect=[((S(2),), (P,))])
    assert any(r.mesh == (2, 2) and r.strategy.ins[0] == (S(2), S(2)) for r in report.results)
