"""Ops that the backward formulas of covered ops emit have rules (issue 9): cumsum's and
cumprod's backward flip, mish's calls mish_backward, sgn's makes an _efficientzerotensor.
Each is verified on meshes (2,), (3,), (2, 2) with even and uneven sizes; the verifier's
strided run (the views the program slices) is checked to catch a kernel that needs
contiguous inputs.

    python -m pytest tests/rules/test_backward_ops.py -q
    python -m pytest tests/rules/test_backward_ops.py -q -m slow    # every covered op's backward
"""
import pytest
import torch

from shardwise.layout import Partial, Replicate, Shard
from shardwise.rules import DEFAULT, Registry, load_all
from shardwise.rules.norm import BACKWARD, backward_strategies
from shardwise.verify import STRIDED, verify_rule
from shardwise.verify_backward import backward_ops_without_rule, joint_ops

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard


def rnd(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("shape,dims", [((4, 6), [1]), ((5, 7), [1]), ((5, 3, 7), [0, 2]), ((3, 2), [-1])])
def test_flip_keeps_the_dims_it_leaves_alone_sharded(shape, dims):
    n = len(shape)
    flipped = {d % n for d in dims}
    kept = [d for d in range(n) if d not in flipped]
    check(aten.flip.default, rnd(*shape), dims,
          expect=[((S(d),), (S(d),)) for d in kept] + [((P,), (P,)), ((Partial("max"),), (Partial("max"),))],
          absent=[((S(d),), (S(d),)) for d in flipped])


@pytest.mark.parametrize("shape", [(4, 6), (5, 7, 3)])
def test_mish_backward_is_linear_in_its_gradient(shape):
    check(aten.mish_backward.default, rnd(*shape), rnd(*shape) * 2,
          expect=[((S(0), S(0)), (S(0),)), ((P, R), (P,))], absent=[((R, P), (P,))])


@pytest.mark.parametrize("size", [[5, 7], [3, 2, 7]])
def test_efficientzerotensor_is_any_placement(size):
    check(aten._efficientzerotensor.default, size, dtype=torch.float32,
          expect=[((), (S(0),)), ((), (S(1),)), ((), (P,)), ((), (R,))])


def _layer_norm_backward_sample(shape=(4, 6, 3)):
    x, w, b = rnd(*shape), rnd(shape[-1]), rnd(shape[-1]) + 1
    out, mean, rstd = aten.native_layer_norm.default(x, [shape[-1]], w, b, 1e-5)
    return rnd(*out.shape), x, [shape[-1]], mean, rstd, w, b, [True, True, True]


def test_verifier_feeds_the_strided_views_the_program_slices():
    """The raw layer-norm backward kernel (mean/rstd read as contiguous rows) passes on
    contiguous locals but fails on the program's strided views of a non-leading dim, and the
    verifier says so; the rule's local call (contiguous statistics) passes both."""
    op = aten.native_layer_norm_backward.default
    raw = Registry()
    raw.register(op, backward_strategies(*BACKWARD[op]))  # the op itself as local call
    report = verify_rule(op, *_layer_norm_backward_sample(), registry=raw)
    bad = report.failures
    assert bad and all(f.error.startswith(STRIDED) for f in bad), report
    assert all(any(isinstance(p, Shard) and (p.dim > 0 or p.groups > 1) for p in f.strategy.ins[0]) for f in bad)
    assert any(r.ok and r.strategy.ins[0] == (S(0),) for r in report.results)  # leading-dim chunks are contiguous
    assert verify_rule(op, *_layer_norm_backward_sample()).ok


def test_scan_backwards_trace_to_covered_ops():
    """cumsum's backward (flip, cumsum, flip) traced like a training step: every op has a rule."""
    got = joint_ops(aten.cumsum.default, (rnd(5, 7), 1), {})
    assert aten.flip.default in got and aten.cumsum.default in got
    assert all(op in load_all(DEFAULT) for op in got), got - set(load_all(DEFAULT).ops())


def test_backward_ops_without_rule_are_found():
    """A registry without flip reports it as emitted by cumsum's backward."""
    reg = Registry()
    reg.register(aten.cumsum.default, lambda call: [])
    missing = backward_ops_without_rule(reg, samples={aten.cumsum.default: _samples(aten.cumsum.default)})
    assert aten.flip.default in missing and missing[aten.flip.default] == ["aten.cumsum.default"]


def _samples(op):
    from shardwise.verify_samples import Sample

    return [Sample(op, (rnd(5, 7), 1))]


@pytest.mark.slow
def test_every_covered_op_backward_has_rules():
    """Every registered op's traced backward (sweep samples) uses only ops with rules."""
    missing = backward_ops_without_rule()
    assert not missing, "\n".join(f"{m} <- {by}" for m, by in missing.items())
