"""Hand samples (uneven sizes) for pointwise rules (rules/pointwise.py) that torch's OpInfo does not
reach by these overloads: a Python number in one operand (``.Scalar``, ``_scalar`` overloads),
Python's operator overloads (``__lshift__``, ...), the torch.special functions whose OpInfo names
differ from the aten names, and ``to.dtype`` (composite: OpInfo's calls go through ``_to_copy``).
Values stay inside each function's domain (positive where a Bessel K/Y or zeta needs it), so the
single-device results are finite."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _ints(*shape, high=9, seed=0):
    return torch.randint(-high, high, shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _polynomials(x57, n57, n7) -> dict:
    """p_n(x) for every orthogonal polynomial: tensors for both, n a number, x a number."""
    kinds = [f"{name}_polynomial_{k}" for name, ks in (("chebyshev", "tuvw"), ("shifted_chebyshev", "tuvw"),
                                                       ("hermite", ("h", "he")), ("laguerre", "l"),
                                                       ("legendre", "p")) for k in ks]
    out = {}
    for kind in kinds:
        packet = getattr(aten, f"special_{kind}")
        out[packet.default] = [(x57, n57), (_r(3, 5, 7).tanh(), n7)]
        out[packet.n_scalar] = [(x57, 3)]
        out[packet.x_scalar] = [(0.5, n57)]
    return out


def _special() -> dict:
    x57, pos57 = _r(5, 7), _r(5, 7).abs() + 0.2
    unary = ("airy_ai", "bessel_j0", "bessel_j1", "modified_bessel_i0", "modified_bessel_i1",
             "spherical_bessel_j0")
    positive = ("bessel_y0", "bessel_y1", "modified_bessel_k0", "modified_bessel_k1",
                "scaled_modified_bessel_k0", "scaled_modified_bessel_k1")  # undefined at x <= 0
    return {
        **{getattr(aten, f"special_{n}").default: [(x57,), (_r(3, 5, 7),)] for n in unary},
        **{getattr(aten, f"special_{n}").default: [(pos57,), (_r(7).abs() + 0.5,)] for n in positive},
        aten.special_zeta.other_scalar: [(pos57 + 1, 2.5)],  # zeta(x, q): x > 1, q > 0
        aten.special_zeta.self_scalar: [(2.5, pos57)],
    }


def pointwise_samples() -> dict:
    x57, x357, pos57 = _r(5, 7), _r(3, 5, 7), _r(5, 7).abs() + 0.1
    i57, shifts = _ints(5, 7), _ints(5, 7, high=5).abs()
    b57 = x57 > 0
    n57 = _ints(5, 7, high=5).abs().float()
    return {
        **_polynomials(x57.tanh(), n57, n57[0]), **_special(),
        aten.to.dtype: [(x57, torch.float64), (i57, torch.float32), (x357, torch.int32)],
        aten.true_divide.Scalar: [(x57, 3.0)],
        # xlogy(self, c): linear in self for c > 0 only (c == 0: log(c) = -inf); xlog1py: c > -1
        aten.xlogy.Scalar_Other: [(x57, 2.5), (x357, 0.0)],
        aten.xlogy.Scalar_Self: [(2.0, pos57)],
        aten.special_xlog1py.other_scalar: [(x57, 0.5), (x357, -1.0)],
        aten.special_xlog1py.self_scalar: [(2.0, pos57)],
        aten.copysign.Scalar: [(x57, -1.0)],
        aten.float_power.Tensor_Scalar: [(pos57, 2.5)],
        aten.float_power.Scalar: [(2.0, x57)],
        aten.clip.default: [(x57, -0.5, 0.5)],
        aten.floor_divide.Scalar: [(x57, 0.7)],
        aten.remainder.Scalar_Tensor: [(2.5, pos57)],
        aten.bitwise_left_shift.Tensor_Scalar: [(i57, 2)], aten.bitwise_left_shift.Scalar_Tensor: [(3, shifts)],
        aten.bitwise_right_shift.Tensor_Scalar: [(i57, 1)], aten.bitwise_right_shift.Scalar_Tensor: [(64, shifts)],
        aten.__lshift__.Scalar: [(i57, 2)], aten.__lshift__.Tensor: [(i57, shifts)],
        aten.__rshift__.Scalar: [(i57, 1)], aten.__rshift__.Tensor: [(i57, shifts)],
        aten.__xor__.Scalar: [(i57, 5)], aten.__xor__.Tensor: [(b57, x57 < 0.5), (i57, _ints(7))],
        **{getattr(aten, f"bitwise_{k}").Scalar_Tensor: [(6, i57)] for k in ("and", "or", "xor")},
    }
