"""Processes that plan the same step differently are stopped before any program runs (each process
of a torch backend plans on its own; the ILP stops at a wall-clock limit, so load can make two
ranks' plans differ, and their programs' collectives would then not meet).

    python -m pytest tests/module/test_plan_agreement.py -q
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.module.agree import plan_digest
from shardwise.run.launch import spawn

MEGATRON = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)]}


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model, torch.randn(6, 8), torch.randn(6, 4)


def _mse(out, t):
    return ((out - t) ** 2).mean()


def _plan(backend="threads", params=None, rank=0):
    model, x, y = _mlp()
    return sw.parallelize(model, sw.Mesh((2,), ("tp",)), (x,), param_placements=params, loss_fn=_mse,
                          example_targets=(y,), backend=backend)


def test_digest_follows_the_plan_not_the_process():
    a, b, c = _plan().plan, _plan().plan, _plan(params=MEGATRON).plan
    assert plan_digest(a) == plan_digest(b)  # planned twice: the same plan
    assert plan_digest(a) != plan_digest(c)  # another layout: another program


def _same_body(rank):
    pm = _plan("torch")
    loss = pm.step(*(_mlp()[1:]))
    return plan_digest(pm.plan), float(loss)


@pytest.mark.dist
def test_processes_with_the_same_plan_run_and_their_digests_agree():
    """Two processes (each with its own str hash seed) compute the same digest and train."""
    (d0, l0), (d1, l1) = spawn(_same_body, 2, timeout=300)
    assert d0 == d1 and l0 == l1


def _differ_body(rank):
    pm = _plan("torch", params=MEGATRON if rank == 1 else None)  # rank 1 configured otherwise: Megatron's plan
    try:
        pm.step(*(_mlp()[1:]))
    except sw.PlanMismatchError as e:
        return {"message": e.message, "fix": e.fix}
    return None


def _one_rank_reads_the_plan_body(rank):
    """Making a plan is not collective: rank 0 alone reads pm.plan (a forward plan, made here on
    rank 0 only) before every rank steps and then calls the model: nothing waits for the others."""
    model, x, y = _mlp()
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), (x,), loss_fn=_mse, backend="torch")
    if rank == 0:
        assert "planner" in pm.plan.summary()
    loss = pm.step(x, y)
    with torch.no_grad():
        out = pm(x)
    return float(loss), out


@pytest.mark.dist
def test_ranks_that_planned_differently_raise_on_every_rank_before_running():
    for rank, got in enumerate(spawn(_differ_body, 2, timeout=300)):
        assert got is not None, f"rank {rank} did not see the other's plan differ"
        assert f"rank {rank} planned this step differently" in got["message"]
        assert "planner='propagate'" in got["fix"]


@pytest.mark.dist
def test_a_plan_made_on_one_rank_alone_does_not_wait_for_the_others():
    model, x, y = _mlp()
    with torch.no_grad():
        out_want = model(x)
        want = _mse(out_want, y).item()
    for loss, out in spawn(_one_rank_reads_the_plan_body, 2, timeout=300):
        assert loss == pytest.approx(want, rel=1e-5)
        torch.testing.assert_close(out, out_want, rtol=1e-4, atol=1e-5)
