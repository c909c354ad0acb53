"""Megatron with a tensor-parallel size that does not divide the attention heads: q, k, v and the
attention output split in whole heads (``recipes.megatron(..., size=)``, ``Shard(d, unit=head_dim)``),
exact against one device and with Megatron's collectives only; and a unit shard that splits as
the plain one would plans as it (Layout.canonical)."""
from collections import Counter

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo

from .harness import check_training

MEGATRON_KINDS = {"all_reduce", "all_gather", "reduce_scatter"}


def _qwen2(hidden: int, heads: int, kv: int):
    return zoo._decoder("Qwen2Config", "Qwen2ForCausalLM", hidden_size=hidden, num_attention_heads=heads,
                        num_key_value_heads=kv, num_hidden_layers=1)(batch=2)


def _kinds(pm) -> Counter:
    return Counter(s.kind for s in pm.plan.collective_steps())


def test_heads_split_whole_where_tp_does_not_divide_them():
    """6 heads on 4 ranks: 2, 2, 1 and 1 whole heads per rank. Cutting heads apart (the plain shards,
    what Megatron-LM refuses) was exact too, but moved the attention's inputs by all_to_alls."""
    model, inputs, _, _ = _qwen2(48, 6, 6)
    mesh = sw.Mesh((4,), ("tp",))
    params = sw.recipes.megatron(model, "tp", size=4)
    assert params["model.layers.0.self_attn.k_proj.weight"] == {"tp": S(0, unit=8)}
    assert params["model.layers.0.self_attn.o_proj.weight"] == {"tp": S(1, unit=8)}
    cut = sw.parallelize(model, mesh, inputs, input_placements={}, param_placements=sw.recipes.megatron(model, "tp"))
    pm = check_training(model, mesh, inputs, steps=2, optim_kwargs={"eps": 1e-2}, input_placements={},
                        param_placements=params)
    assert set(_kinds(pm)) <= MEGATRON_KINDS, _kinds(pm)
    assert "all_to_all" in _kinds(cut)
    whole, apart = pm.plan.stats(), cut.plan.stats()
    assert whole["comm_bytes"] < apart["comm_bytes"] and whole["est_step_time_s"] < apart["est_step_time_s"]


def test_unit_shard_that_changes_nothing_plans_as_the_plain_shard():
    """4 heads on 4 ranks given in units of a head: the same split as Shard(0), so the same plan
    (before the spelling was made canonical, 16 all_to_alls and 14 send_recvs more)."""
    model, inputs, _, _ = _qwen2(32, 4, 4)
    mesh = sw.Mesh((4,), ("tp",))
    plain = sw.recipes.megatron(model, "tp")
    units = {n: {"tp": S(p["tp"].dim, unit=8)} if "self_attn" in n else p for n, p in plain.items()}
    a = sw.parallelize(model, mesh, inputs, input_placements={}, param_placements=plain)
    b = sw.parallelize(model, mesh, inputs, input_placements={}, param_placements=units)
    assert _steps(a) == _steps(b) and set(_kinds(b)) <= MEGATRON_KINDS


def _steps(pm) -> list:
    return [(s.kind, s.bytes) for s in pm.plan.collective_steps()]
