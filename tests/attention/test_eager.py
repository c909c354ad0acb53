"""A plain eager ``sw.attention`` call runs the op's implementations under autograd
(ops/attention/op._EagerAttention) instead of dispatching shardwise::attention: the same
outputs and gradients, bit for bit, as the op's path; every call something intercepts (make_fx,
fake tensors, torch.compile, autocast, vmap, a tensor subclass) still dispatches the op.

    python -m pytest tests/attention/test_eager.py -q
"""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import shardwise as sw
from shardwise.ops.attention import AttentionSettings, attention_with_lse
from shardwise.ops.attention.mods import Mods
from shardwise.ops.attention.op import _plain_eager

OP = torch.ops.shardwise.attention.default


def _tensors(seed=0, hq=4, hk=4, sq=5, sk=6):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()
    return mk(2, hq, sq, 8), mk(2, hk, sk, 8), mk(2, hk, sk, 8)


CASES = {  # name -> (settings, mask, mods builder, tensor shapes)
    "plain": ({}, None, None, {}),
    "causal": ({"is_causal": True}, None, None, {}),
    "bool mask": ({}, lambda: torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) > 0.3, None, {}),
    "gqa, scale": ({"enable_gqa": True, "scale": 0.3}, None, None, {"hk": 2}),
    "bias (differentiable)": ({}, None, lambda: Mods(bias=torch.randn(1, 4, 5, 6, generator=torch.Generator().manual_seed(2))
                                                           .requires_grad_()), {}),
    "softcap, window": ({"softcap": 2.0, "window_left": 2, "window_right": 1}, None, None, {}),
    "document ids": ({}, None, lambda: Mods(q_doc=torch.tensor([[0, 0, 1, 1, 1]] * 2),
                                            k_doc=torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)), {}),
}


def _run(path: str, name: str):
    """(out, lse, grads of q, k, v and the bias) of one call of ``name`` through ``path``."""
    settings, mask, mods, shapes = CASES[name]
    q, k, v = _tensors(**shapes)
    mods = mods() if mods is not None else Mods()
    mask = mask() if mask is not None else None
    st = AttentionSettings(**settings)
    if path == "eager":
        out, lse = attention_with_lse(q, k, v, mask, st, mods)
        assert type(out.grad_fn).__name__ == "_EagerAttentionBackward", "the eager path was not taken"
    else:
        out, lse = OP(q, k, v, mask, *st.to_op_args(), *mods)
        assert "_EagerAttention" not in type(out.grad_fn).__name__
    wrt = [t for t in (q, k, v, mods.bias) if t is not None]
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum() + lse.sum(), wrt)
    return out, lse, grads


@pytest.mark.parametrize("name", list(CASES))
def test_eager_path_equals_the_op_bit_for_bit(name):
    got, want = _run("eager", name), _run("op", name)
    for what, a, b in (("out", got[0], want[0]), ("lse", got[1], want[1])):
        assert torch.equal(a, b), f"{name}: {what}"
        assert a.stride() == b.stride(), f"{name}: {what} layout"
    assert len(got[2]) == len(want[2])
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        assert torch.equal(a, b), f"{name}: gradient {i}"


def test_without_grad_the_implementation_runs_alone():
    q, k, v = (t.detach() for t in _tensors())
    out = sw.attention(q, k, v, is_causal=True)
    assert out.grad_fn is None
    with torch.no_grad():
        q2, k2, v2 = _tensors()
        assert sw.attention(q2, k2, v2).grad_fn is None
    torch.testing.assert_close(out, OP(q, k, v, None, *AttentionSettings(is_causal=True).to_op_args())[0],
                               rtol=0, atol=0)


def test_a_mask_that_requires_grad_is_refused_on_the_eager_path_too():
    q, k, v = (t.detach() for t in _tensors())  # nothing else requires grad: the mask alone records
    mask = torch.zeros(5, 6, requires_grad=True)
    with pytest.raises(sw.AttentionError, match="attn_mask is not differentiable"):
        sw.attention(q, k, v, mask)


def test_intercepted_calls_dispatch_the_op():
    q, k, v = _tensors()
    assert _plain_eager((q, k, v, None))
    graph = make_fx(lambda q, k, v: sw.attention(q, k, v, is_causal=True))(q.detach(), k.detach(), v.detach())
    assert any(n.target is OP for n in graph.graph.nodes), "make_fx did not record shardwise::attention"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _plain_eager((q, k, v, None))
    assert not _plain_eager((torch.nn.Parameter(q.detach()), k, v, None))  # a tensor subclass
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not _plain_eager((torch.empty(2, 4, 5, 8), k, v, None))
    seen = []
    torch.vmap(lambda x: seen.append(_plain_eager((x, None))) or x)(torch.ones(3, 2))
    assert seen == [False]
    seen.clear()

    @torch.compile(backend="eager", fullgraph=False)
    def compiled(x):
        seen.append(_plain_eager((x,)))
        return x + 1

    compiled(torch.ones(2))
    assert seen == [False], "torch.compile: the call was taken for plain eager"
