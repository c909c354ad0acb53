"""Complex-number rules (rules/complex.py) checked by the rule verifier on meshes (2,), (3,), (2, 2)
with uneven sizes (5, 3, 7) and complex dtypes, and the verifier's own complex support: both the
real and the imaginary part are compared, and complex Partial(sum) inputs are split into complex
parts.

    python -m pytest tests/rules/test_complex.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.rules import DEFAULT, Registry, load_all
from shardwise.rules.registry import LocalCall, Rule, Strategy1D
from shardwise.tools.verify import lay_out, verify_rule
from shardwise.core.mesh import Mesh

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial("sum"), Shard


def _z(*shape, seed=0):
    return torch.randn(shape, dtype=torch.complex64, generator=torch.Generator().manual_seed(seed))


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_view_as_complex_shards_every_dim_but_the_pair():
    check(aten.view_as_complex.default, _r(5, 3, 7, 2),
          expect=[((S(0),), (S(0),)), ((S(1),), (S(1),)), ((S(2),), (S(2),)), ((P,), (P,))],
          absent=[((S(3),), (S(3),)), ((S(3),), (R,))])


def test_view_as_real_adds_the_pair_dim_whole():
    check(aten.view_as_real.default, _z(5, 3, 7),
          expect=[((S(0),), (S(0),)), ((S(2),), (S(2),)), ((P,), (P,))], absent=[((R,), (S(3),))])


@pytest.mark.parametrize("op", [aten._conj.default, aten.resolve_neg.default, aten._neg_view.default])
def test_conjugations_pass_shards_and_partials(op):
    check(op, _z(5, 7), expect=[((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,))])


def test_resolve_conj_of_a_conjugate_view():
    check(aten.resolve_conj.default, _z(3, 5).conj(), expect=[((S(1),), (S(1),)), ((P,), (P,))])


def test_polar_is_pointwise_and_not_linear():
    ang = _r(5, 3, 7)
    check(aten.polar.default, ang.abs() + 0.1, ang, expect=[((S(2), S(2)), (S(2),))],
          absent=[((P, P), (P,)), ((P, R), (P,))])
    check(aten.polar.default, _r(5, 1).abs() + 0.1, _r(5, 7), expect=[((R, S(1)), (S(1),))])  # abs broadcast


def test_complex_from_real_and_imaginary_parts():
    check(aten.complex.default, _r(3, 5, 7), _r(7, seed=1), expect=[((S(0), R), (S(0),)), ((P, P), (P,))])


def test_complex_mul_of_rotary_shapes():
    """The rotary product: [batch, seq, heads, pairs] by [1, seq, 1, pairs] (uneven seq 5): a shard of
    seq on both, of batch or heads on one, and a Partial factor by a Replicate one."""
    x, cis = _z(3, 5, 3, 4), _z(1, 5, 1, 4, seed=1)
    check(aten.mul.Tensor, x, cis, expect=[((S(1), S(1)), (S(1),)), ((S(0), R), (S(0),)), ((S(2), R), (S(2),)),
                                           ((P, R), (P,)), ((R, P), (P,))])


def test_complex_partials_are_complex_parts():
    z = _z(5, 3)
    parts = lay_out(z, Mesh((2,)), (P,), torch.Generator().manual_seed(0))
    assert all(p.is_complex() and p.imag.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(parts[0] + parts[1], z)


def _real_part_only(ctx):
    """A wrong local call: the conjugate's imaginary part left unflipped (the real part is right)."""
    return LocalCall(aten.clone.default, ctx.call.args, {})


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 2)])
def test_the_verifier_compares_the_imaginary_part(shape):
    """A rule whose local call gets only the imaginary part wrong fails every strategy: the
    comparison reads both parts (a double() cast would keep the real part and pass it)."""
    reg = Registry([Rule(aten._conj.default, lambda call: [Strategy1D((S(0),), (S(0),))], _real_part_only,
                         blockwise=True)])
    report = verify_rule(aten._conj.default, _z(*shape), registry=reg)
    assert report.results and not any(r.ok for r in report.results), report
    good = verify_rule(aten._conj.default, _z(*shape))
    assert good.ok, good


def test_rows_are_registered():
    ops = load_all(DEFAULT).ops()
    for op in (aten.view_as_complex.default, aten.view_as_real.default, aten._conj.default, aten.polar.default,
               aten.complex.default, aten.resolve_conj.default, aten.resolve_neg.default):
        assert op in ops, op
