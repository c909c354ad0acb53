"""The pointwise table (rules/pointwise.py) against DTensor's pointwise op list, and targeted
checks of the ops issue #50 added: linearity classes, the (out, buffer) pair of log_sigmoid,
xlogy's zeros, broadcasting and uneven sizes on meshes (2,), (3,), (2, 2).

DTensor's list is what torch/distributed/tensor/_ops/_pointwise_ops.py registers as pointwise:
every overload tagged ``torch.Tag.pointwise`` plus its hand-listed extras and specially
registered ops. Its ``pointwise_ops`` is built from ``dir(torch.ops.aten)``, which lists only the
packets looked up so far, so the tag scan here runs over every registered op name instead.

Run: python -m pytest tests/rules/test_pointwise_table.py -q -p no:cacheprovider
"""
import pytest
import torch
import torch.distributed.tensor._ops._pointwise_ops as dtensor_pointwise

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.rules import DEFAULT, Registry, load_all
from shardwise.rules.common import pointwise_strategies
from shardwise.rules.registry import Rule
from shardwise.tools.verify import verify_rule

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard

# Kinds of overload in DTensor's list that never reach a rule: traced graphs are functional (no
# in-place or out= overloads: trace/normalize.py checks), hold aten ops (no prims), and the optimizer
# runs on the local shards outside the graph (no _foreach_/_fused_/_amp_foreach_ lists of tensors).
LIST_OPS = ("aten::_foreach_", "aten::_fused_", "aten::_amp_foreach_")
# Functional aten overloads of DTensor's list that have no rule here, on purpose.
EXCLUDED = {
    # returns a Python bool (all elements equal and same shape): a whole-tensor reduction, not a
    # tensor-valued pointwise op; nothing in a traced graph consumes it as a tensor
    aten.equal.default: "a bool of the whole tensors, not a pointwise tensor",
    # draws random slopes when training=True (and decomposes into rrelu_with_noise, in-place on its
    # noise buffer, before any graph sees it): per-rank draws are rules/random.py's business
    aten.rrelu.default: "random when training; composite (rrelu_with_noise in graphs)",
}


