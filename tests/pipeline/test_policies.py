"""Pipelines with activation checkpointing and mixed precision: the stages are cut from the step
traced with the policy, so a stage's backward recomputes its blocks and every stage computes in
bf16 from fp32 masters, and the results are one device's.

- checkpointing: loss, gradients and the parameters after two AdamW steps equal one device
  (rtol 1e-4), each stage's backward runs the recomputed nodes and stashes fewer bytes;
- bf16 (tests/precision/reference.py): a microbatch is a batch shard, so the pipeline is
  ``sharded_reference`` over the microbatches bit for bit (each microbatch's bf16 gradients
  cast to fp32 and summed in microbatch order), and within ``ULPS`` bf16 ulps of one device
  running the policy on the whole batch; the masters stay fp32, each master's bf16 copy is
  made once per step by its owner and a tied head receives that copy (half the bytes).

    python -m pytest tests/pipeline/test_policies.py -q            # the small models
    python -m pytest tests/pipeline/test_policies.py -q -m slow    # Hugging Face GPT-2 and Llama
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise.trace.recompute import RECOMPUTE
from tests.models import zoo
from tests.parallel.harness import check_training
from tests.precision.reference import FP32, assert_bf16_close, policy_step, sharded_reference

from .models import ADAM, Net, data, hf, mse, pipe

BF16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
ULPS = 16  # as tests/precision/test_mixed_precision.py: the halves' roundings against the whole batch


def _recomputed(pm) -> dict:
    """{(stage, phase): program nodes of recomputed forward ops} of microbatch 0's cut."""
    gm = {n.name: n for n in pm.plan.traced.gm.graph.nodes}
    cut = pm.plan.cut(0)
    out = {}
    for key, piece in cut.pieces.items():
        k = sum(1 for n in piece.nodes if RECOMPUTE in gm.get(n.meta.get("sw_origin"), n).meta)
        if k:
            out[key] = k
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_checkpointing_equals_one_device_and_stashes_less(schedule):
    x, y = data(8)
    kw = dict(loss_fn=mse, example_targets=(y,), pipeline=pipe(schedule, 4, split_points=["blocks.2"]))
    pm = check_training(Net(d=16), sw.Mesh((2,), ("pp",)), (x,), (y,), steps=2,
                        activation_checkpointing="blocks", **kw)
    plain = sw.parallelize(Net(d=16), sw.Mesh((2,), ("pp",)), (x,), **kw)
    again = _recomputed(pm)  # in the backward pieces (B, and W's share under zero-bubble) of both stages
    assert "B" in {phase for _, phase in again} <= {"B", "W"} and {s for s, _ in again} == {0, 1}
    got, want = pm.plan.stats(), plain.plan.stats()
    assert got["recompute_flops"] > 0 == want["recompute_flops"]
    for a, b in zip(got["pipeline"]["stages"], want["pipeline"]["stages"]):
        assert a["stash"] < b["stash"], (a, b)
    assert got["peak_memory_bytes"] < want["peak_memory_bytes"]


def _tiny_lm():
    torch.manual_seed(0)
    model = zoo.TinyLM(layers=2, dim=32, max_len=32)
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 64, (8, 32), generator=g), torch.randint(0, 64, (8, 32), generator=g)


def check_bf16(pm, policy, model, inputs, targets=(), loss_fn=None, loss=None):
    """``pm``'s step (``loss``) against tests/precision/reference.py (module docstring)."""
    m = pm.plan.config.microbatches
    shard_loss, shard_grads, parts = sharded_reference(copy.deepcopy(model), policy, inputs, targets,
                                                       loss_fn, shards=m)
    ref_loss, ref_grads = policy_step(copy.deepcopy(model), policy, inputs, targets, loss_fn)
    assert torch.equal(loss, shard_loss)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    grads = pm.gradients()
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        assert grads[n].dtype == torch.float32
        assert torch.equal(grads[n], shard_grads[n]), n
        assert_bf16_close(grads[n], g, f"grad of {n}", ULPS, parts=[p[n] for p in parts])
    assert all(p.dtype == torch.float32 for p in pm.parameters())  # the masters
    st = pm.plan.stats()
    assert st["memory"]["masters"] > 0 and st["memory"]["optimizer_state"] == 2 * st["memory"]["masters"]


@pytest.mark.parametrize("schedule,checkpointing", [("1f1b", "none"), ("zero-bubble", "blocks")])
def test_bf16_equals_the_policy_on_one_device(schedule, checkpointing):
    model, x, y = _tiny_lm()
    pm = sw.parallelize(copy.deepcopy(model), sw.Mesh((2,), ("pp",)), (x,), loss_fn=zoo.ce_loss, example_targets=(y,),
                        mixed_precision=BF16, activation_checkpointing=checkpointing, pipeline=pipe(schedule, 4))
    check_bf16(pm, BF16, model, (x,), (y,), zoo.ce_loss, pm.step(x, y))
    assert bool(_recomputed(pm)) == (checkpointing != "none")
    # each stage casts the masters it owns once per step: no cast runs in a microbatch's piece
    cut = pm.plan.cut(0)
    assert len(cut.casts) == sum(1 for _ in model.parameters()) and not cut.step_messages
    assert not any(n in cut.casts for p in cut.pieces.values() for n in p.nodes)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_bf16_hf_gpt2_tied_head(schedule):
    """GPT-2's head reads the embedding's weight on the last stage: the owner sends its bf16 copy
    once per step (a step message of half the master's bytes)."""
    model, inputs = zoo.MODELS["gpt2"](batch=4, seq=8, layers=2)[:2]
    policy = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm = sw.parallelize(copy.deepcopy(model), sw.Mesh((2,), ("pp",)), inputs, mixed_precision=policy,
                        pipeline=pipe(schedule, 4))
    check_bf16(pm, policy, model, inputs, loss=pm.step(*inputs))
    (msg,) = pm.plan.cut(0).step_messages
    assert msg.value == "p_transformer_wte_weight_bfloat16" and pm.plan.cut(0).layout_of(msg.value).dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["blocks", "selective"])
def test_checkpointing_hf_llama(checkpointing):
    model, inputs = hf("llama")
    pm = check_training(model, sw.Mesh((2,), ("pp",)), inputs, (), None, **ADAM,
                        activation_checkpointing=checkpointing, pipeline=pipe("1f1b", 4))
    assert pm.plan.stats()["recompute_flops"] > 0


def _gloo_bf16(rank):
    """One step on this gloo process and the reference made here too (bf16 kernels round by
    their blocking, which follows the process's thread count: compared in the same process)."""
    model, inputs = zoo.MODELS["gpt2"](batch=4, seq=8, layers=2)[:2]
    policy = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    want_loss, want, _ = sharded_reference(copy.deepcopy(model), policy, inputs, shards=4)
    pm = sw.parallelize(model, sw.Mesh((2,), ("pp",)), inputs, mixed_precision=policy, backend="torch",
                        pipeline=pipe("1f1b", 4))
    loss = pm.step(*inputs)
    grads = pm.gradients()
    return torch.equal(loss, want_loss), sorted(n for n, g in want.items() if not torch.equal(grads[n], g))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_bf16_gpt2_on_two_gloo_processes():
    """The same step on 2 gloo processes: the tied head's bf16 copy and the bf16 activations sent
    point-to-point; every rank's loss and gradients are the reference's shards, bit for bit."""
    from shardwise.run.launch import spawn

    for same_loss, differ in spawn(_gloo_bf16, 2, timeout=500):
        assert same_loss and not differ, differ
