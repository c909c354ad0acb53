"""Hugging Face Mixture-of-Experts (Mixtral, Qwen2-MoE; tiny configs, random weights, default
experts implementation ``grouped_mm``): data, tensor and expert parallel training equal one
device (loss, every gradient, AdamW updates).

    python -m pytest tests/parallel/test_moe.py -q --durations=0

The experts modules trace as one ``shardwise.moe_experts`` op (shardwise/trace/moe.py; a
module the op does not compute exactly falls back to the grouped matmul's fixed-shape form,
test_unqualified_experts_take_the_dense_form). Expert parallelism here is the experts dim of
the expert weights sharded on a mesh dim with the tokens whole on it: each rank computes its
own experts' share and the shares add up across ranks (a partial sum);
``sw.recipes.experts(model, "ep")`` gives those placements. With the tokens sharded on that
mesh dim too they are dispatched by all-to-all instead: test_moe_dispatch.py.
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


def _unqualified(case):
    """Experts with an activation shardwise.moe_experts does not compute (traced as written)."""
    for m in case.model.modules():
        if hasattr(m, "act_fn") and hasattr(m, "gate_up_proj"):
            m.act_fn = torch.nn.Tanh()
    return case


def test_unqualified_experts_take_the_dense_form():
    """No experts op in the graph: the grouped matmuls in their fixed-shape form, trained data
    parallel exactly (uneven batch)."""
    from shardwise.ops.moe import FORWARD
    from shardwise.trace import trace_step

    case = _unqualified(mixtral(batch=3, seq=4))
    ops = trace_step(*case).ops()
    assert FORWARD not in ops and torch.ops.aten.histc.default in ops, ops
    train(case, sw.Mesh((2,), ("dp",)), input_placements=DATA)


def test_experts_of_every_implementation_trace_as_one_op():
    """eager (a loop over experts with nonzero), batched_mm and grouped_mm: one op each way."""
    from shardwise.ops.moe import BACKWARD, FORWARD
    from shardwise.trace import trace_step

    for impl in ("eager", "batched_mm", "grouped_mm"):
        case = mixtral(batch=2, seq=4)
        case.model.set_experts_implementation(impl)
        ops = trace_step(*case).ops()
        assert {FORWARD, BACKWARD} <= ops and torch.ops.aten.nonzero.default not in ops, (impl, ops)


@pytest.mark.slow
def test_eager_experts_train_expert_parallel():
    """The reference runs Hugging Face's eager loop; the sharded run the op, experts on "ep"."""
    case = mixtral(batch=3, seq=4)
    case.model.set_experts_implementation("eager")
    train(case, sw.Mesh((2,), ("ep",)), param_placements=sw.recipes.experts(case.model, "ep"))


def test_experts_dispatcher_is_wrapped_only_while_tracing():
    """Nested contexts keep Hugging Face's experts dispatcher wrapped and the last one out restores
    it; inside, the experts run as the op, whose eager kernel gives Hugging Face's loss."""
    import transformers.integrations.moe as hf_moe

    from shardwise.trace.moe import experts_as_op

    original = hf_moe.ExpertsInterface.get_interface
    with experts_as_op():
        with experts_as_op():
            assert hf_moe.ExpertsInterface.get_interface is not original
        assert hf_moe.ExpertsInterface.get_interface is not original
    assert hf_moe.ExpertsInterface.get_interface is original
    case = mixtral(batch=1, seq=4)
    with experts_as_op():  # inside it the op runs (here eagerly on real tensors): grouped_mm's loss
        got = case.model(*case.example_inputs).loss
    torch.testing.assert_close(got, case.model(*case.example_inputs).loss, rtol=1e-5, atol=1e-6)
