"""Score modifications of shardwise::attention (soft-capping, a differentiable bias, ALiBi slopes,
sliding windows, document ids), alone and with causal, masks, GQA and a scale: forward,
lse and every gradient (the bias's too) against the scores written out in torch, on the fused
path (v's head dim equal to q's, or unlike it: zero-padded) and the math path; opcheck, compile,
errors.

    python -m pytest tests/attention/test_mods.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from shardwise.core.errors import AttentionError
from shardwise.ops.attention import AttentionSettings, attention, attention_with_lse, fused
from shardwise.ops.attention.mods import Mods

OP = torch.ops.shardwise.attention.default
BWD = torch.ops.shardwise.attention_backward.default
TOL = dict(rtol=1e-4, atol=1e-5)
DOCS = [0, 0, 0, 1, 1, 2, 2]  # three packed documents in 7 positions


def gen(seed):
    return torch.Generator().manual_seed(seed)


def inputs(b=2, hq=4, hk=4, s=7, e=8, ev=8, seed=0):
    g = gen(seed)
    return [torch.randn(*shape, generator=g).requires_grad_() for shape in
            ((b, hq, s, e), (b, hk, s, e), (b, hk, s, ev))]


def reference(q, k, v, mask=None, bias=None, softcap=None, alibi=None, key_only=False, left=None, right=None,
              q_doc=None, k_doc=None, causal=False, scale=None):
    """The modified scores written out (module docstring of ops/attention/mods.py); (out, lse)."""
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    if alibi is not None:
        s = s + alibi[:, None, None] * (j.expand(q.shape[-2], -1) if key_only else j - i).float()
    keep = torch.ones(s.shape, dtype=torch.bool)
    if mask is not None:
        keep, s = (keep & mask, s) if mask.dtype == torch.bool else (keep, s + mask)
    if causal:
        keep = keep & (j <= i)
    if left is not None:
        keep = keep & (j >= i - left)
    if right is not None:
        keep = keep & (j <= i + right)
    if q_doc is not None:
        keep = keep & (q_doc[..., :, None] == k_doc[..., None, :]).unsqueeze(-3)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _docs(b=2, s=7):
    d = torch.tensor(DOCS[:s])
    return d.expand(b, s).clone(), d.expand(b, s).clone()


# name -> (shape kwargs, builder(q) -> (mask, bias, alibi slopes, q_doc, k_doc), settings kwargs)
def _bias(*shape, seed=3):
    return lambda q: (None, torch.randn(*shape, generator=gen(seed)).requires_grad_(), None, None, None)


def _alibi(q):
    return None, None, torch.tensor([0.5, 0.25, 0.125, 0.0625][: q.shape[1]]), None, None


CASES = {
    "softcap": ({}, None, dict(softcap=0.7)),
    "softcap_causal_gqa_scale": ({"hk": 2}, None, dict(softcap=0.5, is_causal=True, enable_gqa=True, scale=0.9)),
    "bias_per_head": ({}, _bias(1, 4, 7, 7), {}),
    "bias_broadcast_causal": ({}, _bias(2, 1, 1, 7), dict(is_causal=True)),
    "alibi_causal": ({}, _alibi, dict(is_causal=True)),
    "alibi_key_only_causal": ({}, _alibi, dict(is_causal=True, alibi_key_only=True)),
    "alibi_gqa": ({"hk": 1}, _alibi, dict(enable_gqa=True)),
    "window_causal": ({}, None, dict(is_causal=True, window_left=2)),
    "window_two_sided": ({}, None, dict(window_left=1, window_right=2)),
    "docs": ({}, lambda q: (None, None, None, *_docs()), {}),
    "docs_causal_window": ({}, lambda q: (None, None, None, *_docs()), dict(is_causal=True, window_left=1)),
    "bool_mask_bias_window": ({}, lambda q: (torch.rand(7, 7, generator=gen(5)) > 0.2, *_bias(1, 4, 7, 7)(q)[1:]),
                              dict(window_left=3, window_right=1)),
    "everything": ({"hk": 2}, lambda q: (None, _bias(2, 4, 7, 7)(q)[1], _alibi(q)[2], *_docs()),
                   dict(is_causal=True, enable_gqa=True, softcap=0.8, scale=0.6, window_left=3)),
}


def case(name, ev=8):
    shape, build, kw = CASES[name]
    q, k, v = inputs(ev=ev, **shape)
    mods = (None,) * 5 if build is None else build(q)
    mask, bias, alibi, q_doc, k_doc = mods
    # the diagonal is seen by every query (no row without a key): the reference's softmax has no NaN
    if mask is not None:
        mask = mask | torch.eye(7, dtype=torch.bool)
    return q, k, v, mask, Mods(bias, alibi, q_doc, k_doc), AttentionSettings(**kw)


def _reference_of(q, k, v, mask, mods, st):
    return reference(q, k, v, mask, mods.bias, st.softcap, mods.alibi_slopes, st.alibi_key_only, st.window_left,
                     st.window_right, mods.q_doc, mods.k_doc, st.is_causal, st.scale)


@pytest.mark.parametrize("path", ["fused", "padded", "math"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_lse_and_gradients_match_written_out_scores(name, path, monkeypatch):
    if path == "math":  # what the fused kernels do not take (soft-capping, a bias gradient) goes here anyway
        monkeypatch.setattr(fused, "applies", lambda *a, **kw: False)
        monkeypatch.setattr(fused, "whole_call_scale", lambda *a, **kw: None)
    q, k, v, mask, mods, st = case(name, 8 if path == "fused" else 6)
    out, lse = attention_with_lse(q, k, v, mask, st, mods)
    want, want_lse = _reference_of(q, k, v, mask, mods, st)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)
    go, gl = torch.randn(out.shape, generator=gen(7)), torch.randn(lse.shape, generator=gen(8))
    wrt = [t for t in (q, k, v, mods.bias) if t is not None]
    got = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), wrt)
    ref = torch.autograd.grad((want * go).sum() + (want_lse * gl).sum(), wrt)
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), got, ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")  # noqa: B023


def test_mods_change_the_result():
    """Each mod moves the output (the cases above would pass on a no-op otherwise)."""
    q, k, v, *_ = case("softcap")
    plain = attention(q, k, v)
    for kw in (dict(softcap=0.7), dict(bias=torch.randn(7, 7, generator=gen(1))), dict(window_left=1),
               dict(alibi_slopes=torch.full((4,), 0.5)), dict(q_doc=_docs()[0], k_doc=_docs()[1])):
        assert (attention(q, k, v, **kw) - plain).abs().max() > 1e-2, kw


def test_alibi_forms_give_one_output_and_lse_shifted_by_slope_times_position():
    q, k, v, _, mods, st = case("alibi_causal")
    out_rel, lse_rel = attention_with_lse(q, k, v, None, st, mods)
    out_key, lse_key = attention_with_lse(q, k, v, None, AttentionSettings(is_causal=True, alibi_key_only=True), mods)
    torch.testing.assert_close(out_rel, out_key, **TOL)
    shift = mods.alibi_slopes[:, None] * torch.arange(7.0)  # slope_h * i
    torch.testing.assert_close(lse_key - lse_rel, shift.expand_as(lse_rel), **TOL)


def test_fully_masked_rows_by_documents_and_window_are_zero():
    """Cross attention: queries whose document has no key, or whose window holds none."""
    q, k, v = inputs(s=7)
    kq = k[..., :4, :].detach().requires_grad_()
    vq = v[..., :4, :].detach().requires_grad_()
    q_doc, k_doc = torch.tensor([0, 0, 1, 1, 2, 2, 2]), torch.tensor([0, 0, 1, 1])
    out, lse = attention_with_lse(q, kq, vq, None, AttentionSettings(window_right=0, window_left=5),
                                  Mods(q_doc=q_doc, k_doc=k_doc))
    assert torch.isneginf(lse[..., 4:]).all() and (out[..., 4:, :] == 0).all() and torch.isfinite(lse[..., :4]).all()
    grads = torch.autograd.grad(out.sum(), (q, kq, vq))
    assert all(torch.isfinite(g).all() for g in grads) and (grads[0][..., 4:, :] == 0).all()


def _op_args(name, ev=8):
    q, k, v, mask, mods, st = case(name, ev)
    return (q, k, v, mask, *st.to_op_args(), *mods), st


@pytest.mark.parametrize("name", ["everything", pytest.param("bias_broadcast_causal", marks=pytest.mark.slow),
                                  pytest.param("alibi_key_only_causal", marks=pytest.mark.slow)])
def test_opcheck_forward_and_backward_ops(name):
    args, st = _op_args(name)
    torch.library.opcheck(OP, args)
    q, k, v, mask = (t.detach() if t is not None else None for t in args[:4])
    mods = Mods(*(None if t is None else t.detach() for t in args[-4:]))
    out, lse = OP(q, k, v, mask, *st.to_op_args(), *mods)
    bwd = (torch.randn_like(out), torch.randn_like(lse), q, k, v, mask, out, lse, *st.to_op_args(), *mods,
           mods.bias is not None)
    torch.library.opcheck(BWD, bwd)
    dq, dk, dv, db = BWD(*bwd)
    assert db.shape == (mods.bias.shape if mods.bias is not None else (0,))


def test_compile_fullgraph_with_every_mod():
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        q, k, v, _, mods, st = case("everything")

        @torch.compile(fullgraph=True)
        def f(q, k, v, bias, slopes, q_doc, k_doc):
            return attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.6, softcap=0.8, window_left=3,
                             bias=bias, alibi_slopes=slopes, q_doc=q_doc, k_doc=k_doc)

        out = f(q, k, v, *mods)
        want, _ = _reference_of(q, k, v, None, mods, st)
        torch.testing.assert_close(out, want, **TOL)
        got = torch.autograd.grad(out.sum(), (q, k, v, mods.bias))
        ref = torch.autograd.grad(want.sum(), (q, k, v, mods.bias))
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def test_bad_mods_fail_with_typed_errors():
    q, k, v = inputs()
    with pytest.raises(AttentionError, match="softcap"):
        AttentionSettings(softcap=0.0)
    with pytest.raises(AttentionError, match="window_left"):
        AttentionSettings(window_left=-1)
    with pytest.raises(AttentionError, match="bias"):
        attention(q, k, v, bias=torch.randn(3, 7, 7))
    with pytest.raises(AttentionError, match="alibi_slopes"):
        attention(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(AttentionError, match="go together"):
        attention(q, k, v, q_doc=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(AttentionError, match="integer ids"):
        attention(q, k, v, q_doc=torch.zeros(2, 7), k_doc=torch.zeros(2, 7))
    with pytest.raises(AttentionError, match="alibi_slopes is not differentiable"):
        attention(q, k, v, alibi_slopes=torch.ones(4, requires_grad=True))
    s = AttentionSettings(softcap=2.0, window_left=1, window_right=None, alibi_key_only=True, q_offset=1,
                          q_len_global=8, k_len_global=7, is_causal=True)
    assert AttentionSettings.from_op_args(*s.to_op_args()) == s
