"""The torch backend on real gloo processes (shardwise.run.launch.spawn) against one device:
MLP data and Megatron tensor parallelism on (2,), data x tensor on (2, 2).

    python -m pytest tests/parallel/test_gloo.py -q -m dist --durations=0

Process start-up costs seconds, so one spawn per world size runs every check of that size;
each rank returns its losses, gathered gradients, final state and its program's source, and
the parent compares them with one device and with the threads backend's program.
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.run.launch import spawn

from ..models.zoo import seeded_mlp
from .harness import assert_close, single_step

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS, LR = 3, 1e-2
MEGATRON = {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)}


def mlp(hidden=8):
    return seeded_mlp(hidden=hidden)


def mse(out, y):
    return ((out - y) ** 2).mean()


def data(batch):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


# (name, mesh shape, mesh names, batch, parallelize kwargs)
CASES = {
    2: [
        ("dp_uneven_batch", (2,), ("dp",), 5, dict(input_placements={0: [S(0)]})),
        ("megatron", (2,), ("tp",), 4, dict(param_placements={n: [p] for n, p in MEGATRON.items()})),
        # hidden units in 2 groups (as a fused projection's parts): gathers of them open the groups
        ("megatron_groups", (2,), ("tp",), 4, dict(param_placements={n: [S(p.dim, groups=2)]
                                                                   for n, p in MEGATRON.items()})),
    ],
    4: [
        ("dp_x_tp", (2, 2), ("dp", "tp"), 5, dict(input_placements={0: {"dp": S(0)}},
                                               param_placements={n: {"tp": p} for n, p in MEGATRON.items()})),
    ],
}


def _run(backend, shape, names, batch, kwargs):
    """Three AdamW steps; what every rank reports (gradients and state are gathered: collective)."""
    x, y = data(batch)
    pm = sw.parallelize(mlp(), sw.Mesh(shape, names), (x,), loss_fn=mse, backend=backend, **kwargs)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR)
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(pm.step(x, y))
        grads.append(pm.gradients())
        opt.step()
        opt.zero_grad()
    return pm, {"losses": losses, "grads": grads, "state": pm.state_dict()}


def _rank_body(rank, world):
    import torch.distributed as dist

    out = {"backend": dist.get_backend()}
    for name, shape, names, batch, kwargs in CASES[world]:
        pm, res = _run("torch", shape, names, batch, kwargs)
        res["program"] = pm.plan.program(rank)
        out[name] = res
    return out


def _reference(batch):
    x, y = data(batch)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for _ in range(STEPS):
        loss, g = single_step(model, (x,), (y,), mse)
        losses.append(loss)
        grads.append({n: t.clone() for n, t in g.items()})
        opt.step()
    return {"losses": losses, "grads": grads, "state": copy.deepcopy(model.state_dict())}


# 4 processes (~40 s on 2 cores) with the slow tests; tests/run/test_distributed.py's world4 case
# checks sub-groups per mesh dim on 4 gloo processes by default.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["world2", "world4"])
def world(request):
    return request.param, spawn(_rank_body, request.param, request.param, timeout=240)


def test_gloo_matches_one_device_and_threads(world):
    size, outs = world
    assert [o["backend"] for o in outs] == ["gloo"] * size
    for name, shape, names, batch, kwargs in CASES[size]:
        want = _reference(batch)
        threads_pm, threads = _run("threads", shape, names, batch, kwargs)
        for rank, out in enumerate(outs):
            got = out[name]
            where = f"{name} rank {rank}"
            for i in range(STEPS):
                assert_close(got["losses"][i], want["losses"][i], f"{where} step {i} loss")
                assert_close(got["losses"][i], threads["losses"][i], f"{where} step {i} loss vs threads", 0, 0)
                for n, g in want["grads"][i].items():
                    assert_close(got["grads"][i][n], g, f"{where} step {i} grad of {n}")
            for n, p in want["state"].items():
                assert_close(got["state"][n], p, f"{where} parameter {n} after {STEPS} steps")
            # both backends run the very same per-rank program
            assert got["program"] == threads_pm.plan.program(rank), where
