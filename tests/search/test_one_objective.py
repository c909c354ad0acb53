"""One objective: the step time a plan reports (stats()["est_step_time_s"], search/steptime.py) is
the figure its planner minimised (search/ilp.plan_cost; the ILP's own optimum for its plan).

    python -m pytest tests/search/test_one_objective.py -q
"""
from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.search.ilp import plan_cost
from tests.models import zoo


@pytest.mark.parametrize("planner,shape", [("ilp", (2, 2)), ("propagate", (4,))], ids=["ilp-2x2", "propagate-4"])
def test_stats_step_time_is_the_objective(planner, shape):
    model, x, y, loss_fn = zoo.mlp()
    mesh = sw.Mesh(shape, ("dp", "tp")[: len(shape)])
    pm = sw.parallelize(model, mesh, x, loss_fn=loss_fn, example_targets=y, planner=planner,
                        input_placements={0: {"dp": sw.Shard(0)}},
                        param_placements="auto" if planner == "ilp" else None)
    reported = pm.plan.stats()["est_step_time_s"]
    assert reported == pytest.approx(plan_cost(pm.planner, pm.plan.prop), rel=1e-9)
    report = pm.plan.prop.solve_report
    if planner == "ilp":
        assert reported == pytest.approx(report.cost_s, rel=1e-9)
        assert reported == pytest.approx(report.objective_s, rel=1e-9)
