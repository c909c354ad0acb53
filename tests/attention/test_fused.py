"""torch's fused kernels behind shardwise.attention: same results as the math path, block by block.

    python -m pytest tests/attention/test_fused.py

The math path (kernels.math_block / math_block_backward) materialises the scores and is the
reference here; the fused path (fused.forward / fused.backward) must agree with it at every
block geometry the ring and gathered-KV strategies produce (global offsets, causal blocks
that are aligned, fully visible, hidden or diagonal-but-shifted), with bool and additive
masks (fully masked rows included), GQA and a gradient of lse.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from shardwise.ops.attention import AttentionSettings, attention, fused, kernels
from shardwise.ops.attention.benchmark import peak_bytes

TOL = dict(rtol=1e-4, atol=1e-5)


def _t(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _mask(kind, sq, sk, seed=7):
    """None, or a bool / additive mask with one fully masked row (row 1) when there are rows."""
    if kind is None:
        return None
    keep = torch.rand(sq, sk, generator=torch.Generator().manual_seed(seed)) > 0.4
    if sq > 1:
        keep[1] = False
    if kind == "bool":
        return keep
    return torch.randn(sq, sk, generator=torch.Generator().manual_seed(seed + 1)).masked_fill(~keep, float("-inf"))


def _visible(settings, sq, sk):
    qpos = torch.arange(sq)[:, None] + settings.q_offset
    kpos = torch.arange(sk)[None, :] + settings.k_offset
    return torch.ones(sq, sk, dtype=torch.bool) if not settings.is_causal else kpos <= qpos


def test_pieces_cover_exactly_the_visible_keys():
    """Every (query, key) pair the global causal mask shows is computed by exactly one piece."""
    for sq, sk, qo, ko in itertools.product(range(1, 6), range(1, 6), range(0, 8), range(0, 8)):
        s = AttentionSettings(is_causal=True).block(qo, ko, qo + sq, ko + sk)
        seen = torch.zeros(sq, sk, dtype=torch.int64)
        for q0, k0, k1, causal in fused.pieces(s, sq, sk):
            block = torch.ones(sq - q0, k1 - k0, dtype=torch.int64)
            seen[q0:, k0:k1] += block.tril() if causal else block
        assert torch.equal(seen, _visible(s, sq, sk).long()), (sq, sk, qo, ko, fused.pieces(s, sq, sk))
    assert fused.pieces(AttentionSettings(), 3, 4) == [(0, 0, 4, False)]
    assert fused.pieces(AttentionSettings(is_causal=True), 0, 4) == []


# (q_offset, k_offset) of a 4-query block against a 5-key block: aligned, keys before (partly and
# wholly), keys after (partly and wholly), and the gathered-KV geometry (keys from 0)
GEOMETRIES = [(0, 0), (3, 0), (2, 1), (9, 2), (0, 2), (1, 3), (0, 7), (6, 0)]


def _check_block(settings, q, k, v, mask, grad_lse_seed=None):
    """fused.forward/backward (blocks: compute dtype) vs the math path, out, lse and grads."""
    got = fused.forward(q, k, v, mask, settings, native=False)
    want = kernels.math_block(q, k, v, mask, settings)
    assert got is not None
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    torch.testing.assert_close(got[1], want[1], **TOL)
    # the row logsumexp over all keys comes from elsewhere (other blocks): any finite values
    # for live rows, -inf for rows that see nothing anywhere
    lse = torch.where(torch.isneginf(want[1]), want[1], want[1] + 0.3)
    out = _t(*want[0].shape, seed=11)
    go = _t(*want[0].shape, seed=12)
    gl = None if grad_lse_seed is None else _t(*lse.shape, seed=grad_lse_seed)
    got_g = fused.backward(go, gl, q, k, v, mask, out, lse, settings, native=False)
    want_g = kernels.math_block_backward(go, gl, q, k, v, mask, kernels.row_dot(go, out), lse, settings)[:3]
    for a, b in zip(got_g, want_g, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_causal_blocks_at_global_offsets_match_math_path(mask_kind):
    q, k, v = _t(2, 4, 4, 8, seed=1), _t(2, 2, 5, 8, seed=2), _t(2, 2, 5, 8, seed=3)
    mask = _mask(mask_kind, 4, 5)
    for (qo, ko), grad_lse in itertools.product(GEOMETRIES, (None, 5)):
        s = AttentionSettings(is_causal=True, enable_gqa=True).block(qo, ko, 16, 16)
        _check_block(s, q, k, v, mask, grad_lse)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_unmasked_causal_free_blocks_match_math_path(mask_kind):
    q, k, v = _t(3, 6, 8, seed=1), _t(3, 7, 8, seed=2), _t(3, 7, 8, seed=3)  # 3-d: [heads, seq, dim]
    for grad_lse in (None, 5):
        _check_block(AttentionSettings(scale=0.7), q, k, v, _mask(mask_kind, 6, 7), grad_lse)


def test_causal_row_whose_visible_keys_are_all_masked():
    """Row 2 sees keys 0..2 causally, all of them masked: out 0, lse -inf, gradients 0."""
    q, k, v = _t(1, 2, 5, 8, seed=1), _t(1, 2, 5, 8, seed=2), _t(1, 2, 5, 8, seed=3)
    keep = torch.ones(5, 5, dtype=torch.bool)
    keep[2, :3] = False
    for mask in (keep, torch.zeros(5, 5).masked_fill(~keep, float("-inf"))):
        s = AttentionSettings(is_causal=True)
        out, lse = fused.forward(q, k, v, mask, s, native=True)
        assert (out[..., 2, :] == 0).all() and torch.isneginf(lse[..., 2]).all()
        assert torch.isfinite(lse[..., [0, 1, 3, 4]]).all()
        _check_block(s, q, k, v, mask, grad_lse_seed=4)


def test_causal_with_a_padding_mask_broadcast_over_rows():
    """A [batch, 1, 1, S] key-padding mask hiding the first keys of batch 0: under causal its first
    rows see nothing (dead), the others see the later keys; at global offsets too."""
    q, k, v = _t(2, 2, 5, 8, seed=1), _t(2, 2, 6, 8, seed=2), _t(2, 2, 6, 8, seed=3)
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[0, ..., :2] = False
    for mask in (keep, torch.zeros(2, 1, 1, 6).masked_fill(~keep, float("-inf"))):
        for qo, ko in ((0, 0), (2, 0), (0, 1)):
            s = AttentionSettings(is_causal=True).block(qo, ko, 8, 8)
            _check_block(s, q, k, v, mask, grad_lse_seed=4)
    _, lse = fused.forward(q, k, v, keep, AttentionSettings(is_causal=True), native=True)
    assert torch.isneginf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all() and torch.isfinite(lse[1]).all()


def _no_math_path(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the math path ran where the fused kernel applies")

    monkeypatch.setattr(kernels, "math_block", refuse)
    monkeypatch.setattr(kernels, "math_block_backward", refuse)


CASES = {  # name -> (q shape, kv heads, mask, kwargs)
    "plain": ((2, 4, 9, 8), 4, None, {}),
    "causal": ((2, 4, 9, 8), 4, None, {"is_causal": True}),
    "causal_sq_gt_sk": ((2, 4, 9, 8), 4, None, {"is_causal": True, "sk": 5}),
    "gqa_causal": ((2, 4, 9, 8), 2, None, {"is_causal": True, "enable_gqa": True}),
    "bool_mask": ((2, 4, 9, 8), 4, "bool", {}),
    "float_mask_gqa": ((2, 4, 9, 8), 1, "float", {"enable_gqa": True, "scale": 0.3}),
    "2d": ((9, 8), None, None, {"is_causal": True}),
    "3d_bool": ((4, 9, 8), 4, "bool", {}),
    "5d_mask": ((2, 3, 2, 9, 8), 2, "float5d", {}),
}


def _case(name):
    shape, hk, mask_kind, kw = CASES[name]
    kw = dict(kw)
    sk = kw.pop("sk", shape[-2])
    kv_shape = (*shape[:-3], hk, sk, shape[-1]) if hk is not None else (sk, shape[-1])
    q, k, v = _t(*shape, seed=1), _t(*kv_shape, seed=2), _t(*kv_shape, seed=3)
    mask = (_t(2, 1, 1, shape[-2], sk, seed=4) if mask_kind == "float5d" else _mask(mask_kind, shape[-2], sk))
    return q, k, v, mask, kw


@pytest.mark.parametrize("name", list(CASES))
def test_whole_sequences_run_on_the_fused_kernel(name, monkeypatch):
    """No sequence split: forward and backward never touch the math path and equal F.sdpa."""
    q, k, v, mask, kw = _case(name)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, **kw)
    want = torch.autograd.grad(ref, (qr, kr, vr), torch.ones_like(ref))
    _no_math_path(monkeypatch)
    calls = []
    fwd, bwd = fused.KERNELS["cpu"]
    monkeypatch.setitem(fused.KERNELS, "cpu", (lambda *a: calls.append("f") or fwd(*a),
                                               lambda *a: calls.append("b") or bwd(*a)))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(qs, ks, vs, mask, **kw)
    got = torch.autograd.grad(out, (qs, ks, vs), torch.ones_like(out))
    assert calls == ["f", "b"]
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("ev", [3, 12])
@pytest.mark.parametrize("mask_kind", [None, "bool"])
def test_value_head_size_unlike_the_query_s_is_padded_onto_the_kernel(monkeypatch, ev, mask_kind):
    """v's head size smaller (3) or larger (12) than q's (8): zero-padded to one size for the CPU
    kernel, equal to the math path block by block (global offsets, GQA, a gradient of lse) and to
    F.sdpa whole, without the math path."""
    q, k, v = _t(2, 4, 4, 8, seed=1), _t(2, 2, 5, 8, seed=2), _t(2, 2, 5, ev, seed=3)
    assert fused.applies(q, k, v)
    mask = _mask(mask_kind, 4, 5)
    for (qo, ko), grad_lse in itertools.product(GEOMETRIES[:4], (None, 5)):
        _check_block(AttentionSettings(is_causal=True, enable_gqa=True).block(qo, ko, 16, 16), q, k, v, mask, grad_lse)
    _no_math_path(monkeypatch)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*mine, is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    assert out.shape == want.shape == (2, 4, 4, ev)
    torch.testing.assert_close(out, want, **TOL)
    go = _t(*out.shape, seed=9)
    for a, b in zip(torch.autograd.grad(out, mine, go), torch.autograd.grad(want, ref, go), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_with_scale_at_or_below_zero_takes_the_math_path(scale):
    """The CPU kernel scales its causal mask with the scores (NaN at scale 0): math path, exact."""
    q, k, v = _t(1, 2, 5, 8, seed=1), _t(1, 2, 5, 8, seed=2), _t(1, 2, 5, 8, seed=3)
    s = AttentionSettings(is_causal=True, scale=scale)
    assert not fused.applies(q, k, v, s) and fused.applies(q, k, v, AttentionSettings(scale=scale))
    out = attention(q, k, v, is_causal=True, scale=scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, kernels.math_block(q, k, v, None, s)[0], **TOL)
    _check_block(AttentionSettings(scale=scale), q, k, v, None, grad_lse_seed=4)  # not causal: fused, fine


def test_bf16_blocks_merge_in_float32_and_whole_calls_match_sdpa():
    q, k, v = (_t(2, 4, 16, 8, seed=i, dtype=torch.bfloat16) for i in (1, 2, 3))
    s = AttentionSettings(is_causal=True).block(8, 0, 16, 16)  # gathered-KV geometry: two pieces
    out, lse = fused.forward(q[..., 8:, :], k, v, None, s, native=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)[..., 8:, :]
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    blk, _ = fused.forward(q[..., 8:, :], k, v, None, s, native=False)
    assert blk.dtype == torch.float32
    torch.testing.assert_close(blk, ref, rtol=1e-2, atol=1e-2)
    whole = attention(q, k, v, is_causal=True)
    assert torch.equal(whole, F.scaled_dot_product_attention(q, k, v, is_causal=True))  # the same kernel


def test_peak_memory_and_saved_tensors_stay_at_aten_level():
    """Forward+backward allocates no more than aten's SDPA (+20%): no L x S scores anywhere."""
    q, k, v = (_t(2, 4, 256, 32, seed=i).requires_grad_() for i in (1, 2, 3))
    go = _t(2, 4, 256, 32, seed=4)

    def step(fn):
        out = fn(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), go)

    step(attention)
    aten, mine = peak_bytes(lambda: step(F.scaled_dot_product_attention)), peak_bytes(lambda: step(attention))
    scores = 2 * 4 * 256 * 256 * 4
    assert mine <= 1.2 * aten, (mine, aten)
    assert mine < scores, (mine, scores)


