"""shardwise::attention with a value head size Ev unlike the query/key one E (Multi-head Latent
Attention: DeepSeek's E 192, Ev 128), smaller and larger: ring, gathered keys/values and Ulysses
(Shard(seq) -> Shard(heads), the op on each rank's heads, and back) against one-device F.sdpa in
float64, causal and not, with masks (a fully masked row), GQA and sizes that split unevenly;
opcheck of both ops; the rule verifier on every strategy of meshes (2,), (3,), (2, 2).

    python -m pytest tests/attention/test_value_head_size.py -q -p no:cacheprovider
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Shard as S
from shardwise.ops.attention import AttentionSettings, attention, fused

from .test_ring import STRATEGIES, _check, _run

FWD = torch.ops.shardwise.attention.default
BWD = torch.ops.shardwise.attention_backward.default
F64 = dict(rtol=1e-9, atol=1e-11)  # float64: the kernels' rounding only


def _bool_mask(sq, sk, seed=3):
    keep = torch.rand(sq, sk, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[:, 0] = True
    keep[2] = False  # a row that sees no key: out 0, gradients 0, no NaN
    return keep


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("ev", [5, 12])
@pytest.mark.parametrize("n, sq, sk, causal, gqa, mask", [
    (2, 7, 7, True, True, None),
    (3, 7, 7, False, False, "bool"),
    (3, 5, 9, True, False, None),  # cross attention, own block sizes, causal at global positions
    (2, 7, 7, False, True, "float"),  # (F.sdpa refuses a mask with causal)
])
def test_sequence_sharded_matches_sdpa_in_float64(strategy, ev, n, sq, sk, causal, gqa, mask):
    """q/k head size 8, v's ``ev``: every rank's out, dq, dk, dv equal F.sdpa's rows (float64)."""
    m = None if mask is None else (_bool_mask(sq, sk) if mask == "bool" else
                                   torch.randn(2, 1, sq, sk, generator=torch.Generator().manual_seed(4),
                                               dtype=torch.float64))
    results, ref, geom = _run(strategy, (n,), sq, sk, causal=causal, gqa=gqa, mask=m, dtype=torch.float64, ev=ev)
    assert ref[0].shape[-1] == ev and results[0][0].shape[-1] == ev
    _check(results, ref, geom, tol=F64)


def _qkv(hq=4, hk=4, s=7, e=8, ev=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, s, d, generator=g, dtype=dtype) for h, d in ((hq, e), (hk, e), (hk, ev))]


@pytest.mark.parametrize("n, hk, causal", [(2, 2, True), (3, 4, False), (3, 4, True)])
@pytest.mark.parametrize("ev", [5, 12])
def test_ulysses_heads_after_all_to_all_match_sdpa(n, hk, causal, ev):
    """Ulysses by hand: q, k, v sharded on the sequence (7 positions), redistributed to the heads
    (an all-to-all), the op on each rank's heads with autograd, out and gradients redistributed
    back to the sequence: equal to F.sdpa (float64). 4 query heads on 3 ranks split unevenly."""
    mesh = sw.Mesh((n,), ("sp",))
    q, k, v = _qkv(hk=hk, ev=ev)
    gqa = hk != q.shape[1]
    go = torch.randn(2, 4, 7, ev, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    seq, heads = [S(2)], [S(1)]
    steps = sw.plan_redistribute(sw.Layout(q.shape, q.dtype, seq), heads, mesh)
    assert [s.kind for s in steps] == ["all_to_all"], steps
    local = [sw.redistribute(sw.distribute(t, mesh, seq), mesh, seq, heads) for t in (q, k, v, go)]
    outs, grads = [], []
    for lq, lk, lv, lgo in zip(*local, strict=True):
        lq, lk, lv = (t.clone().requires_grad_() for t in (lq, lk, lv))
        out = attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out, (lq, lk, lv), lgo))
    back = lambda ts: sw.collect(sw.redistribute(list(ts), mesh, heads, seq), mesh, seq)  # noqa: E731
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=gqa)
    torch.testing.assert_close(back(outs), want.detach(), **F64)
    for i, want_g in enumerate(torch.autograd.grad(want, ref, go)):
        torch.testing.assert_close(back(g[i] for g in grads), want_g, **F64)


def _op_args(ev, causal=True, gqa=True, mask=True, dtype=torch.float32):
    q, k, v = _qkv(hk=2 if gqa else 4, s=5, ev=ev, dtype=dtype)
    m = _bool_mask(5, 5) if mask else None
    return q, k, v, m, AttentionSettings(is_causal=causal, enable_gqa=gqa)


@pytest.mark.parametrize("ev", [5, 12])
def test_opcheck_forward_and_backward(ev):
    q, k, v, m, st = _op_args(ev)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(FWD, (q, k, v, m, *st.to_op_args()))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = FWD(q, k, v, m, *st.to_op_args())
    assert out.shape == (*q.shape[:-1], ev) and lse.shape == q.shape[:-1]
    g = torch.Generator().manual_seed(6)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    torch.library.opcheck(BWD, (go, gl, q, k, v, m, out, lse, *st.to_op_args()))
    dq, dk, dv, _ = BWD(go, gl, q, k, v, m, out, lse, *st.to_op_args())
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_fused_kernel_takes_unlike_head_sizes():
    """The CPU kernel takes Ev != E zero-padded (fused.py): the op's blocks never materialise scores."""
    q, k, v, _, _ = _op_args(5)
    assert fused.applies(q, k, v) and fused.applies(q, k, _qkv(ev=12)[2])


def _verify(op, args):
    report = sw.verify_rule(op, *args)
    assert report.ok, report
    tags = {r.strategy.tags for r in report.results}
    assert {("ring",), ("seq_gather",), ("leading",), ("partial",)} <= tags, tags  # each family tried
    assert {r.mesh for r in report.results} == {(2,), (3,), (2, 2)}, report
    return report


@pytest.mark.parametrize("ev", [5, pytest.param(12, marks=pytest.mark.slow)])
def test_rule_verifier_passes_with_unlike_value_head_size(ev):
    """Every strategy of the forward and backward op (batch / head split, Ulysses' heads, gathered
    keys, ring, partial) on meshes (2,), (3,), (2, 2): 5 positions and 4 heads split unevenly."""
    q, k, v, m, st = _op_args(ev)
    out, lse = FWD(q, k, v, m, *st.to_op_args())
    g = torch.Generator().manual_seed(7)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    _verify(FWD, (q, k, v, m, *st.to_op_args()))
    _verify(BWD, (go, gl, q, k, v, m, out, lse, *st.to_op_args()))
