"""Compare a sharded run with the single-device run of the same computation."""
from __future__ import annotations

import copy
import math

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


def assert_traced_equals_eager(traced, model, inputs) -> None:
    """The traced step run on ``model``'s weights gives the eager model's loss and gradients (an
    HF model whose output has ``.loss``)."""
    loss, grads = traced.run(model, inputs)
    ref = model(*inputs).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


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


def assert_outputs_close(got, want, what, rtol=1e-4, atol=1e-5):
    """Every tensor of a forward's output (a tensor, or tuples, lists, dicts and ModelOutputs of
    them) equals the reference's; the structures hold the same keys."""
    if isinstance(want, torch.Tensor):
        assert_close(got, want, what, rtol, atol)
    elif isinstance(want, dict):
        assert set(got.keys()) == set(want.keys()), f"{what}: keys {sorted(got.keys())} != {sorted(want.keys())}"
        for k, v in want.items():
            assert_outputs_close(got[k], v, f"{what}.{k}", rtol, atol)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{what}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_outputs_close(g, w, f"{what}[{i}]", rtol, atol)


def check_forward_and_sgd(pm, ref, inputs, targets=(), loss_fn=None, steps=2, lr=1e-2, rtol=1e-4, atol=1e-5):
    """After check_training: ``ref`` (a copy of the model) takes ``pm``'s full state; then the
    forward-only outputs (``pm(*inputs)``, every tensor) equal ``ref``'s under no_grad, and
    ``steps`` SGD steps each give the same loss, every gradient, and after the update every
    parameter and buffer (``pm.state_dict()``)."""
    ref.load_state_dict(pm.state_dict())
    with torch.no_grad():
        want = ref(*inputs)
    assert_outputs_close(pm(*inputs), want, "forward-only output", rtol, atol)
    pm.zero_grad()
    opt = pm.optimizer(torch.optim.SGD, lr=lr)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr)
    for i in range(steps):
        loss = pm.step(*inputs, *targets)
        ref_loss, ref_grads = single_step(ref, inputs, targets, loss_fn)
        assert_close(loss, ref_loss, f"SGD step {i} loss", rtol, atol)
        grads = pm.gradients()
        for n, g in ref_grads.items():
            assert_close(grads[n], g, f"SGD step {i} grad of {n}", rtol, atol)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        state = pm.state_dict()
        for n, p in ref.state_dict().items():
            assert_close(state[n], p, f"{n} after SGD step {i}", rtol, atol)


def argument_gather_calls(plan, rank: int = 0) -> list:
    """(mesh dim, bytes each rank sends) per all_gather CALL of program arguments that rank
    ``rank``'s program makes: a coalesced unit's (lower/prefetch.start_all_gather: its flat
    buffer, each member padded to the largest along its dim) or a plain one's."""
    from shardwise.core.cost import sent_bytes
    from shardwise.lower import comm
    from shardwise.lower.prefetch import start_all_gather

    calls = []
    for n in plan.program_module(rank, guards=False).graph.nodes:
        if n.op == "call_function" and n.target is start_all_gather:
            members, m, splits = n.args
            numel, itemsize = 0, 0
            for x, (dim, sizes) in zip(members, splits):
                lay = plan.prop.layouts[x.name][0]
                block = list(lay.local_shape(plan.mesh, rank))
                block[dim] = max(sizes)
                numel, itemsize = numel + math.prod(block), lay.itemsize
            calls.append((m, sent_bytes("all_gather", plan.mesh.shape[m], numel, itemsize)))
        elif n.op == "call_function" and n.target is comm.all_gather and n.args[0].op == "placeholder":
            calls.append((n.meta["sw_step"].mesh_dim, n.meta["sw_step"].bytes))
    return calls


def comm_seconds_per_call(plan, rank: int = 0) -> float:
    """The plan's communication priced as the program runs it: one latency per argument
    all_gather call (argument_gather_calls), plus every other step of the plan's moves
    (gradients' reductions in their buckets; a scalar output's, the loss's, a call of its own)."""
    cost, mesh = plan.cost, plan.mesh
    gathers = sum(cost.collective_time("all_gather", b, mesh.shape[m], m, mesh)
                  for m, b in argument_gather_calls(plan, rank))
    args = {n.name for n in plan.prop.gm.graph.nodes if n.op == "placeholder"}
    rest = sum(cost.bucketed_time(s, mesh, plan.bucket_bytes if dst == "output" and s.src.shape else None)
               for dst, src, steps in plan.edges for i, s in enumerate(steps)
               if not (i == 0 and s.kind == "all_gather" and src in args and dst not in ("output", src)))
    return gathers + rest
