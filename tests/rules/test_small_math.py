"""trace, count_nonzero, hash_tensor, vdot, linalg_cross, dist, renorm, linspace / logspace with tensor endpoints
(rules/small_math.py): every strategy verified on meshes (2,), (3,), (2, 2) with uneven sizes; Partial forms
only where the parts combine exactly.

    python -m pytest tests/rules/test_small_math.py -q -p no:cacheprovider
"""
import math

import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX, PMIN = Replicate(), Partial(), Partial("max"), Partial("min")


def _r(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("shape", [(5, 7), (7, 5), (5, 5)])
def test_trace_of_a_block_is_a_partial_sum(shape):
    check(aten.trace.default, _r(*shape), expect=[((S(0),), (P,)), ((S(1),), (P,)), ((P,), (P,))],
          absent=[((PMAX,), (PMAX,))])


def test_count_nonzero_sums_counts():
    x = _r(5, 7) * (_r(5, 7) > 0)
    check(aten.count_nonzero.default, x, expect=[((S(0),), (P,)), ((S(1),), (P,))], absent=[((P,), (P,))])
    check(aten.count_nonzero.default, x, 1, expect=[((S(0),), (S(0),)), ((S(1),), (P,))])
    check(aten.count_nonzero.dim_IntList, _r(3, 5, 7) * (_r(3, 5, 7) > 0), [0, 2],
          expect=[((S(0),), (P,)), ((S(1),), (S(0),)), ((S(2),), (P,))])


def test_hash_tensor_keeps_reduced_dims_whole():
    check(aten.hash_tensor.default, _r(5, 7), [1], expect=[((S(0),), (S(0),))], absent=[((S(1),), (P,))])
    check(aten.hash_tensor.default, _r(5, 7), [0], keepdim=True, expect=[((S(1),), (S(1),))])
    check(aten.hash_tensor.default, _r(5, 7), expect=[((R,), (R,))], absent=[((S(0),), (P,))])


def test_vdot_contracts():
    check(aten.vdot.default, _r(7), _r(7), expect=[((S(0), S(0)), (P,)), ((P, R), (P,)), ((R, P), (P,))])


def test_cross_keeps_the_vector_dim_whole():
    check(aten.linalg_cross.default, _r(5, 3), _r(5, 3), expect=[((S(0), S(0)), (S(0),)), ((P, R), (P,))],
          absent=[((S(1), S(1)), (S(1),))])
    check(aten.linalg_cross.default, _r(3, 7), _r(3, 1), dim=0, expect=[((S(1), R), (S(1),))],
          absent=[((S(0), S(0)), (S(0),))])
    check(aten.linalg_cross.default, _r(5, 1, 3), _r(1, 4, 3), expect=[((S(0), R), (S(0),)), ((R, S(1)), (S(1),))])


@pytest.mark.parametrize("p,partial", [(1, P), (0, P), (math.inf, PMAX), (-math.inf, PMIN)])
def test_dist_partials_where_exact(p, partial):
    check(aten.dist.default, _r(5, 7), _r(7), p, expect=[((S(0), R), (partial,)), ((S(1), S(0)), (partial,))])
    check(aten.dist.default, _r(1, 3), _r(1, 3), p, expect=[((S(0), S(0)), (partial,))])  # an empty block


@pytest.mark.parametrize("p", [2, 3.5])
def test_dist_other_p_is_replicated(p):
    report = check(aten.dist.default, _r(5, 7), _r(5, 7), p, expect=[((R, R), (R,))])
    assert {r.strategy for r in report.results if r.mesh == (2,)} == {r.strategy for r in report.results[:1]}


def test_renorm_shards_its_dim():
    check(aten.renorm.default, _r(5, 7), 2, 0, 1.0, expect=[((S(0),), (S(0),))], absent=[((S(1),), (S(1),))])
    check(aten.renorm.default, _r(3, 5, 7), 1, -1, 0.5, expect=[((S(2),), (S(2),))], absent=[((S(0),), (S(0),))])


@pytest.mark.parametrize("op,args", [
    (aten.linspace.Tensor_Tensor, (torch.tensor(-1.5), torch.tensor(3.25), 7)),
    (aten.linspace.Tensor_Scalar, (torch.tensor(0.3), 2.0, 5)),
    (aten.linspace.Scalar_Tensor, (1, torch.tensor(-4.0), 9)),
    (aten.logspace.Tensor_Tensor, (torch.tensor(-1.0), torch.tensor(2.0), 7, 2.0)),
    (aten.logspace.Tensor_Scalar, (torch.tensor(0.5), 1.5, 5)),
    (aten.logspace.Scalar_Tensor, (0, torch.tensor(1.0), 3)),
])
def test_ranges_with_tensor_endpoints(op, args):
    n = len([a for a in args if isinstance(a, torch.Tensor)])
    check(op, *args, expect=[((R,) * n, (S(0),)), ((R,) * n, (P,)), ((R,) * n, (PMAX,))])
