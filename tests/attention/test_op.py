"""shardwise::attention: opcheck, torch.compile, traced joint graph, and agreement with aten sdpa.

    python -m pytest tests/attention/test_op.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import shardwise as sw
from shardwise.ops.attention import AttentionSettings, attention, attention_with_lse, kernels

OP = torch.ops.shardwise.attention.default
BWD = torch.ops.shardwise.attention_backward.default


def _qkv(b=2, hq=4, hk=4, sq=5, sk=5, e=8, ev=8, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(b, hq, sq, e), mk(b, hk, sk, e), mk(b, hk, sk, ev)


def _bool_mask(sq, sk, seed=1, dead_row=None):
    m = torch.rand(sq, sk, generator=torch.Generator().manual_seed(seed)) > 0.3
    m[:, 0] = True
    if dead_row is not None:
        m[dead_row] = False
    return m


# name -> (qkv kwargs, mask builder or None, settings kwargs)
CASES = {
    "plain": ({}, None, {}),
    "causal": ({}, None, {"is_causal": True}),
    "cross_sq_ne_sk": ({"sq": 3, "sk": 7, "ev": 6}, None, {}),
    "causal_sq_lt_sk": ({"sq": 3, "sk": 7}, None, {"is_causal": True}),
    "causal_sq_gt_sk": ({"sq": 7, "sk": 3}, None, {"is_causal": True}),
    "bool_mask": ({"sk": 6}, lambda q: _bool_mask(5, 6), {}),
    "float_mask": ({"sk": 6}, lambda q: torch.randn(2, 1, 5, 6, dtype=q.dtype), {}),
    "gqa": ({"hk": 2}, None, {"enable_gqa": True}),
    "gqa_causal_scale": ({"hk": 1}, None, {"enable_gqa": True, "is_causal": True, "scale": 0.3}),
}


def _args(name, dtype=torch.float32, grad=True):
    shape, mask, kw = CASES[name]
    q, k, v = _qkv(dtype=dtype, grad=grad, **shape)
    return q, k, v, (None if mask is None else mask(q)), kw


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    q, k, v, m, kw = _args(name)
    torch.library.opcheck(OP, (q, k, v, m, *AttentionSettings(**kw).to_op_args()))


def test_opcheck_with_offsets_and_backward_op():
    q, k, v = _qkv(sq=3, sk=4, hk=2)
    s = AttentionSettings(is_causal=True, enable_gqa=True, q_offset=4, k_offset=2, q_len_global=9, k_len_global=9)
    torch.library.opcheck(OP, (q, k, v, None, *s.to_op_args()))
    out, lse = OP(q, k, v, None, *s.to_op_args())
    args = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(), None,
            out.detach(), lse.detach(), *s.to_op_args())
    torch.library.opcheck(BWD, args)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grads_match_sdpa(name):
    q, k, v, m, kw = _args(name)
    out = attention(q, k, v, m, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), go)
    want = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["causal", "gqa", "bool_mask"])
def test_bf16_matches_sdpa(name):
    q, k, v, m, kw = _args(name, dtype=torch.bfloat16)
    out = attention(q, k, v, m, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    go = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    _, lse = attention_with_lse(q, k, v, m, AttentionSettings(**kw))
    assert lse.dtype == torch.float32


def test_lse_and_its_gradient():
    q, k, v = _qkv(sk=6)
    _, lse = attention_with_lse(q, k, v)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    ref = torch.logsumexp(s, -1)
    torch.testing.assert_close(lse, ref)
    gl = torch.randn_like(lse)
    for a, b in zip(torch.autograd.grad(lse, (q, k), gl), torch.autograd.grad(ref, (q, k), gl), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fully_masked_rows_are_zero_without_nan():
    q, k, v = _qkv(sk=6)
    m = _bool_mask(5, 6, dead_row=2)
    m[2] = False
    out, lse = attention_with_lse(q, k, v, m)
    assert torch.isneginf(lse[:, :, 2]).all() and torch.isfinite(lse[:, :, [0, 1, 3, 4]]).all()
    assert (out[:, :, 2] == 0).all()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # the CPU kernel gives 0 there too
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.sum() + lse[:, :, [0, 1]].sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, :, 2] == 0).all()


def test_block_with_global_offsets_equals_slice_of_full():
    """Rows [a, b) against keys [c, d) with global offsets, merged over key blocks = full rows."""
    q, k, v = _qkv(sq=9, sk=9, hk=2, grad=False)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    a, b = 3, 7
    s = AttentionSettings(is_causal=True, enable_gqa=True)
    out, lse = kernels.empty_block(q[..., a:b, :], v)
    for c, d in ((0, 4), (4, 6), (6, 9)):
        blk = s.block(a, c, 9, 9)
        o, l_ = kernels.attention_block(q[..., a:b, :], k[..., c:d, :], v[..., c:d, :], None, blk)
        out, lse = kernels.merge(out, lse, o, l_)
    torch.testing.assert_close(out, full[..., a:b, :], rtol=1e-4, atol=1e-5)


def test_joint_graph_has_one_forward_and_one_backward_node():
    q, k, v = _qkv(hk=2)

    def step(q, k, v):
        out = attention(q, k, v, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(out.sum(), (q, k, v))

    gm = make_fx(step, tracing_mode="fake")(q, k, v)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("shardwise.attention.default") == 1
    assert targets.count("shardwise.attention_backward.default") == 1
    math_ops = {"aten.bmm.default", "aten.mm.default", "aten._softmax.default", "aten.exp.default",
                "aten.logsumexp.default", "aten.matmul.default"}
    assert not math_ops & set(targets), targets
    assert "aten.zeros.default" not in targets  # an unused lse adds no zero gradient


def test_compile_fullgraph_forward_and_backward():
    # Inductor's on-disk caches key a graph without the custom op's fake function, so an entry
    # written by an older version of the op (other output strides) would be replayed: compile afresh.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _compile_fullgraph_forward_and_backward()


def _compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    q, k, v = _qkv(hk=2, sk=6, sq=6)

    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, backend=counter)
    def f(q, k, v):
        return attention(q, k, v, is_causal=True, enable_gqa=True)

    out = f(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1
    assert any("shardwise.attention" in str(n.target) for g in counter.graphs for n in g.graph.nodes)


def _count_saved(fn):
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return n[0]


def test_saved_tensors_deduplicated_by_storage():
    q, k, v = _qkv()
    x = q.detach().clone().requires_grad_()
    assert _count_saved(lambda: attention(q, k, v)) == 5  # q, k, v, out, lse
    # same memory seen through three distinct Python tensors: saved once
    assert _count_saved(lambda: attention(x, x.view_as(x), x[:])) == 3
    # same storage, different views: kept apart
    kv = torch.randn(2, 4, 10, 8, requires_grad=True) * 1.0
    assert _count_saved(lambda: attention(q, kv[..., :5, :], kv[..., 5:, :])) == 5
    out = attention(x, x.view_as(x), x[:])
    (g,) = torch.autograd.grad(out.sum(), (x,))
    xr = x.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(F.scaled_dot_product_attention(xr, xr, xr).sum(), (xr,))
    torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-5)


def test_settings_fail_loudly():
    q, k, v = _qkv(grad=False)
    with pytest.raises(ValueError, match="q_len_global"):
        OP(q, k, v, None, *AttentionSettings(is_causal=True, q_offset=3).to_op_args())
    with pytest.raises(ValueError, match="outside the global"):
        OP(q, k, v, None, *AttentionSettings(q_offset=3, q_len_global=6, k_len_global=5).to_op_args())
    with pytest.raises(ValueError, match="enable_gqa"):
        attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="broadcast"):
        attention(q, k, v, torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError):
        AttentionSettings(is_causal=1)
    with pytest.raises(ValueError):
        AttentionSettings(q_offset=-1)
    assert AttentionSettings(scale=0.0).resolve_scale(16) == 0.0  # an explicit 0 is not "unset"
    assert AttentionSettings().resolve_scale(16) == 0.25
    s = AttentionSettings(is_causal=True, scale=0.5, enable_gqa=True, q_offset=1, k_offset=2, q_len_global=3,
                          k_len_global=4)
    assert AttentionSettings.from_op_args(*s.to_op_args()) == s


def test_mask_gradient_is_refused():
    q, k, v = _qkv()
    m = torch.zeros(5, 5, requires_grad=True)
    with pytest.raises(sw.AttentionError, match="not differentiable"):
        attention(q, k, v, m)
    with torch.no_grad():
        attention(q, k, v, m)  # nothing recorded: fine
    (gq,) = torch.autograd.grad(attention(q, k, v, m.detach()).sum(), (q,))
    assert torch.isfinite(gq).all()


@pytest.mark.parametrize("shape", [(5, 8), (3, 5, 8), (2, 3, 2, 5, 8)], ids=["2d", "3d", "5d"])
def test_other_ranks_match_sdpa(shape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True) for _ in range(3))
    out, ref = attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_merge_identity_and_empty_rows():
    out_a, lse_a = torch.randn(2, 3, 4), torch.randn(2, 3)
    e_out, e_lse = torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf"))
    out, lse = kernels.merge(out_a, lse_a, e_out, e_lse)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = kernels.merge(e_out, e_lse, e_out, e_lse)
    assert (out == 0).all() and torch.isneginf(lse).all()
