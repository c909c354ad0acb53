"""The hand recipes are the ILP's starts (issue #49, "never worse than a recipe"): with
``param_placements="auto"``, planning for a device (the cost model knows its memory, as the
calculator's presets do) or under a ``memory_budget``, the recipes that apply (FSDP on the data dims, Megatron on "tp", the two
merged; module/recipe_starts.py) are priced before the rounds, the cheapest that fits is where the
rounds start, and the rounds only keep a cheaper plan: the planner's answer is never costlier than a
recipe in its own cost model. The prices are the recipes' own plans' (``parallelize(param_placements=
recipe)``, est_step_time_s), so the comparison is like for like.

    python -m pytest tests/search/test_recipe_starts.py -q -p no:cacheprovider
"""
import copy

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from tests.parallel.harness import check_training
from tests.search.test_plan_time_limit import tiny_llama

H100 = sw.CostModel.preset("h100")  # a device: the cost model knows its memory


def _recipes(model):
    meg = sw.recipes.megatron(model, "tp")
    return {"fsdp": sw.recipes.fsdp(model, "dp"), "megatron": meg,
            "fsdp+megatron": sw.recipes.merge(sw.recipes.fsdp(model, "dp", beside=meg), meg)}


def test_auto_is_never_costlier_than_a_recipe_and_prices_them_as_their_own_plans():
    model, inputs = tiny_llama()
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    pm = sw.parallelize(copy.deepcopy(model), mesh, inputs, planner="ilp", cost_model=H100,
                        memory_budget=float("inf"))
    report, auto = pm.plan.prop.solve_report, pm.plan.stats()["est_step_time_s"]
    assert set(report.starts) == {"fsdp", "megatron", "fsdp+megatron"}, report
    for label, spec in _recipes(model).items():
        own = sw.parallelize(copy.deepcopy(model), mesh, inputs, param_placements=spec, cost_model=H100,
                             memory_budget=float("inf")).plan.stats()["est_step_time_s"]
        assert report.starts[label] == pytest.approx(own, rel=1e-9), (label, report)
        assert auto <= own * (1 + 1e-9), (label, auto, own, report)
    assert "recipes priced" in str(report)


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 512), nn.Linear(512, 64)

    def forward(self, x):
        return (self.down(torch.relu(self.up(x))) ** 2).mean()


def test_a_recipe_that_fits_starts_the_search_where_propagation_does_not():
    """Parameters whole (propagation's start) do not fit the budget; FSDP's do: the rounds start from
    FSDP's plan, the answer fits and is no costlier than FSDP's own, and it trains as one device."""
    torch.manual_seed(0)
    model, x = _Wide(), torch.randn(16, 64)
    mesh = sw.Mesh((4,), ("dp",))
    whole = sw.parallelize(copy.deepcopy(model), mesh, (x,), input_placements={0: [sw.Shard(0)]})
    fsdp = sw.parallelize(copy.deepcopy(model), mesh, (x,), input_placements={0: [sw.Shard(0)]},
                          param_placements=sw.recipes.fsdp(model, "dp"))
    peak_whole, peak_fsdp = whole.plan.stats()["peak_memory_bytes"], fsdp.plan.stats()["peak_memory_bytes"]
    assert peak_fsdp < peak_whole
    budget = (peak_whole + peak_fsdp) / 2
    pm = check_training(model, mesh, (x,), input_placements={0: [sw.Shard(0)]}, planner="ilp",
                        param_placements="auto", memory_budget=budget)
    report = pm.plan.prop.solve_report
    assert report.starts["fsdp"] < float("inf") and report.started_from == "fsdp", report
    assert pm.plan.stats()["peak_memory_bytes"] <= budget
    assert pm.plan.stats()["est_step_time_s"] <= fsdp.plan.stats()["est_step_time_s"] * (1 + 1e-9), report


def test_a_threads_run_on_the_host_prices_no_recipe():
    """The host's cost model (no device memory) and no budget: no starts (three propagations, ~1 CPU s
    on this model), as the plan-time bound of tests/search/test_plan_time_limit.py holds it to."""
    model, inputs = tiny_llama()
    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), inputs, planner="ilp")
    assert pm.plan.prop.solve_report.starts == {} and pm.plan.prop.solve_report.started_from == "propagation"
