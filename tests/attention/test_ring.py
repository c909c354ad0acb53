"""Ring and gathered-KV attention on the threads backend: every rank vs single-device sdpa.

    python -m pytest tests/attention/test_ring.py
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from shardwise.ops.attention import AttentionSettings
from shardwise.ops.attention import ring
from shardwise.core.mesh import Mesh
from shardwise.run import run_threads
from shardwise.run.collectives import Collectives, current, using

STRATEGIES = {
    "ring": (ring.ring_attention_forward, ring.ring_attention_backward),
    "gathered": (ring.gathered_kv_attention_forward, ring.gathered_kv_attention_backward),
}
TOL = dict(rtol=1e-4, atol=1e-5)


class Counting(Collectives):
    """Wraps this rank's collectives and counts the calls of each kind."""

    def __init__(self, inner: Collectives):
        super().__init__(inner.mesh, inner.rank)
        self.inner, self.calls = inner, Counter()

    def _call(self, kind, *args, **kwargs):
        self.calls[kind] += 1
        return getattr(self.inner, kind)(*args, **kwargs)

    def all_reduce(self, t, mesh_dim, op="sum"):
        return self._call("all_reduce", t, mesh_dim, op)

    def all_gather(self, t, mesh_dim):
        return self._call("all_gather", t, mesh_dim)

    def reduce_scatter(self, t, mesh_dim, op="sum"):
        return self._call("reduce_scatter", t, mesh_dim, op)

    def all_to_all(self, t, mesh_dim):
        return self._call("all_to_all", t, mesh_dim)

    def send_recv(self, t, mesh_dim, shift=1):
        return self._call("send_recv", t, mesh_dim, shift)

    def barrier(self):
        return self._call("barrier")


