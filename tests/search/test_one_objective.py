"""One objective: the step time a plan reports (stats()["est_step_time_s"], search/steptime.py) is
the figure its planner minimised (search/ilp.plan_cost; the ILP's own optimum for its plan).

    python -m pytest tests/search/test_one_objective.py -q
"""
from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.search.ilp import plan_cost
from shardwise.search.params import optimizer_time
from shardwise.search.schedules import simulate
from tests.models import zoo
from tests.parallel.harness import check_training


@pytest.mark.parametrize("planner,shape", [("ilp", (2, 2)), ("propagate", (4,))], ids=["ilp-2x2", "propagate-4"])
def test_stats_step_time_is_the_objective(planner, shape):
    model, x, y, loss_fn = zoo.mlp()
    mesh = sw.Mesh(shape, ("dp", "tp")[: len(shape)])
    pm = sw.parallelize(model, mesh, x, loss_fn=loss_fn, example_targets=y, planner=planner,
                        input_placements={0: {"dp": sw.Shard(0)}},
                        param_placements="auto" if planner == "ilp" else None)
    reported = pm.plan.stats()["est_step_time_s"]
    optimizer_s = optimizer_time(pm.plan.prop, pm.plan.param_placeholders, pm.plan.cost)  # the update after backward
    assert optimizer_s > 0 and pm.plan.stats()["optimizer_time_s"] == optimizer_s
    assert reported == pytest.approx(plan_cost(pm.planner, pm.plan.prop) + optimizer_s, rel=1e-9)
    report = pm.plan.prop.solve_report
    if planner == "ilp":
        assert reported == pytest.approx(report.cost_s, rel=1e-9)
        assert reported == pytest.approx(report.objective_s, rel=1e-9)


@pytest.mark.parametrize("planner", ["ilp", "propagate"])
def test_pipeline_step_time_is_the_objective(planner):
    """A pipeline plan (pp x dp): its est_step_time_s is the modelled schedule's makespan, bubble
    and point-to-point messages included, plus the epilogue; the ILP's search chose its plan by
    that figure (SolveReport.cost_s, also what it would be for propagation's plan), not by one
    microbatch's time."""
    from tests.pipeline.models import Net, data, mse, pipe

    x, y = data(8)
    kw = dict(loss_fn=mse, example_targets=(y,), input_placements={0: {"dp": sw.Shard(0)}},
              target_placements={0: {"dp": sw.Shard(0)}}, pipeline=pipe("1f1b", 4))
    if planner == "ilp":
        kw["planner"], kw["param_placements"] = "ilp", "auto"
    pm = check_training(Net(), sw.Mesh((2, 2), ("pp", "dp")), (x,), (y,), **kw)  # and it runs exactly
    st, tl = pm.plan.stats(), pm.plan.timeline
    secs = pm.plan.piece_seconds
    epilogue = max(secs.get((s, "E"), 0.0) for s in range(2))
    assert st["est_step_time_s"] == pytest.approx(tl.end + epilogue, rel=1e-12)
    # the bubble is in it: the makespan exceeds the busiest rank's own work
    busy = max(tl.busy(r) for r in range(2))
    assert tl.end > busy and st["bubble_fraction"] > 0
    # messages are in it: the same schedule with free messages ends sooner
    assert st["p2p_bytes"] > 0
    free = simulate(pm.plan.schedule, lambda a: secs.get((a.stage, a.kind), 0.0))
    assert free.end < tl.end
    report = pm.plan.prop.solve_report
    if planner == "ilp":
        assert st["est_step_time_s"] == pytest.approx(report.cost_s, rel=1e-12)
        assert report.cost_s <= report.propagation_cost_s
        # the program's own objective is the schedule's makespan for an even split (the bubble of
        # (p - 1) / (m + p - 1) included), with the gradients' reductions once a step: what it
        # minimised is plan_cost under those weights; the plan's split and messages only add
        vplanner = pm.planning.pipeline.planner
        w, w_out = vplanner.objective_weights
        assert w == pytest.approx((4 + 2 - 1) / 2) and w_out == 0.5
        assert report.objective_s == pytest.approx(plan_cost(vplanner, pm.plan.prop), rel=1e-9)
        assert report.objective_s <= report.cost_s * (1 + 1e-9)
        # the same price of the plan, made again from its Propagation
        price = pm.planning.pipeline.pricer(pm.plan.traced, pm.plan.plan.param_placeholders, frozenset())
        assert price(pm.plan.prop) == pytest.approx(st["est_step_time_s"], rel=1e-12)
    else:
        assert report is None
