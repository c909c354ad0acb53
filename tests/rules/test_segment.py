"""segment_reduce and _segment_reduce_backward (rules/segment.py): the dims before ``axis`` shard with
the lengths/offsets, those after it with the lengths whole, ``axis`` stays whole; Partials where the
reduction commutes with them; the backward is linear in the gradient. Meshes (2,), (3,), (2, 2).

    python -m pytest tests/rules/test_segment.py -q -p no:cacheprovider
"""
import torch

import shardwise as sw
from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX = Replicate(), Partial(), Partial("max")
LENGTHS = torch.tensor([[2, 1, 3], [1, 4, 1], [6, 0, 0]])


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_segment_reduce_keeps_the_axis_whole():
    check(aten.segment_reduce.default, _r(6, 7), "sum", lengths=torch.tensor([2, 0, 3, 1]),
          expect=[((S(1), R), (S(1),)), ((P, R), (P,))], absent=[((S(0), R), (S(0),))])
    # axis 1 of [3, 6, 5]: rows of dim 0 carry their own lengths (a rank may hold none: 3 rows on (2, 2))
    check(aten.segment_reduce.default, _r(3, 6, 5), "max", lengths=LENGTHS, axis=1, initial=0.5,
          expect=[((S(0), S(0)), (S(0),)), ((S(2), R), (S(2),)), ((PMAX, R), (PMAX,))], absent=[((P, R), (P,))])
    check(aten.segment_reduce.default, _r(6, 7), "sum", lengths=torch.tensor([2, 1, 3]), initial=1.5,
          absent=[((P, R), (P,))])
    check(aten.segment_reduce.default, _r(6, 7), "prod", offsets=torch.tensor([0, 2, 2, 5, 6]),
          expect=[((S(1), R), (S(1),))], absent=[((P, R), (P,))])


def test_segment_reduce_backward_is_linear_in_the_gradient():
    data = _r(3, 6, 5)
    out = aten.segment_reduce.default(data, "max", lengths=LENGTHS, axis=1, initial=0.0)
    check(aten._segment_reduce_backward.default, _r(*out.shape, seed=1), out, data, "max", lengths=LENGTHS, axis=1,
          initial=0.0, expect=[((S(0), S(0), S(0), S(0)), (S(0),)), ((S(2), S(2), S(2), R), (S(2),)),
                               ((P, R, R, R), (P,))])


class _Segments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(_r(6, 5, seed=2))

    def forward(self):
        y = torch.segment_reduce(self.x, "mean", lengths=torch.tensor([2, 1, 3]), axis=0)
        return (y * torch.arange(15.0).view(3, 5)).sum()


def test_segment_reduce_trains_sharded_beside_the_axis():
    want_model = _Segments()
    want_loss = want_model()
    want_loss.backward()
    pm = sw.parallelize(_Segments(), sw.Mesh((2,)), (), param_placements={"x": [sw.Shard(1)]})
    torch.testing.assert_close(pm.step(), want_loss.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pm.gradients()["x"], want_model.x.grad, rtol=1e-4, atol=1e-5)
