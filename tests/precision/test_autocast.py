"""torch.autocast in forward, and models cast to bf16, under every parallelism: the sharded step
equals one device running the same autocast (or the same bf16 model).

    python -m pytest tests/precision/test_autocast.py -q -p no:logging -m "slow or not slow"

make_fx traces autocast's casts as ops (``_to_copy`` of each weight where a matmul reads it, of
activations into fp32 ops): the planner places them like any op, so a sharded weight is cast on
its shard and then gathered when that is cheaper. Tolerances (reference.py): where every rank
reads the single device's bits (each row of a batch-sharded activation) results are bitwise;
a partial sum made in bf16 on each rank (a weight gradient over half the batch, a row-parallel
output) is rounded once more than the single device's one rounding of the whole sum, so
gradients are held to a few bf16 ulps of their scale. A model cast to bf16 also reduces its
gradients in bf16 (one more rounding of a two-term sum), and its fp32-free softmax/norm inputs
carry bf16 rounding through two layers: 16 ulps.
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo
from tests.parallel.harness import single_step

from .reference import assert_bf16_close
from .test_mixed_precision import ULPS, layouts

slow = pytest.mark.slow


class Autocast(torch.nn.Module):
    """``model`` run under torch.autocast(cpu, bf16): the user's forward, as written."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(*args)


def _wrapped(name: str, model) -> tuple:
    """``layouts(name)`` for the wrapper: parameter names under its ``model.``, inputs by position
    (its forward takes ``*args``)."""
    import inspect

    mesh, kw = layouts(name, model)
    if isinstance(kw.get("param_placements"), dict):
        kw = {**kw, "param_placements": {f"model.{k}": v for k, v in kw["param_placements"].items()}}
    if "input_placements" in kw:
        index = {p: i for i, p in enumerate(inspect.signature(model.forward).parameters)}
        kw = {**kw, "input_placements": {index[k]: v for k, v in kw["input_placements"].items()}}
    return mesh, kw


def check(model, mesh, inputs, ulps, **kw):
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, mesh, inputs, **kw)
    loss = pm.step(*inputs)
    ref_loss, ref_grads = single_step(ref, inputs, (), None)
    assert_bf16_close(loss.float().reshape(1), ref_loss.float().reshape(1), "loss", ulps)
    grads = pm.gradients()
    for n, g in ref_grads.items():
        assert grads[n].dtype == g.dtype
        assert_bf16_close(grads[n].float(), g.float(), f"grad of {n}", ulps)
    return pm


def test_autocast_data_parallel_tiny_lm():
    """The fast one: autocast's casts are graph ops; data parallel equals one device."""
    c = zoo.transformer(batch=4, seq=16)
    model = Autocast(c.model)
    x, y = c.example_inputs[0], c.example_targets[0]
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=c.loss_fn, example_targets=(y,),
                        input_placements={0: [S(0)]})
    loss = pm.step(x, y)
    ref_loss, ref_grads = single_step(ref, (x,), (y,), c.loss_fn)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)  # same rows, an fp32 mean in another order
    grads = pm.gradients()
    for n, g in ref_grads.items():
        assert_bf16_close(grads[n], g, f"grad of {n}", 2)
    assert any(n.kwargs.get("dtype") == torch.bfloat16 for n in pm.plan.prop.gm.graph.nodes
               if n.op == "call_function" and n.target == torch.ops.aten._to_copy.default)


@slow  # a Llama plan per layout, ~10-30 s each here
@pytest.mark.parametrize("name", ["data", "fsdp", "megatron", "fsdp_megatron", "ulysses", "ring"])
def test_autocast_llama(name):
    c = zoo.llama(batch=4, seq=8)
    model = Autocast(c.model)
    mesh, kw = _wrapped("ulysses" if name == "ring" else name, c.model)
    if name == "ring":
        kw["attention"] = "ring"
    check(model, mesh, c.example_inputs, ULPS.get(name, 8), **kw)


@slow
@pytest.mark.parametrize("name", ["data", "megatron", "fsdp", "fsdp_megatron", "ulysses", "ring"])
def test_bf16_model_llama(name):
    c = zoo.llama(dtype=torch.bfloat16, batch=4, seq=8)
    mesh, kw = layouts("ulysses" if name == "ring" else name, c.model)
    if name == "ring":
        kw["attention"] = "ring"
    check(c.model, mesh, c.example_inputs, 16, **kw)


@slow
def test_autocast_expert_parallel_mixtral():
    """Expert parallelism (each rank its experts' share, added across ranks) under autocast."""
    from tests.parallel.test_moe import mixtral

    c = mixtral(batch=3)
    model = Autocast(c.model)
    spec = {f"model.{k}": v for k, v in sw.recipes.experts(c.model, "ep").items()}
    check(model, sw.Mesh((2,), ("ep",)), c.example_inputs, 8, param_placements=spec)


@slow
def test_bf16_model_expert_parallel_mixtral():
    """A Mixtral cast to bf16 under expert parallelism equals the bf16 model on one device."""
    from tests.parallel.test_moe import mixtral

    c = mixtral(batch=3)
    c.model.to(torch.bfloat16)
    check(c.model, sw.Mesh((2,), ("ep",)), c.example_inputs, 16, param_placements=sw.recipes.experts(c.model, "ep"))


@slow
def test_mixed_precision_expert_parallel_mixtral():
    """sw.MixedPrecision under expert parallelism: equals one device running the policy."""
    from tests.parallel.test_moe import mixtral

    from .reference import policy_step
    from .test_mixed_precision import BF16

    c = mixtral(batch=3)
    ref_loss, ref_grads = policy_step(copy.deepcopy(c.model), BF16, c.example_inputs)
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("ep",)), c.example_inputs, mixed_precision=BF16,
                        param_placements=sw.recipes.experts(c.model, "ep"))
    loss = pm.step(*c.example_inputs)
    assert_bf16_close(loss.reshape(1), ref_loss.reshape(1), "loss", 8)
    grads = pm.gradients()
    for n, g in ref_grads.items():
        assert_bf16_close(grads[n], g, f"grad of {n}", 8)
