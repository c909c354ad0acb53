"""Eager attention (matmul -> scale -> soft-cap -> bias / mask -> softmax -> matmul) recognised
while tracing and computed by ``shardwise.attention``, so sequence parallelism applies to it as
to SDPA calls.

Hugging Face's ``eager_attention_forward`` and hand-written attention compute

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale     # or / d, or no scale
    scores = softcap * tanh(scores / softcap)                 # optional (Gemma 2)
    scores = scores + position_bias + mask                    # optional additive terms
    probs  = softmax(scores, dim=-1)                          # in the input's dtype
    probs  = probs.type(v.dtype); dropout(probs, p=0)         # identities here
    out    = torch.matmul(probs, v)

and Bloom ``alibi.baddbmm(q, k^T, beta, alpha)`` on [batch * heads, L, E] tensors viewed as
[batch, heads, L, S] for the mask, Falcon ``(q k^T + alibi) * scale + mask`` with one shared
key/value head (broadcast: grouped-query attention). A TorchFunctionMode follows each tensor
of that chain (by identity, while tracing; the steps are eager_chain.py's) and at the last
matmul returns ``shardwise.attention(q, k, v, attn_mask=mask, bias=..., scale=...,
softcap=...)`` instead: what the op computes, so the result is equal (up to float rounding)
and the chain's own ops are left without users (the trace drops them). The additive terms
become the op's ``attn_mask`` (the last one that needs no gradient, of q's dtype) and its
``bias`` (the others, summed: a learned T5 position bias keeps its gradient). Any step that
does not fit (a dropout that drops, a softmax over another dim or in another dtype, a term
that is not added, operands that are not 4-d [batch, heads, seq, dim] alike) breaks the
chain and the model's own ops are traced as they are; ``check_request`` then refuses
``attention="ulysses"|"ring"|...`` for a graph with no attention op, rather than ignoring the
request.

``F.scaled_dot_product_attention`` with a float mask that requires grad (Hugging Face's sdpa
T5: the position bias folded into the mask) has no fused aten kernel: torch decomposes it into
its math. The mode sends it to ``shardwise.attention(bias=mask)`` instead, whose backward
gives the mask's gradient.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..core.errors import ShardingError
from . import eager_chain as chain
from .moe import GROUPED, dense_in_place
from .recompute import recomputed_in

T = torch.Tensor


def _fits(q, k, v) -> bool:
    """[batch, heads, L, E] x [batch, heads or 1, S, E] x [batch, heads or 1, S, Ev], same batch,
    floating point: what the op computes as the chain does (one key/value head broadcast over
    the query heads is grouped-query attention)."""
    return (isinstance(v, T) and q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]
            and k.shape[1] == v.shape[1] and k.shape[1] in (1, q.shape[1]) and q.shape[-1] == k.shape[-1]
            and k.shape[-2] == v.shape[-2] and q.is_floating_point() and q.dtype == k.dtype == v.dtype)


def _as_4d(t: T, split) -> T | None:
    """A 3-d [batch * heads, ...] tensor (or term) as [batch, heads, ...] (others as they are: a
    term added after the 4-d view); None if it cannot be."""
    if split is None or t.dim() != 3:
        return t
    if t.shape[0] == split[0] * split[1]:
        return t.reshape(*split, *t.shape[1:])
    return t.unsqueeze(0) if t.shape[0] == 1 else None


def _terms(c: chain.Chain, q: T):
    """(attn_mask, bias) of the chain's additive terms; None when a term cannot be laid out."""
    terms = []
    for t, coef in c.terms:
        t = _as_4d(t, c.split)
        if t is None:
            return None
        terms.append(t if coef == 1 else t * coef)
    plain = [t for t in terms if not t.requires_grad]
    mask = plain[-1] if plain and plain[-1].dtype == q.dtype else None
    rest = [t for t in terms if t is not mask]
    bias = None
    for t in rest:
        bias = t if bias is None else bias + t
    return mask, bias


