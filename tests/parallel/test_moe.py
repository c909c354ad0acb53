"""Hugging Face Mixture-of-Experts (Mixtral, Qwen2-MoE; tiny configs, random weights, default
experts implementation ``grouped_mm``): data, tensor and expert parallel training equal one
device (loss, every gradient, AdamW updates).

    python -m pytest tests/parallel/test_moe.py -q --durations=0

The grouped matmul is traced in its fixed-shape form (shardwise/trace/moe.py). Expert
parallelism here is the experts dim of the expert weights sharded on a mesh dim: each rank
multiplies by its own experts and their contributions add up across ranks (a partial sum);
``sw.recipes.experts(model, "ep")`` gives those placements.
"""
import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models.zoo import _hf_case, _seeded

from .harness import check_training

ADAM = dict(lr=1e-3, optim_kwargs={"eps": 1e-6})
DATA = {"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}
_COMMON = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
               max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               attn_implementation="sdpa")


@_seeded
def mixtral(batch=3, seq=8, experts=4):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(intermediate_size=48, num_local_experts=experts, num_experts_per_tok=2, **_COMMON)
    return _hf_case(MixtralForCausalLM(cfg), torch.float32, batch, seq, 64)


@_seeded
def qwen2_moe(batch=3, seq=8, experts=4):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                         num_experts=experts, num_experts_per_tok=2, **_COMMON)
    return _hf_case(Qwen2MoeForCausalLM(cfg), torch.float32, batch, seq, 64)


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}


def expert_params(model) -> list[str]:
    names = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert names, "the model has no expert weights"
    return names


def train(case, mesh, **kwargs):
    model, inputs, _, _ = case
    return check_training(model, mesh, inputs, **ADAM, **kwargs)


@pytest.mark.parametrize("name", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_data_parallel_uneven_batch(name):
    train(MODELS[name](batch=3), sw.Mesh((2,), ("dp",)), input_placements=DATA)


@pytest.mark.parametrize("name", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen2_moe"])
def test_tensor_parallel_experts_and_attention(name):
    """Megatron inside every expert: gate_up [E, 2I, H] in 2 groups of columns, down [E, H, I] by
    rows; attention's projections too."""
    case = MODELS[name]()
    spec = sw.recipes.megatron(case.model, "tp")
    for n in expert_params(case.model):
        spec[n] = {"tp": S(1, groups=2)} if n.endswith("gate_up_proj") else {"tp": S(2)}
    pm = train(case, sw.Mesh((2,), ("tp",)), param_placements=spec)
    assert pm.plan.stats()["collectives"].get("all_reduce", 0) > 0


@pytest.mark.parametrize("name,ep,experts", [
    ("qwen2_moe", 4, 5),  # 5 experts over 4 ranks: 2, 2, 1 and an empty shard
    pytest.param("mixtral", 4, 4, marks=pytest.mark.slow),
    pytest.param("mixtral", 2, 5, marks=pytest.mark.slow),  # 3 + 2
    pytest.param("qwen2_moe", 2, 4, marks=pytest.mark.slow)])
def test_expert_parallel(name, ep, experts):
    """Experts on a mesh dim of ``ep``: every expert weight Shard(0) there, nothing gathered."""
    case = MODELS[name](experts=experts)
    spec = sw.recipes.experts(case.model, "ep")
    assert set(spec) == set(expert_params(case.model))
    pm = train(case, sw.Mesh((ep,), ("ep",)), param_placements=spec)
    want = [len(c) for c in torch.arange(experts).chunk(ep)] + [0] * (ep - len(torch.arange(experts).chunk(ep)))
    for n in expert_params(case.model):  # each rank holds its own experts only
        assert [pm.shards[r][n].shape[0] for r in range(ep)] == want, n
    # the expert products are partial sums over ranks: reduced, never gathered
    assert "all_gather" not in pm.plan.stats()["collectives"], pm.plan.summary()


def test_data_by_expert_parallel_2x2():
    """Batch on "dp", experts on "ep" (uneven batch: 3 rows over 2 ranks)."""
    case = mixtral(batch=3, experts=4)
    spec = sw.recipes.experts(case.model, "ep")
    train(case, sw.Mesh((2, 2), ("dp", "ep")), input_placements=DATA, param_placements=spec)


def test_experts_recipe_refuses_a_dense_model():
    from tests.models import zoo

    with pytest.raises(sw.ShardingError, match="no stacked expert weights"):
        sw.recipes.experts(zoo.cached("llama").model)
