"""The steps of an eager attention chain (q k^T -> scale -> soft-cap -> additive terms -> softmax
-> @ v), followed tensor by tensor while tracing (eager_attention.py's mode calls ``step``).

A ``Chain`` is what the scores of one chain are so far, as the op's settings express them:

    scores = softcap * tanh(scale * q k^T / softcap) + sum(coef_i * term_i)

Each step returns the chain its result continues, or None (the step does not fit: the
model's own ops are traced as they are). Steps that fit:

- ``x.transpose(-1, -2)`` (k^T), ``q @ kT`` / ``matmul`` / ``bmm``; ``baddbmm(bias, q, kT,
  beta, alpha)`` (Bloom: alpha scales q k^T, beta the bias);
- a product or quotient with a Python number (in place too: ``*=``): it scales q k^T and every
  term so far (before soft-capping only);
- soft-capping: ``/ c`` (a scale), ``tanh``, ``* c`` (Gemma 2);
- ``+ tensor`` (in place too) that broadcasts to the scores without growing them: a term (a
  mask, T5's position bias, a model's ALiBi tensor);
- casts that keep the dtype, views and reshapes that keep the shape, and one view of 3-d
  ``[batch * heads, L, S]`` scores as 4-d ``[batch, heads, L, S]`` (Bloom), remembered as
  ``split`` so that q, k and v can be viewed the same way at the end;
- softmax over the keys (in the scores' dtype), then casts, no-op dropout, and a view of the
  probabilities back to 3-d, until the final matmul with v.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

T = torch.Tensor
TRANSPOSE = (T.transpose, torch.transpose)
MATMUL = (torch.matmul, T.matmul, T.__matmul__, torch.bmm, T.bmm)
BADDBMM = (torch.baddbmm, T.baddbmm)
SCALE = {T.__mul__: False, T.mul: False, torch.mul: False, T.__rmul__: False, T.__imul__: False, T.mul_: False,
         T.__truediv__: True, T.div: True, torch.div: True, T.__itruediv__: True, T.div_: True}
ADD = (T.__add__, T.add, torch.add, T.__radd__, T.__iadd__, T.add_)
TANH = (torch.tanh, T.tanh)
SOFTMAX = (F.softmax, T.softmax, torch.softmax)
CASTS = (T.type, T.to, T.type_as, T.float)
VIEWS = (T.view, T.reshape, torch.reshape)
DROPOUT = (F.dropout, torch.dropout)


@dataclass(frozen=True)
class Chain:
    """One chain's scores so far (module docstring). ``kind``: "scores", "tanh" (inside
    soft-capping, between tanh and its ``* c``) or "probs" (after softmax)."""

    q: T
    k: T
    kind: str = "scores"
    scale: float = 1.0
    softcap: Optional[float] = None
    terms: tuple = ()  # ((tensor, coef), ...)
    split: Optional[tuple] = None  # (batch, heads) of 3-d scores viewed as 4-d
    flat: bool = False  # probs viewed back to 3-d [batch * heads, L, S]
    seen: tuple = ()  # ((tensor, its version counter), ...) for q, k and every term when read

    def but(self, **kw) -> "Chain":
        return dataclasses.replace(self, **kw)

    def unchanged(self) -> bool:
        """True when no tensor the chain read has been written in place since (the op reads them
        again at the end: a later in-place write would make it compute something else)."""
        return all(t._version == v for t, v in self.seen)


def _seen(*ts) -> tuple:
    return tuple((t, t._version) for t in ts)


def arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def start(func, args, kwargs, kt_of) -> Optional[Chain]:
    """A chain begun by q @ k^T (or baddbmm), ``kt_of(x)`` the k whose transpose ``x`` is."""
    if func in MATMUL and len(args) == 2:
        q, k = args[0], kt_of(args[1])
        if k is not None and isinstance(q, T) and q.dim() == k.dim() and q.dtype == k.dtype:
            return Chain(q, k, seen=_seen(q, k))
    elif func in BADDBMM:
        bias = args[0]
        q, kt = arg(args, kwargs, 1, "batch1"), arg(args, kwargs, 2, "batch2")
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        k = kt_of(kt)
        if k is not None and isinstance(q, T) and isinstance(bias, T) and bias.is_floating_point() \
                and all(isinstance(x, numbers.Real) for x in (beta, alpha)) and q.dtype == k.dtype:
            return Chain(q, k, scale=float(alpha), terms=((bias, float(beta)),), seen=_seen(q, k, bias))
    return None


def step(chain: Chain, func, args, kwargs, out, me: T) -> Optional[Chain]:  # noqa: C901 - one branch per step
    """The chain ``out`` continues, or None; ``chain`` is that of ``me``, an operand of the call
    (``args[0]``, or either operand of an add)."""
    if chain.kind == "probs":
        return _probs_step(chain, func, args, kwargs, out)
    if func in SCALE and len(args) == 2 and isinstance(args[1], numbers.Real) and args[1] != 0:
        f = 1.0 / args[1] if SCALE[func] else float(args[1])
        if chain.kind == "tanh":  # c * tanh(a x) == c * tanh((a c) x / c)
            return chain.but(kind="scores", softcap=f, scale=chain.scale * f) if f > 0 else None
        if chain.softcap is None:
            return chain.but(scale=chain.scale * f, terms=tuple((t, c * f) for t, c in chain.terms))
        return None
    if chain.kind == "tanh":
        return None
    if func in TANH and chain.softcap is None and not chain.terms:
        return chain.but(kind="tanh")
    if func in ADD and "alpha" not in kwargs and len(args) == 2:
        return _add(chain, args[1] if args[0] is me else args[0], me, out)
    if func in CASTS and isinstance(out, T) and out.dtype == args[0].dtype and out.device == args[0].device:
        return chain
    if func in VIEWS:
        return _view(chain, args[0], out)
    if func in SOFTMAX:
        dim = arg(args, kwargs, 1, "dim")
        dtype = kwargs.get("dtype", args[3] if func is F.softmax and len(args) > 3 else None)
        if dim is not None and dim % out.dim() == out.dim() - 1 and dtype in (None, chain.q.dtype) \
                and out.dtype == chain.q.dtype:
            return chain.but(kind="probs")
    return None


def softmax_misfit(chain: Chain, args, kwargs, out) -> str:
    """Why a softmax of ``chain`` (one ``step`` refused) is not the op's: for the error that names
    the attention calls a request could not act on (trace/attention_request.py)."""
    if chain.kind != "scores":
        return f"a softmax of its {'soft-capped scores before the * c' if chain.kind == 'tanh' else 'probabilities'}"
    dim = arg(args, kwargs, 1, "dim")
    if dim is None or not isinstance(out, T) or dim % out.dim() != out.dim() - 1:
        return f"softmax over dim {dim}, not the keys' (the last)"
    return (f"softmax in {out.dtype} of {chain.q.dtype} scores (the op's softmax is in the inputs' dtype; cast q, k "
            "and v instead)")


def _add(chain: Chain, term, scores: T, out) -> Optional[Chain]:
    if not isinstance(term, T) or not term.is_floating_point() or term.dim() > out.dim() or out.shape != scores.shape:
        return None
    return chain.but(terms=chain.terms + ((term, 1.0),), seen=chain.seen + _seen(term))


def _view(chain: Chain, x: T, out: T) -> Optional[Chain]:
    if out.shape == x.shape:
        return chain
    if chain.kind == "scores" and chain.split is None and x.dim() == 3 == chain.q.dim() and out.dim() == 4 \
            and out.shape[0] * out.shape[1] == x.shape[0] and tuple(out.shape[2:]) == tuple(x.shape[1:]):
        return chain.but(split=(out.shape[0], out.shape[1]))
    return None


def _probs_step(chain: Chain, func, args, kwargs, out) -> Optional[Chain]:
    x = args[0] if args else None
    if func in CASTS and isinstance(out, T) and out.dtype == x.dtype and out.device == x.device:
        return chain
    if func in DROPOUT:
        p, training = arg(args, kwargs, 1, "p", 0.5), arg(args, kwargs, 2, "training", True)
        return chain if p == 0 or not training else None
    if func in VIEWS and isinstance(out, T):
        if out.shape == x.shape:
            return chain
        if chain.split is not None and not chain.flat and out.dim() == 3 and out.shape[0] == x.shape[0] * x.shape[1] \
                and tuple(out.shape[1:]) == tuple(x.shape[2:]):
            return chain.but(flat=True)
    return None
