"""Attention that is not an SDPA call: the eager chain (matmul, scale, mask, softmax, matmul)
is traced as shardwise.attention where it is the same computation, so sequence parallelism
works for eager models; where it is not, an ``attention=`` request raises instead of being
ignored.

    python -m pytest tests/parallel/test_eager_attention.py -q
"""
import math

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Shard as S
from shardwise.trace import trace_step
from tests.models import zoo

from .harness import assert_traced_equals_eager, check_training

aten = torch.ops.aten
ATTN = torch.ops.shardwise.attention.default
ADAM = dict(lr=1e-3, optim_kwargs={"eps": 1e-6})


def gpt2_eager(**kwargs):
    case = zoo.gpt2(**kwargs)
    case.model.set_attn_implementation("eager")
    return case


def test_gpt2_eager_ulysses_is_sequence_parallel_and_exact():
    model, inputs, _, _ = gpt2_eager(batch=2, seq=8)
    pm = check_training(model, sw.Mesh((2,), ("sp",)), inputs, input_placements={"input_ids": [S(1)], "labels": [S(1)]},
                        attention="ulysses", **ADAM)
    traced = pm.plan.traced
    assert ATTN in traced.ops() and aten._softmax.default not in traced.ops()
    assert any("eager attention" in n for n in traced.notes)
    assert pm.plan.stats()["collectives"].get("all_to_all", 0) > 0, pm.plan.summary()


class EagerBlock(nn.Module):
    """Hand-written causal attention: q k^T / sqrt(d), an additive causal mask, softmax, @ v."""

    def __init__(self, dim=16, heads=2, dropout=0.0, softmax_dim=-1):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.dropout, self.softmax_dim = heads, dropout, softmax_dim

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        probs = torch.softmax(scores + mask, dim=self.softmax_dim)
        probs = nn.functional.dropout(probs, p=self.dropout, training=self.training)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
        return self.out(y).square().mean()


def test_hand_written_chain_is_mapped_and_equal():
    torch.manual_seed(0)
    model, x = EagerBlock(), torch.randn(2, 7, 16)
    traced = trace_step(model, (x,))
    assert ATTN in traced.ops() and aten._softmax.default not in traced.ops()
    loss, grads = traced.run(model, (x,))
    ref = model(x)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_hand_written_chain_ring_on_uneven_sequence():
    torch.manual_seed(0)
    model, x = EagerBlock(), torch.randn(2, 7, 16)
    pm = check_training(model, sw.Mesh((2,), ("sp",)), (x,), input_placements={0: [S(1)]}, attention="ring", **ADAM)
    assert ATTN in pm.plan.traced.ops()


@pytest.mark.parametrize("variant", [dict(dropout=0.1), dict(softmax_dim=-2)])
def test_chain_that_differs_is_kept_and_a_request_raises(variant):
    """A dropout that drops, or a softmax over the keys' dim of the wrong side, is not attention
    as the op computes it: the model's own ops stay, and attention='ulysses' says it cannot act."""
    torch.manual_seed(0)
    model, x = EagerBlock(**variant), torch.randn(2, 8, 16)
    traced = trace_step(model, (x,))
    assert ATTN not in traced.ops() and aten._softmax.default in traced.ops()
    with pytest.raises(sw.ShardingError, match="attention='ulysses' cannot be honoured") as e:
        sw.parallelize(model, sw.Mesh((2,), ("sp",)), (x,), input_placements={0: [S(1)]}, attention="ulysses")
    assert "test_eager_attention.py" in str(e.value) and "sdpa" in e.value.fix


def test_llama_eager_is_mapped_and_equal():
    """Llama's eager path: scaling by multiplication, softmax in float32 then .to(dtype), repeated
    KV heads (GQA), dropout with p=0."""
    model, inputs, _, _ = zoo.llama()
    model.set_attn_implementation("eager")
    traced = trace_step(model, inputs)
    assert ATTN in traced.ops() and aten._softmax.default not in traced.ops()
    assert_traced_equals_eager(traced, model, inputs)


class WrittenAfterUse(nn.Module):
    """The mask is written in place after the scores read it: the chain must not be the op (the op
    would read the written mask), so the model's own ops are traced."""

    def forward(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) + mask
        mask.mul_(0)
        return torch.matmul(torch.softmax(scores, -1), v)


def test_a_term_written_in_place_after_use_breaks_the_chain():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(3))
    mask = torch.randn(5, 5, generator=g)
    from shardwise.trace.eager_attention import eager_attention_as_op

    want = WrittenAfterUse()(q, k, v, mask.clone())
    with eager_attention_as_op() as mode:
        got = WrittenAfterUse()(q, k, v, mask.clone())
    assert mode.mapped == 0
    torch.testing.assert_close(got, want)
