"""Ring and gathered-KV attention with score modifications on the threads backend: every rank's
output and gradients (the bias's too) equal the single-device op's on its block; windows and
ALiBi at global positions, the bias sliced per key block, key document ids rotating with k/v.

    python -m pytest tests/attention/test_ring_mods.py -q
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from shardwise.core.mesh import Mesh
from shardwise.ops.attention import AttentionSettings, attention_with_lse, ring
from shardwise.ops.attention.mods import Mods
from shardwise.run import run_threads
from shardwise.run.collectives import current, using

from .test_ring import STRATEGIES, Counting

TOL = dict(rtol=1e-4, atol=1e-5)


def _inputs(s, hq=4, hk=4, ev=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return mk(2, hq, s, 8), mk(2, hk, s, 8), mk(2, hk, s, ev), mk(2, hq, s, ev), g


def _mods(kind, s, hq, g):
    docs = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3][:s]).expand(2, s).clone()
    return {
        "bias": Mods(bias=torch.randn(1, hq, s, s, generator=g)),
        "bias_keys_only": Mods(bias=torch.randn(2, hq, 1, s, generator=g)),
        "alibi": Mods(alibi_slopes=torch.rand(hq, generator=g)),
        "docs": Mods(q_doc=docs, k_doc=docs.clone()),
        "everything": Mods(bias=torch.randn(2, 1, s, s, generator=g), alibi_slopes=torch.rand(hq, generator=g),
                           q_doc=docs, k_doc=docs.clone()),
        "none": Mods(),
    }[kind]


SETTINGS = {
    "bias": dict(is_causal=True),
    "bias_keys_only": dict(),
    "alibi": dict(is_causal=True, alibi_key_only=True),
    "docs": dict(is_causal=True),
    "everything": dict(is_causal=True, softcap=0.6, window_left=3, enable_gqa=True),
    "window": dict(window_left=2, window_right=1),
    "window_causal": dict(is_causal=True, window_left=1),
}


def _run(strategy, n, s, mods_kind, settings_kind, hk=4, ev=8):
    mesh = Mesh((n,))
    q, k, v, go, g = _inputs(s, hk=hk, ev=ev)
    mods = _mods(mods_kind, s, 4, g)
    st = AttentionSettings(**SETTINGS[settings_kind])
    sizes = ring.chunk_sizes(s, n)
    off = ring.offsets(sizes)
    fwd, bwd = STRATEGIES[strategy]
    grad_bias = mods.bias is not None

    def local(rank):
        rows = slice(off[rank], off[rank] + sizes[rank])
        bias = mods.bias if mods.bias is None or mods.bias.shape[-2] == 1 else mods.bias[..., rows, :]
        docs = (None, None) if mods.q_doc is None else (mods.q_doc[..., rows], mods.k_doc[..., rows])
        return rows, mods._replace(bias=bias, q_doc=docs[0], k_doc=docs[1])

    def per_rank(rank):
        c = Counting(current())
        rows, lm = local(rank)
        with using(c):
            out, lse = fwd(q[..., rows, :], k[..., rows, :], v[..., rows, :], 0, st, sizes, mods=lm)
            grads = bwd(go[..., rows, :], q[..., rows, :], k[..., rows, :], v[..., rows, :], out, lse, 0, st, sizes,
                        mods=lm, grad_bias=grad_bias)
        return rows, out, grads, c.calls

    results = run_threads(per_rank, mesh, timeout=60)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    br = None if mods.bias is None else mods.bias.clone().requires_grad_()
    want, _ = attention_with_lse(qr, kr, vr, None, st, mods._replace(bias=br))
    ref = torch.autograd.grad(want, [t for t in (qr, kr, vr, br) if t is not None], go)
    return results, want.detach(), ref, mods


def _check(results, want, ref, mods):
    dbias = None
    for rows, out, (dq, dk, dv, db), _ in results:
        torch.testing.assert_close(out, want[..., rows, :], **TOL)
        for got, full in zip((dq, dk, dv), ref[:3]):
            torch.testing.assert_close(got, full[..., rows, :], **TOL)
        if mods.bias is None:
            assert db is None
        elif mods.bias.shape[-2] == 1:  # broadcast over the rows: each rank holds a partial sum
            dbias = db if dbias is None else dbias + db
        else:
            torch.testing.assert_close(db, ref[3][..., rows, :], **TOL)
    if dbias is not None:
        torch.testing.assert_close(dbias, ref[3], **TOL)


CASES = [("bias", "bias"), ("bias_keys_only", "bias_keys_only"), ("alibi", "alibi"), ("docs", "docs"),
         ("none", "window"), ("none", "window_causal"), ("everything", "everything")]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("n,s", [(2, 7), (3, 7), (4, 6)])
@pytest.mark.parametrize("mods_kind,settings_kind", CASES)
def test_matches_single_device(strategy, n, s, mods_kind, settings_kind):
    hk = 2 if settings_kind == "everything" else 4
    _check(*_run(strategy, n, s, mods_kind, settings_kind, hk=hk))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_math_path_blocks_with_every_mod(strategy):
    _check(*_run(strategy, 3, 8, "everything", "everything", hk=2, ev=6))


def test_document_ids_travel_with_the_keys():
    """Forward: P-1 shifts of k/v plus P-1 of the int64 ids (their own message); backward: the ids
    ride the P-1 shifts of k/v and dk/dv (one more message each), then one shift brings dk/dv home."""
    results, *_ = _run("ring", 3, 7, "docs", "docs")
    for *_, calls in results:
        assert calls == Counter({"send_recv": 2 * 2 + 2 * 2 + 1})


def test_window_skips_blocks_out_of_reach():
    """A window of one key to the left: on 4 ranks of 2 positions, ranks see only their own block and
    their left neighbour's; the others are never computed (still rotated: the ring is one loop)."""
    seen = Counter()
    from shardwise.ops.attention import kernels

    real = kernels.attention_block

    def counting(q, k, v, mask, settings, mods=Mods()):
        seen[(settings.q_offset, settings.k_offset)] += 1
        return real(q, k, v, mask, settings, mods)

    kernels.attention_block = counting
    try:
        _check(*_run("ring", 4, 8, "none", "window_causal"))
    finally:
        kernels.attention_block = real
    assert set(seen) == {(0, 0), (2, 0), (2, 2), (4, 2), (4, 4), (6, 4), (6, 6)}
