"""The calculator's figures cannot break its invariants (tools/cluster/invariants.py): every memory
part >= 0, the live peak the sum of its parts and at least the resident state, the reserve at least
the live peak, ``fits`` exactly the chosen peak within the budget, and the step's total work alike
across layouts within 15% (less what a layout replicates on purpose and says so).

A property test over calculator configurations (hypothesis): depth, pipelines of many stages
(every schedule, interleaved stages, microbatches), activation checkpointing, meshes of one and two
dims, memory budgets. The tiny Llama's blocks are planned once per mesh, policy and layout
(``estimate(plans=...)``, tests/cluster/_tiny.py) and reused, so each example only stamps and plays its
schedule. The quick test runs in CI; every policy, mesh and candidate (the ILP's too) is ``slow``.

    python -m pytest tests/cluster/test_invariants.py -q
"""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardwise.core.errors import CliError
from shardwise.search.schedules import SCHEDULES
from shardwise.tools.cluster import report
from shardwise.tools.cluster.calc import Job, Layout, estimate
from shardwise.tools.cluster.invariants import FiguresError, check_layout, step_work, total_work

from ._tiny import PLANS, config

MESHES = {"dp2": ((2,), ("dp",)), "dp2xtp2": ((2, 2), ("dp", "tp"))}


def _assert_invariants(est) -> None:
    """The invariants, restated here from the estimate's JSON (what a user reads)."""
    d = report.data(est)
    for c in est.candidates:
        assert all(c.memory[k] >= 0 for k in report.MEMORY_KINDS), (c.name, c.memory)
        assert c.memory["peak"] >= c.memory["parameters"] + c.memory["optimizer_state"]
        assert c.memory.get("reserved", math.inf) >= c.memory["peak"] * (1 - 1e-9)
    assert d["fits"] == (d["peak_memory_bytes"] <= d["memory_budget_bytes"])
    assert d["peak_memory_bytes"] == pytest.approx(sum(d["memory_bytes"].values()), rel=1e-9)
    work = {c.name: total_work(c, est.mesh.size) for c in est.candidates}
    least = step_work(est.candidates, {id(c): w for c, w in zip(est.candidates, work.values())})
    for c in est.candidates:  # beyond 15% of the step's only where the layout says so, and then not chosen
        assert (work[c.name] > 1.15 * least) == (c.excess_work is not None), (work, c.excess_work)
        named = next(x for x in d["candidates"] if x["layout"] == c.name)
        assert named["excess_work"] == c.excess_work
        if c.excess_work is not None:
            assert f"does {c.excess_work:.2f}x the step's work" in report.text(est)
    if any(c.excess_work is None for c in est.candidates):
        assert est.layout.excess_work is None


def _estimate(layers, pp, m, schedule, v, mesh, checkpoint, budget_mib, candidates):
    shape, names = MESHES[mesh]
    inner = math.prod(shape)
    job = Job(None, gpu="h100", gpus=pp * inner, gpus_per_node=inner, seq=32, local_batch=m if pp > 1 else 1,
              precision="bf16", checkpoint=checkpoint, memory_budget=budget_mib * 2 ** 20,
              config_path=config(layers), pp=pp, microbatches=m if pp > 1 else None,
              schedule=schedule, stages_per_rank=v if schedule == "interleaved" else None,
              candidates=tuple(c for c in candidates if c != "fsdp+tp" or "tp" in names))
    try:
        return estimate(job, shape, names, plans=PLANS)
    except CliError:  # a schedule the pipeline does not allow (more stages than blocks, m not a multiple of pp)
        assume(False)


CONFIGS = dict(layers=st.integers(3, 32), pp=st.sampled_from([1, 1, 2, 3, 4, 8]),
               m=st.sampled_from([1, 2, 4, 8, 16]), schedule=st.sampled_from(sorted(SCHEDULES)), v=st.integers(1, 3),
               budget_mib=st.floats(0.5, 64.0))


@settings(max_examples=12, deadline=None)
@given(**CONFIGS)
def test_invariants_hold_for_any_configuration(layers, pp, m, schedule, v, budget_mib):
    """Full activation checkpointing, FSDP and FSDP x Megatron on 2 x 2 per stage: two plans (shared with
    test_calculator.py's quick test), then stamps and schedules."""
    _assert_invariants(_estimate(layers, pp, m, schedule, v, "dp2xtp2", "full", budget_mib, ("fsdp", "fsdp+tp")))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(**CONFIGS, mesh=st.sampled_from(sorted(MESHES)), checkpoint=st.sampled_from(["none", "selective", "full"]))
def test_invariants_hold_for_any_configuration_and_layout(layers, pp, m, schedule, v, budget_mib, mesh, checkpoint):
    """Every policy and every candidate, the planner's ILP included."""
    _assert_invariants(_estimate(layers, pp, m, schedule, v, mesh, checkpoint, budget_mib,
                                 ("planner", "fsdp", "fsdp+tp", "dp+tp")))


def test_a_figure_that_cannot_be_true_is_refused():
    """The checks can fail: negative activations, a peak below the resident state, a reserve below the live peak."""
    mem = {"parameters": 4.0, "gradients": 0.0, "optimizer_state": 8.0, "activations": -20.0, "peak": -8.0}
    lay = Layout("fsdp", {}, None, dict(mem))
    with pytest.raises(FiguresError, match="activations is .* below zero"):
        check_layout(lay, 100.0)
    with pytest.raises(FiguresError, match="below the live peak"):
        check_layout(dataclasses.replace(lay, memory={**mem, "activations": 1.0, "peak": 13.0, "reserved": 12.0}),
                     100.0)
    check_layout(dataclasses.replace(lay, memory={**mem, "activations": 1.0, "peak": 13.0, "reserved": 13.0}), 100.0)
