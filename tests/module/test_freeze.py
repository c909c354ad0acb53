"""Freezing and unfreezing parameters after the first step (fine-tuning's habit: the embeddings or
a whole backbone frozen, later thawed): the next step plans again, a frozen parameter gets no
gradient and sends none, and everything else equals one device with the same parameters frozen.

    python -m pytest tests/module/test_freeze.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.core.errors import ShardingError
from tests.models import zoo
from tests.parallel.harness import assert_close


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(7, 8), torch.randn(7, 4)  # 7 rows: uneven on 2 data ranks
    return model, x, y


def _mse(out, t):
    return ((out - t) ** 2).mean()


def _check(pm, ref, loss, want):
    """Loss and every gradient against ``ref`` (one device); a frozen parameter's shards on every
    rank: requires_grad False, no .grad."""
    assert_close(loss, want, "loss")
    got = pm.gradients()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            assert_close(got[name], p.grad, f"grad {name}")
        else:
            assert got.get(name) is None, f"{name} is frozen but has a gradient"
            for rank in pm.shards:
                shard = pm.named_local_parameters(rank)[name]
                assert not shard.requires_grad and shard.grad is None, (name, rank)


MESHES = {
    "dp": (sw.Mesh((2,), ("dp",)), None),
    "dp x tp (Megatron MLP)": (sw.Mesh((2, 2), ("dp", "tp")),
                               {"0.weight": {"tp": S(0)}, "0.bias": {"tp": S(0)}, "2.weight": {"tp": S(1)}}),
}


@pytest.mark.parametrize("case", list(MESHES))
def test_freeze_then_thaw_after_steps_equals_one_device(case):
    mesh, params = MESHES[case]
    model, x, y = _mlp()
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, mesh, (x,), input_placements={0: {"dp": S(0)}}, param_placements=params,
                        loss_fn=_mse, example_targets=(y,))
    opt, ref_opt = pm.optimizer(torch.optim.AdamW, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    first, sent = pm.plan, pm.plan.stats()["comm_bytes"]

    def step():
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm.step(x, y)
        want = _mse(ref(x), y)
        want.backward()
        _check(pm, ref, loss, want)
        opt.step()
        ref_opt.step()

    step()
    for m in (model, ref):  # freeze the first layer through the model, as with nn.Module
        m[0].weight.requires_grad_(False)
        m[0].bias.requires_grad_(False)
    frozen = pm.state_dict()["0.weight"]
    step()
    assert pm.plan is not first, "freezing did not plan the step again"
    if case == "dp":  # the frozen layer's gradients are no longer all-reduced
        assert pm.plan.stats()["comm_bytes"] < sent, (pm.plan.stats()["comm_bytes"], sent)
    step()
    full = pm.state_dict()
    assert torch.equal(full["0.weight"], frozen), "a frozen parameter changed under AdamW"
    for m in (model, ref):  # thaw: the gradient is computed again, and the first plan is reused
        m[0].weight.requires_grad_(True)
        m[0].bias.requires_grad_(True)
    step()
    assert pm.plan is first
    for name, p in ref.named_parameters():
        assert_close(pm.state_dict()[name], p.detach(), f"parameter {name} after the steps")


def test_hf_gpt2_frozen_embeddings_after_a_step():
    """Hugging Face GPT-2 (tied head: the token embedding is also the output projection) with its
    position embedding frozen after one step, on 2 data ranks with 3 rows."""
    model = zoo.gpt2(batch=3, seq=8).model
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (), example_kwargs={"input_ids": ids, "labels": ids})
    pm.step(input_ids=ids, labels=ids)
    for m in (model, ref):
        m.transformer.wpe.weight.requires_grad_(False)
    pm.zero_grad()
    ref.zero_grad()
    loss = pm.step(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    _check(pm, ref, loss, want)


def test_a_shard_frozen_directly_is_named():
    """Freezing goes through the model (the plans read it there): a local shard frozen on its own
    would still be given the gradient the plan computes, so the step says so instead."""
    model, x, y = _mlp()
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [S(0)]}, loss_fn=_mse,
                        example_targets=(y,))
    pm.step(x, y)
    pm.zero_grad()
    pm.named_local_parameters(0)["2.weight"].requires_grad_(False)
    with pytest.raises(ShardingError, match=r"'2\.weight'.*frozen") as e:
        pm.step(x, y)
    assert "requires_grad_(False)" in e.value.fix
