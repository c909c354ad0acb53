"""Every aten attention variant torch lowers F.scaled_dot_product_attention to (flash for CPU;
flash, memory-efficient and cuDNN on CUDA) maps onto shardwise.attention (trace/attention.py).

A trace on a GPU holds the CUDA variants (half precision: flash or cuDNN; float32: memory
efficient); unmapped, the planner has no rule for them. Here each variant's forward and backward
are traced on fake tensors as autograd calls them, mapped, and the mapped graph is run on CPU
against F.scaled_dot_product_attention's output and gradients.
"""
from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.trace.attention import (
    BACKWARD,
    BACKWARDS,
    FORWARD,
    FORWARDS,
    map_attention,
)

A = torch.ops.aten
SCALE = 0.3


def _flash_cpu(q, k, v, m, go, causal):
    out, lse = A._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, attn_mask=m, scale=SCALE)
    return (out, *A._scaled_dot_product_flash_attention_for_cpu_backward.default(
        go, q, k, v, out, lse, 0.0, causal, attn_mask=m, scale=SCALE))


def _efficient(q, k, v, m, go, causal):
    out, lse, seed, offset = A._scaled_dot_product_efficient_attention.default(q, k, v, m, True, 0.0, causal, scale=SCALE)
    dq, dk, dv, _ = A._scaled_dot_product_efficient_attention_backward.default(
        go, q, k, v, m, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=SCALE)
    return out, dq, dk, dv


def _flash(q, k, v, m, go, causal):
    out, lse, cq, ck, mq, mk, rng, unused, _ = A._scaled_dot_product_flash_attention.default(
        q, k, v, 0.0, causal, False, scale=SCALE)
    return (out, *A._scaled_dot_product_flash_attention_backward.default(
        go, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=SCALE))


def _cudnn(q, k, v, m, go, causal):
    out, lse, cq, ck, mq, mk, seed, offset, _ = A._scaled_dot_product_cudnn_attention.default(
        q, k, v, m, True, 0.0, causal, False, scale=SCALE)
    return (out, *A._scaled_dot_product_cudnn_attention_backward.default(
        go, q, k, v, out, lse, seed, offset, m, cq, ck, mq, mk, 0.0, causal, scale=SCALE))


def _fake_mode_of(gm):
    vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return torch._guards.detect_fake_mode(vals) or contextlib.nullcontext()


VARIANTS = {"flash_cpu": (_flash_cpu, True), "efficient": (_efficient, True), "flash": (_flash, False),
            "cudnn": (_cudnn, True)}  # (calls, takes a mask)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_maps_onto_shardwise_attention_and_computes_sdpa(variant, masked, causal):
    calls, takes_mask = VARIANTS[variant]
    if masked and not takes_mask:
        pytest.skip("flash takes no mask")
    b, h, L, d = 2, 3, 8, 16
    ex = [torch.empty(b, h, L, d) for _ in range(4)]
    gm = make_fx(lambda q, k, v, m, go: calls(q, k, v, m, go, causal), tracing_mode="fake")(
        ex[0], ex[1], ex[2], torch.empty(1, 1, L, L) if masked else None, ex[3])
    assert {n.target for n in gm.graph.nodes} & set(FORWARDS + BACKWARDS)
    with _fake_mode_of(gm):  # as in a trace: the mapped nodes' values are made in the trace's fake mode
        notes = map_attention(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert not set(targets) & set(FORWARDS + BACKWARDS), notes
    assert targets.count(FORWARD) == 1 and targets.count(BACKWARD) == 1, targets

    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(b, h, L, d, generator=g, dtype=torch.float64) for _ in range(4))
    m = torch.randn(1, 1, L, L, generator=g, dtype=torch.float64) if masked else None
    got = gm(q, k, v, m, go)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, attn_mask=m, is_causal=causal, scale=SCALE)
    want = (out, *torch.autograd.grad(out, ref, go))
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, w.detach(), msg=lambda s, n=name: f"{variant} {n}: {s}")


def test_dropout_is_left_as_is_and_said():
    ex = [torch.empty(2, 3, 8, 16, dtype=torch.float16) for _ in range(3)]
    gm = make_fx(lambda q, k, v: A._scaled_dot_product_flash_attention.default(q, k, v, 0.1, False, False)[0],
                 tracing_mode="fake")(*ex)
    with _fake_mode_of(gm):
        notes = map_attention(gm)
    assert any("kept" in n for n in notes)
    assert any(n.target == A._scaled_dot_product_flash_attention.default for n in gm.graph.nodes)
