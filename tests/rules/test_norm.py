"""Layer norm and RMS norm rules checked numerically on meshes (2,), (3,), (2, 2), forward and
backward, with even and uneven leading dims (a batch of 7, a dim smaller than the mesh).

Run: python -m pytest tests/rules/test_norm.py -q -p no:cacheprovider
"""
import pytest
import torch
from torch._decomp import decomposition_table

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.rules import norm
from shardwise.rules.registry import Registry
from shardwise.tools.verify import verify_rule

from ._rulecheck import check, strategies_1d

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard




def rnd(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


# -- layer norm ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape,k", [((7, 4), 1), ((7, 2, 3), 1), ((2, 5, 3), 2)])
def test_layer_norm_forward(shape, k):
    """A batch of 7 on 2 and 3 ranks; the normalized dims are never sharded."""
    lead = len(shape) - k
    ns = list(shape[lead:])
    w, b = rnd(*ns), rnd(*ns)
    expect = [((S(d), R, R), (S(d),) * 3) for d in range(lead)] + [((R, R, R), (R, R, R))]
    absent = [((S(d), R, R), (S(d),) * 3) for d in range(lead, len(shape))]
    check(aten.native_layer_norm.default, rnd(*shape), ns, w, b, 1e-5, expect=expect, absent=absent)


def test_layer_norm_forward_no_affine_bf16():
    check(aten.native_layer_norm.default, rnd(7, 6, dtype=torch.bfloat16), [6], None, None, 1e-5,
          expect=[((S(0),), (S(0),) * 3)])


def _ln_backward_args(shape, k, mask, affine=True, dtype=torch.float32):
    lead = len(shape) - k
    ns = list(shape[lead:])
    torch.manual_seed(0)
    # x spread wide keeps rstd small: the verifier's Partial grad_out parts are N(0, 1) whatever
    # grad_out is, and in bf16 each part's grad_input rounds on its own scale.
    x, g = (10 * rnd(*shape)).to(dtype), rnd(*shape, dtype=dtype)
    w, b = (rnd(*ns, dtype=dtype), rnd(*ns, dtype=dtype)) if affine else (None, None)
    _, mean, rstd = aten.native_layer_norm.default(x, ns, w, b, 1e-5)
    return (g, x, ns, mean, rstd, w, b, mask), lead


@pytest.mark.parametrize("shape,k", [((7, 4), 1), ((2, 7, 3), 1), ((7, 2, 3), 2)])
def test_layer_norm_backward(shape, k):
    """grad_weight / grad_bias sum over the (sharded) batch: exact Partial sums, uneven too."""
    args, lead = _ln_backward_args(shape, k, [True, True, True])
    sh = lambda d: (S(d),) * 4 + (R, R)  # noqa: E731 - grad_out, input, mean, rstd; weight, bias
    expect = [(sh(d), (S(d), P, P)) for d in range(lead)]
    expect += [((P, R, R, R, R, R), (P, P, P)), ((R,) * 6, (R, R, R))]
    rep = check(aten.native_layer_norm_backward.default, *args, expect=expect,
                absent=[(sh(d), (S(d), P, P)) for d in range(lead, len(shape))])
    for mesh in ((2,), (3,)):
        assert any(r.ok and r.mesh == mesh and r.strategy.ins[0] == (S(0),) for r in rep.results)


@pytest.mark.parametrize("mask", [[True, False, True], [False, True, False]])
def test_layer_norm_backward_masked(mask):
    """Masked-off grads are None outputs, with None placements."""
    args, _ = _ln_backward_args((5, 3), 1, mask)
    want = tuple(pl if m else None for pl, m in zip((S(0), P, P), mask))
    check(aten.native_layer_norm_backward.default, *args, expect=[((S(0),) * 4 + (R, R), want)])


def test_layer_norm_backward_no_affine_bf16():
    args, _ = _ln_backward_args((7, 4), 1, [True, False, False], affine=False, dtype=torch.bfloat16)
    check(aten.native_layer_norm_backward.default, *args,
          expect=[((S(0),) * 4, (S(0), None, None)), ((P, R, R, R), (P, None, None))])


# -- RMS norm ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,k,affine", [((7, 4), 1, True), ((2, 5, 3), 2, True), ((7, 3), 1, False)])
def test_fused_rms_norm_forward(shape, k, affine):
    lead = len(shape) - k
    ns = list(shape[lead:])
    w = rnd(*ns) if affine else None
    side = (R,) if affine else ()
    expect = [((S(d),) + side, (S(d), S(d))) for d in range(lead)]
    check(aten._fused_rms_norm.default, rnd(*shape), ns, w, 1e-5, expect=expect,
          absent=[((S(d),) + side, (S(d), S(d))) for d in range(lead, len(shape))])


def _rms_backward_reference(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """torch's decomposition of _fused_rms_norm_backward (the op has no CPU kernel in 2.13)."""
    return decomposition_table[aten._fused_rms_norm_backward.default](
        grad_out, input, normalized_shape, rstd, weight, output_mask)


def _rms_registry():
    """A registry where the reference stands in for the op, under the op's own strategies."""
    reg = Registry()
    reg.add(*norm.ROWS)
    spec = norm.BACKWARD[aten._fused_rms_norm_backward.default]
    reg.register(_rms_backward_reference, norm.backward_strategies(*spec))
    return reg


@pytest.mark.parametrize("shape,k,mask", [((7, 4), 1, [True, True]), ((2, 7, 3), 1, [True, False]),
                                          ((7, 2, 3), 2, [False, True])])
def test_fused_rms_norm_backward(shape, k, mask):
    lead = len(shape) - k
    ns = list(shape[lead:])
    x, g, w = rnd(*shape), rnd(*shape), rnd(*ns)
    _, rstd = aten._fused_rms_norm.default(x, ns, w, 1e-5)
    want = lambda d: tuple(pl if m else None for pl, m in zip((S(d), P), mask))  # noqa: E731
    expect = [((S(d), S(d), S(d), R), want(d)) for d in range(lead)]
    expect += [((P, R, R, R), tuple(P if m else None for m in mask))]
    check(_rms_backward_reference, g, x, ns, rstd, w, mask, registry=_rms_registry(), expect=expect)
