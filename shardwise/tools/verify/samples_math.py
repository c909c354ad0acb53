"""Hand samples (uneven sizes) for the complex, FFT and linear-algebra rules (rules/complex.py,
fft.py, linalg.py): complex inputs, which OpInfo's float32 samples never make, and the aten
overloads that torch.fft / torch.linalg calls reach only below their public functions. Matrices
are well conditioned (a diagonal lift) or symmetric positive definite where the op needs it, so
batches differ only in values, not in which LAPACK path they take."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=_g(seed + sum(shape)), dtype=dtype)


def _z(*shape, seed=0):
    return _r(*shape, seed=seed, dtype=torch.complex64)


def _well(*shape, seed=0):
    """Square matrices [*b, n, n] away from singular."""
    return _r(*shape, seed=seed) + shape[-1] * torch.eye(shape[-1])


def _spd(*shape, seed=0):
    a = _r(*shape, seed=seed)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def complex_samples() -> dict:
    ang = _r(5, 3, 4)
    return {
        aten.view_as_complex.default: [(_r(5, 3, 4, 2),), (_r(3, 7, 2),)],
        aten.view_as_real.default: [(_z(5, 3, 4),), (_z(7, 3),)],
        aten._conj.default: [(_z(5, 7),), (_z(3, 5, 2),)],
        aten.resolve_conj.default: [(_z(5, 7).conj(),)],
        aten.resolve_neg.default: [(_z(5, 7),)],
        aten._neg_view.default: [(_z(3, 5),)],
        aten.complex.default: [(_r(5, 7), _r(5, 7, seed=1)), (_r(3, 5, 4), _r(4, seed=1))],
        aten.polar.default: [(ang.abs() + 0.1, ang), (_r(5, 1).abs() + 0.1, _r(5, 7))],
        # complex arithmetic: the pointwise family's rows, here with complex factors
        aten.mul.Tensor: [(_z(3, 5, 4), _z(5, 4, seed=1))],
    }


def fft_samples() -> dict:
    ortho, forward = 2, 1  # normalisation: 0 none, 1 by 1/n, 2 by 1/sqrt(n)
    return {
        aten._fft_r2c.default: [(_r(5, 3, 7), [2], ortho, True), (_r(3, 5, 4), [0, 2], forward, False)],
        aten._fft_c2r.default: [(_z(5, 3, 4), [2], ortho, 7), (_z(3, 5, 4), [0, 2], 0, 6)],
        aten._fft_c2c.default: [(_z(5, 3, 7), [1], ortho, True), (_z(3, 5, 4), [0, 2], forward, False)],
    }


def linalg_samples() -> dict:
    a, b = _well(5, 4, 4), _r(5, 4, 3, seed=1)
    a32 = _well(3, 2, 4, 4, seed=2)
    spd = _spd(5, 4, 4)
    tri = torch.triu(a)
    lu, piv = torch.linalg.lu_factor(a)
    chol = torch.linalg.cholesky(spd)
    return {
        aten.linalg_solve_triangular.default: [((tri, b), {"upper": True}),
                                               ((tri[0], _r(3, 5, 4, 2)), {"upper": True, "left": True})],
        aten._linalg_solve_ex.default: [(a, b), (a32, _r(2, 4, 3, seed=3)), (a, _r(5, 4, seed=4))],
        aten.linalg_lu_solve.default: [(lu, piv, b), ((lu, piv, _r(5, 3, 4, seed=5)), {"left": False})],
        aten.cholesky_solve.default: [(b, chol), (_r(3, 5, 4, 2, seed=6), chol[0], False)],
        aten.triangular_solve.default: [(b, tri, True), (_r(3, 5, 4, 2, seed=7), tri[1], True, True)],
        aten._linalg_svd.default: [(a,), (_r(3, 5, 4, seed=8), False, False)],
        aten.linalg_qr.default: [(a,), (_r(5, 4, 3, seed=9), "complete")],
        aten._linalg_eigh.default: [(spd,), (spd, "U", False)],
        aten.linalg_inv_ex.default: [(a,), (a32,)],
        aten.linalg_cholesky_ex.default: [(spd,), ((spd,), {"upper": True})],
        aten._linalg_det.default: [(a,), (a32,)],
        aten._linalg_slogdet.default: [(a,), (a32,)],
        aten.linalg_lu_factor_ex.default: [(a,), (a32,)],
        aten.linalg_lu.default: [(a,), (_r(3, 5, 4, seed=10),)],
        aten.lu_unpack.default: [(lu, piv), (lu, piv, True, False)],
        aten.cholesky.default: [(spd,)],
        aten.cholesky_inverse.default: [(chol,), (chol, False)],
        aten.linalg_matrix_exp.default: [(_r(5, 3, 3, seed=11) * 0.3,)],
        aten._linalg_check_errors.default: [((torch.zeros(5, dtype=torch.int32), "linalg.inv"), {"is_matrix": False})],
    }


def math_samples() -> dict:
    return {**complex_samples(), **fft_samples(), **linalg_samples()}