def _inputs(sq, sk, hq=4, hk=4, dtype=torch.float32, seed=0, ev=8):
    """q, k, v, grad_out (q and k of head size 8, v of ``ev``: unlike 8, the fused kernel takes the
    blocks zero-padded to one head size)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(2, hq, sq, 8), mk(2, hk, sk, 8), mk(2, hk, sk, ev), mk(2, hq, sq, ev)


def _reference(q, k, v, go, mask, kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return out.detach(), dq, dk, dv


def _run(strategy, mesh_shape, sq, sk, *, causal=False, gqa=False, mask=None, dtype=torch.float32, mesh_dim=0,
         ev=8):
    """Shard q/k/v on the sequence over ``mesh_dim``, run fwd+bwd per rank; return (per-rank, reference)."""
    mesh = Mesh(mesh_shape)
    n = mesh.shape[mesh_dim]
    q, k, v, go = _inputs(sq, sk, hk=2 if gqa else 4, dtype=dtype, ev=ev)
    settings = AttentionSettings(is_causal=causal, enable_gqa=gqa)
    qs, ks = ring.chunk_sizes(sq, n), ring.chunk_sizes(sk, n)
    qo, ko = ring.offsets(qs), ring.offsets(ks)
    fwd, bwd = STRATEGIES[strategy]

    def per_rank(rank):
        c = Counting(current())
        i = mesh.coord(rank)[mesh_dim]
        rows = lambda t, o, s: t[..., o[i]:o[i] + s[i], :]  # noqa: E731
        lq, lk, lv, lgo = rows(q, qo, qs), rows(k, ko, ks), rows(v, ko, ks), rows(go, qo, qs)
        lmask = None if mask is None else mask[..., qo[i]:qo[i] + qs[i], :]
        with using(c):
            out, lse = fwd(lq, lk, lv, mesh_dim, settings, qs, ks, attn_mask=lmask)
            fwd_calls = Counter(c.calls)
            grads = bwd(lgo, lq, lk, lv, out, lse, mesh_dim, settings, qs, ks, attn_mask=lmask)[:3]  # no bias gradient
        return out, lse, grads, fwd_calls, c.calls - fwd_calls

    results = run_threads(per_rank, mesh, timeout=30)
    kw = {"is_causal": causal, "enable_gqa": gqa}
    return results, _reference(q, k, v, go, mask, kw), (qs, ks, qo, ko, mesh, mesh_dim)


def _check(results, ref, geom, tol=TOL):
    qs, ks, qo, ko, mesh, mesh_dim = geom
    out_ref, dq_ref, dk_ref, dv_ref = ref
    for rank, (out, lse, (dq, dk, dv), _, _) in enumerate(results):
        i = mesh.coord(rank)[mesh_dim]
        qsl, ksl = slice(qo[i], qo[i] + qs[i]), slice(ko[i], ko[i] + ks[i])
        assert out.dtype == out_ref.dtype and lse.shape == out.shape[:-1]
        torch.testing.assert_close(out, out_ref[..., qsl, :], **tol)
        torch.testing.assert_close(dq, dq_ref[..., qsl, :], **tol)
        torch.testing.assert_close(dk, dk_ref[..., ksl, :], **tol)
        torch.testing.assert_close(dv, dv_ref[..., ksl, :], **tol)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("s", [8, 7, 3])
@pytest.mark.parametrize("causal,gqa", [(False, False), (True, False), (True, True)])
def test_matches_single_device(strategy, n, s, causal, gqa):
    results, ref, geom = _run(strategy, (n,), s, s, causal=causal, gqa=gqa)
    _check(results, ref, geom)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_uneven_q_and_kv(strategy, causal):
    """Sq != Sk with their own block sizes (causal: F.sdpa's top-left alignment, at global positions)."""
    results, ref, geom = _run(strategy, (3,), 5, 9, causal=causal)
    _check(results, ref, geom)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_rows_sliced_per_rank(strategy, kind):
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(7, 7, generator=g) > 0.4
        mask[:, 0] = True
        mask[4] = False  # a fully masked row: 0 output, no NaN anywhere
    else:
        mask = torch.randn(2, 1, 7, 7, generator=g)
    results, ref, geom = _run(strategy, (3,), 7, 7, mask=mask)
    _check(results, ref, geom)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("sq,sk,causal", [(7, 7, True), (5, 9, True), (8, 8, False)])
def test_value_head_size_unlike_the_query_s(strategy, sq, sk, causal):
    """v's head dim != q's (Multi-head Latent Attention): blocks padded onto the fused kernel."""
    results, ref, geom = _run(strategy, (3,), sq, sk, causal=causal, gqa=causal, ev=6)
    _check(results, ref, geom)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_second_mesh_dim_of_2d_mesh(strategy):
    results, ref, geom = _run(strategy, (2, 3), 7, 7, causal=True, gqa=True, mesh_dim=1)
    _check(results, ref, geom)


def test_bf16_ring():
    results, ref, geom = _run("ring", (3,), 8, 8, causal=True, gqa=True, dtype=torch.bfloat16)
    for out, lse, grads, _, _ in results:
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert all(g.dtype == torch.bfloat16 for g in grads)
    _check(results, ref, geom, tol=dict(rtol=3e-2, atol=3e-2))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_exchange_counts(n):
    """Forward: P-1 k/v rotations. Backward: P-1 rotations of k/v with dk/dv (one message: same
    dtype) + one shift that brings dk/dv home. Nothing else."""
    results, _, _ = _run("ring", (n,), 7, 7, causal=True)
    for *_, fwd_calls, bwd_calls in results:
        assert fwd_calls == Counter({"send_recv": n - 1} if n > 1 else {})
        assert bwd_calls == Counter({"send_recv": n} if n > 1 else {})


def test_ring_bf16_sends_kv_and_fp32_grads_separately():
    results, _, _ = _run("ring", (3,), 6, 6, dtype=torch.bfloat16)
    for *_, fwd_calls, bwd_calls in results:
        assert fwd_calls == Counter({"send_recv": 2})
        assert bwd_calls == Counter({"send_recv": 2 * 2 + 1})


def test_gathered_collective_counts():
    results, _, _ = _run("gathered", (4,), 7, 7, causal=True)
    for *_, fwd_calls, bwd_calls in results:
        assert fwd_calls == Counter({"all_gather": 1})
        assert bwd_calls == Counter({"all_gather": 1, "reduce_scatter": 1})


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_seq_dim_argument_bshd_layout(strategy):
    """[B, S, H, D] tensors with seq_dim=1 give the [B, H, S, D] results transposed."""
    mesh, n, s = Mesh((2,)), 2, 7
    q, k, v, go = _inputs(s, s)
    settings = AttentionSettings(is_causal=True)
    sizes = ring.chunk_sizes(s, n)
    off = ring.offsets(sizes)
    fwd, bwd = STRATEGIES[strategy]
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731

    def per_rank(rank):
        rows = lambda x: t(x)[:, off[rank]:off[rank] + sizes[rank]]  # noqa: E731
        out, lse = fwd(rows(q), rows(k), rows(v), 0, settings, sizes, seq_dim=1)
        return out, lse, bwd(rows(go), rows(q), rows(k), rows(v), out, lse, 0, settings, sizes, seq_dim=1)[:3]

    out_ref, dq, dk, dv = _reference(q, k, v, go, None, {"is_causal": True})
    for rank, (out, lse, grads) in enumerate(run_threads(per_rank, mesh, timeout=30)):
        sl = slice(off[rank], off[rank] + sizes[rank])
        assert lse.shape == out.shape[:-1]
        torch.testing.assert_close(out, t(out_ref)[:, sl], **TOL)
        for got, want in zip(grads, (dq, dk, dv), strict=True):
            torch.testing.assert_close(got, t(want)[:, sl], **TOL)


def test_lse_matches_global_logsumexp():
    q, k, v, _ = _inputs(7, 7)
    sizes, mesh = ring.chunk_sizes(7, 3), Mesh((3,))
    off = ring.offsets(sizes)
    full = q @ k.transpose(-1, -2) / 8 ** 0.5
    full = full.masked_fill(torch.ones(7, 7, dtype=torch.bool).tril().logical_not(), float("-inf"))
    ref = torch.logsumexp(full, -1)

    def per_rank(rank):
        sl = slice(off[rank], off[rank] + sizes[rank])
        return ring.ring_attention_forward(q[..., sl, :], k[..., sl, :], v[..., sl, :], 0,
                                           AttentionSettings(is_causal=True), sizes)[1]

    lses = run_threads(per_rank, mesh, timeout=30)
    torch.testing.assert_close(torch.cat(lses, -1), ref, **TOL)


def test_bad_arguments_fail_loudly():
    mesh = Mesh((2,))
    q, k, v, _ = _inputs(4, 4)

    def wrong_sizes(rank):
        return ring.ring_attention_forward(q[..., :2, :], k[..., :2, :], v[..., :2, :], 0, AttentionSettings(), (2, 1, 1))

    with pytest.raises(ValueError, match="one non-negative int per member"):
        run_threads(wrong_sizes, mesh, timeout=10)

    def offsets_given(rank):
        s = AttentionSettings(is_causal=True, q_offset=2, q_len_global=4, k_len_global=4)
        return ring.ring_attention_forward(q[..., :2, :], k[..., :2, :], v[..., :2, :], 0, s, (2, 2))

    with pytest.raises(ValueError, match="computes offsets"):
        run_threads(offsets_given, mesh, timeout=10)

    def block_mismatch(rank):
        return ring.gathered_kv_attention_forward(q[..., :3, :], k[..., :3, :], v[..., :3, :], 0,
                                                  AttentionSettings(), (2, 2))

    with pytest.raises(ValueError, match="local q/k blocks"):
        run_threads(block_mismatch, mesh, timeout=10)


def test_chunk_sizes_follow_torch_chunk():
    assert ring.chunk_sizes(7, 4) == (2, 2, 2, 1)
    assert ring.chunk_sizes(3, 4) == (1, 1, 1, 0)
    assert ring.chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert ring.offsets((2, 2, 1, 0)) == (0, 2, 4, 5)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_backward_with_lse_gradient(strategy):
    """A loss that uses lse too (grad_lse) gives the gradients of the single-device op."""
    from shardwise.ops.attention import attention_with_lse

    mesh, s = Mesh((3,)), 7
    q, k, v, go = _inputs(s, s, hk=2)
    gl = torch.randn(2, 4, s, generator=torch.Generator().manual_seed(5))
    settings = AttentionSettings(is_causal=True, enable_gqa=True)
    sizes = ring.chunk_sizes(s, 3)
    off = ring.offsets(sizes)
    fwd, bwd = STRATEGIES[strategy]

    def per_rank(rank):
        sl = slice(off[rank], off[rank] + sizes[rank])
        lq, lk, lv = q[..., sl, :], k[..., sl, :], v[..., sl, :]
        out, lse = fwd(lq, lk, lv, 0, settings, sizes)
        return bwd(go[..., sl, :], lq, lk, lv, out, lse, 0, settings, sizes, grad_lse=gl[..., sl])[:3]

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_with_lse(qr, kr, vr, None, settings)
    want = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), (qr, kr, vr))
    for rank, grads in enumerate(run_threads(per_rank, mesh, timeout=30)):
        sl = slice(off[rank], off[rank] + sizes[rank])
        for got, w in zip(grads, want, strict=True):
            torch.testing.assert_close(got, w[..., sl, :], **TOL)
