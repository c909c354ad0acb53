"""Compare a sharded run with the single-device run of the same computation."""
from __future__ import annotations

import copy

import torch

import shardwise as sw


def assert_close(got, want, what, rtol=1e-4, atol=1e-5):
    assert got is not None, f"{what}: missing"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def single_step(model, inputs, targets, loss_fn):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = loss_fn(out, *targets) if loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def check_training(model, mesh, inputs, targets=(), loss_fn=None, steps=1, lr=1e-2, rtol=1e-4, atol=1e-5,
                   batches=None, optim_kwargs=None, **kwargs):
    """Sharded loss and every gradient equal the single-device run; with steps > 1 also AdamW updates.

    ``optim_kwargs`` go to both AdamW optimizers (e.g. ``eps``: a gradient that is zero in exact
    arithmetic, such as an attention key bias's, is float noise that Adam's m / sqrt(v) turns
    into a full-size step unless eps dominates it)."""
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, mesh, tuple(inputs), loss_fn=loss_fn, **kwargs)
    opt = pm.optimizer(torch.optim.AdamW, lr=lr, **(optim_kwargs or {}))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, **(optim_kwargs or {}))
    batches = batches or [(inputs, targets)] * steps
    for i, (x, y) in enumerate(batches):
        loss = pm.step(*x, *y)
        ref_loss, ref_grads = single_step(ref, x, y, loss_fn)
        assert_close(loss, ref_loss, f"step {i} loss", rtol, atol)
        grads = pm.gradients()
        for n, g in ref_grads.items():
            assert_close(grads[n], g, f"step {i} grad of {n}", rtol, atol)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
    state = pm.state_dict()
    for n, p in ref.state_dict().items():
        assert_close(state[n], p, f"parameter {n} after {len(batches)} steps", rtol, atol)
    return pm
