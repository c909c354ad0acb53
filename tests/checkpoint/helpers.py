"""Shared pieces of the checkpoint tests: models, placements, training and bitwise comparisons."""
from __future__ import annotations

import copy

import torch

import shardwise as sw
from shardwise import Shard as S

from ..models.zoo import seeded_mlp


def mlp(d_in=6, hidden=5, d_out=3, seed=0):
    """The zoo's seeded MLP, 5 hidden units by default."""
    return seeded_mlp(d_in, hidden, d_out, seed)


def mse(out, y):
    return ((out - y) ** 2).mean()


def batch(n=6, d_in=6, d_out=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def fsdp(model, mesh_dim="dp"):
    return {n: {mesh_dim: S(0)} for n, _ in model.named_parameters()}


# eps dominates the float noise of gradients that are zero in exact arithmetic (an attention key
# bias's), which Adam's m / sqrt(v) would otherwise turn into full-size, run-dependent steps
ADAMW = dict(lr=1e-3, eps=1e-6, weight_decay=0.1)


def adamw(params):
    return torch.optim.AdamW(params, **ADAMW)


def train(pm, opt, inputs, targets, steps):
    losses = []
    for _ in range(steps):
        losses.append(pm.step(*inputs, *targets))
        opt.step()
        opt.zero_grad()
    return losses


def train_one_device(model, opt, inputs, targets, loss_fn, steps):
    losses = []
    for _ in range(steps):
        out = model(*inputs)
        loss = loss_fn(out, *targets) if loss_fn is not None else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def fake_steps(pm, opt, steps=2, seed=3):
    """Optimizer steps from seeded full gradients laid out as each parameter (no tracing): the
    optimizer state then exists and agrees across replicas, as after real training steps."""
    g = torch.Generator().manual_seed(seed)
    full = {n: p for n, p in pm.model.named_parameters()}
    for _ in range(steps):
        for name, p in full.items():
            grad = torch.randn(p.shape, generator=g)
            lay = sw.Layout(p.shape, p.dtype, pm.specs[name])
            for rank, shards in pm.shards.items():
                shards[name].grad = lay.local_view(grad, pm.mesh, rank).clone()
        opt.step()
        opt.zero_grad()


def snapshot(pm, opt) -> dict:
    """Full parameters and full optimizer state, gathered (no arithmetic: bitwise comparable); copied,
    since like torch's state dicts they may share storage with what keeps training."""
    return copy.deepcopy({"model": pm.state_dict(), "optim": pm.optimizer_state_dict(opt)})


def assert_bitwise(got, want, where=""):
    """Nested dicts / lists of tensors and plain values are equal, tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{tuple(got.shape)} " \
                                                                    f"vs {want.dtype}{tuple(want.shape)}"
        assert torch.equal(got, want), f"{where}: max diff {(got.double() - want.double()).abs().max()}"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"
        for k in want:
            assert_bitwise(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} vs {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_bitwise(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def parallel(model, mesh, inputs, params, inputs_spec=None, backend="threads"):
    return sw.parallelize(copy.deepcopy(model), mesh, inputs, loss_fn=mse, param_placements=params,
                          input_placements=inputs_spec, backend=backend)

