"""multi_margin_loss / multilabel_margin_loss rules (rules/loss_margin.py): the batch shards, the class dim
stays whole; 'mean' over the GLOBAL batch; on meshes (2,), (3,), (2, 2), uneven.

Run: python -m pytest tests/rules/test_loss_margin.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
NONE, MEAN, SUM = 0, 1, 2
g = torch.Generator().manual_seed(1)
X, N = torch.randn(5, 7, generator=g), torch.randn(5, generator=g)
CLS, W = torch.tensor([0, 6, 3, 2, 6]), torch.rand(7, generator=g) + 0.5
LABELS = torch.tensor([[0, 3, -1, 1, 1, 1, 1], [6, -1, 0, 0, 0, 0, 0], [2, 2, 5, 1, 0, 4, 3],
                       [-1, 0, 0, 0, 0, 0, 0], [4, 1, -1, 2, 2, 2, 2]])


@pytest.mark.parametrize("red", [NONE, MEAN, SUM], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("p, weight", [(1, None), (2, W)])
def test_multi_margin(red, p, weight):
    w = (R,) if weight is not None else ()
    class_shard = ((S(1), R) + w, (P,))
    check(aten.multi_margin_loss.default, X, CLS, p, 0.7, weight, red,
          expect=[((S(0), S(0)) + w, (S(0) if red == NONE else P,))], absent=[class_shard])
    grad = N if red == NONE else torch.tensor(1.3)
    check(aten.multi_margin_loss_backward.default, grad, X, CLS, p, 0.7, weight, red,
          expect=[((S(0) if red == NONE else R, S(0), S(0)) + w, (S(0),)), ((P, R, R) + w, (P,))])


@pytest.mark.parametrize("red", [NONE, MEAN, SUM], ids=["none", "mean", "sum"])
def test_multilabel_margin(red):
    check(aten.multilabel_margin_loss_forward.default, X, LABELS, red,
          expect=[((S(0), S(0)), (S(0) if red == NONE else P, S(0)))])
    _, is_target = aten.multilabel_margin_loss_forward.default(X, LABELS, red)
    grad = N if red == NONE else torch.tensor(1.3)
    check(aten.multilabel_margin_loss_backward.default, grad, X, LABELS, red, is_target,
          expect=[((S(0) if red == NONE else R, S(0), S(0), S(0)), (S(0),)), ((P, R, R, R), (P,))])


def test_one_sample_leaves_ranks_empty():
    """A batch of 1 on 2 or 3 ranks: the empty ranks give zeros, not a kernel error."""
    check(aten.multi_margin_loss.default, X[:1], CLS[:1], 1, 1.0, None, MEAN, expect=[((S(0), S(0)), (P,))])
    check(aten.multilabel_margin_loss_forward.default, X[:1], LABELS[:1], NONE,
          expect=[((S(0), S(0)), (S(0), S(0)))])