def _aten_op(name: str):
    base, _, overload = name.removeprefix("aten::").partition(".")
    try:
        return getattr(getattr(aten, base), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def dtensor_pointwise_ops() -> set:
    """Every aten overload DTensor registers as pointwise (tag scan over all registered names,
    DTensor's extras and specially registered ops, and its own possibly partial list)."""
    tagged = (_aten_op(n) for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::"))
    ops = {op for op in tagged if op is not None and torch.Tag.pointwise in op.tags}
    ops |= set(dtensor_pointwise._extra_pointwise_ops) | set(dtensor_pointwise._specially_registered_ops)
    ops |= set(dtensor_pointwise.pointwise_ops)
    return {op for op in ops if op.namespace == "aten"}


def reaches_rules(op) -> bool:
    schema = op._schema
    return not (schema.is_mutable or any(a.is_out for a in schema.arguments) or op.name().startswith(LIST_OPS))


def missing_rules(ruled: frozenset) -> list:
    """DTensor's pointwise overloads that reach rules, are not excluded, and are not in ``ruled``."""
    return sorted((str(op) for op in dtensor_pointwise_ops()
                   if reaches_rules(op) and op not in ruled and op not in EXCLUDED))


def test_every_dtensor_pointwise_op_has_a_rule():
    assert missing_rules(load_all(DEFAULT).ops()) == []


def test_the_comparison_catches_a_missing_rule():
    """Without two of the rules the comparison names exactly them."""
    ruled = load_all(DEFAULT).ops() - {aten.exp2.default, aten.logaddexp.default}
    assert missing_rules(ruled) == ["aten.exp2.default", "aten.logaddexp.default"]


def test_exclusions_are_dtensor_ops_that_reach_rules():
    """Each exclusion names an op the comparison would otherwise demand (no stale entries)."""
    ops = dtensor_pointwise_ops()
    assert all(op in ops and reaches_rules(op) for op in EXCLUDED), [op for op in EXCLUDED if op not in ops]


# -- linearity classes ---------------------------------------------------------------------
LINEAR_FIRST_GRADS = [  # (op, args after grad_output): linear in grad_output, the rest Replicate
    (aten.hardswish_backward.default, ()), (aten.hardsigmoid_backward.default, ()),
    (aten.softshrink_backward.default, (0.5,)), (aten.hardshrink_backward.default, (0.5,)),
]


@pytest.mark.parametrize("op,extra", LINEAR_FIRST_GRADS, ids=lambda v: str(v) if not isinstance(v, tuple) else "")
def test_activation_backwards_are_linear_in_grad(op, extra):
    g, x = torch.randn(5, 7), torch.randn(5, 7) * 4  # both sides of every kink
    check(op, g, x, *extra, expect=[((P, R), (P,)), ((S(0), S(0)), (S(0),)), ((S(1), S(1)), (S(1),))],
          absent=[((R, P), (P,)), ((P, P), (P,))])


def test_logit_backward_with_and_without_eps():
    g, x = torch.randn(5, 7), torch.rand(5, 7) * 0.98 + 0.01
    for kwargs in ({}, {"eps": 0.2}):
        check(aten.logit_backward.default, g, x, expect=[((P, R), (P,))], absent=[((R, P), (P,))], **kwargs)
    check(aten.logit.default, x, 0.1, expect=[((S(1),), (S(1),))], absent=[((P,), (P,))])


def test_log_sigmoid_buffer_is_shaped_as_the_input_and_sharded_with_it():
    """On CPU log_sigmoid_forward's buffer is exp(-|x|), one element per element of x: it shards
    as the output does, and the backward reads each rank's own piece of it."""
    x = torch.randn(5, 7) * 3
    out, buffer = aten.log_sigmoid_forward.default(x)
    assert buffer.shape == x.shape
    torch.testing.assert_close(buffer, torch.exp(-x.abs()))
    check(aten.log_sigmoid_forward.default, x, expect=[((S(0),), (S(0), S(0))), ((S(1),), (S(1), S(1)))],
          absent=[((P,), (P, P))])
    g = torch.randn(5, 7)
    check(aten.log_sigmoid_backward.default, g, x, buffer,
          expect=[((P, R, R), (P,)), ((S(1), S(1), S(1)), (S(1),))], absent=[((R, P, R), (P,))])


def test_xlogy_of_a_tensor_is_not_linear():
    """xlogy(x, y) is 0 where x == 0 even where y == 0 (log y = -inf); split x into parts and each
    nonzero part gives +-inf, which add to nan. So no Partial strategy, and a rule claiming one
    fails the verifier on exactly such a call."""
    x, y = torch.randn(5, 7), torch.rand(5, 7)
    x[1, :3], y[1, :3] = 0.0, 0.0
    check(aten.xlogy.Tensor, x, y, expect=[((S(0), S(0)), (S(0),))], absent=[((P, R), (P,))])
    claims = Registry([Rule(aten.xlogy.Tensor, lambda call: pointwise_strategies(call, "first"), blockwise=True)])
    report = verify_rule(aten.xlogy.Tensor, x, y, registry=claims)
    assert not report.ok, report
    assert all(any(isinstance(p, Partial) for p in f.strategy.ins[0]) for f in report.failures), report


@pytest.mark.parametrize("op,low", [(aten.xlogy.Scalar_Other, 0.0), (aten.special_xlog1py.other_scalar, -1.0)])
def test_xlogy_by_a_number_is_linear_where_the_log_is_finite(op, low):
    x = torch.randn(3, 5, 7)
    check(op, x, low + 1.5, expect=[((P,), (P,)), ((S(2),), (S(2),))])
    check(op, x, low, expect=[((S(1),), (S(1),))], absent=[((P,), (P,))])  # log(0): -inf


def test_scaling_ops_are_linear():
    x, e = torch.randn(5, 7), torch.randint(-3, 4, (7,))
    check(aten.deg2rad.default, x, expect=[((P,), (P,))])
    check(aten.rad2deg.default, x, expect=[((P,), (P,))])
    check(aten.true_divide.Scalar, x, 3.0, expect=[((P,), (P,))])
    check(aten.ldexp.Tensor, x, e, expect=[((P, R), (P,)), ((S(1), S(0)), (S(1),)), ((S(0), R), (S(0),))],
          absent=[((R, P), (P,))])


def test_binary_ops_broadcast_and_stay_nonlinear():
    x, y = torch.randn(5, 7), torch.randn(7)
    for op in (aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.logaddexp.default, aten.hypot.default,
               aten.fmax.default, aten.copysign.Tensor, aten.nextafter.default):
        check(op, x, y, expect=[((S(0), R), (S(0),)), ((S(1), S(0)), (S(1),))], absent=[((P, R), (P,))])


def test_two_outputs_shard_together():
    check(aten.frexp.Tensor, torch.randn(5, 7) * 40, expect=[((S(1),), (S(1), S(1)))], absent=[((P,), (P, P))])


def test_special_functions_with_a_leading_number():
    x = torch.rand(5, 7) + 0.5
    check(aten.polygamma.default, 2, x, expect=[((S(0),), (S(0),))], absent=[((P,), (P,))])
    check(aten.special_zeta.self_scalar, 2.5, x, expect=[((S(1),), (S(1),))])
    check(aten.bitwise_left_shift.Scalar_Tensor, 3, torch.randint(0, 5, (5, 7)), expect=[((S(0),), (S(0),))])
