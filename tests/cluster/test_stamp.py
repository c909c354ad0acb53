"""Stamping (tools/cluster/stamp.py): a plan of 3 blocks stamped to depth equals the plan of the
deep model, figure by figure (step terms, bytes, collectives, flops, the liveness peak with and
without activation checkpointing), for FSDP on one mesh dim and FSDP x Megatron on two. The tiny
blocks' gradients are bucketed small, so that no bucket spans two blocks, as in a model whose
blocks hold more gradient bytes than a bucket.

    python -m pytest tests/cluster/test_stamp.py -q
"""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

import shardwise as sw
from shardwise.core.cost import CostModel
from shardwise.lower.recompute import checkpointing
from shardwise.tools.cluster import models
from shardwise.tools.cluster.stamp import stamp

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)


def _plan(layers: int, mesh: sw.Mesh, recipe: str):
    model, inputs = models.build(CFG, layers, batch=8, seq=16)
    dims = {n: sw.Shard(0) for n in mesh.names if n != "tp"}
    params = sw.recipes.fsdp(model, tuple(dims))
    if "tp" in mesh.names:
        params = sw.recipes.merge(sw.recipes.megatron(model, "tp"), params)
    cost = CostModel.cluster("h100", mesh, gpus_per_node=2)
    # gradients bucketed per block, as a real model's are (a block's gradients fill more than a bucket):
    # stamping copies a block with its buckets
    pm = sw.parallelize(model, mesh, inputs, input_placements={0: dims, 1: dims}, param_placements=params,
                        planner="propagate", cost_model=cost, bucket_bytes=4096)
    return pm.plan


# slow: each case plans a 3- and a 6-block model (15-35 s on 2 cores)
CASES = [pytest.param(mesh, policy, id=f"{mid}-{policy}")
         for mid, mesh in (("fsdp4", sw.Mesh((4,), ("dp",))), ("fsdp2xtp2", sw.Mesh((2, 2), ("dp", "tp"))))
         for policy in ("none", "selective", "full")]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,policy", CASES)
def test_stamped_equals_planned_at_depth(mesh, policy):
    few, deep = _plan(3, mesh, "fsdp"), _plan(6, mesh, "fsdp")
    ck_few = checkpointing(few.prop.gm, few.param_placeholders, policy)
    ck_deep = checkpointing(deep.prop.gm, deep.param_placeholders, policy)
    got, want = stamp(few, 6, ck_few), stamp(deep, 6, ck_deep)  # the deep plan stamped by 0: its own figures
    for term in ("compute_fwd_s", "compute_bwd_s", "blocking_s", "overlap_fwd_s", "overlap_bwd_s"):
        assert getattr(got.step, term) == pytest.approx(getattr(want.step, term), rel=1e-9, abs=1e-15), term
    assert got.step.total_s == pytest.approx(deep.step_time.total_s + want.recompute_s, rel=1e-9)
    assert got.recompute_s == pytest.approx(want.recompute_s, rel=1e-9)
    assert (got.comm_bytes, got.collectives, got.comm_bytes_by_dim) == (want.comm_bytes, want.collectives,
                                                                       want.comm_bytes_by_dim)
    assert got.flops == pytest.approx(want.flops, rel=1e-12)
    assert (got.params, got.grads) == (want.params, want.grads)
    assert got.peak == want.peak, (got.peak, want.peak)
    if policy == "none":
        assert want.peak == deep.memory()["peak"]  # no checkpointing: the plan's own estimate


@pytest.mark.slow
def test_checkpointing_holds_less():
    plan = _plan(3, sw.Mesh((4,), ("dp",)), "fsdp")
    peaks = {p: stamp(plan, 32, checkpointing(plan.prop.gm, plan.param_placeholders, p)).peak
             for p in ("none", "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
