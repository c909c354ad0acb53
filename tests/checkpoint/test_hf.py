"""Hugging Face round trip: GPT-2 (tiny config, random weights, no downloads) trained under Megatron
tensor parallelism, its weights written with save_pretrained and its optimizer state with pm.save,
comes back on another mesh (data x tensor) and on one device; the losses continue exactly.

    python -m pytest tests/checkpoint/test_hf.py -q --durations=0
"""
from __future__ import annotations

import copy

import torch

import shardwise as sw
from shardwise import Shard as S, recipes
from tests.models import zoo
from tests.parallel.harness import assert_close

from .helpers import ADAMW, adamw, assert_bitwise, train, train_one_device


def test_save_pretrained_round_trip_continues_exactly(tmp_path):
    from transformers import GPT2LMHeadModel

    model, inputs, targets, _ = zoo.gpt2(batch=4, seq=8)
    tp = sw.parallelize(copy.deepcopy(model), sw.Mesh((2,), ("tp",)), inputs,
                        param_placements=recipes.megatron(model, "tp"))
    opt = tp.optimizer(torch.optim.AdamW, **ADAMW)
    train(tp, opt, inputs, targets, 2)
    tp.sync_to(model).save_pretrained(tmp_path / "hf")
    tp.save(tmp_path / "ck", optimizer=opt)
    full_optim = tp.optimizer_state_dict(opt)

    fresh = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").train()
    assert_bitwise(fresh.state_dict(), tp.state_dict(), "from_pretrained")
    data = {"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}
    dp_tp = sw.parallelize(copy.deepcopy(fresh), sw.Mesh((2, 2), ("dp", "tp")), inputs, input_placements=data,
                           param_placements=recipes.megatron(fresh, "tp"))
    opt2 = dp_tp.optimizer(torch.optim.AdamW, lr=1.0)
    dp_tp.load(tmp_path / "ck", optimizer=opt2)  # the optimizer state; the weights are the same
    one = copy.deepcopy(fresh)
    one_opt = adamw(one.parameters())
    one_opt.load_state_dict(full_optim)

    losses = {"continued": train(tp, opt, inputs, targets, 2), "dp x tp": train(dp_tp, opt2, inputs, targets, 2),
              "one device": train_one_device(one, one_opt, inputs, targets, None, 2)}
    for name, got in losses.items():
        for i, (a, b) in enumerate(zip(got, losses["continued"])):
            assert_close(a, b, f"{name}: loss {i} after the round trip")
    state = dp_tp.state_dict()
    for k, v in one.state_dict().items():
        assert_close(state[k], v, f"{k} after 2 more steps", rtol=1e-4, atol=1e-5)
