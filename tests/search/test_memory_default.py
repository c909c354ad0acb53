"""memory_budget=None is the cost model's device memory less a reserve (module/options.py
DEVICE_MEMORY_RESERVE), float("inf") is no budget, and the optimizer step is part of the ILP's
objective (search/params.py optimizer_seconds).

    python -m pytest tests/search/test_memory_default.py -q -p no:cacheprovider
    python -m pytest tests/search/test_memory_default.py -q -p no:cacheprovider -m slow   # Llama 3.1 8B's shape
"""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S
from shardwise.core.errors import MemoryBudgetError
from shardwise.module.options import DEVICE_MEMORY_RESERVE, resolve_memory_budget
from shardwise.search.params import optimizer_seconds
from tests.models import zoo
from tests.parallel.harness import check_training

GIB = 2 ** 30


def wide_mlp(batch=1024):
    """640 KiB of parameters: replicated with their gradients and AdamW's state 2.6 MiB a rank."""
    torch.manual_seed(0)
    return zoo.MLP(256, 512, 64), (torch.randn(batch, 256),), (torch.randn(batch, 64),)


def kw(device_memory=None, **more):
    cost = sw.CostModel.preset("cpu", device_memory=device_memory)
    return {**dict(loss_fn=zoo.mse_loss, planner="ilp", input_placements={0: [S(0)]}, cost_model=cost), **more}


def test_resolve():
    """None: the device memory less the reserve; inf: none; a number: itself; a cost model without
    device memory (the CPU preset, the threads default): no budget."""
    h100 = sw.CostModel.preset("h100")
    assert h100.device_memory == 80 * GIB and sw.CostModel.preset("a100").device_memory == 80 * GIB
    assert sw.CostModel.preset("cpu").device_memory is None
    assert resolve_memory_budget(None, h100) == (80 * GIB * (1 - DEVICE_MEMORY_RESERVE), "device")
    assert resolve_memory_budget(float("inf"), h100) == (None, "given")
    assert resolve_memory_budget(5 * GIB, h100) == (5 * GIB, "given")
    assert resolve_memory_budget(None, sw.CostModel.preset("cpu")) == (None, "given")
    assert resolve_memory_budget(None, sw.CostModel()) == (None, "given")
    for bad in (0, -1, float("nan"), "8GiB", True):
        with pytest.raises(sw.ShardingError, match="memory_budget"):
            resolve_memory_budget(bad, h100)


def test_cpu_default_has_no_budget():
    model, x, y = wide_mlp(64)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, example_targets=y, loss_fn=zoo.mse_loss)
    assert pm.options.memory_budget is None and pm.options.cost.device_memory is None


def test_device_budget_honoured_by_default():
    """A device whose memory (less the reserve) is below what the unbounded plan needs: the default
    plan fits it (sharding what it must), trains exactly as one device, and differs from the plan
    with memory_budget=inf, which does not fit."""
    model, x, y = wide_mlp()
    mesh = sw.Mesh((4,), ("dp",))
    free = sw.parallelize(model, mesh, x, example_targets=y, memory_budget=float("inf"), **kw(1e12))
    assert free.options.memory_budget is None
    need = free.plan.stats()["peak_memory_bytes"]
    with pytest.raises(MemoryBudgetError) as err:  # the least any plan needs, as the planner finds it
        sw.parallelize(model, mesh, x, example_targets=y, memory_budget=1000, **kw())
    least = int(str(err.value).split("at least ")[1].split(",")[0])
    assert least < need
    device = (need + least) / 2 / (1 - DEVICE_MEMORY_RESERVE)  # its budget between the two
    pm = check_training(model, mesh, x, y, lr=1e-3, optim_kwargs={"eps": 1e-6}, **kw(device))
    budget = pm.options.memory_budget
    assert pm.options.budget_source == "device" and budget == pytest.approx((need + least) / 2)
    assert pm.plan.stats()["peak_memory_bytes"] <= budget < need
    assert pm.specs != free.specs


