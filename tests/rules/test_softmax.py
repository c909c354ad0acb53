"""Softmax-family rules checked numerically on meshes (2,), (3,), (2, 2): any dim but the
softmax dim is sharded (sizes 3, 5, 7 and a dim smaller than the mesh), negative dims too.

Run: python -m pytest tests/rules/test_softmax.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.tools.verify import verify_rule

from ._rulecheck import check, strategies_1d

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard




def rnd(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


def _expect(ndim, dim, n_in):
    dim %= ndim
    expect = [((S(d),) * n_in, (S(d),)) for d in range(ndim) if d != dim] + [((R,) * n_in, (R,))]
    return expect, [((S(dim),) * n_in, (S(dim),))]


FORWARD = [aten._softmax.default, aten._log_softmax.default]


@pytest.mark.parametrize("op", FORWARD)
def test_softmax_non_softmax_dim_of_3_on_2(op):
    """The issue's case: the non-softmax dim has 3 rows on a mesh dim of 2 (chunks 2 + 1)."""
    expect, absent = _expect(2, -1, 1)
    rep = check(op, rnd(3, 5), -1, False, expect=expect, absent=absent)
    assert any(r.ok and r.mesh == (2,) and r.strategy.ins == ((S(0),),) for r in rep.results)


@pytest.mark.parametrize("op", FORWARD)
@pytest.mark.parametrize("shape,dim", [((5, 7, 2), 1), ((5, 7, 2), -3), ((2, 3, 4), -1)])
def test_softmax_3d(op, shape, dim):
    expect, absent = _expect(len(shape), dim, 1)
    check(op, rnd(*shape), dim, False, expect=expect, absent=absent)


@pytest.mark.parametrize("op", FORWARD)
def test_softmax_bf16(op):
    expect, absent = _expect(2, 0, 1)
    check(op, rnd(7, 3, dtype=torch.bfloat16), 0, False, expect=expect, absent=absent)


def test_safe_softmax_fully_masked_rows():
    x = rnd(5, 3, 4)
    x[1, :, 2] = float("-inf")  # rows entirely masked give zeros, not NaN
    x[4] = float("-inf")
    expect, absent = _expect(3, -1, 1)
    check(aten._safe_softmax.default, x, -1, expect=expect, absent=absent)
    check(aten._safe_softmax.default, x, 0, dtype=torch.float32, expect=_expect(3, 0, 1)[0])


@pytest.mark.parametrize("fwd,bwd", [(aten._softmax.default, aten._softmax_backward_data.default),
                                     (aten._log_softmax.default, aten._log_softmax_backward_data.default)])
@pytest.mark.parametrize("shape,dim", [((3, 5), -1), ((5, 2, 7), 1), ((7, 3), 0)])
def test_softmax_backward(fwd, bwd, shape, dim):
    """Linear in grad_output: a Partial grad_output with the output replicated gives a Partial grad."""
    y = fwd(rnd(*shape), dim, False)
    expect, absent = _expect(len(shape), dim, 2)
    check(bwd, rnd(*shape), y, dim, torch.float32, expect=expect + [((P, R), (P,))],
          absent=absent + [((P, P), (P,))])


def test_softmax_backward_bf16():
    y = aten._softmax.default(rnd(5, 3, dtype=torch.bfloat16), -1, False)
    check(aten._softmax_backward_data.default, rnd(5, 3, dtype=torch.bfloat16), y, -1, torch.bfloat16,
          expect=[((S(0), S(0)), (S(0),)), ((P, R), (P,))])
