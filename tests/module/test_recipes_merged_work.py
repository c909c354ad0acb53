"""FSDP merged into Megatron keeps Megatron's split of the compute (issue #48): on a (2, 4)
("dp", "tp") mesh a tiny Llama (hidden 256, 2 blocks) with ``merge(fsdp(m, "dp"), megatron(m, "tp"))``
and the batch on "dp" does at most 1.05x the flops per rank of Megatron's placements alone (FSDP
adds gathers and reduce-scatters on "dp", not work), and trains as one device does.

    python -m pytest tests/module/test_recipes_merged_work.py -q
"""
from __future__ import annotations

import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models.zoo import positional
from tests.parallel.harness import check_training

MESH = sw.Mesh((2, 4), ("dp", "tp"))
BATCH_ON_DP = {"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=512, vocab_size=128, max_position_embeddings=32, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, 128, (4, 16))
    return model, positional(model.forward, input_ids=ids, labels=ids.clone())


def test_fsdp_merged_into_megatron_keeps_its_compute():
    model, inputs = _tiny_llama()
    merged = sw.recipes.merge(sw.recipes.fsdp(model, "dp"), sw.recipes.megatron(model, "tp"))
    # loss and gradients at rtol 1e-4; AdamW's eps dominating so that a gradient's float noise near zero
    # (reduced in another order) is not turned into a whole step of +-lr (tests/parallel/test_hf_families.py)
    pm = check_training(model, MESH, inputs, input_placements=BATCH_ON_DP, param_placements=merged, lr=1e-3,
                        optim_kwargs={"eps": 1e-2})
    alone = sw.parallelize(model, MESH, inputs, input_placements=BATCH_ON_DP,
                           param_placements=sw.recipes.megatron(model, "tp"))
    ours, theirs = pm.plan.stats(), alone.plan.stats()
    assert ours["flops_per_rank"] <= 1.05 * theirs["flops_per_rank"], (ours["flops_per_rank"], theirs["flops_per_rank"])
    # FSDP's own collectives on "dp": the parameters gathered there and their gradients reduce-scattered
    kinds = {s.kind for s in pm.plan.collective_steps() if MESH.names[s.mesh_dim] == "dp"}
    assert {"all_gather", "reduce_scatter"} <= kinds, kinds
