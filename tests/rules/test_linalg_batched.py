"""The batched linalg rows added to rules/linalg.py: linalg_pinv (every overload), linalg_ldl_factor_ex,
linalg_ldl_solve, geqrf, ormqr, linalg_householder_product: batch dims shard, matrix dims whole,
solves (ldl_solve, ormqr's Q C) Partial in their right-hand side. Meshes (2,), (3,), (2, 2), uneven batches.

    python -m pytest tests/rules/test_linalg_batched.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _sym(*shape):
    a = _r(*shape, seed=1)
    return a + a.mT + 0.5 * torch.eye(shape[-1])


def test_pinv_shards_the_batch_with_its_tolerances():
    a = _r(5, 4, 3)
    check(aten.linalg_pinv.atol_rtol_tensor, a, atol=torch.tensor(0.1), rtol=_r(5, seed=2).abs() * 0.1,
          expect=[((S(0), R, S(0)), (S(0),))], absent=[((S(1), R, R), (S(1),))])
    check(aten.linalg_pinv.default, _sym(3, 4, 4), 1e-5, True, expect=[((S(0),), (S(0),))])
    # tolerances that widen the batch: [3, 5, 4] against [3, 1] gives [3, 3, 5, 4]; kept whole
    report = check(aten.linalg_pinv.rcond_tensor, _r(3, 5, 4), torch.full((3, 1), 1e-3))
    assert all(p == R for r in report.results for ps in r.strategy.ins for p in ps)


def test_ldl_factor_and_solve():
    sym = _sym(5, 4, 4)
    check(aten.linalg_ldl_factor_ex.default, sym, expect=[((S(0),), (S(0), S(0), S(0)))])
    ld, piv, _ = aten.linalg_ldl_factor_ex.default(sym)
    check(aten.linalg_ldl_solve.default, ld, piv, _r(5, 4, 2, seed=3),
          expect=[((S(0), S(0), S(0)), (S(0),)), ((R, R, P), (P,))], absent=[((R, R, S(2)), (S(2),))])


def test_geqrf_ormqr_householder_product():
    check(aten.geqrf.default, _r(3, 5, 2, 4), expect=[((S(0),), (S(0), S(0))), ((S(1),), (S(1), S(1)))])
    qa, tau = aten.geqrf.default(_r(5, 4, 3, seed=4))
    check(aten.ormqr.default, qa, tau, _r(5, 2, 4, seed=5), False, True,
          expect=[((S(0), S(0), S(0)), (S(0),)), ((R, R, P), (P,))])
    check(aten.linalg_householder_product.default, qa[..., :2], tau[..., :2], expect=[((S(0), S(0)), (S(0),))],
          absent=[((R, R), (P,))])
