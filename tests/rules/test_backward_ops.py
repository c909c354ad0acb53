"""Ops that the backward formulas of covered ops emit have rules (issue 9): cumsum's and
cumprod's backward flip, mish's calls mish_backward, sgn's makes an _efficientzerotensor.
Each is verified on meshes (2,), (3,), (2, 2) with even and uneven sizes (contiguous locals
and the strided views the program slices).

    python -m pytest tests/rules/test_backward_ops.py -q
    python -m pytest tests/rules/test_backward_ops.py -q -m slow    # every covered op's backward
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.rules import DEFAULT, Registry, load_all
from shardwise.tools.verify.backward import backward_ops_without_rule, joint_ops

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
    from shardwise.tools.verify.samples import Sample

    return [Sample(op, (rnd(5, 7), 1))]


@pytest.mark.slow
def test_every_covered_op_backward_has_rules():
    """Every registered op's traced backward (sweep samples) uses only ops with rules."""
    missing = backward_ops_without_rule()
    assert not missing, "\n".join(f"{m} <- {by}" for m, by in missing.items())
