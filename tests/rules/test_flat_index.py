"""take, put, masked_scatter, masked_scatter_backward, nonzero_static (rules/flat_index.py): flat
(row-major) positions. take shards with its index, or reads each rank's flat run of self (dim 0) into a
Partial(sum); put writes each rank's run; masked_scatter and nonzero_static keep the whole tensor (a
global prefix count places every element), only Partials pass. Meshes (2,), (3,), (2, 2), uneven sizes.

    python -m pytest tests/rules/test_flat_index.py -q -p no:cacheprovider
"""
import torch

import shardwise as sw
from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX, PMIN = Replicate(), Partial(), Partial("max"), Partial("min")


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_take_shards_with_the_index_or_reads_each_ranks_run():
    flat = torch.tensor([[4, 0, -2], [34, 17, 3]])
    check(aten.take.default, _r(5, 7), flat,
          expect=[((R, S(0)), (S(0),)), ((R, S(1)), (S(1),)), ((S(0), R), (P,)), ((PMAX, R), (PMAX,))],
          absent=[((S(1), R), (P,))])
    check(aten.take.default, _r(3, 5, 7), torch.tensor([104, 0, 50, 7, -8]), expect=[((S(0), R), (P,))])


def test_put_writes_each_ranks_run():
    flat = torch.tensor([[4, 0, -2], [34, 17, 3]])
    check(aten.put.default, _r(5, 7), flat, _r(2, 3, seed=1),
          expect=[((S(0), R, R), (S(0),)), ((P, R, P), (P,)), ((PMIN, R, PMIN), (PMIN,))],
          absent=[((P, S(0), S(0)), (P,))])
    # accumulating: repeated positions, and the (index, source) pairs split over the ranks into a Partial self
    check(aten.put.default, _r(5, 7), torch.tensor([[4, 0, -2], [34, 4, 3]]), _r(2, 3, seed=2), True,
          expect=[((S(0), R, R), (S(0),)), ((P, S(0), S(0)), (P,)), ((P, S(1), S(1)), (P,))],
          absent=[((PMAX, R, PMAX), (PMAX,))])


def test_masked_scatter_keeps_the_prefix_count_whole():
    mask = torch.arange(35).view(5, 7) % 3 != 1
    check(aten.masked_scatter.default, _r(5, 7), mask, _r(30, seed=3),
          expect=[((R, R, R), (R,)), ((P, R, P), (P,)), ((PMAX, R, PMAX), (PMAX,))],
          absent=[((S(0), S(0), R), (S(0),)), ((S(1), S(1), R), (S(1),))])
    check(aten.masked_scatter_backward.default, _r(3, 5, 7), mask, [3, 25],
          expect=[((P, R), (P,)), ((PMIN, R), (PMIN,))], absent=[((S(0), R), (S(0),))])


def test_nonzero_static_is_whole():
    report = check(aten.nonzero_static.default, torch.arange(35).view(5, 7) % 3 != 1, size=30)
    assert {r.strategy.outs[0] for r in report.results} == {(R,) * len(r.mesh) for r in report.results}


class _Take(torch.nn.Module):
    """take forward; put(accumulate) into zeros in its backward."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(_r(7, 5, seed=4))

    def forward(self):
        idx = torch.tensor([[0, 34, -1, 12], [12, 3, 33, 7], [20, 21, 0, 6]])
        return (torch.take(self.x, idx) * torch.arange(12.0).view(3, 4)).sum()


def test_take_trains_with_self_sharded():
    want_model = _Take()
    want_loss = want_model()
    want_loss.backward()
    pm = sw.parallelize(_Take(), sw.Mesh((3,)), (), param_placements={"x": [sw.Shard(0)]})
    torch.testing.assert_close(pm.step(), want_loss.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pm.gradients()["x"], want_model.x.grad, rtol=1e-4, atol=1e-5)
