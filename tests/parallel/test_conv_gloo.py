"""Vision models on real gloo processes (the torch backend) against one device: a ResNet with
BatchNorm in train mode data parallel (statistics all-reduced inside the local batch-norm
calls) and a height-sharded conv stack (halo exchanges through send_recv), 3 ranks, uneven.
About 30 s (three processes starting torch), so it runs with the slow tests:

    python -m pytest tests/parallel/test_conv_gloo.py -q -m slow
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Shard as S
from shardwise.run.launch import spawn

from ..models import vision
from .harness import assert_close, single_step

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]


def mse(out, t):
    return ((out - t) ** 2).mean()


def _cases():
    """(name, model factory, loss, parallelize kwargs): 3 ranks each."""
    return [
        ("resnet_bn", lambda: vision.resnet(5), F.cross_entropy, dict(input_placements={0: [S(0)]})),
        ("halo", lambda: vision.conv_stack(), mse, dict(input_placements={0: [S(2)]}, target_placements={0: [S(2)]})),
    ]


def _steps(pm, x, y, n=2):
    losses, grads = [], []
    for _ in range(n):
        pm.zero_grad()
        losses.append(pm.step(x, y))
        grads.append(pm.gradients())
    return losses, grads, pm.state_dict()


def _rank_body(rank):
    out = {}
    for name, make, loss_fn, kwargs in _cases():
        model, x, y = make()
        pm = sw.parallelize(model, sw.Mesh((3,), ("d",)), (x,), loss_fn=loss_fn, backend="torch", **kwargs)
        out[name] = _steps(pm, x, y) + (pm.plan.stats()["collectives"],)
    return out


def test_gloo_vision_models_match_one_device():
    outs = spawn(_rank_body, 3, timeout=240)
    for name, make, loss_fn, _ in _cases():
        model, x, y = make()
        want = []
        for _ in range(2):
            loss, grads = single_step(model, (x,), (y,), loss_fn)
            want.append((loss, {n: g.clone() for n, g in grads.items()}))
        for rank, out in enumerate(outs):
            losses, grads, state, coll = out[name]
            where = f"{name} rank {rank}"
            for i, (loss, g) in enumerate(want):
                assert_close(losses[i], loss, f"{where} step {i} loss")
                for n, t in g.items():
                    assert_close(grads[i][n], t, f"{where} step {i} grad of {n}")
            for n, t in model.state_dict().items():  # running statistics after 2 steps
                assert_close(state[n], t, f"{where} state {n}")
            assert ("send_recv" in coll) == (name == "halo"), coll
    assert torch.is_tensor(outs[0]["resnet_bn"][2]["stem.1.running_var"])
