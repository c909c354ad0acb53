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

``F.scaled_dot_product_attention`` calls that no fused aten kernel takes are decomposed by torch
into their math, which trace/attention.py cannot map; the mode sends two such kinds to the op:
one with a float mask that requires grad (Hugging Face's sdpa T5: the position bias folded into
the mask) as ``shardwise.attention(bias=mask)``, whose backward gives the mask's gradient, and
one whose values' head size differs from the queries' and keys' (DeepSeek's Multi-head Latent
Attention: E 192, Ev 128) as the op with the same arguments. A call the mode passes over (and a
chain that reaches softmax but not the op) is noted with where and why (``PASSED``):
attention_request.py names them when ``attention=`` cannot be honoured.
"""
from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..core.errors import AttentionError
from . import eager_chain as chain
from .attention_request import check_request, passed_note  # noqa: F401 (check_request: re-exported)
from .moe import GROUPED, dense_in_place
from .provenance import _forward_frame, source_line
from .recompute import recomputed_in

T = torch.Tensor
# F.scaled_dot_product_attention's arguments: (name, default), in order
_SDPA = (("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
         ("is_causal", False), ("scale", None), ("enable_gqa", False))


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
        self.unlike = 0  # sdpa calls with a value head size unlike the query's, as the op
        self.passed: list[tuple[str, str]] = []  # (where, why) of each call or chain passed over

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
            got = self._sdpa({n: chain.arg(args, kwargs, i, n, d) for i, (n, d) in enumerate(_SDPA)})
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

    def _pass_over(self, why: str, what: str = "scaled_dot_product_attention") -> None:
        self.passed.append((f"{what} at {_call_site()}", why))

    def _attention(self, c: chain.Chain, v: T):
        from ..ops.attention import attention

        why = _chain_misfit(c, v)
        q, k, v4 = (_as_4d(t, c.split) for t in (c.q, c.k, v)) if why is None else (None,) * 3
        terms = _terms(c, q) if q is not None and k is not None and v4 is not None else None
        if why is None and (terms is None or not _fits(q, k, v4)):
            why = (f"q {_shape(c.q)}, k {_shape(c.k)}, v {_shape(v)} (and the additive terms) are not "
                   "[batch, heads, seq, head_dim] alike")
        if why is not None:
            self._pass_over(why, "an eager attention chain (softmax -> matmul)")
            return None
        self.mapped += 1
        out = attention(q, k, v4, attn_mask=terms[0], scale=c.scale, enable_gqa=k.shape[1] != q.shape[1],
                        bias=terms[1], softcap=c.softcap)
        return out if c.split is None else out.flatten(0, 1)

    def _sdpa(self, a: dict):
        """An F.sdpa call that no fused kernel takes (module docstring) as the op, else None (the
        call runs as torch computes it)."""
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if not all(isinstance(t, T) for t in (q, k, v)):
            return None
        if isinstance(mask, T) and mask.is_floating_point() and mask.requires_grad:
            return self._sdpa_with_bias(a)
        if q.dim() and v.dim() and v.shape[-1] != q.shape[-1]:
            return self._sdpa_unlike_heads(a)
        if q.dim() != 4:  # not mapped (yet): the fused kernels are 4-d only, torch decomposes it
            self._pass_over(f"q {_shape(q)} is not 4-d [batch, heads, seq, head_dim]: no fused kernel takes it and "
                            "torch decomposes it into its math")
        elif a["dropout_p"]:  # torch's kernel with dropout inside: trace/attention.py keeps it
            self._pass_over(_sdpa_misfit(a))
        return None

    def _sdpa_with_bias(self, a: dict):
        """F.sdpa with a float mask that requires grad, as the op with that mask as its bias."""
        from ..ops.attention import attention

        q, k, v = a["query"], a["key"], a["value"]
        why = _sdpa_misfit(a) or ("is_causal=True with a mask that requires grad (the op takes the mask as a "
                                  "bias, without causal)" if a["is_causal"] else None)
        if why is None and not (q.dim() == k.dim() == v.dim() >= 3 and q.shape[:-3] == k.shape[:-3]):
            why = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)} differ in rank or batch dims"
        if why is not None:
            self._pass_over(why + "; with a mask that requires grad torch decomposes it into its math")
            return None
        self.sdpa += 1
        return attention(q, k, v, scale=a["scale"], enable_gqa=bool(a["enable_gqa"]), bias=a["attn_mask"])

    def _sdpa_unlike_heads(self, a: dict):
        """F.sdpa whose values' head size differs from the queries' (Multi-head Latent Attention):
        no fused kernel takes it (torch decomposes it into its math); the op computes it whole."""
        from ..ops.attention import attention
        from ..ops.attention.kernels import check_shapes
        from ..ops.attention.settings import AttentionSettings

        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        why = _sdpa_misfit(a)
        if why is None and a["is_causal"] and mask is not None:
            why = "both attn_mask and is_causal=True (torch refuses the pair)"
        if why is None:
            try:
                check_shapes(q, k, v, mask, AttentionSettings(scale=a["scale"], enable_gqa=bool(a["enable_gqa"])))
            except AttentionError as e:
                why = str(e).split("\n")[0]
        if why is not None:
            self._pass_over(why + f"; its value head size {v.shape[-1]} unlike the query's {q.shape[-1]} has no "
                                  "fused kernel: torch decomposes it into its math")
            return None
        self.unlike += 1
        return attention(q, k, v, attn_mask=mask, is_causal=bool(a["is_causal"]), scale=a["scale"],
                         enable_gqa=bool(a["enable_gqa"]))

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
                if c is None and func in chain.SOFTMAX:
                    self._pass_over(chain.softmax_misfit(mine, args, kwargs, out), "an eager attention chain's softmax")
                break
        if c is not None:
            self.chains[id(out)] = (out, c)
        elif out is x:  # an in-place op the chain does not follow: what it held is gone
            self.chains.pop(id(out), None)
            self.kt.pop(id(out), None)
        return out


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, T) else repr(t)


def _sdpa_misfit(a: dict) -> str | None:
    """Why an F.sdpa call cannot be the op whatever its shapes (dropout), or None."""
    return f"dropout_p={a['dropout_p']} inside attention (the op has no dropout)" if a["dropout_p"] else None


def _chain_misfit(c: chain.Chain, v) -> str | None:
    """Why a chain at its final matmul cannot be the op (before its shapes are looked at), or None."""
    if c.flat != (c.split is not None):
        return "its scores were viewed as 4-d but its probabilities not back as 3-d (or the reverse)"
    if not isinstance(v, T):
        return "the values are not a tensor"
    if not c.unchanged():
        return "a tensor it read (q, k or an additive term) was written in place before the last matmul"
    return None


def _call_site() -> str:
    """The user's source line of the torch call being handled: the frame provenance.py gives its
    nodes (the innermost ``forward`` outside torch), read off the stack, so the note is the same
    whether the call is traced or run for the stamp's fingerprint (trace/stamp.py)."""
    line = _forward_frame(sys._getframe(1))
    return (line and source_line(types.SimpleNamespace(meta={"stack_trace": line}))) or "an unknown line"


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
    counts = mode.mapped, mode.sdpa, mode.unlike, len(mode.passed)
    try:
        with mode:
            yield
    finally:  # the note counts the model's chains once (the recomputation has its own note)
        mode.mapped, mode.sdpa, mode.unlike = counts[:3]
        del mode.passed[counts[3]:]


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
        if notes is not None and mode.unlike:
            notes.append(f"attention: {mode.unlike} scaled_dot_product_attention call(s) with a value head size unlike "
                         "the query's (no fused kernel) -> shardwise.attention")
        if notes is not None:
            notes += [passed_note(what, why, n) for (what, why), n in Counter(mode.passed).items()]
