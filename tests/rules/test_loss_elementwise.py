"""huber / smooth_l1 / soft_margin / binary_cross_entropy rules (rules/loss_elementwise.py), forward and
backward, on meshes (2,), (3,), (2, 2) with uneven shards: 'mean' must be a partial sum over the GLOBAL count.

Run: python -m pytest tests/rules/test_loss_elementwise.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
NONE, MEAN, SUM = 0, 1, 2
g = torch.Generator().manual_seed(0)
X, T, G = (torch.randn(5, 7, generator=g) for _ in range(3))
PROB, TGT, W = torch.sigmoid(X) * 0.9 + 0.05, torch.rand(5, 7, generator=g), torch.rand(5, 7, generator=g) + 0.5
ONE = torch.tensor(1.3)

CASES = {  # name: (forward op, its tensors and extra args, backward op)
    "huber": (aten.huber_loss.default, (X, T), (0.7,), aten.huber_loss_backward.default),
    "smooth_l1": (aten.smooth_l1_loss.default, (X, T), (0.5,), aten.smooth_l1_loss_backward.default),
    "soft_margin": (aten.soft_margin_loss.default, (X, T.sign()), (), aten.soft_margin_loss_backward.default),
}


@pytest.mark.parametrize("red", [NONE, MEAN, SUM], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("name", list(CASES))
def test_elementwise_loss(name, red):
    fwd, tensors, extra, bwd = CASES[name]
    summed = (P,) if red != NONE else (S(1),)
    check(fwd, *tensors, red, *extra, expect=[((S(0), S(0)), summed if red != NONE else (S(0),)),
                                              ((S(1), S(1)), summed)])
    grad = G if red == NONE else ONE
    check(bwd, grad, *tensors, red, *extra,
          expect=[((S(0) if red == NONE else R, S(0), S(0)), (S(0),)), ((P, R, R), (P,))])


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("red", [NONE, MEAN, SUM], ids=["none", "mean", "sum"])
def test_binary_cross_entropy(red, weight):
    w = (W,) if weight else ()
    linear_w = [((R, R, P), (P,))] if weight else []
    check(aten.binary_cross_entropy.default, PROB, TGT, W if weight else None, red,
          expect=[((S(1),) * (2 + len(w)), (S(1) if red == NONE else P,))] + linear_w)
    grad = G if red == NONE else ONE
    check(aten.binary_cross_entropy_backward.default, grad, PROB, TGT, W if weight else None, red,
          expect=[((S(0) if red == NONE else R,) + (S(0),) * (2 + len(w)), (S(0),)), ((P, R, R) + (R,) * len(w), (P,))]
          + ([((R, R, R, P), (P,))] if weight else []))


def test_mean_is_not_an_average_of_local_means():
    """5 rows on 2 ranks split 3 + 2: averaging the two local means gives another number than one
    device's mean, and the row-sharded strategy still matches one device (the global count)."""
    huber = aten.huber_loss.default
    local_means = (huber(X[:3], T[:3], MEAN, 0.7) + huber(X[3:], T[3:], MEAN, 0.7)) / 2
    assert not torch.allclose(local_means, huber(X, T, MEAN, 0.7), rtol=1e-4)
    report = check(huber, X, T, MEAN, 0.7, meshes=((2,),), expect=[((S(0), S(0)), (P,))])
    assert all(r.ok for r in report.results if r.strategy.ins[0] == (S(0),))