def test_device_budget_unmet_names_what_would_fit():
    """No plan within the device's budget: a MemoryBudgetError with the smallest peak found, where
    the budget came from, and the ways out (more ranks, checkpointing, a pipeline, no budget)."""
    model, x, y = wide_mlp(512)
    with pytest.raises(MemoryBudgetError) as err:
        sw.parallelize(model, sw.Mesh((4,), ("dp",)), x, example_targets=y, **kw(200_000))
    msg = str(err.value)
    assert "device memory" in msg and f"{DEVICE_MEMORY_RESERVE:.0%} reserve" in msg, msg
    least = int(msg.split("at least ")[1].split(",")[0])
    assert least > 200_000 * (1 - DEVICE_MEMORY_RESERVE)
    ranks = int(msg.split("about ")[1].split(" ranks")[0])
    assert ranks > 4, msg
    for way in ('activation_checkpointing="blocks"', "sw.Pipeline", 'memory_budget=float("inf")'):
        assert way in msg, (way, msg)


def test_propagate_over_device_budget_raises():
    """Placements the user gave (propagation) that the device's budget cannot hold: the same typed
    error, not a plan that will not fit."""
    model, x, y = wide_mlp(512)
    mesh = sw.Mesh((2,), ("dp",))
    placed = {n: [R()] for n, _ in model.named_parameters()}
    with pytest.raises(MemoryBudgetError, match="device memory"):
        sw.parallelize(model, mesh, x, example_targets=y, **kw(200_000, param_placements=placed, planner="auto"))
    pm = sw.parallelize(model, mesh, x, example_targets=y,
                        **kw(200_000, param_placements=placed, planner="auto", memory_budget=float("inf")))
    assert pm.options.planner == "propagate" and pm.plan.stats()["peak_memory_bytes"] > 200_000


def test_optimizer_step_in_the_objective():
    """The optimizer step is memory-bound and per rank: a parameter sharded n ways costs 1/n of it
    (ceil-sized shards: uneven too), and the ILP's reported cost is plan_cost plus it for the
    parameters it places."""
    from shardwise.search.params import optimizer_time
    from shardwise.search.solve import plan_cost

    cost, mesh = sw.CostModel.preset("h100"), sw.Mesh((4,), ("dp",))
    val = torch.empty(10, 6)
    whole = optimizer_seconds(cost, val, (R(),), mesh)
    assert whole == pytest.approx(60 * 4 * 7 / cost.memory_bandwidth)  # AdamW: 28 bytes a float32 element
    assert optimizer_seconds(cost, val, (S(0),), mesh) == pytest.approx(whole * 3 / 10)  # 3 of 10 rows
    assert optimizer_seconds(cost, val.bfloat16(), (R(),), mesh, torch.float32) == pytest.approx(whole)
    model, x, y = wide_mlp(64)
    pm = sw.parallelize(model, mesh, x, example_targets=y, **kw())
    prop = pm.plan.prop
    extra = optimizer_time(prop, prop.param_choices, pm.planner.cost)
    assert extra > 0
    assert prop.solve_report.cost_s == pytest.approx(plan_cost(pm.planner, prop) + extra, rel=1e-12)


@pytest.mark.slow
def test_llama3_8b_shape_fits_80gib_by_default():
    """The user's case (issue #49): Llama 3.1 8B's shape on 8 ranks, every parameter to the planner,
    the h100 preset, bf16 policy, checkpointed blocks, no memory_budget: the estimate fits 80 GiB
    (the device budget, 72 GiB); with memory_budget=inf it did not (109.7 GiB)."""
    from shardwise.tools.cluster import models

    model, inputs = models.build(models.config("llama3-8b"), 32, 8, 2048, torch.float32)
    pm = sw.parallelize(model, sw.Mesh((8,), ("dp",)), inputs, input_placements={0: [S(0)], 1: [S(0)]},
                        param_placements="auto", planner="ilp", cost_model=sw.CostModel.preset("h100"),
                        mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16),
                        activation_checkpointing="blocks")
    peak = pm.plan.stats()["peak_memory_bytes"]
    assert peak <= pm.options.memory_budget <= 80 * GIB, peak / GIB
