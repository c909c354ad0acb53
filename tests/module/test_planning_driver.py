"""The planning driver (module/planning.py) and the ParallelModule's state: the parameters the
planner places are chosen by the first step plan, and the model's state is cut into shards once,
with those placements: no parameter is gathered to full size and cut again (no gather-and-reslice,
no plan cache flush), unless shards were asked for before any plan could choose.

    python -m pytest tests/module/test_planning_driver.py -q
"""
from __future__ import annotations

import sys

import pytest

import shardwise as sw
from shardwise import Replicate as R
from shardwise.module import parallel_module
from shardwise.run.backend import ThreadsBackend
from tests.models import zoo
from tests.parallel.harness import check_training

# compute-bound and no gradient buckets (each gradient all_reduce pays its latency): the ILP
# makes this MLP tensor parallel on 2 ranks (tests/search/test_auto_params.py)
TP = dict(planner="ilp", cost_model=sw.CostModel(flops=1e9), bucket_bytes=None, steps=2, lr=1e-3)


@pytest.fixture
def counted(monkeypatch):
    """{"cuts": calls of the backend's shard_state, "gathers": parameters gathered to full size to be
    cut again (ParallelModule._adopt; gradients() and state_dict() gather too, for the caller)}."""
    seen = {"cuts": 0, "gathers": 0}
    cut, gather = ThreadsBackend.shard_state, parallel_module.gather

    def counting_cut(self, model, specs):
        seen["cuts"] += 1
        return cut(self, model, specs)

    def counting_gather(*args, **kwargs):
        seen["gathers"] += sys._getframe(1).f_code.co_name == "_adopt"
        return gather(*args, **kwargs)

    monkeypatch.setattr(ThreadsBackend, "shard_state", counting_cut)
    monkeypatch.setattr(parallel_module, "gather", counting_gather)
    return seen


@pytest.mark.parametrize("plan_at", ["parallelize", "first step"])
def test_planner_placements_cut_the_state_once(counted, plan_at):
    """Planned at parallelize (example_targets) or at the first step (loss_fn, no targets yet):
    the shards are cut once, with the planner's tensor-parallel placements, and never gathered
    and cut again; training equals one device."""
    model, x, y, loss_fn = zoo.mlp(batch=6)
    kw = {"example_targets": y} if plan_at == "parallelize" else {}
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), x, loss_fn=loss_fn, planner="ilp",
                        cost_model=sw.CostModel(flops=1e9), bucket_bytes=None, **kw)
    assert counted == {"cuts": 0, "gathers": 0}  # cut when first needed
    pm.step(*x, *y)
    pm.step(*x, *y)
    assert counted == {"cuts": 1, "gathers": 0}, counted
    assert any(pl != (R(),) for pl in pm.specs.values()), pm.specs
    for ph, name in pm.plan.param_placeholders.items():  # each shard as the plan lays it out
        assert pm.shards[0][name].shape == pm.plan.prop.layouts[ph][0].local_shape(pm.mesh, 0)
    model, x, y, loss_fn = zoo.mlp(batch=6)
    check_training(model, sw.Mesh((2,), ("tp",)), x, y, loss_fn, example_targets=y, **TP)
    assert counted["gathers"] == 0


def test_an_optimizer_made_before_the_first_plan_keeps_its_parameters(counted):
    """pm.optimizer before any plan could choose (loss_fn, no example targets) needs the shards:
    they are cut replicated, and the first step plan cuts the planner's parameters again in place,
    so the optimizer's parameters are the ones that train; exact against one device."""
    model, x, y, loss_fn = zoo.mlp(batch=6)
    pm = check_training(model, sw.Mesh((2,), ("tp",)), x, y, loss_fn, **TP)
    moved = sum(pl != (R(),) for pl in pm.specs.values())
    assert moved and counted["cuts"] == 1 and counted["gathers"] == moved, (counted, pm.specs)


def test_plans_are_keyed_by_signature_and_mode():
    """One plan per signature and training flag; the options reach the planner once, checked."""
    model, x, y, loss_fn = zoo.mlp(batch=6)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, loss_fn=loss_fn, input_placements={0: [sw.Shard(0)]},
                        example_targets=y, bucket_bytes=1 << 20)
    assert pm.planner.bucket_bytes == 1 << 20 and pm.options.planner == "propagate"
    first = pm.plan
    pm.step(*x, *y)
    assert pm.plan is first
    pm.eval()
    pm.step(*x, *y)
    assert pm.plan is not first and len(pm.planning._plans) == 2
    with pytest.raises(sw.ConfigError, match="unknown planner"):
        sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, loss_fn=loss_fn, planner="greedy")
