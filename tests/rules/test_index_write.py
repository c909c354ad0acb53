"""index_fill, index_copy, _unsafe_masked_index, _unsafe_masked_index_put_accumulate (rules/indexing.py):
the dims not indexed shard; the indexed dim too, each rank writing (or reading) the positions in its range;
Partials where the write is linear or commutes with max/min. Checked on meshes (2,), (3,), (2, 2) with
uneven sizes and negative indices, and one training step under parallelize against one device.

    python -m pytest tests/rules/test_index_write.py -q -p no:cacheprovider
"""
import torch

import shardwise as sw
from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX = Replicate(), Partial(), Partial("max")


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_index_fill_shards_every_dim_and_its_partials_follow_the_value():
    x, idx = _r(5, 7), torch.tensor([4, 0, -2])
    # dim 0 sharded too (each rank fills the rows in its range); a nonzero Scalar fill is no Partial(sum)
    check(aten.index_fill.int_Scalar, x, 0, idx, 2.5, expect=[((S(0), R), (S(0),)), ((S(1), R), (S(1),)),
                                                             ((PMAX, R), (PMAX,))], absent=[((P, R), (P,))])
    check(aten.index_fill.int_Scalar, x, 1, idx, 0.0, expect=[((P, R), (P,))])
    # a Tensor value is filled linearly with self: Partial(sum) on both
    check(aten.index_fill.int_Tensor, _r(3, 5, 7), 2, idx, torch.tensor(-1.5),
          expect=[((S(2), R, R), (S(2),)), ((S(0), R, R), (S(0),)), ((P, R, P), (P,))])


def test_index_copy_writes_the_rows_in_each_ranks_range():
    check(aten.index_copy.default, _r(5, 7), 0, torch.tensor([4, 0, 2]), _r(3, 7, seed=1),
          expect=[((S(0), R, R), (S(0),)), ((S(1), R, S(1)), (S(1),)), ((P, R, P), (P,))])
    check(aten.index_copy.default, _r(3, 5, 7), 2, torch.tensor([6, 0, 3, 1]), _r(3, 5, 4, seed=2),
          expect=[((S(2), R, R), (S(2),)), ((S(0), R, S(0)), (S(0),))], absent=[((S(2), R, S(2)), (S(2),))])


def test_masked_index_follows_index_with_the_mask_on_the_output():
    x, col = _r(5, 7), torch.tensor([True, False, True]).view(3, 1)
    # out [3, 7]: self's dim 1 kept (the mask broadcasts there), the index's dim with the mask's dim 0;
    # self sharded on the indexed dim gives a Partial(sum) only for a fill of 0
    check(aten._unsafe_masked_index.default, x, col, [torch.tensor([4, 0, -2])], 0.0,
          expect=[((S(1), R, R), (S(1),)), ((R, S(0), S(0)), (S(0),)), ((S(0), R, R), (P,)), ((P, R, R), (P,))])
    check(aten._unsafe_masked_index.default, x, col, [torch.tensor([4, 0, 9])], 1.5,
          expect=[((PMAX, R, R), (PMAX,))], absent=[((S(0), R, R), (P,)), ((P, R, R), (P,))])


def test_masked_index_of_an_empty_chunk_keeps_its_shape():
    # [3, 5, 7] sharded on dim 0 over (2, 2): a rank holds no rows, and the CPU kernel's result for an
    # empty self has the wrong shape ([0, 3, 0]); the local call composes the op there instead
    check(aten._unsafe_masked_index.default, _r(3, 5, 7), torch.tensor([True, False, True]).view(3, 1),
          [None, torch.tensor([4, 0, 9])], 1.5, expect=[((S(0), R, R), (S(0),))])


def test_masked_index_put_accumulates_in_each_ranks_rows():
    mask = _r(3, 3, 2, seed=3) > 0
    check(aten._unsafe_masked_index_put_accumulate.default, _r(3, 5, 7), mask,
          [None, torch.tensor([[4], [0], [4]]), torch.tensor([1, -1])], _r(3, 3, 2, seed=4),
          expect=[((S(0), S(0), R, R, S(0)), (S(0),)), ((S(1), R, R, R, R), (S(1),)), ((S(2), R, R, R, R), (S(2),)),
                  ((P, S(1), S(0), R, S(1)), (P,)), ((P, R, R, R, P), (P,))])


class _Copy(torch.nn.Module):
    """index_copy forward, index_fill and index_select in its backward."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(_r(7, 6, seed=5))
        self.src = torch.nn.Parameter(_r(3, 6, seed=6))

    def forward(self):
        y = self.x.index_copy(0, torch.tensor([5, 0, 3]), self.src)
        return (y.index_fill(1, torch.tensor([-1, 2]), 0.5) * torch.arange(42.0).view(7, 6)).sum()


def test_index_copy_trains_sharded_on_the_indexed_dim():
    want_model = _Copy()
    want_loss = want_model()
    want_loss.backward()
    pm = sw.parallelize(_Copy(), sw.Mesh((3,)), (), param_placements={"x": [sw.Shard(0)], "src": [sw.Shard(1)]})
    torch.testing.assert_close(pm.step(), want_loss.detach(), rtol=1e-4, atol=1e-4)
    got = pm.gradients()
    for n, p in want_model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5)
