"""Pointwise ops: rules as lists. Each entry: op overload -> how it treats Partial(sum) inputs."""
from __future__ import annotations

import math

import torch

from .common import pointwise_strategies
from .registry import Rule, TensorMeta

aten = torch.ops.aten

# Linear in all tensor inputs together: f(sum of parts) = sum of f(parts).
LINEAR_ALL = [
    aten.neg.default, aten.clone.default,
    aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default,
    aten.mul.Scalar, aten.div.Scalar, aten.conj_physical.default, aten._conj_physical.default,
    aten.true_divide.Scalar, aten.deg2rad.default, aten.rad2deg.default,  # x times a constant
]
# Linear in each input separately (exactly one Partial, others Replicate).
LINEAR_ONE = [aten.mul.Tensor]
# Linear in the first input only (gradients of activations, division by a replicated divisor).
LINEAR_FIRST = [
    aten.div.Tensor, aten.threshold_backward.default, aten.gelu_backward.default, aten.silu_backward.default,
    aten.tanh_backward.default, aten.sigmoid_backward.default, aten.mish_backward.default,
    aten.true_divide.Tensor, aten.ldexp.Tensor,  # self / other, self * 2**other
    # grad_output times a function of the saved input (0 where the forward is flat): linear in grad_output
    aten.hardswish_backward.default, aten.hardsigmoid_backward.default, aten.softshrink_backward.default,
    aten.hardshrink_backward.default, aten.logit_backward.default,
    # (grad_output, self, buffer): on CPU the buffer is exp(-|self|), shaped as self (sharded with it);
    # a CUDA forward leaves it empty and unread (shape [0]: every rank's chunk is empty too)
    aten.log_sigmoid_backward.default,
]
NONLINEAR = [
    aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor, aten.div.Tensor_mode,
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.log.default, aten.log1p.default, aten.expm1.default, aten.rsqrt.default,
    aten.sqrt.default, aten.erf.default, aten.abs.default, aten.reciprocal.default, aten.sin.default,
    aten.cos.default, aten.sign.default, aten.floor.default, aten.ceil.default, aten.round.default,
    aten.trunc.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.maximum.default, aten.minimum.default, aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default,
    aten.clamp_max.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
    aten.lt.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.ge.Tensor,
    aten.ge.Scalar, aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.isnan.default,
    aten.isinf.default, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.fill.Scalar, aten.fill.Tensor, aten.lerp.Scalar,
    aten.lerp.Tensor, aten.addcmul.default, aten.addcdiv.default, aten.hardtanh.default,
    aten.hardtanh_backward.default, aten.leaky_relu.default, aten.leaky_relu_backward.default,
    aten.elu.default, aten.elu_backward.default, aten.softplus.default, aten.softplus_backward.default,
    aten.mish.default, aten.sgn.default, aten.square.default, aten.atan2.default, aten.fmod.Scalar,
    aten.remainder.Scalar, aten.copy.default, aten.nan_to_num.default,
    aten.empty_like.default, aten.ones_like.default, aten.full_like.default,
    # trigonometric, logarithms in other bases, bitwise/logical xor, fmod and remainder of tensors,
    # ``div`` with a rounding mode by a number
    aten.acos.default, aten.acosh.default, aten.asin.default, aten.asinh.default, aten.atan.default,
    aten.atanh.default, aten.cosh.default, aten.sinh.default, aten.tan.default, aten.log10.default,
    aten.log2.default, aten.logical_xor.default, aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar,
    aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.fmod.Tensor, aten.remainder.Tensor,
    aten.div.Scalar_mode,
    # activations; log_sigmoid_forward returns (out, buffer), both shaped as self on CPU
    aten.hardswish.default, aten.hardsigmoid.default, aten.relu6.default, aten.selu.default, aten.celu.default,
    aten.threshold.default, aten.softshrink.default, aten.hardshrink.default, aten.logit.default,
    aten.log_sigmoid_forward.default,
    # exponentials, logarithms, rounding, special functions
    aten.exp2.default, aten.logaddexp.default, aten.logaddexp2.default, aten.erfc.default, aten.erfinv.default,
    aten.i0.default, aten.sinc.default, aten.frac.default, aten.round.decimals, aten.frexp.Tensor,
    aten.digamma.default, aten.lgamma.default, aten.polygamma.default, aten.mvlgamma.default,
    aten.igamma.default, aten.igammac.default, aten.angle.default,
    # two-argument arithmetic (xlogy of a tensor: 0 where self == 0 even where log(other) is -inf, which
    # parts of self do not add up to; xlogy by a number: _xlogy_number)
    aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.special_xlog1py.default, aten.special_xlog1py.self_scalar,
    aten.hypot.default, aten.copysign.Tensor, aten.copysign.Scalar, aten.nextafter.default,
    aten.heaviside.default, aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar,
    aten.float_power.Scalar, aten.fmax.default, aten.fmin.default, aten.max.other, aten.min.other,
    aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.clip.default, aten.clip.Tensor,
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.remainder.Scalar_Tensor,
    # predicates
    aten.signbit.default, aten.isfinite.default, aten.isneginf.default, aten.isposinf.default,
    aten.isreal.default,
    # integers: gcd/lcm, shifts, bitwise with a number first, Python's operator overloads
    aten.gcd.default, aten.lcm.default, aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
    aten.bitwise_left_shift.Scalar_Tensor, aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_right_shift.Scalar_Tensor,
    aten.bitwise_and.Scalar_Tensor, aten.bitwise_or.Scalar_Tensor, aten.bitwise_xor.Scalar_Tensor,
    aten.__lshift__.Scalar, aten.__lshift__.Tensor, aten.__rshift__.Scalar, aten.__rshift__.Tensor,
    aten.__xor__.Scalar, aten.__xor__.Tensor,
    # torch.special
    *(getattr(aten, f"special_{name}").default for name in (
        "i0e", "i1", "i1e", "ndtri", "log_ndtr", "erfcx", "entr", "airy_ai", "bessel_j0", "bessel_j1",
        "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1", "modified_bessel_k0",
        "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "spherical_bessel_j0")),
    *(getattr(getattr(aten, "special_zeta"), ov) for ov in ("default", "other_scalar", "self_scalar")),
    # orthogonal polynomials p_n(x): tensors for both, or a number for n or for x
    *(getattr(getattr(aten, f"special_{name}_polynomial_{k}"), ov) for ov in ("default", "n_scalar", "x_scalar")
      for name, kinds in (("chebyshev", "tuvw"), ("shifted_chebyshev", "tuvw"), ("hermite", ("h", "he")),
                          ("laguerre", "l"), ("legendre", "p")) for k in kinds),
]
# Zero is a valid Partial(sum) (every part zero), so these also produce Partial outputs.
ZERO_LIKE = [aten.zeros_like.default]


def _with(linear):
    def strategies(call):
        return pointwise_strategies(call, linear)

    strategies.__name__ = f"pointwise[{linear or 'nonlinear'}]"
    return strategies


def _add_sub(call):
    """add/sub of two tensors is linear; with a Python number every rank would add it once."""
    linear = "all" if all(isinstance(a, TensorMeta) for a in call.args[:2]) else None
    return pointwise_strategies(call, linear)


def _xlogy_number(call):
    """xlogy(self, c) = self * log(c) and xlog1py(self, c) = self * log1p(c), but 0 where self == 0:
    linear in self only where the factor is finite (c > 0, c > -1), else parts of a zero add to nan."""
    c, low = call.arg(1, "other"), 0 if call.op is aten.xlogy.Scalar_Other else -1
    linear = isinstance(c, (int, float)) and math.isfinite(c) and c > low
    return pointwise_strategies(call, "all" if linear else None)


def _to_copy(call):
    """A cast of parts sums to the cast of the sum only where no rounding to integers happens."""
    src, dst = call.ins[0].dtype, call.out.dtype
    exact = dst.is_floating_point or not (src.is_floating_point or dst == torch.bool or src == torch.bool)
    return pointwise_strategies(call, "all" if exact else None)


def _zeros_like(call):
    from .common import P, Strategy1D

    return pointwise_strategies(call) + [Strategy1D((P,), tuple(P for _ in call.ins))]


ROWS = (*(Rule(ops, _with(linear), blockwise=True) for ops, linear in
          ((LINEAR_ALL, "all"), (LINEAR_ONE, "one"), (LINEAR_FIRST, "first"), (NONLINEAR, None))),
        Rule(ZERO_LIKE, _zeros_like, blockwise=True),
        Rule([aten._to_copy.default, aten.to.dtype], _to_copy, blockwise=True),
        Rule([aten.xlogy.Scalar_Other, aten.special_xlog1py.other_scalar], _xlogy_number, blockwise=True),
        Rule([aten.add.Tensor, aten.sub.Tensor], _add_sub, blockwise=True))
