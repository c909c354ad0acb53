"""Eager attention (matmul -> scale -> mask -> softmax -> matmul) recognised while tracing and
computed by ``shardwise.attention``, so sequence parallelism applies to it as to SDPA calls.

Hugging Face's ``eager_attention_forward`` and hand-written attention compute

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale     # or / d, or no scale
    scores = scores + mask                                    # optional additive mask
    probs  = softmax(scores, dim=-1)                          # float32 or the input's dtype
    probs  = probs.type(v.dtype); dropout(probs, p=0)         # identities here
    out    = torch.matmul(probs, v)

A TorchFunctionMode follows each tensor of that chain (by identity, while tracing) and at the
last matmul returns ``shardwise.attention(q, k, v, attn_mask=mask, scale=scale)`` instead:
softmax(q k^T * scale + mask) v is what the op computes, so the result is equal (up to float
rounding) and the chain's own ops are left without users (the trace drops them). Any step
that does not fit (a dropout that drops, a softmax over another dim or in a lower dtype, a
mask that is not added, operands that are not 4-d [batch, heads, seq, dim] alike) breaks the chain and the model's own ops are traced as
they are; ``check_request`` then refuses ``attention="ulysses"|"ring"|...`` for a graph with
no attention op, rather than ignoring the request.
"""
from __future__ import annotations

import contextlib
import numbers

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..core.errors import ShardingError
from .moe import GROUPED, dense_in_place

T = torch.Tensor
_TRANSPOSE = (T.transpose, torch.transpose)
_MATMUL = (torch.matmul, T.matmul, T.__matmul__)
_SCALE = {T.__mul__: False, T.mul: False, torch.mul: False, T.__rmul__: False,
          T.__truediv__: True, T.div: True, torch.div: True}
_ADD = (T.__add__, T.add, torch.add, T.__radd__)
_SOFTMAX = (F.softmax, T.softmax, torch.softmax)
_IDENTITY_CASTS = (T.type, T.to, T.type_as)
_DROPOUT = (F.dropout, torch.dropout)


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _fits(q, k, v) -> bool:
    """[batch, heads, L, E] x [batch, heads, S, E] x [batch, heads, S, Ev], same batch and heads
    (no broadcasting), floating point: what the op computes as the chain does."""
    return (isinstance(v, T) and q.dim() == k.dim() == v.dim() == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2]
            and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2] and q.is_floating_point()
            and q.dtype == k.dtype == v.dtype)


class EagerAttention(TorchFunctionMode):
    """Follows q k^T -> scale -> mask -> softmax -> (cast, no-op dropout) -> @ v; see the module doc."""

    def __init__(self):
        super().__init__()
        self.state: dict = {}  # id(tensor) -> (tensor, kind, info); the tensor is held so ids stay unique
        self.mapped = 0

    def _get(self, x, kind):
        s = self.state.get(id(x)) if isinstance(x, T) else None
        return s[2] if s is not None and s[0] is x and s[1] == kind else None

    def _put(self, out, kind, info):
        if isinstance(out, T):
            self.state[id(out)] = (out, kind, info)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GROUPED:  # a grouped matmul's dense form (trace/moe.py), in this mode: one mode, not two
            return dense_in_place(func, args, kwargs)
        if func in _MATMUL and len(args) == 2:
            probs = self._get(args[0], "probs")
            if probs is not None and _fits(probs["q"], probs["k"], args[1]):
                return self._attention(probs, args[1])
        out = func(*args, **kwargs)
        return self._follow(func, args, kwargs, out)

    def _attention(self, st: dict, v: T) -> T:
        from ..ops.attention import attention

        self.mapped += 1
        return attention(st["q"], st["k"], v, attn_mask=st["mask"], scale=st["scale"])

    def _follow(self, func, args, kwargs, out):  # noqa: C901 - one branch per step of the chain
        if func in _TRANSPOSE and isinstance(args[0], T) and args[0].dim() >= 3:
            dims = {d % args[0].dim() for d in (_arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1"))}
            if dims == {args[0].dim() - 1, args[0].dim() - 2}:
                return self._put(out, "kt", {"k": args[0]})
        elif func in _MATMUL and len(args) == 2:
            kt = self._get(args[1], "kt")
            q = args[0]
            if kt is not None and isinstance(q, T) and q.dim() == kt["k"].dim() and q.dtype == kt["k"].dtype:
                return self._put(out, "scores", {"q": q, "k": kt["k"], "scale": 1.0, "mask": None})
        elif func in _SCALE and len(args) == 2:
            st = self._get(args[0], "scores")
            if st is not None and st["mask"] is None and isinstance(args[1], numbers.Real) and args[1] != 0:
                factor = 1.0 / args[1] if _SCALE[func] else float(args[1])
                return self._put(out, "scores", {**st, "scale": st["scale"] * factor})
        elif func in _ADD and len(args) == 2 and "alpha" not in kwargs:
            a, b = args
            st, mask = (self._get(a, "scores"), b) if self._get(a, "scores") is not None else (self._get(b, "scores"), a)
            if st is not None and st["mask"] is None and isinstance(mask, T) and mask.is_floating_point() \
                    and mask.dim() <= out.dim() and out.shape == (a if mask is b else b).shape:
                return self._put(out, "scores", {**st, "mask": mask})
        elif func in _SOFTMAX:
            st = self._get(args[0], "scores")
            dim = _arg(args, kwargs, 1, "dim")
            dtype = kwargs.get("dtype", args[3] if func is F.softmax and len(args) > 3 else None)
            if st is not None and dim is not None and dim % out.dim() == out.dim() - 1 and dtype in (None, st["q"].dtype):
                return self._put(out, "probs", st)
        elif func in _IDENTITY_CASTS:
            st = self._get(args[0], "probs")
            if st is not None and isinstance(out, T) and out.dtype == args[0].dtype and out.device == args[0].device:
                return self._put(out, "probs", st)
        elif func in _DROPOUT:
            st = self._get(args[0], "probs")
            p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
            if st is not None and (p == 0 or not training):
                return self._put(out, "probs", st)
        return out


@contextlib.contextmanager
def eager_attention_as_op(notes: list | None = None):
    """Around the first tracing pass (capture.py); appends a note when chains were mapped."""
    mode = EagerAttention()
    try:
        with mode:
            yield mode
    finally:
        mode.state.clear()
        if notes is not None and mode.mapped:
            notes.append(f"attention: {mode.mapped} eager attention chain(s) (matmul, scale, mask, softmax, matmul) "
                         "-> shardwise.attention")


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
        "shardwise maps F.scaled_dot_product_attention and the eager chain matmul -> scale -> additive mask -> "
        "softmax -> matmul onto shardwise.attention, and this model's attention is neither",
        fix="call torch.nn.functional.scaled_dot_product_attention or shardwise.attention in the model (Hugging "
            "Face: attn_implementation='sdpa'), or leave attention='auto'")
