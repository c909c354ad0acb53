"""Megatron's placements given by hand, the default planner (propagation): the plan sends what
Megatron sends, two all-reduces of [b, s, h] forward and two backward per layer (issue #49).

    python -m pytest tests/search/test_megatron_floor.py -q -p no:cacheprovider
    python -m pytest tests/search/test_megatron_floor.py -q -p no:cacheprovider -m slow   # the issue's 4 layers
"""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S
from tests.models.zoo import positional
from tests.parallel.harness import check_training
from tests.search.test_auto_params import megatron_floor


def hand_megatron(model, layers: int) -> dict:
    """GPT-2's Megatron placements as a user writes them: c_attn (q, k, v fused: three groups) and
    c_fc column-split with their biases, both c_proj row-split, everything else whole."""
    placements = {}
    for i in range(layers):
        h = f"transformer.h.{i}"
        placements |= {f"{h}.attn.c_attn.weight": [S(1, groups=3)], f"{h}.attn.c_attn.bias": [S(0, groups=3)],
                       f"{h}.mlp.c_fc.weight": [S(1)], f"{h}.mlp.c_fc.bias": [S(0)],
                       f"{h}.attn.c_proj.weight": [S(0)], f"{h}.mlp.c_proj.weight": [S(0)]}
    return {n: placements.get(n, [R()]) for n, _ in model.named_parameters()}


@pytest.mark.parametrize("layers", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gpt2_hand_megatron_sends_the_floor(layers):
    """Hugging Face GPT-2 (2 or 4 layers, hidden 256, 8 heads, vocab 96) on tp 4, batch 4 x 128: each
    row-parallel projection's output gradient, read by its input's product, its weight's and its
    bias's sum, is all-reduced once where it is [b, s, h] (search/propagate.Planner._owed's
    read_later). Carried through the input's product instead, it gathered the weight and the
    saved input and reduce-scattered the weight gradient and the attention's input gradient:
    1.09x the floor with 4 layers. Trains as one device does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hidden, heads, vocab, t, batch, seq = 256, 8, 96, 4, 4, 128
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                     eos_token_id=0, attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, vocab, (batch, seq))
    inputs = positional(model.forward, input_ids=ids, labels=ids.clone())
    mesh = sw.Mesh((t,), ("tp",))
    pm = check_training(model, mesh, inputs, param_placements=hand_megatron(model, layers), lr=1e-3,
                        optim_kwargs={"eps": 1e-6})
    st = pm.plan.stats()
    assert pm.options.planner == "propagate"
    assert st["comm_bytes"] <= 1.01 * megatron_floor(batch, seq, hidden, t, layers), (st, pm.plan.summary())
    # no weight or saved activation gathered to carry a partial gradient past its reduction
    assert "all_gather" not in st["collectives"], st
