"""Numbers that cannot go bad silently: ``pm.optimizer(..., skip_nonfinite=True)`` skips a step whose
gradients hold a NaN or an infinity on any rank, on every rank alike (threads and gloo), counts it,
logs it and saves the count in checkpoints; finite steps are bitwise those of a plain optimizer and
run torch's step hooks once. ``pm.clip_grad_norm_(..., error_if_nonfinite=True)`` raises as torch's
does, before scaling anything.

    python -m pytest tests/parallel/test_nonfinite.py -q            # threads
    python -m pytest tests/parallel/test_nonfinite.py -q -m slow    # 2 gloo processes
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S

from ..checkpoint.helpers import assert_bitwise, batch, mlp, mse, snapshot

FSDP = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)], "2.bias": [S(0)]}


def _pm(backend="threads"):
    x, _ = batch()
    return sw.parallelize(mlp(hidden=5), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]},
                          param_placements=FSDP, backend=backend)


def _poison(pm, rank: int) -> None:
    """A NaN in one gradient element of ``rank``'s shard only."""
    grad = pm.shards[rank]["0.weight"].grad
    grad.view(-1)[0] = float("nan")


def test_a_nonfinite_step_is_skipped_on_every_rank_counted_and_logged(caplog):
    x, y = batch()
    pm = _pm()
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, skip_nonfinite=True)
    pm.step(x, y)
    opt.step()
    pm.zero_grad()
    before = snapshot(pm, opt)
    pm.step(x, y)
    _poison(pm, 1)
    assert not opt.grads_finite()
    with caplog.at_level(logging.WARNING, logger="shardwise.optim"):
        assert opt.step() is None
    assert opt.skipped_steps == 1
    assert "optimizer step skipped: a gradient holds NaN or inf (1 step(s) skipped so far)" in caplog.text
    assert_bitwise(snapshot(pm, opt), before)  # rank 0's finite shards did not move either
    pm.zero_grad()
    pm.step(x, y)
    opt.step()
    assert opt.skipped_steps == 1
    assert all(bool(torch.isfinite(p).all()) for p in pm.parameters())


def test_finite_steps_are_a_plain_optimizers_and_run_hooks_once():
    x, y = batch()
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch now wraps AdamW.step in its hook runner too
    runs = {}
    for skip in (False, True):
        pm = _pm()
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, skip_nonfinite=skip)
        calls = []
        opt.register_step_post_hook(lambda *a: calls.append(1))
        for _ in range(3):
            pm.step(x, y)
            opt.step()
            pm.zero_grad()
        assert len(calls) == 3
        runs[skip] = snapshot(pm, opt)
    assert_bitwise(runs[True], runs[False])


def test_the_skip_count_is_saved_and_restored(tmp_path):
    x, y = batch()
    pm = _pm()
    opt = pm.optimizer(torch.optim.SGD, lr=0.1, skip_nonfinite=True)
    pm.step(x, y)
    _poison(pm, 0)
    opt.step()
    pm.save(tmp_path / "ck", optimizer=opt, step=1)
    other = _pm()
    opt2 = other.optimizer(torch.optim.SGD, lr=0.1, skip_nonfinite=True)
    assert other.load(tmp_path / "ck", optimizer=opt2) == {"step": 1}
    assert opt2.skipped_steps == 1


def test_clip_error_if_nonfinite_raises_before_scaling():
    x, y = batch()
    pm = _pm()
    pm.step(x, y)
    _poison(pm, 1)
    grads = copy.deepcopy([p.grad for p in pm.parameters()])
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        pm.clip_grad_norm_(1e-3, error_if_nonfinite=True)
    for p, g in zip(pm.parameters(), grads):
        assert torch.equal(p.grad.nan_to_num(7.0), g.nan_to_num(7.0))


def _gloo_body(rank):
    x, y = batch()
    pm = _pm(backend="torch")
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, skip_nonfinite=True)
    pm.step(x, y)
    before = {k: v.clone() for k, v in pm.shards[rank].items()}
    if rank == 1:
        _poison(pm, 1)
    opt.step()
    unchanged = all(torch.equal(v, before[k]) for k, v in pm.shards[rank].items())
    return {"skipped": opt.skipped_steps, "unchanged": unchanged, "state": len(opt.state)}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gloo_ranks_agree_on_the_skip():
    """Rank 1's gradient holds a NaN, rank 0's are finite: both skip (no state made, shards unchanged)."""
    from shardwise.run.launch import spawn

    for out in spawn(_gloo_body, 2, timeout=120):
        assert out == {"skipped": 1, "unchanged": True, "state": 0}
