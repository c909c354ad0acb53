"""Repeated pure computations traced once (trace/normalize.merge_duplicates): a causal mask that
every layer rebuilds is one value, so a plan lays it out and moves it once, not per layer.

    python -m pytest tests/trace/test_merge_duplicates.py -q
"""
from __future__ import annotations

import collections

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.trace import trace_step
from shardwise.trace.normalize import merge_duplicates
from tests.parallel.harness import check_training


def _targets(step) -> collections.Counter:
    return collections.Counter(str(n.target) for n in step.gm.graph.nodes if n.op == "call_function")


class Repeats(nn.Module):
    """The same mask built twice (merged); scalars that compare equal but act differently
    (0.0 / -0.0, 1 / 1.0) and two dropouts of one tensor (random: never merged)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        n = x.shape[-1]
        a = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), 0.0, float("-inf"))
        b = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), 0.0, float("-inf"))
        y = (x @ self.w + a).softmax(-1) + (x @ self.w + b).softmax(-1)
        z = y * 0.0 + y * -0.0 + (y + 1) + (y + 1.0)
        return nn.functional.dropout(z, 0.5, self.training) + nn.functional.dropout(z, 0.5, self.training)


def test_repeated_pure_nodes_merged_random_and_lookalikes_kept():
    torch.manual_seed(0)
    step = trace_step(Repeats(), (torch.randn(4, 6, 6),), loss_fn=lambda out: out.sum())
    ops = _targets(step)
    assert ops["aten.where.self"] == 1, step
    assert ops["aten.tril.default"] == 1, step
    assert ops["aten.bernoulli.p"] == 2, step  # two draws stay two
    muls = [n.args[1] for n in step.gm.graph.nodes if str(n.target) == "aten.mul.Tensor" and not isinstance(n.args[1], torch.fx.Node)]
    assert 0.0 in muls and any(str(v) == "-0.0" for v in muls), step
    adds = [n.args[1] for n in step.gm.graph.nodes if str(n.target) == "aten.add.Tensor" and not isinstance(n.args[1], torch.fx.Node)]
    assert any(type(v) is int and v == 1 for v in adds) and any(type(v) is float and v == 1.0 for v in adds), step
    assert any("merged" in note for note in step.notes), step.notes


def test_forward_and_backward_copies_not_merged():
    """A forward node and an identical backward one stay two: merging would keep the forward
    value alive through backward (more memory) for nothing saved."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    fwd = [g.call_function(torch.ops.aten.exp.default, (x,)) for _ in range(2)]
    back = [g.call_function(torch.ops.aten.exp.default, (x,)) for _ in range(2)]
    for n in back:
        n.meta["autograd_backward"] = True
    g.output(tuple(fwd + back))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert merge_duplicates(gm) == ["merged 2 repeated pure node(s)"]
    kept = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [bool(n.meta.get("autograd_backward")) for n in kept] == [False, True]
    gm.recompile()
    x = torch.randn(3)
    assert all(torch.equal(o, x.exp()) for o in gm(x))


def test_merged_graph_trains_exactly_sharded():
    torch.manual_seed(0)
    model = Repeats()
    model.eval()  # no dropout: exact comparison of the merged mask path
    check_training(model, sw.Mesh((2,)), (torch.randn(5, 6, 6),), loss_fn=lambda out: out.sum(),
                   input_placements={0: [sw.Shard(0)]}, steps=2)
