"""Scaled-dot-product attention rules (batch- and head-sharded, GQA) on meshes (2,), (3,), (2, 2).

The backward is checked with the forward's real outputs (out, logsumexp) as its inputs.
Run: python -m pytest tests/rules/test_attention_sdpa.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, OpCall, load_all
from shardwise.rules.registry import expand, local_shapes_match

from ._rulecheck import check, strategies_1d

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def qkv(b, hq, hk, L, s, e, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((b, hq, L, e), (b, hk, s, e), (b, hk, s, e))]


def masks(b, hq, L, s):
    g = torch.Generator().manual_seed(1)
    return {
        "none": None,
        "2d": torch.randn(L, s, generator=g),
        "batch": torch.randn(b, 1, L, s, generator=g),
        "batch_bool": torch.rand(b, 1, L, s, generator=g) > 0.3,
        "full": torch.randn(b, hq, L, s, generator=g),
    }


def mask_place(m, d, q):
    """Expected placement of the mask when batch (d=0) or heads (d=1) are sharded."""
    if m is None:
        return ()
    k = d - (4 - m.dim())
    return (R,) if k < 0 or (m.shape[k] == 1 and q.shape[d] != 1) else (S(k),)


def check_flash(q, k, v, mask=None, is_causal=False, gqa_dims=(0, 1), dtype_tol=None):
    kw = {} if mask is None else {"attn_mask": mask}
    mk = lambda d: mask_place(mask, d, q)  # noqa: E731
    check(FLASH, q, k, v, 0.0, is_causal, **kw,
          expect=[((S(d), S(d), S(d)) + mk(d), (S(d), S(d))) for d in gqa_dims]
          + [((R, R, P) + ((R,) if mask is not None else ()), (P, R))])
    out, lse = FLASH(q, k, v, 0.0, is_causal, **kw)
    go = torch.randn(out.shape).to(q.dtype)
    check(FLASH_BWD, go, q, k, v, out, lse, 0.0, is_causal, **kw,
          expect=[((S(d),) * 6 + mk(d), (S(d),) * 3) for d in gqa_dims]
          + [((P,) + (R,) * (5 + (mask is not None)), (P, P, P))])


@pytest.mark.parametrize("mask", ["none", "2d", "batch", "full"])
@pytest.mark.parametrize("b,h,L,s", [(2, 4, 5, 6), (3, 5, 4, 3), (1, 2, 3, 3)])
def test_flash_cpu_batch_and_heads(b, h, L, s, mask):
    check_flash(*qkv(b, h, h, L, s, 4), mask=masks(b, h, L, s)[mask])


def test_flash_cpu_causal():
    check_flash(*qkv(3, 3, 3, 5, 5, 4), is_causal=True)


def test_flash_cpu_bf16():
    check_flash(*qkv(2, 3, 3, 4, 4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("hq,hk", [(4, 2), (6, 3), (6, 2), (8, 2)])
def test_flash_cpu_gqa(hq, hk):
    check_flash(*qkv(2, hq, hk, 3, 4, 4), mask=masks(2, hq, 3, 4)["full"], gqa_dims=(0,))


def _tried(op, args, kwargs, mesh_shape):
    load_all()
    call = OpCall.from_values(op, args, kwargs, op(*args, **kwargs))
    return {st for st in expand(call, DEFAULT.get(op), Mesh(mesh_shape))}


@pytest.mark.parametrize("hq,hk,n,ok", [(4, 2, 2, True), (4, 2, 3, True), (6, 3, 2, False), (6, 3, 3, True),
                                        (6, 2, 2, True), (6, 2, 3, False), (8, 2, 2, True)])
def test_gqa_head_split_only_when_chunks_map(hq, hk, n, ok):
    q, k, v = qkv(2, hq, hk, 3, 4, 4)
    heads = {st for st in _tried(FLASH, (q, k, v), {}, (n,)) if st.ins[0] == (S(1),)}
    assert bool(heads) == ok, heads


def test_composite_and_math_ops():
    q, k, v = qkv(3, 4, 2, 3, 5, 4)
    m = masks(3, 4, 3, 5)["batch_bool"]
    check(aten.scaled_dot_product_attention.default, q, k, v, m, enable_gqa=True,
          expect=[((S(0), S(0), S(0), S(0)), (S(0),)), ((R, R, P, R), (P,))])
    r = check(aten._scaled_dot_product_attention_math.default, q, k, v, m, enable_gqa=True,
              expect=[((S(0), S(0), S(0), S(0)), (S(0), S(0))), ((R, R, P, R), (P, R))])
    assert ((S(1), S(1), S(1), R), (S(1), S(1))) in strategies_1d(r)


def test_dropout_is_replicate_only():
    q, k, v = qkv(2, 2, 2, 3, 3, 4)
    load_all()
    op = aten._scaled_dot_product_attention_math.default
    call = OpCall.from_values(op, (q, k, v, None, 0.5), {}, op(q, k, v, None, 0.0))
    assert len(DEFAULT.get(op).strategies(call)) == 1


@pytest.mark.parametrize("mask", [False, True])
def test_efficient_attention_strategies_and_local_shapes(mask):
    """No CPU kernel: check the strategies and the local shapes on meta tensors only."""
    load_all()
    fwd = aten._scaled_dot_product_efficient_attention.default
    bwd = aten._scaled_dot_product_efficient_attention_backward.default
    q, k, v = (t.to("meta") for t in qkv(3, 5, 5, 4, 6, 8))
    bias = torch.randn(3, 5, 4, 6, device="meta") if mask else None
    out = fwd(q, k, v, bias, True)
    grads = bwd(out[0], q, k, v, bias if mask else torch.empty(0, device="meta"), out[0], out[1], out[2], out[3],
                0.0, [True, True, True, mask])
    cases = [(fwd, (q, k, v, bias, True), out),
             (bwd, (out[0], q, k, v, bias if mask else torch.empty(0, device="meta"), out[0], out[1], out[2], out[3],
                    0.0, [True, True, True, mask]), grads)]
    for op, args, res in cases:
        call = OpCall.from_values(op, args, {}, res)
        rule = DEFAULT.get(op)
        one = rule.strategies(call)
        assert any(s.ins[0] == S(0) for s in one) and any(s.ins[0] == S(1) for s in one)
        for shape in ((2,), (3,), (2, 2)):
            sts = expand(call, rule, Mesh(shape))
            assert len(sts) == len(set(one)) ** len(shape)
            assert all(local_shapes_match(call, rule, st, Mesh(shape)) for st in sts)
