"""The calculator's planner candidate is never worse than a recipe that fits (calc.never_worse): the
recipes (FSDP, FSDP x TP, DP x TP: Megatron on "tp") are planned beside it, and where the search's
own layout does not fit or is slower, the best fitting recipe's placements are its answer, said so.

    python -m pytest tests/cluster/test_planner_vs_recipes.py -q -p no:cacheprovider
    python -m pytest tests/cluster/test_planner_vs_recipes.py -q -p no:cacheprovider -m slow   # Llama 3 shapes
"""
import dataclasses
import json

import pytest

from shardwise.tools.cluster import report
from shardwise.tools.cluster.calc import Job, estimate, never_worse

from ._tiny import PLANS, config

GIB = 2 ** 30


def _tiny_job(**kw):
    return Job(None, gpu="h100", gpus=4, gpus_per_node=4, seq=32, local_batch=1, precision="bf16",
               checkpoint="full", config_path=config(6), **kw)


def test_planner_alone_is_compared_with_every_recipe():
    """--layout planner on 2 x 2: the recipes are planned as references; the planner's step is at most
    the fastest fitting recipe's, and vs_recipes says by how much it wins over each (JSON and text)."""
    est = estimate(_tiny_job(candidates=("planner",)), (2, 2), ("dp", "tp"), plans=PLANS)
    planner = est.layout
    # recipes whose figures do more than the step's work (invariants.mark_excess_work) are not compared
    assert planner.name == "planner" and "fsdp" in planner.vs_recipes
    assert set(planner.vs_recipes) <= {"fsdp", "fsdp+tp", "dp+tp"}
    assert all(f >= 1.0 for f in planner.vs_recipes.values()), planner.vs_recipes  # never slower than one
    got = json.loads(json.dumps(report.data(est)))
    assert got["candidates"][0]["vs_recipes"] == pytest.approx(planner.vs_recipes)
    assert "planner vs recipes" in report.text(est)


def test_a_recipe_is_kept_where_the_search_loses():
    """A planner layout that does not fit, or is slower than a fitting recipe, gives way to the best
    fitting recipe: its placements and figures, named "planner", with a note saying why."""
    est = estimate(_tiny_job(candidates=("planner", "fsdp", "fsdp+tp")), (2, 2), ("dp", "tp"), plans=PLANS)
    planner, recipes = est.candidates[0], est.candidates[1:]
    best = min(recipes, key=lambda r: r.step_time_s)
    budget = max(r.memory["peak"] for r in recipes) * 2
    heavy = dataclasses.replace(planner, memory={**planner.memory, "peak": budget * 2})
    kept = never_worse(heavy, recipes, budget)
    assert kept.name == "planner" and kept.placements == best.placements and "does not fit" in kept.note
    assert kept.step_time_s == best.step_time_s and kept.vs_recipes[best.name] == pytest.approx(1.0)
    slow = dataclasses.replace(planner, optimizer_s=planner.optimizer_s + 10 * best.step_time_s)
    kept = never_worse(slow, recipes, budget)
    assert kept.placements == best.placements and "is slower" in kept.note
    # none fits: the search's own layout stays (the estimate then reports the least memory)
    alone = never_worse(heavy, recipes, min(r.memory["peak"] for r in recipes) / 2)
    assert alone.placements == planner.placements and alone.note == ""


# torchtitan's runs (bf16 policy; selective checkpointing for 8B, full for 70B): model, gpu, mesh, checkpointing
TITAN = [("llama3-8b", "h100", (8,), "selective"), ("llama3-8b", "h100", (8, 8), "selective"),
         ("llama3-70b", "a100", (16, 4), "full"), ("llama3-70b", "h100", (32, 8), "full")]


@pytest.mark.slow
@pytest.mark.parametrize("model,gpu,mesh,ck", TITAN, ids=["8b-8", "8b-8x8", "70b-16x4", "70b-32x8"])
def test_planner_fits_and_is_within_2_percent_of_the_best_recipe(model, gpu, mesh, ck):
    import math

    names = ("dp",) if len(mesh) == 1 else ("dp", "tp")
    job = Job(model, gpu=gpu, gpus=math.prod(mesh), gpus_per_node=8, seq=8192, local_batch=1 if "70b" in model else 2,
              precision="bf16", checkpoint=ck, candidates=("planner",))
    est = estimate(job, mesh, names)
    planner = est.layout
    assert est.fits, planner.memory["peak"] / GIB
    assert planner.vs_recipes and min(planner.vs_recipes.values()) >= 1 / 1.02, planner.vs_recipes
