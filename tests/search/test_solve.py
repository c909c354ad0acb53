"""The ILP planner (search/solve.py, ``parallelize(..., planner="ilp")``): training stays exact
against one device, the plan is never costlier than propagation's under the cost model,
Llama with Megatron placements gets Megatron's collectives, a bad planner name fails early.

    python -m pytest tests/search/test_solve.py -q --durations=0
"""
import pytest

import shardwise as sw
from shardwise import Shard as S
from shardwise.search.solve import plan_cost
from tests.models import zoo
from tests.parallel.harness import check_training
from tests.parallel.recipes import (MEGATRON, collectives_by_phase, megatron_ok, megatron_transformer, on,
                                    program_collectives)

# At these toy sizes every collective is a few KiB, so the default model's 5 us latency is all
# that counts: one latency round per weight all-gather against two per all-reduce makes
# "gather the (tiny) weights once, compute replicated" honestly cheaper than Megatron, and
# ~1e5 flops are free at 100 Tflop/s. Without latency, bytes decide, as they do for real
# models (megabytes per collective), and Megatron is the optimum.
BYTES_BOUND = sw.CostModel(latency=0.0)
# Compute at 1 Gflop/s outweighs any collective here: the optimum shards nearly everything,
# which exercises many kinds of redistribution (all-to-all, reduce-scatter, ...).
COMPUTE_BOUND = sw.CostModel(flops=1e9)
COST_MODELS = {"default": sw.CostModel(), "compute_bound": COMPUTE_BOUND}
ADAM = dict(steps=2, lr=1e-3, optim_kwargs={"eps": 1e-6})  # see tests/parallel/test_transformer.ADAM
N_LAYERS = 2


def mlp_case(mesh_kind):
    model, x, y, loss_fn = zoo.mlp(batch=6)
    megatron = {"fc1.weight": S(0), "fc1.bias": S(0), "fc2.weight": S(1)}
    return (model, x, y, loss_fn), _specs(mesh_kind, {0: S(0)}, megatron)


def transformer_case(mesh_kind):
    model, x, y, loss_fn = zoo.transformer(batch=4)
    return (model, x, y, loss_fn), _specs(mesh_kind, {0: S(0)}, megatron_transformer(N_LAYERS))


def _specs(mesh_kind, data: dict, megatron: dict):
    if mesh_kind == "dp":
        return sw.Mesh((2,), ("dp",)), dict(input_placements={k: [p] for k, p in data.items()})
    if mesh_kind == "tp":
        return sw.Mesh((2,), ("tp",)), dict(param_placements={n: [p] for n, p in megatron.items()})
    return sw.Mesh((2, 2), ("dp", "tp")), dict(input_placements={k: {"dp": p} for k, p in data.items()},
                                               param_placements=on("tp", megatron))


CASES = {"mlp": mlp_case, "transformer": transformer_case}


def assert_not_costlier(pm, case, mesh, cost_model, **kwargs):
    """The ILP finished and its plan costs no more than propagation's, both priced by plan_cost."""
    report = pm.plan.prop.solve_report
    assert report is not None and report.status.startswith(("optimal", "converged")), report
    # the program prices the plan exactly as plan_cost does (each unique redistribution once)
    assert abs(report.objective_s - report.cost_s) <= 1e-9 * report.cost_s, report
    model, x, y, loss_fn = case
    greedy = sw.parallelize(model, mesh, x, loss_fn=loss_fn, example_targets=y, cost_model=cost_model,
                            planner="propagate", **kwargs)
    ilp_cost, greedy_cost = plan_cost(pm.planner, pm.plan.prop), plan_cost(greedy.planner, greedy.plan.prop)
    assert ilp_cost <= greedy_cost * (1 + 1e-9), f"{report}\nilp {ilp_cost} > propagation {greedy_cost}"


def _combos():
    """Every (case, mesh, cost model); transformer 2x2 under the default model takes 5 rounds of
    local search (~7 s of planning on 2 cores), so it runs with the slow tests."""
    for name in CASES:
        for mesh_kind in ("dp", "tp", "2x2"):
            for cost in COST_MODELS:
                slow = name == "transformer" and mesh_kind == "2x2" and cost == "default"
                yield pytest.param(name, mesh_kind, cost, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name, mesh_kind, cost", list(_combos()))
def test_exact_and_not_costlier(name, mesh_kind, cost):
    case, (mesh, kwargs) = CASES[name](mesh_kind)
    model, x, y, loss_fn = case
    pm = check_training(model, mesh, x, y, loss_fn, planner="ilp", cost_model=COST_MODELS[cost], **ADAM, **kwargs)
    assert_not_costlier(pm, case, mesh, COST_MODELS[cost], **kwargs)


def test_llama_megatron_collectives():
    """Megatron placements on HF Llama: per layer 2 all-reduces in forward and 2 in backward (or
    a reduce-scatter + all-gather pair in place of each: sequence parallelism) and nothing
    else, where propagation carries partial sums into the norm backward (~3 per layer)."""
    model, inputs, _, _ = zoo.llama()
    mesh = sw.Mesh((2,), ("tp",))
    pm = check_training(model, mesh, inputs, (), None, planner="ilp", cost_model=BYTES_BOUND,
                        param_placements=MEGATRON["llama"](N_LAYERS), **ADAM)
    plan = pm.plan
    assert plan.prop.solve_report.status == "optimal", plan.prop.solve_report
    phases = collectives_by_phase(plan)
    assert megatron_ok(phases["forward"], N_LAYERS), f"forward {dict(phases['forward'])}\n{plan.summary()}"
    assert megatron_ok(phases["backward"], N_LAYERS), f"backward {dict(phases['backward'])}\n{plan.summary()}"
    assert plan.stats()["collectives"] == dict(phases["forward"] + phases["backward"])
    for rank in range(2):
        assert program_collectives(plan.program(rank)) == phases["forward"] + phases["backward"]


def test_summary_names_the_planner():
    model, x, y, loss_fn = zoo.mlp()
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, loss_fn=loss_fn, example_targets=y, planner="ilp",
                        input_placements={0: [S(0)]})
    assert "# planner: ilp optimal" in pm.plan.summary()
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, loss_fn=loss_fn, example_targets=y,
                        input_placements={0: [S(0)]})
    assert "# planner:" not in pm.plan.summary()  # propagation is the default


@pytest.mark.parametrize("bad", ["greedy", "ILP", None, 3])
def test_bad_planner_name(bad):
    model, x, y, loss_fn = zoo.mlp()
    with pytest.raises(sw.ShardingError) as err:
        sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, loss_fn=loss_fn, planner=bad)
    msg = str(err.value)
    assert repr(bad) in msg and "'propagate'" in msg and "'ilp'" in msg and "fix:" in msg, msg


def test_fallback_is_reported(monkeypatch):
    """No solution from HiGHS (here: no time at all): the propagation plan is kept and says so."""
    import shardwise.search.ilp as ilp

    class NoSolution:
        x, status, message = None, 1, "time limit reached"

    monkeypatch.setattr(ilp.Model, "solve", lambda self, *a, **k: NoSolution())
    model, x, y, loss_fn = zoo.mlp()
    pm = check_training(model, sw.Mesh((2,), ("tp",)), x, y, loss_fn, planner="ilp",
                        param_placements={"fc1.weight": [S(0)]})
    report = pm.plan.prop.solve_report
    assert report.status.startswith("stopped") and "time limit" in report.status, report
    assert report.cost_s == report.propagation_cost_s
    assert "# planner: ilp stopped" in pm.plan.summary()
