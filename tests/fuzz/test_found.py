"""Bugs the fuzzer found, as small tests exact against one device (reproducers shrunk by hand).

    python -m pytest -q -p no:cacheprovider tests/fuzz/test_found.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate, Shard

from .runner import compare_with_one_device


class ExpandedAttention(torch.nn.Module):
    """q = v = x expanded over the sequence (stride 0), k projected: shardwise.attention laid
    its output out like q (head dim not innermost) and aten's CPU flash backward, which reads
    the head dim of q/k/v/out as contiguous without checking, gave wrong q and k gradients,
    on any mesh and even replicated (fuzz seed 100088)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = torch.nn.Parameter(torch.randn((5, 5), generator=g) * 0.5)
        self.register_buffer("w", torch.randn((2, 5, 3, 5), generator=g))

    def forward(self, x):
        q = x.unsqueeze(2).expand(2, 5, 3, 5)
        return (F.scaled_dot_product_attention(q, q @ self.p, q, is_causal=True) * self.w).sum()


def test_attention_of_an_expanded_input_equals_one_device():
    """In float64, to 1e-9: the bug gave wrong numbers, not noise. In float32 the (3, 2) plan's
    parameters after two AdamW steps differ by 3.7e-5 on some CPUs (AMD EPYC's kernels sum in
    another order): a gradient's rounding noise, amplified by Adam's normalised step, over the
    runner's 1e-5 floor; float64 agrees to 1e-9 there."""
    x = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(1))
    for mesh, placements in (((2,), [Replicate()]), ((2,), [Shard(0)]), ((3, 2), [Shard(0), Shard(2)])):
        for planner in ("propagate", "ilp"):
            compare_with_one_device(ExpandedAttention, ((x,), ()), None, sw.Mesh(mesh), {0: placements}, {}, {},
                                    planner, dtype=torch.float64, rtol=1e-9, atol=1e-9)


def test_attention_op_of_a_transposed_query_equals_sdpa():
    """One device, no sharding: sw.attention's gradients do not depend on q's memory layout."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 4, generator=g).transpose(-1, -2)  # head dim not innermost
    k, v, grad = (torch.randn(2, 3, 4, 5, generator=g) for _ in range(3))

    def grads(fn, q):
        ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*ts), ts, grad)

    for got, want in zip(grads(sw.attention, q), grads(F.scaled_dot_product_attention, q.contiguous()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
