"""Linear-algebra rules (rules/linalg.py) checked by the rule verifier on meshes (2,), (3,), (2, 2)
with uneven batches (5; 3 x 2, whose second dim leaves a rank of the 3-mesh empty): batch dims
shard alike on every input and output that holds them, an input broadcast along one stays
Replicate, the matrix dims never shard; solves take a Partial(sum) right-hand side. Complex
matrices too.

    python -m pytest tests/rules/test_linalg.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial("sum"), Shard


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _well(*shape, seed=0, dtype=torch.float32):
    return _r(*shape, seed=seed, dtype=dtype) + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def _spd(*shape, dtype=torch.float32):
    a = _r(*shape, dtype=dtype)
    return a @ a.mH + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def matrix_dims_whole(report):
    """No strategy tried, on any mesh, shards a matrix dim (the last two) of the first input."""
    ndim = len(report.call.ins[0].shape)
    for r in report.results:
        assert not any(isinstance(p, Shard) and p.dim >= ndim - 2 for p in r.strategy.ins[0]), r


A, B = _well(5, 4, 4), _r(5, 4, 3, seed=1)
A32 = _well(3, 2, 4, 4, seed=2)


def test_solve_ex_batch_broadcast_and_partial_rhs():
    # A [5,4,4], B [5,4,3] -> result, LU, pivots [5,4], info [5]
    check(aten._linalg_solve_ex.default, A, B,
          expect=[((S(0), S(0)), (S(0),) * 4), ((R, P), (P, R, R, R))], absent=[((S(1), S(1)), (S(1),) * 4)])
    # A broadcast over B's leading batch dim: A Replicate, its LU too
    check(aten._linalg_solve_ex.default, A[0], _r(3, 4, 2, seed=3), expect=[((R, S(0)), (S(0), R, R, R))])
    # A [3,2,4,4] with B [2,4,3]: dim 1 of B is dim 0 of B's batch
    check(aten._linalg_solve_ex.default, A32, _r(2, 4, 3, seed=4),
          expect=[((S(0), R), (S(0),) * 4), ((S(1), S(0)), (S(1),) * 4)])


def test_solve_ex_vector_right_hand_side():
    check(aten._linalg_solve_ex.default, A, _r(5, 4, seed=5), expect=[((S(0), S(0)), (S(0),) * 4)])


def test_solve_triangular_left_and_right():
    tri = torch.triu(A)
    matrix_dims_whole(check(aten.linalg_solve_triangular.default, tri, B, upper=True,
                            expect=[((S(0), S(0)), (S(0),)), ((R, P), (P,))]))
    check(aten.linalg_solve_triangular.default, tri[:3], _r(3, 2, 4, seed=6), upper=True, left=False,
          expect=[((S(0), S(0)), (S(0),))])


def test_triangular_and_cholesky_solves():
    chol = torch.linalg.cholesky(_spd(5, 4, 4))
    check(aten.cholesky_solve.default, B, chol, expect=[((S(0), S(0)), (S(0),)), ((P, R), (P,))])
    check(aten.cholesky_solve.default, _r(3, 5, 4, 2), chol[0], True, expect=[((S(1), R), (S(1),))])
    check(aten.triangular_solve.default, B, torch.triu(A), True,
          expect=[((S(0), S(0)), (S(0), S(0))), ((P, R), (P, R))])


def test_lu_factor_solve_and_unpack():
    lu, piv = torch.linalg.lu_factor(A)
    check(aten.linalg_lu_factor_ex.default, A32, expect=[((S(0),), (S(0),) * 3), ((S(1),), (S(1),) * 3)])
    check(aten.linalg_lu_solve.default, lu, piv, B, expect=[((S(0),) * 3, (S(0),)), ((R, R, P), (P,))])
    check(aten.linalg_lu_solve.default, lu, piv, _r(5, 3, 4), left=False, adjoint=True,
          expect=[((S(0),) * 3, (S(0),))])
    check(aten.lu_unpack.default, lu, piv, expect=[((S(0), S(0)), (S(0),) * 3)])
    check(aten.linalg_lu.default, A32, expect=[((S(1),), (S(1),) * 3)])


@pytest.mark.parametrize("op, outs", [(aten.linalg_inv_ex.default, 2), (aten._linalg_det.default, 3),
                                      (aten._linalg_slogdet.default, 4)])
def test_inverse_and_determinants(op, outs):
    """On a [3, 2] batch the chunk of dim 1 is strided: _linalg_det returns a wrong LU for a strided
    batch unless the rule hands it contiguous inputs."""
    matrix_dims_whole(check(op, A32, expect=[((S(0),), (S(0),) * outs), ((S(1),), (S(1),) * outs)]))


def test_decompositions():
    spd = _spd(5, 4, 4)
    check(aten.linalg_cholesky_ex.default, spd, upper=True, expect=[((S(0),), (S(0), S(0)))])
    check(aten.cholesky.default, spd, expect=[((S(0),), (S(0),))])
    check(aten.cholesky_inverse.default, torch.linalg.cholesky(spd), expect=[((S(0),), (S(0),))])
    check(aten._linalg_eigh.default, spd, "U", expect=[((S(0),), (S(0), S(0)))])
    matrix_dims_whole(check(aten._linalg_svd.default, _r(5, 4, 3), expect=[((S(0),), (S(0),) * 3)]))
    check(aten._linalg_svd.default, _r(3, 5, 4), False, False, expect=[((S(0),), (R, S(0), R))])  # no U, Vh
    check(aten.linalg_qr.default, _r(5, 4, 3), "complete", expect=[((S(0),), (S(0), S(0)))])
    check(aten.linalg_matrix_exp.default, _r(5, 3, 3) * 0.3, expect=[((S(0),), (S(0),))])


def test_complex_matrices():
    za = _well(5, 3, 3, dtype=torch.complex64)
    check(aten._linalg_solve_ex.default, za, _r(5, 3, 2, dtype=torch.complex64),
          expect=[((S(0), S(0)), (S(0),) * 4), ((R, P), (P, R, R, R))])
    check(aten.linalg_inv_ex.default, za, expect=[((S(0),), (S(0), S(0)))])
    check(aten._linalg_eigh.default, _spd(5, 3, 3, dtype=torch.complex64), expect=[((S(0),), (S(0), S(0)))])


def test_check_errors_has_no_output():
    check(aten._linalg_check_errors.default, torch.zeros(5, dtype=torch.int32), "linalg.inv", is_matrix=False,
          expect=[((S(0),), (None,)), ((R,), (None,))])
