"""diagonal, diagonal_copy, diagonal_backward, diagonal_scatter, diag_embed (rules/diagonal.py): the diagonal
dims whole, every other dim sharded alike (renumbered: diagonal appends the diagonal as its last dim),
checked on meshes (2,), (3,), (2, 2) with uneven sizes.

    python -m pytest tests/rules/test_diagonal.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX = Replicate(), Partial(), Partial("max")


def test_diagonal_keeps_the_other_dims_sharded():
    # [5, 4, 7] diagonal of dims (1, 2) -> [5, 4]: dim 0 stays dim 0; the diagonal dims stay whole
    check(aten.diagonal.default, torch.randn(5, 4, 7), 1, 1, 2,
          expect=[((S(0),), (S(0),)), ((P,), (P,)), ((PMAX,), (PMAX,))],
          absent=[((S(1),), (S(0),)), ((S(2),), (S(1),)), ((S(1),), (S(1),))])
    # dims (2, 0) of [3, 5, 7]: kept dim 1 becomes output dim 0
    check(aten.diagonal_copy.default, torch.randn(3, 5, 7), -1, 2, 0, expect=[((S(1),), (S(0),))],
          absent=[((S(0),), (S(0),)), ((S(2),), (S(0),))])


def test_diagonal_backward_and_scatter_put_the_diagonal_back():
    d = aten.diagonal.default(torch.randn(5, 4, 7), 1, 1, 2)  # [5, 4]
    check(aten.diagonal_backward.default, torch.randn(d.shape), [5, 4, 7], 1, 1, 2,
          expect=[((S(0),), (S(0),)), ((P,), (P,))], absent=[((S(1),), (S(2),))])
    check(aten.diagonal_scatter.default, torch.randn(5, 4, 7), torch.randn(d.shape), 1, 1, 2,
          expect=[((S(0), S(0)), (S(0),)), ((P, P), (P,))])
    # a 4-d diagonal over dims (0, 3): kept dims 1, 2 are the gradient's dims 0, 1
    d4 = aten.diagonal.default(torch.randn(3, 5, 7, 4), 0, 0, 3)  # [5, 7, 3]
    check(aten.diagonal_backward.default, torch.randn(d4.shape), [3, 5, 7, 4], 0, 0, 3,
          expect=[((S(0),), (S(1),)), ((S(1),), (S(2),))], absent=[((S(2),), (S(0),))])


def test_diag_embed_and_diag():
    # [5, 3, 4] -> [4+1, 5, 4+1, 3] with dims (0, 2): input dims 0, 1 become output dims 1, 3
    check(aten.diag_embed.default, torch.randn(5, 3, 4), 1, 0, 2,
          expect=[((S(0),), (S(1),)), ((S(1),), (S(3),))], absent=[((S(2),), (S(0),)), ((S(2),), (S(2),))])
    # torch.diag of a vector / a matrix: no dim to shard, Replicate and Partial only
    check(aten.diag_embed.default, torch.randn(7), -1, expect=[((R,), (R,)), ((P,), (P,))])
