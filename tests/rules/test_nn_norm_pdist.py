"""The functional training batch norm (_batch_norm_with_update_functional, batch_norm_backward: rules/
norm_batch.py) and pdist (_pdist_forward/_pdist_backward: rules/distance.py) on meshes (2,), (3,), (2, 2),
uneven.

Run: python -m pytest tests/rules/test_nn_norm_pdist.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
g = torch.Generator().manual_seed(4)


def r(*shape):
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("shape", [(5, 3, 7), (5, 3)])
def test_batch_norm_with_update(shape):
    x, w, b, rm, rv = r(*shape), r(3), r(3), r(3), r(3).abs() + 0.5
    fwd = aten._batch_norm_with_update_functional.default
    stats = (S(0), S(0))
    check(fwd, x, w, b, rm, rv, 0.1, 1e-5,
          expect=[((S(1),) + (S(0),) * 4, (S(1), S(0), S(0), R, S(0), S(0))),  # channels
                  ((S(0),) + (R,) * 4, (S(0), R, R, R, R, R))])  # the batch: statistics all-reduced
    out = fwd(x, w, b, rm, rv, 0.1, 1e-5)
    check(aten.batch_norm_backward.default, r(*shape), x, w, rm, rv, out[1], out[2], True, 1e-5,
          [True, True, True], out[3],
          expect=[((S(1), S(1)) + (S(0),) * 5 + (R,), (S(1),) + stats),
                  ((S(0), S(0)) + (R,) * 6, (S(0), R, R)), ((P,) + (R,) * 7, (P, P, P))])


@pytest.mark.parametrize("p, combine", [(0.0, P), (1.0, P), (float("inf"), Partial("max")), (2.0, None), (3.0, None)])
def test_pdist_features_only_where_the_norm_combines(p, combine):
    x = r(5, 7)
    features = ((S(1),), (combine,))
    check(aten._pdist_forward.default, x, p, expect=[features] if combine else [],
          absent=[] if combine else [((S(1),), (P,))])
    check(aten._pdist_backward.default, r(10), x, p, aten._pdist_forward.default(x, p),
          expect=[((R, S(1), R), (S(1),)), ((P, R, R), (P,))])
