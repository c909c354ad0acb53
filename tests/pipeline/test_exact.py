"""Pipelined training equals one device on the threads backend: loss, every gradient and the
parameters after two AdamW steps (rtol 1e-4), Hugging Face GPT-2 and Llama with labels ignored
unevenly across the microbatches, every schedule; dropout masks equal one device's; pipeline x
data x tensor parallel on (2, 2, 2).

    python -m pytest tests/pipeline/test_exact.py -q              # a representative subset
    python -m pytest tests/pipeline/test_exact.py -q -m slow      # the whole cross product
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.module import recipes
from tests.parallel.harness import assert_close, check_training, single_step

from .models import ADAM, Net, data, hf, mse, pipe

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


def train_hf(name, schedule, p, m, layers=None, **kw):
    model, inputs = hf(name, layers=layers or max(2, p * (2 if schedule == "interleaved" else 1) // 2))
    return check_training(model, sw.Mesh((p,), ("pp",)), inputs, (), None, **ADAM, pipeline=pipe(schedule, m), **kw)


@pytest.mark.parametrize("name,schedule,p,m", [("gpt2", "1f1b", 2, 4),
                                               pytest.param("llama", "zero-bubble", 2, 4, marks=pytest.mark.slow)])
def test_hf_equals_one_device(name, schedule, p, m):
    pm = train_hf(name, schedule, p, m)
    st = pm.plan.stats()
    assert 0 < st["bubble_fraction"] < 1 and st["p2p_bytes"] > 0
    assert st["pipeline"]["schedule"] == schedule and len(st["pipeline"]["stages"]) == p * (1 + (schedule == "interleaved"))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_cross_product(name, p, m, schedule):
    """2 layers on 2 ranks, 4 on 4; interleaved on 4 ranks runs 8 stages: 6 layers (the
    embeddings, 6 blocks and the head are 8 forward runs to cut)."""
    train_hf(name, schedule, p, m, layers=2 if p == 2 else (6 if schedule == "interleaved" else 4))


def test_each_rank_holds_its_stages_parameters():
    model, inputs = hf("gpt2")
    pm = sw.parallelize(model, sw.Mesh((2,), ("pp",)), inputs, pipeline=pipe("1f1b", 4, split_points=["transformer.h.1"]))
    first, second = set(pm.shards[0]), set(pm.shards[1])
    assert not first & second and first | second == set(pm.specs)
    assert "transformer.wte.weight" in first and "transformer.h.1.attn.c_attn.weight" in second
    assert pm.plan.stages.names == ("transformer.h.1.ln_1",)
    # the tied head reads wte on stage 1: one message per step, its gradient share sent back
    cut = pm.plan.cut(0)
    assert [pm.plan.roles[m.value].name for m in cut.step_messages] == ["transformer.wte.weight"]


def test_dropout_masks_equal_one_device():
    """Every stage draws one device's whole-batch masks from the state one device has there, and
    the generator ends the step where one device's does."""
    model, inputs = hf("gpt2", layers=2, batch=5, dropout=True)
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("pp",)), inputs, pipeline=pipe("1f1b", 4))
    for seed in (11, 12):
        torch.manual_seed(seed)
        loss = pm.step(*inputs)
        after = torch.random.get_rng_state()
        torch.manual_seed(seed)
        ref_loss, ref_grads = single_step(ref, inputs, (), None)
        assert torch.equal(after, torch.random.get_rng_state())
        assert_close(loss, ref_loss, f"seed {seed} loss")
        got = pm.gradients()
        for n, g in ref_grads.items():
            assert_close(got[n], g, f"seed {seed} grad of {n}")
        pm.zero_grad()


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_uneven_and_empty_microbatches(schedule):
    """7 rows in 4 microbatches (2, 2, 2, 1) and 3 rows in 4 (1, 1, 1, 0: an empty one)."""
    for rows in (7, 3):
        x, y = data(rows)
        check_training(Net(), sw.Mesh((2,), ("pp",)), (x,), (y,), mse, steps=2, example_targets=(y,),
                       pipeline=pipe(schedule, 4))


def test_pipeline_data_tensor_2x2x2_net():
    x, y = data(8)
    model = Net(d=8)
    tp = {f"blocks.{k}.0.weight": {"tp": S(0)} for k in range(4)} | {f"blocks.{k}.0.bias": {"tp": S(0)}
                                                                     for k in range(4)}
    check_training(model, sw.Mesh((2, 2, 2), ("pp", "dp", "tp")), (x,), (y,), mse, steps=2, example_targets=(y,),
                   input_placements={0: {"dp": S(0)}}, target_placements={0: {"dp": S(0)}}, param_placements=tp,
                   pipeline=pipe("zero-bubble", 4))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_pipeline_data_tensor_2x2x2(name, schedule):
    model, inputs = hf(name)
    tp = {n: {"tp": pl} for n, pl in recipes.megatron(model).items()}
    pm = check_training(model, sw.Mesh((2, 2, 2), ("pp", "dp", "tp")), inputs, (), None, **ADAM,
                        input_placements={"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}, param_placements=tp,
                        pipeline=pipe(schedule, 4))
    assert {"all_reduce", "p2p"} <= set(pm.plan.stats()["collectives"])


def test_grad_norm_and_clipping_equal_one_device():
    x, y = data(6)
    model = Net()
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("pp",)), (x,), loss_fn=mse, example_targets=(y,),
                        pipeline=pipe("gpipe", 2))
    pm.step(x, y)
    mse(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert_close(pm.clip_grad_norm_(0.05), want, "total norm")
    for n, g in pm.gradients().items():
        assert_close(g, dict(ref.named_parameters())[n].grad, f"clipped grad of {n}")
