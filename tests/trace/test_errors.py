"""Tracing errors that explain themselves: the aten op, the user's line and the way out; every
op without a rule in one error; replicate_fallback's op names checked.

    python -m pytest tests/trace/test_errors.py -q
"""
import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.core.errors import UnsupportedOpsError
from shardwise.trace import trace_step
from shardwise.trace.errors import TraceError

for _name in ("twice", "thrice", "halve"):
    torch.library.define(f"swtest_err::{_name}", "(Tensor x) -> Tensor")
torch.library.impl("swtest_err::twice", "CompositeExplicitAutograd")(lambda x: x * 2)
torch.library.impl("swtest_err::thrice", "CompositeExplicitAutograd")(lambda x: x * 3)
torch.library.impl("swtest_err::halve", "CompositeExplicitAutograd")(lambda x: x / 2)
for _name in ("twice", "thrice", "halve"):
    torch.library.register_fake(f"swtest_err::{_name}")(lambda x: torch.empty_like(x))
ops = torch.ops.swtest_err


class ThreeRuleless(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        side = ops.twice(x) + ops.thrice(x) + ops.halve(x)  # no rules, no gradients needed
        return (h * side).sum()


def test_three_ops_without_rules_are_reported_at_once():
    x = torch.randn(5, 4)
    with pytest.raises(sw.UnsupportedOpError) as e:
        sw.parallelize(ThreeRuleless(), sw.Mesh((2,)), (x,), input_placements={0: [S(0)]})
    err = e.value
    assert isinstance(err, UnsupportedOpsError)
    names = {str(op) for op, _, _ in err.ops}
    assert names == {"swtest_err.twice.default", "swtest_err.thrice.default", "swtest_err.halve.default"}
    msg = str(err)
    for n in names:
        assert n in msg
    assert msg.count("test_errors.py") >= 3 and "ops.halve(x)" in msg  # each op's source line
    assert "replicate_fallback={" in msg


def test_the_named_ops_as_fallback_make_it_run_exactly():
    x = torch.randn(5, 4)
    model = ThreeRuleless()
    names = {"swtest_err.twice.default", "swtest_err.thrice.default", "swtest_err.halve.default"}
    pm = sw.parallelize(model, sw.Mesh((2,)), (x,), input_placements={0: [S(0)]}, replicate_fallback=names)
    loss = pm.step(x)
    ref = model(x)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pm.gradients()["lin.weight"], model.lin.weight.grad, rtol=1e-4, atol=1e-5)


class MaskedSum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h[h > 0].sum()


class BranchOnData(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            h = h * 2
        return h.sum()


def test_data_dependent_shape_names_the_op_and_the_users_line():
    with pytest.raises(TraceError) as e:
        trace_step(MaskedSum(), (torch.randn(3, 4),))
    err = e.value
    assert isinstance(err, sw.ShardingError) and err.op is not None
    assert "depends on the data" in str(err) and str(err.op) in str(err)
    assert "test_errors.py" in err.source and "h[h > 0].sum()" in err.source
    assert "torch.where" in err.fix


def test_python_value_from_data_names_the_op_and_line():
    with pytest.raises(TraceError) as e:
        trace_step(BranchOnData(), (torch.randn(3, 4),))
    err = e.value
    assert err.op == torch.ops.aten._local_scalar_dense.default
    assert "if h.sum() > 0:" in err.source and "torch.where" in err.fix


def test_hf_moe_eager_experts_are_refused_with_the_alternative():
    from tests.parallel.test_moe import mixtral

    case = mixtral()
    case.model.set_experts_implementation("eager")
    for m in case.model.modules():  # an activation shardwise.moe_experts does not compute: traced as written
        if hasattr(m, "act_fn") and hasattr(m, "gate_up_proj"):
            m.act_fn = torch.nn.Tanh()
    with pytest.raises(TraceError) as e:
        trace_step(*case)
    err = e.value
    assert err.op == torch.ops.aten.nonzero.default
    assert "modeling_mixtral.py" in err.source and "nonzero()" in err.source
    assert "experts_implementation='grouped_mm'" in err.fix


@pytest.mark.parametrize("bad,says", [
    ({"aten.floordivide.default"}, "did you mean aten.floor_divide"),
    ({"aten.histc.defualt"}, "has no overload"),
    ({"aten.histc"}, "not an op overload name"),
    ("aten.histc.default", "got the string"),
    ({torch.ops.aten.histc}, "op packet"),
    ({3}, "not an op or op name"),
])
def test_replicate_fallback_names_are_checked(bad, says):
    with pytest.raises(sw.ShardingError, match=says):
        sw.parallelize(torch.nn.Linear(4, 4), sw.Mesh((2,)), (torch.randn(3, 4),), replicate_fallback=bad)


def test_replicate_fallback_accepts_ops_and_their_names():
    model, x = torch.nn.Linear(4, 4), torch.randn(3, 4)
    for ok in ({"aten.histc.default"}, {torch.ops.aten.histc.default}, ()):
        sw.parallelize(model, sw.Mesh((2,)), (x,), loss_fn=lambda out: out.sum(), replicate_fallback=ok)
