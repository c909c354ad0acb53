"""glu, _prelu_kernel and _trilinear rules (rules/layers.py) with their backwards, on meshes (2,), (3,),
(2, 2), uneven: glu's split dim sharded as two groups, PReLU's weight sharded with the channels or
broadcast, bilinear's contraction as an einsum.

Run: python -m pytest tests/rules/test_layers.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
g = torch.Generator().manual_seed(2)


def r(*shape):
    return torch.randn(shape, generator=g)


def test_glu_shards_the_split_dim_in_halves():
    check(aten.glu.default, r(5, 6, 3), 1,
          expect=[((S(1, groups=2),), (S(1),)), ((S(0),), (S(0),)), ((S(2),), (S(2),))])
    check(aten.glu_backward.default, r(5, 3, 3), r(5, 6, 3), 1,
          expect=[((S(1), S(1, groups=2)), (S(1, groups=2),)), ((S(0), S(0)), (S(0),)), ((P, R), (P,))])


def test_prelu_weight_with_the_channels_or_broadcast():
    x, w = r(5, 3, 7), r(1, 3, 1)
    check(aten._prelu_kernel.default, x, w, expect=[((S(1), S(1)), (S(1),)), ((S(0), R), (S(0),))])
    check(aten._prelu_kernel.default, r(5, 7), torch.tensor([0.25]), expect=[((S(1), R), (S(1),))])
    check(aten._prelu_kernel_backward.default, r(5, 3, 7), x, w,
          expect=[((S(1), S(1), S(1)), (S(1), S(1))), ((S(2), S(2), R), (S(2), S(2))), ((P, R, R), (P, P))])


def test_trilinear_is_bilinears_einsum():
    x1, x2, w, grad = r(5, 3), r(5, 4), r(6, 3, 4), r(5, 6)
    # forward: out[n, o] = sum_ij x1[n, i] w[o, i, j] x2[n, j]
    check(aten._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [2, 3],
          expect=[((S(0), R, S(0)), (S(0),)), ((R, S(0), R), (S(1),)), ((S(1), S(1), R), (P,)),
                  ((R, P, R), (P,))])
    # the weight's gradient: sum over the batch
    check(aten._trilinear.default, x1, grad, x2, [1, 3], [2, 3], [1, 2], [0],
          expect=[((S(0), S(0), S(0)), (P,)), ((R, S(1), R), (S(0),))])


def test_trilinear_does_not_shard_a_broadcast_dim():
    x1 = r(1, 3)  # one row against a batch of 5
    check(aten._trilinear.default, x1, r(6, 3, 4), r(5, 4), [1, 3], [0], [1, 2], [2, 3],
          absent=[((S(0), R, S(0)), (S(0),))], expect=[((R, S(0), R), (S(1),))])
