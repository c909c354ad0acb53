"""Pointwise ops: rules as lists. Each entry: op overload -> how it treats Partial(sum) inputs."""
from __future__ import annotations

import torch

from .common import pointwise_strategies
from .registry import Rule, TensorMeta

aten = torch.ops.aten

# Linear in all tensor inputs together: f(sum of parts) = sum of f(parts).
LINEAR_ALL = [
    aten.neg.default, aten.clone.default,
    aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default,
    aten.mul.Scalar, aten.div.Scalar, aten.conj_physical.default,
]
# Linear in each input separately (exactly one Partial, others Replicate).
LINEAR_ONE = [aten.mul.Tensor]
# Linear in the first input only (gradients of activations, division by a replicated divisor).
LINEAR_FIRST = [
    aten.div.Tensor, aten.threshold_backward.default, aten.gelu_backward.default, aten.silu_backward.default,
    aten.tanh_backward.default, aten.sigmoid_backward.default, aten.mish_backward.default,
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
        Rule(ZERO_LIKE, _zeros_like, blockwise=True), Rule(aten._to_copy.default, _to_copy, blockwise=True),
        Rule([aten.add.Tensor, aten.sub.Tensor], _add_sub, blockwise=True))
