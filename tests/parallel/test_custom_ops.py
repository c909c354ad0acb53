"""Ops without a rule: a typed error naming op, node and source line; the replicate
fallback; and a user rule registered with @sw.rule and checked by the verifier."""
import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.rules import Registry
from shardwise.rules.common import pointwise_strategies


@torch.library.custom_op("swtest::softsign2", mutates_args=())
def softsign2(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


@softsign2.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g / (1 + x.abs()) ** 2


softsign2.register_autograd(_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))
OP = torch.ops.swtest.softsign2.default


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return softsign2(self.lin(x)).sum()


def test_unsupported_op_names_op_node_source_and_ways_out():
    x = torch.randn(5, 4)
    with pytest.raises(sw.UnsupportedOpError) as e:
        sw.parallelize(Net(), sw.Mesh((2,)), (x,), input_placements={0: [S(0)]})
    msg = str(e.value)
    assert "swtest.softsign2.default" in msg and "node 'softsign2'" in msg
    assert "test_custom_ops.py" in msg and "softsign2(self.lin(x))" in msg  # the user's source line
    assert "@shardwise.rule" in msg and "replicate_fallback" in msg
    assert isinstance(e.value, sw.ShardingError)


def _reference(x):
    model = Net()
    loss = model(x)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_replicate_fallback_is_exact_and_reported():
    x = torch.randn(5, 4)
    pm = sw.parallelize(Net(), sw.Mesh((2,)), (x,), input_placements={0: [S(0)]},
                        replicate_fallback={"swtest.softsign2.default"})
    loss = pm.step(x)
    ref_loss, ref_grads = _reference(x)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    for n, g in pm.gradients().items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5)
    assert "[replicate fallback]" in pm.plan.summary()
    assert "all_gather" in pm.plan.program(0)  # its sharded input is gathered


def test_user_rule_is_verified_and_used():
    reg = Registry()
    sw.rule(OP, registry=reg)(lambda call: pointwise_strategies(call))
    report = sw.verify_rule(OP, torch.randn(5, 3), registry=reg)
    assert report.ok, report
    assert any(r.strategy.outs[0] == (S(1),) for r in report.results)
    x = torch.randn(5, 4)
    pm = sw.parallelize(Net(), sw.Mesh((2,)), (x,), input_placements={0: [S(0)]}, registry=reg)
    loss = pm.step(x)
    ref_loss, ref_grads = _reference(x)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    for n, g in pm.gradients().items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5)
    node = next(n for n in pm.plan.prop.nodes.values() if n.call.op == OP)
    assert node.strategy.ins[0] == (S(0),) and not node.fallback