def test_projection_views_give_aten_results_and_layouts():
    """q/k/v as transposed views of one [batch, seq, 3, heads, dim] projection (as HF models make
    them): bitwise the results of F.sdpa on the same kernel, in the same memory layouts."""
    x = _t(2, 7, 3, 4, 8, seed=1)
    mine = [x[:, :, i].transpose(1, 2).requires_grad_() for i in range(3)]
    ref = [x[:, :, i].transpose(1, 2).requires_grad_() for i in range(3)]
    out, want = attention(*mine, is_causal=True), F.scaled_dot_product_attention(*ref, is_causal=True)
    assert torch.equal(out, want) and out.stride() == want.stride()
    go = _t(*out.shape, seed=2)
    for a, b in zip(torch.autograd.grad(out, mine, go), torch.autograd.grad(want, ref, go), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()


# -- the whole-call fast path (fused.whole_call_scale): the general path's bits, its checks skipped
def _general(q, k, v, mask, causal, scale, go):
    """The op's results through kernels.attention_forward / attention_backward (no fast path)."""
    from shardwise.ops.attention import op

    s = AttentionSettings(is_causal=causal, scale=scale)
    out, lse = kernels.attention_forward(q, k, v, mask, s)
    out, lse = op._like(out.to(q.dtype), q), lse.contiguous()
    dq, dk, dv, _ = kernels.attention_backward(go, q, k, v, mask, out, lse, s)
    return (out, lse, *(op._in_order(g, op._grad_order(x)) for g, x in zip((dq, dk, dv), (q, k, v))))


FAST = {"causal": dict(causal=True), "full": dict(causal=False), "longer keys": dict(causal=False, sk=7),
        "scale": dict(causal=True, scale=0.3), "bf16": dict(causal=True, dtype=torch.bfloat16),
        "projection views": dict(causal=True, views=True),
        "bool mask, a row hidden": dict(causal=False, mask="bool"),
        "additive mask and causal": dict(causal=True, mask="additive"),
        "4-d bool mask over the batch": dict(causal=False, mask="4d")}


@pytest.mark.parametrize("name", list(FAST))
def test_whole_call_fast_path_gives_the_general_paths_bits(name):
    from shardwise.ops.attention import op

    c = dict(FAST[name])
    causal, scale, dtype, sk = c["causal"], c.get("scale"), c.get("dtype", torch.float32), c.get("sk", 5)
    if c.get("views"):  # [batch, seq, heads, dim] projections seen as [batch, heads, seq, dim]
        q, k, v = (_t(2, n, 3, 8, seed=i, dtype=dtype).transpose(1, 2) for i, n in ((1, 5), (2, sk), (3, sk)))
    else:
        q, k, v = _t(2, 3, 5, 8, seed=1, dtype=dtype), _t(2, 3, sk, 8, seed=2, dtype=dtype), _t(2, 3, sk, 8, seed=3, dtype=dtype)
    mask = {"4d": lambda: torch.rand(2, 1, 5, sk, generator=torch.Generator().manual_seed(5)) > 0.3,
            None: lambda: None}.get(c.get("mask"), lambda: _mask(c.get("mask"), 5, sk))()
    args = (mask, causal, scale, False, 0, 0, None, None)
    assert fused.whole_call_scale(q, k, v, *args) is not None
    out, lse = op.attention_op._init_fn(q, k, v, *args)
    go = _t(*out.shape, seed=4, dtype=dtype)
    got = (out, lse, *op.attention_backward_op._init_fn(go, None, q, k, v, *args[:1], out, lse, *args[1:])[:3])
    for a, b in zip(got, _general(q, k, v, mask, causal, scale, go), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype
    if c.get("mask") == "bool":
        assert torch.isneginf(lse[:, :, 1]).all()  # the hidden row, as the general path reports it


def test_whole_call_fast_path_leaves_every_other_call_to_the_general_path():
    q, k, v = _t(2, 4, 5, 8, seed=1), _t(2, 4, 5, 8, seed=2), _t(2, 4, 5, 8, seed=3)
    plain = (None, True, None, False, 0, 0, None, None)
    assert fused.whole_call_scale(q, k, v, *plain) == pytest.approx(8 ** -0.5)
    others = {"gqa": (q, k[:, :2], v[:, :2], None, True, None, True, 0, 0, None, None),
              "offsets": (q, k, v, None, True, None, False, 5, 0, 10, 10),
              "global lengths": (q, k, v, None, True, None, False, 0, 0, 10, 10),
              "one key, causal": (q, k[..., :1, :], v[..., :1, :], *plain),
              "scale 0, causal": (q, k, v, None, True, 0.0, False, 0, 0, None, None),
              "3-d": (q[0], k[0], v[0], *plain),
              "head dim not innermost": (q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2), *plain),
              "v's head dim": (q, k, v[..., :3], *plain),  # padded by the general path
              "int": (q.int(), k.int(), v.int(), *plain),
              "mask not broadcasting": (q, k, v, torch.ones(3, 5, dtype=torch.bool), *plain[1:]),
              "5-d mask": (q, k, v, torch.ones(1, 2, 4, 5, 5, dtype=torch.bool), *plain[1:]),
              "int mask": (q, k, v, torch.ones(5, 5, dtype=torch.int64), *plain[1:])}
    for what, args in others.items():
        assert fused.whole_call_scale(*args) is None, what
    for i, name in enumerate(("softcap", "window_left", "window_right", "alibi_key_only", "bias")):
        rest = [None] * 5
        rest[i] = True if name == "alibi_key_only" else (q if name == "bias" else 2)
        assert fused.whole_call_scale(q, k, v, *plain, *rest) is None, name
