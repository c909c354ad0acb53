"""The default planner (issue 12, item 4): planner="auto" is the ILP (the best plan under the cost
model found within its limits, propagation's plan as the incumbent) when the layout is left to
shardwise, and propagation from the placements a user gives; deterministic either way.

    python -m pytest tests/search/test_default_planner.py -q -p no:cacheprovider
"""
import copy

import pytest
import torch

import shardwise as sw
from shardwise.module.options import DEFAULT_PLANNER, choose_planner
from tests.models.zoo import gpt2
from tests.parallel.harness import check_training


def test_auto_is_the_default_and_picks_by_what_the_user_placed():
    assert DEFAULT_PLANNER == "auto"
    nothing = dict(input_placements=None, target_placements=None, param_placements="auto", memory_budget=None)
    assert choose_planner("auto", **nothing) == "ilp"
    assert choose_planner("auto", **{**nothing, "input_placements": {}, "param_placements": {}}) == "ilp"
    assert choose_planner("auto", **{**nothing, "input_placements": {0: {"dp": sw.Shard(0)}}}) == "propagate"
    assert choose_planner("auto", **{**nothing, "target_placements": {0: [sw.Shard(0)]}}) == "propagate"
    assert choose_planner("auto", **{**nothing, "param_placements": {"w": [sw.Shard(0)]}}) == "propagate"
    placed_with_budget = {**nothing, "input_placements": {0: [sw.Shard(0)]}, "memory_budget": 1 << 20}
    assert choose_planner("auto", **placed_with_budget) == "ilp"  # only the ILP can steer to a budget
    for explicit in ("propagate", "ilp"):
        assert choose_planner(explicit, **nothing) == explicit
        assert choose_planner(explicit, **placed_with_budget) == explicit
    with pytest.raises(sw.ShardingError, match="unknown planner 'greedy'"):
        sw.parallelize(torch.nn.Linear(2, 2), sw.Mesh((2,)), (torch.randn(4, 2),), planner="greedy")


@pytest.fixture(scope="module")
def left_to_shardwise():
    """GPT-2 (2 layers, h 32) on a (2, 2) dp x tp mesh with nothing placed: planned twice by default."""
    case = gpt2(batch=4)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    plans = [sw.parallelize(copy.deepcopy(case.model), mesh, case.example_inputs).plan for _ in range(2)]
    return case, mesh, plans


def test_nothing_placed_plans_by_the_ilp_deterministically(left_to_shardwise):
    _, _, (a, b) = left_to_shardwise
    report = a.prop.solve_report
    assert report is not None and str(report).startswith("ilp"), a.summary()
    assert report.cost_s <= report.propagation_cost_s * (1 + 1e-9)  # propagation is the incumbent
    assert a.prop.param_choices == b.prop.param_choices
    assert {n: p.strategy for n, p in a.prop.nodes.items()} == {n: p.strategy for n, p in b.prop.nodes.items()}
    for rank in range(4):
        assert a.program(rank) == b.program(rank)
    assert a.stats()["est_step_time_s"] == b.stats()["est_step_time_s"]


def test_nothing_placed_trains_exactly(left_to_shardwise):
    case, mesh, _ = left_to_shardwise
    # lr and eps as tests/parallel/test_transformer.ADAM: the key bias's gradient is float noise
    pm = check_training(copy.deepcopy(case.model), mesh, case.example_inputs, steps=2, lr=1e-3,
                        optim_kwargs={"eps": 1e-6})
    assert str(pm.plan.prop.solve_report).startswith("ilp")
    assert pm.plan.stats()["comm_bytes"] > 0  # at the CPU's rates (the model's device) it does not replicate all


def test_placements_given_are_followed_by_propagation():
    case = gpt2(batch=4)
    pm = sw.parallelize(case.model, sw.Mesh((2,), ("dp",)), case.example_inputs,
                        input_placements={0: {"dp": sw.Shard(0)}})
    assert pm.plan.prop.solve_report is None and pm.plan.stats()["collectives"].get("all_reduce")


def test_propagation_does_not_make_a_partial_sum_larger_than_what_it_contracts():
    """Hidden states split on "tp" (a colwise layer given) meet an LM head left whole: computing it
    row-parallel from them moves nothing then, but leaves partial logits [b, vocab], 16x the hidden
    states, whose reduction costs more than any other way (search/propagate.Planner._owed). Before,
    propagation took it: one all_reduce of the logits, 246 KB a step against 106 KB now."""
    torch.manual_seed(0)
    hidden, vocab, batch = 32, 512, 64
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, vocab))
    x, y = torch.randn(batch, hidden), torch.randint(0, vocab, (batch,))
    pm = check_training(model, sw.Mesh((4,), ("tp",)), (x,), (y,), torch.nn.functional.cross_entropy,
                        param_placements={"0.weight": {"tp": sw.Shard(0)}, "0.bias": {"tp": sw.Shard(0)}},
                        steps=2, lr=1e-3, optim_kwargs={"eps": 1e-6})
    assert pm.options.planner == "propagate"
    logits_all_reduce = 2 * 3 * batch * vocab  # bytes each rank sends for it: 2 (n - 1) / n of [b, vocab] float32
    moved = [(tuple(s.src.shape), s.kind) for s in pm.plan.collective_steps()]
    assert all(shape != (batch, vocab) for shape, _ in moved), moved
    assert pm.plan.stats()["comm_bytes"] < logits_all_reduce


def test_data_parallel_weight_gradients_are_all_reduced_not_rebuilt_from_gathered_activations():
    """A small batch (8 rows against 256 x 1024 weights, 1 MiB each, where the "cpu" preset's bytes
    outweigh its latencies): each weight's gradient is a partial sum over the batch, larger than the
    activations it contracts. Propagation used to charge that growth
    and rebuild the gradient from gathered activations instead (an all_to_all and an all_gather
    per weight, then an all_gather of its halves: six blocking calls, 1.7x slower than DDP's plan
    on gloo, bench/RESULTS.md). A value that views carry straight to the outputs owes nothing: the
    gradients are all_reduced, in one bucket, as DDP does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    pm = check_training(model, sw.Mesh((2,), ("dp",)), (x,), (y,), torch.nn.functional.mse_loss,
                        input_placements={0: [sw.Shard(0)]}, target_placements={0: [sw.Shard(0)]}, steps=2)
    assert pm.options.planner == "propagate"
    kinds = {s.kind for s in pm.plan.collective_steps()}
    assert kinds == {"all_reduce"}, kinds
    weights = 2 * 256 * 1024 * 4
    assert weights <= pm.plan.stats()["comm_bytes"] < 1.1 * weights