class EagerAttention(TorchFunctionMode):
    """Follows eager attention chains (module docstring) and computes them with the op."""

    def __init__(self):
        super().__init__()
        self.kt: dict = {}      # id(k^T) -> (k^T, k); the tensors are held so ids stay unique
        self.chains: dict = {}  # id(tensor) -> (tensor, chain.Chain)
        self.mapped = 0
        self.sdpa = 0

    def _kt_of(self, x):
        s = self.kt.get(id(x)) if isinstance(x, T) else None
        return s[1] if s is not None and s[0] is x else None

    def _chain(self, x):
        s = self.chains.get(id(x)) if isinstance(x, T) else None
        return s[1] if s is not None and s[0] is x else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GROUPED:  # a grouped matmul's dense form (trace/moe.py), in this mode: one mode, not two
            return dense_in_place(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            got = self._sdpa_with_bias(args, kwargs)
            if got is not None:
                return got
        if func in chain.MATMUL and len(args) == 2:
            c = self._chain(args[0])
            if c is not None and c.kind == "probs":
                got = self._attention(c, args[1])
                if got is not None:
                    return got
        out = func(*args, **kwargs)
        return self._follow(func, args, kwargs, out)

    def _attention(self, c: chain.Chain, v: T):
        from ..ops.attention import attention

        if c.flat != (c.split is not None) or not isinstance(v, T) or not c.unchanged():
            return None
        q, k, v4 = (_as_4d(t, c.split) for t in (c.q, c.k, v))
        terms = _terms(c, q) if q is not None and k is not None and v4 is not None else None
        if terms is None or not _fits(q, k, v4):
            return None
        self.mapped += 1
        out = attention(q, k, v4, attn_mask=terms[0], scale=c.scale, enable_gqa=k.shape[1] != q.shape[1],
                        bias=terms[1], softcap=c.softcap)
        return out if c.split is None else out.flatten(0, 1)

    def _sdpa_with_bias(self, args, kwargs):
        """F.sdpa with a float mask that requires grad, as the op with that mask as its bias."""
        from ..ops.attention import attention

        q, k, v = (chain.arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        mask = chain.arg(args, kwargs, 3, "attn_mask")
        dropout, causal = chain.arg(args, kwargs, 4, "dropout_p", 0.0), chain.arg(args, kwargs, 5, "is_causal", False)
        scale, gqa = chain.arg(args, kwargs, 6, "scale"), chain.arg(args, kwargs, 7, "enable_gqa", False)
        if not (isinstance(mask, T) and mask.is_floating_point() and mask.requires_grad) or dropout or causal \
                or not all(isinstance(t, T) for t in (q, k, v)) or not q.dim() == k.dim() == v.dim() >= 3 \
                or q.shape[:-3] != k.shape[:-3]:
            return None
        self.sdpa += 1
        return attention(q, k, v, scale=scale, enable_gqa=bool(gqa), bias=mask)

    def _follow(self, func, args, kwargs, out):
        if not isinstance(out, T):
            return out
        x = args[0] if args else None
        if func in chain.TRANSPOSE and isinstance(x, T) and x.dim() >= 3:
            dims = {d % x.dim() for d in (chain.arg(args, kwargs, 1, "dim0"), chain.arg(args, kwargs, 2, "dim1"))}
            if dims == {x.dim() - 1, x.dim() - 2}:
                self.kt[id(out)] = (out, x)
                return out
        c = chain.start(func, args, kwargs, self._kt_of)
        operands = [a for a in args[:2 if func in chain.ADD else 1] if isinstance(a, T)]
        for me in operands if c is None else ():
            mine = self._chain(me)
            if mine is not None:
                c = chain.step(mine, func, args, kwargs, out, me)
                break
        if c is not None:
            self.chains[id(out)] = (out, c)
        elif out is x:  # an in-place op the chain does not follow: what it held is gone
            self.chains.pop(id(out), None)
            self.kt.pop(id(out), None)
        return out


@contextlib.contextmanager
def _again(mode: EagerAttention):
    """``mode`` around torch.utils.checkpoint's recomputation in backward, where no torch function
    mode is on (autograd does not carry them; torch re-enters only a DeviceContext), so the
    recomputation traces what forward did (an eager attention chain as the op, not as its own
    ops: Hugging Face's activation checkpointing on Gemma 2 or Falcon would save other tensors in
    recomputation than in forward, and torch.utils.checkpoint raises); trace/recompute.recomputed_in."""
    if mode in _get_current_function_mode_stack():  # a recomputation inside one
        yield
        return
    counts = mode.mapped, mode.sdpa
    try:
        with mode:
            yield
    finally:  # the note counts the model's chains once (the recomputation has its own note)
        mode.mapped, mode.sdpa = counts


@contextlib.contextmanager
def eager_attention_as_op(notes: list | None = None):
    """Around the first tracing pass (capture.py); appends a note when chains were mapped."""
    mode = EagerAttention()
    try:
        with mode, recomputed_in(lambda: _again(mode)):
            yield mode
    finally:
        mode.chains.clear()
        mode.kt.clear()
        if notes is not None and mode.mapped:
            notes.append(f"attention: {mode.mapped} eager attention chain(s) (matmul, scale, soft-cap, bias / mask, "
                         "softmax, matmul) -> shardwise.attention")
        if notes is not None and mode.sdpa:
            notes.append(f"attention: {mode.sdpa} scaled_dot_product_attention call(s) with a mask that requires grad "
                         "-> shardwise.attention(bias=mask)")


def check_request(gm: fx.GraphModule, mode: str) -> None:
    """``attention=`` other than "auto" needs an attention op in the graph to act on."""
    if mode == "auto":
        return
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    if torch.ops.shardwise.attention.default in targets:
        return
    aten = torch.ops.aten
    softmax = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._softmax.default]
    from .provenance import source_line

    where = f" (softmax at {source_line(softmax[0]) or softmax[0].name})" if softmax else ""
    raise ShardingError(
        f"attention={mode!r} cannot be honoured: the traced graph has no attention op to apply it to{where}; "
        "shardwise maps F.scaled_dot_product_attention and the eager chain matmul (or baddbmm) -> scale -> "
        "soft-cap -> additive bias / mask -> softmax -> matmul onto shardwise.attention, and this model's attention "
        "is neither",
        fix="call torch.nn.functional.scaled_dot_product_attention or shardwise.attention in the model (Hugging "
            "Face: attn_implementation='sdpa'), or leave attention='auto'")
