"""Matmul-family rules (einsum-declared) checked numerically on meshes (2,), (3,), (2, 2).

Run: python -m pytest tests/rules/test_matmul.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


MM_EXPECT = [((S(0), R), (S(0),)), ((R, S(1)), (S(1),)), ((S(1), S(0)), (P,)), ((P, R), (P,)), ((R, P), (P,)),
             ((R, R), (R,))]


@pytest.mark.parametrize("m,k,n", [(4, 6, 2), (5, 7, 3), (1, 2, 5)])
def test_mm(m, k, n):
    check(aten.mm.default, rnd(m, k), rnd(k, n), expect=MM_EXPECT)


def test_mm_restated_on_two_mesh_dims_at_once():
    """A weight gradient t(grad) @ x whose features arrive in 2 groups on one mesh dim (a fused [gate|up])
    while the tokens arrive in units on the other (a flattened batch): the verifier restates the
    strategies on both mesh dims at once, as the planner does, and each is exact on (2, 2)."""
    report = check(aten.mm.default, rnd(12, 10), rnd(10, 5))

    def cuts(st):  # (unit > 1, groups > 1) of each shard among the inputs
        return {(p.unit > 1, p.groups > 1) for pl in st.ins for p in pl if isinstance(p, Shard)}

    both = [r for r in report.results if r.mesh == (2, 2) and cuts(r.strategy) >= {(True, False), (False, True)}]
    assert both and all(r.ok for r in both), report
    want = ((S(1, unit=2), S(0, groups=2)), (S(0, unit=2), R))  # tokens contracted on one dim, features kept
    assert any(r.strategy.ins == want and r.strategy.outs == ((P, S(0, groups=2)),) for r in both), report


def test_mm_bf16():
    check(aten.mm.default, rnd(5, 3, dtype=torch.bfloat16), rnd(3, 4, dtype=torch.bfloat16), expect=MM_EXPECT)


@pytest.mark.parametrize("b,m,k,n", [(2, 4, 4, 2), (3, 5, 2, 1)])
def test_bmm(b, m, k, n):
    check(aten.bmm.default, rnd(b, m, k), rnd(b, k, n),
          expect=[((S(0), S(0)), (S(0),)), ((S(1), R), (S(1),)), ((R, S(2)), (S(2),)), ((S(2), S(1)), (P,)),
                  ((P, R), (P,))])


@pytest.mark.parametrize("bias_shape", [(3,), (5, 3), (1, 3), (5, 1)])
def test_addmm_bias_broadcast(bias_shape):
    bias = rnd(*bias_shape)
    row = S(0) if bias_shape[0] == 5 and len(bias_shape) == 2 else R
    col = S(len(bias_shape) - 1) if bias_shape[-1] == 3 else R
    check(aten.addmm.default, bias, rnd(5, 7), rnd(7, 3),
          expect=[((row, S(0), R), (S(0),)), ((col, R, S(1)), (S(1),)), ((P, S(1), S(0)), (P,)),
                  ((P, P, R), (P,)), ((P, R, P), (P,))])


def test_addmm_alpha_beta():
    check(aten.addmm.default, rnd(4), rnd(6, 5), rnd(5, 4), beta=0.5, alpha=-2.0,
          expect=[((P, S(1), S(0)), (P,)), ((S(0), R, S(1)), (S(1),))])


def test_addmm_bf16():
    t = torch.bfloat16
    check(aten.addmm.default, rnd(3, dtype=t), rnd(4, 3, dtype=t), rnd(3, 3, dtype=t),
          expect=[((P, S(1), S(0)), (P,))])


@pytest.mark.parametrize("bias_shape", [(3, 4, 2), (2,), (1, 4, 1)])
def test_baddbmm(bias_shape):
    bias = rnd(*bias_shape)
    check(aten.baddbmm.default, bias, rnd(3, 4, 5), rnd(3, 5, 2), beta=2.0, alpha=0.5,
          expect=[((S(0) if bias_shape == (3, 4, 2) else R, S(0), S(0)), (S(0),)),
                  ((P, S(2), S(1)), (P,)), ((P, P, R), (P,))])


def test_addbmm():
    check(aten.addbmm.default, rnd(4, 2), rnd(3, 4, 5), rnd(3, 5, 2),
          expect=[((S(0), S(1), R), (S(0),)), ((P, S(0), S(0)), (P,)), ((P, S(2), S(1)), (P,))])


def test_mv_dot_addmv():
    check(aten.mv.default, rnd(5, 3), rnd(3), expect=[((S(0), R), (S(0),)), ((S(1), S(0)), (P,))])
    check(aten.dot.default, rnd(7), rnd(7), expect=[((S(0), S(0)), (P,)), ((P, R), (P,))])
    check(aten.addmv.default, rnd(5), rnd(5, 3), rnd(3), beta=0.5,
          expect=[((S(0), S(0), R), (S(0),)), ((P, S(1), S(0)), (P,))])
