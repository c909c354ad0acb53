"""Stamping (tools/cluster/stamp.py): a plan of 3 blocks stamped to depth equals the plan of the
deep model, figure by figure (step terms, bytes, collectives, flops, recomputation, the liveness
peak, the caching allocator's replay of its allocations), planned as the calculator plans them:
parallelize's mixed precision (bf16 compute, float32 masters and gradient reductions) and its
activation checkpointing (none, selective, blocks), and once in float32 throughout; for FSDP on one mesh dim and FSDP x Megatron on two. The tiny blocks'
gradients are bucketed small, so that no bucket spans two blocks, as in a model whose blocks hold
more gradient bytes than a bucket.

    python -m pytest tests/cluster/test_stamp.py -q
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import shardwise as sw
from shardwise.core.cost import CostModel
from shardwise.tools.cluster import models
from shardwise.tools.cluster.stamp import _deep_events, _memory, blocks, deep_peak, stamp

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)


BF16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _plan(layers: int, mesh: sw.Mesh, policy: str = "none", precision=BF16, seq: int = 16):
    model, inputs = models.build(CFG, layers, batch=8, seq=seq)
    dims = {n: sw.Shard(0) for n in mesh.names if n != "tp"}
    params = sw.recipes.fsdp(model, tuple(dims))
    if "tp" in mesh.names:
        params = sw.recipes.merge(sw.recipes.megatron(model, "tp"), params)
    cost = CostModel.cluster("h100", mesh, gpus_per_node=2)
    # gradients bucketed per block, as a real model's are (a block's gradients fill more than a bucket):
    # stamping copies a block with its buckets
    pm = sw.parallelize(model, mesh, inputs, input_placements={0: dims, 1: dims}, param_placements=params,
                        planner="propagate", cost_model=cost, bucket_bytes=4096, mixed_precision=precision,
                        activation_checkpointing=policy)
    return pm.plan


# each case plans a 3- and a 6-block model (15-35 s on 2 cores): one runs in CI (FSDP x Megatron,
# the calculator's default policy), the others are slow
FSDP4, FSDP2XTP2 = sw.Mesh((4,), ("dp",)), sw.Mesh((2, 2), ("dp", "tp"))
QUICK = "fsdp2xtp2-selective-bf16"
CASES = [pytest.param(mesh, policy, BF16, id=f"{mid}-{policy}-bf16",
                      marks=() if f"{mid}-{policy}-bf16" == QUICK else pytest.mark.slow)
         for mid, mesh in (("fsdp4", FSDP4), ("fsdp2xtp2", FSDP2XTP2))
         for policy in ("none", "selective", "blocks")]
CASES.append(pytest.param(FSDP4, "selective", None, id="fsdp4-selective-fp32", marks=pytest.mark.slow))


@pytest.mark.parametrize("mesh,policy,precision", CASES)
def test_stamped_equals_planned_at_depth(mesh, policy, precision):
    few, deep = _plan(3, mesh, policy, precision), _plan(6, mesh, policy, precision)
    got, want = stamp(few, 6), stamp(deep, 6)  # the deep plan stamped by 0: its own figures
    for term in ("compute_fwd_s", "compute_bwd_s", "blocking_s", "overlap_fwd_s", "overlap_bwd_s"):
        assert getattr(got.step, term) == pytest.approx(getattr(want.step, term), rel=1e-9, abs=1e-15), term
    assert got.step.total_s == pytest.approx(deep.step_time.total_s, rel=1e-9)  # recomputation included
    stats = deep.stats()
    assert got.recompute_s == pytest.approx(want.recompute_s, rel=1e-9)
    assert got.recompute_flops == pytest.approx(want.recompute_flops, rel=1e-9)
    assert want.recompute_flops == pytest.approx(stats["recompute_flops"], rel=1e-9)
    assert (want.recompute_flops > 0) == (policy != "none")
    assert (got.comm_bytes, got.collectives, got.comm_bytes_by_dim, got.comm_bytes_by_dtype) == (
        want.comm_bytes, want.collectives, want.comm_bytes_by_dim, want.comm_bytes_by_dtype)
    assert want.comm_bytes_by_dtype == {k: float(v) for k, v in stats["comm_bytes_by_dtype"].items()}
    assert got.flops == pytest.approx(want.flops, rel=1e-12)
    assert (got.params, got.grads) == (want.params, want.grads)
    assert got.peak == want.peak, (got.peak, want.peak)
    mem = deep.memory()
    assert want.peak == mem["peak"]  # the plan's own liveness estimate, recomputation and casts included
    assert want.params == mem["masters"] + (0 if precision else mem["parameters"])  # float32 masters resident
    # the stamped allocations: their peak is the stamped curve's, the gradients made by it the deep plan's,
    # and the caching allocator's replay of them the deep plan's
    _, by = blocks(few)
    deep_events = _deep_events(few, got.peak_rank, few.memory_estimate(got.peak_rank), by[1],
                               _memory(few, got.peak_rank, by, 1, 3)[5])
    assert deep_peak(deep_events)[0] == got.peak
    assert got.peak_grads == want.peak_grads == mem["gradients"]
    assert got.reserved == want.reserved and set(want.reserved) == {"expandable", "segments"}
    assert mem["rank"] == want.peak_rank and want.reserved == deep.reserved_memory()  # the deep plan's own


@pytest.mark.slow
def test_checkpointing_holds_less():
    """At a length where the saved activations outweigh the parameters' state (the calculator's
    regime: at 16 tokens the peak sits in a gradient bucket, the same for every policy)."""
    peaks = {p: stamp(_plan(3, FSDP4, p, seq=256), 32).peak for p in ("none", "selective", "blocks")}
    assert peaks["blocks"] < peaks["selective"] < peaks["none"], peaks
