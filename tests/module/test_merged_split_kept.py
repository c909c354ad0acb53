"""FSDP merged into Megatron keeps Megatron's split of the compute where the blocks are large
(issues #49 item 4, #48): propagation keeps a parameter's split on a mesh dim no data is sharded
on (search/propagate._unsplit).

Priced by the cluster calculator's H100 cost model, a Llama of hidden 1024 (16 heads, 8 kv heads,
2 blocks, sequence 2048, bf16) on a (2, 2) ("dp", "tp") mesh under ``merge(megatron(m, "tp"),
fsdp(m, "dp", beside=...))`` did 1.48x the flops per rank of Megatron's placements alone: FSDP's
shard nested under Megatron's makes the gather on "dp" that keeps a column-parallel weight's "tp"
split cost a step more (a gather on "tp" and a slice here, an all_to_all on larger meshes), so
propagation kept the weights whole on "tp" (or moved them to their other dim) and every block ran
whole on every "tp" rank. Planned on the meta device; a small Llama on the same mesh and cost
model trains as one device does.

    python -m pytest tests/module/test_merged_split_kept.py -q -p no:cacheprovider
"""
from __future__ import annotations

import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.core.cost import CostModel
from tests.models.zoo import positional
from tests.parallel.harness import check_training

MESH = sw.Mesh((2, 2), ("dp", "tp"))
BATCH_ON_DP = {"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}
BF16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _llama(hidden: int, heads: int, kv: int, vocab: int, batch: int, seq: int, meta: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    with torch.device("meta" if meta else "cpu"):
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, vocab, (batch, seq)) if not meta else torch.zeros((batch, seq), dtype=torch.long)
    model.train()
    model.loss_type = "ForCausalLM"
    return model, positional(model.forward, input_ids=ids, labels=ids.clone())


def _recipes(model):
    tp = sw.recipes.megatron(model, "tp")
    return tp, sw.recipes.merge(tp, sw.recipes.fsdp(model, "dp", beside=tp))


def _flops(model, inputs, params, **kwargs) -> float:
    pm = sw.parallelize(model, MESH, inputs, input_placements=BATCH_ON_DP, param_placements=params,
                        cost_model=CostModel.cluster("h100", MESH, 8), **kwargs)
    return pm.plan.stats()["flops_per_rank"]


def test_large_blocks_keep_megatrons_split_meta():
    model, inputs = _llama(1024, 16, 8, 1024, 2, 2048, meta=True)
    tp, merged = _recipes(model)
    ours = _flops(model, inputs, merged, mixed_precision=BF16, memory_budget=float("inf"))
    theirs = _flops(model, inputs, tp, mixed_precision=BF16, memory_budget=float("inf"))
    assert ours <= 1.05 * theirs, (ours / theirs, ours, theirs)


def test_small_llama_merged_trains_as_one_device():
    model, inputs = _llama(128, 4, 4, 128, 8, 64, meta=False)
    tp, merged = _recipes(model)
    cost = CostModel.cluster("h100", MESH, 8)
    # loss and gradients at rtol 1e-4; AdamW's eps dominating as in test_recipes_merged_work.py
    pm = check_training(model, MESH, inputs, input_placements=BATCH_ON_DP, param_placements=merged, lr=1e-3,
                        optim_kwargs={"eps": 1e-2}, cost_model=cost)
    theirs = _flops(model, inputs, tp)
    assert pm.plan.stats()["flops_per_rank"] <= 1.05 * theirs
