"""Building blocks for rules: strategy generators shared by the op families."""
from __future__ import annotations

import math

from ..core.errors import RuleError
from ..core.layout import Partial, R, Shard
from .registry import OpCall, Strategy1D

P = Partial("sum")


def replicate_all(call: OpCall) -> Strategy1D:
    """Everything replicated: always valid, the fallback of every rule."""
    return Strategy1D(tuple(None if o is None else R for o in call.outs), tuple(R for _ in call.ins))


def whole_slice(size: int, start, end, step=1) -> bool:
    """Does [start:end:step] keep every element of a dim of ``size`` (so it may stay sharded)?"""
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return step == 1 and start <= 0 and end >= size


def slice_bounds(size: int, start, end) -> tuple[int, int]:
    """``[start:end]`` of a dim of ``size`` as Python clamps it: 0 <= start, end <= size."""
    start = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    end = size if end is None else min(max(end + size if end < 0 else end, 0), size)
    return start, end


def slice_parts(size: int, start, end, step) -> tuple[int, int] | None:
    """(k, m) when ``[start:end:step]`` of a dim of ``size`` is m whole parts of it cut in k equal
    parts (k >= 2, the fewest parts whose boundaries it falls on): a fused [q|k|v] projection's q is
    1 of 3 parts; else None. A dim split in k groups (``Shard(d, groups=k)``) then slices rank by
    rank: each rank's chunk of those m parts, so the result is split in m groups (plain for m = 1)."""
    if step != 1 or size <= 0:
        return None
    start, end = slice_bounds(size, start, end)
    part = math.gcd(start, end, size)
    if end <= start or part == size:
        return None
    return size // part, (end - start) // part


def local_parts(size: int, groups: int, local: int, start, end) -> tuple[int, int]:
    """``[start:end]``, whole parts of a dim of ``size`` in ``groups`` (``slice_parts``), on a rank
    holding ``local`` elements of it: its chunk c of each part lies end to end, so parts [i, j) are
    local elements [i c, j c)."""
    start, end = slice_bounds(size, start, end)
    part, c = size // groups, local // groups
    return start // part * c, end // part * c


def groups_on(layout, dim: int) -> int:
    """How many groups ``layout`` splits tensor dim ``dim`` in (1: plain or not split)."""
    return next((p.groups for p in layout.placements if isinstance(p, Shard) and p.dim == dim), 1)


def aligned_dim(out_ndim: int, in_shape: tuple, out_shape: tuple, d: int):
    """Broadcasting: the input dim that feeds output dim ``d`` (None if broadcast or absent)."""
    k = d - (out_ndim - len(in_shape))
    if k < 0 or (in_shape[k] == 1 and out_shape[d] != 1):
        return None
    return k


# How a pointwise op treats Partial(sum) inputs (sum-linearity):
#   "all": f(a1+a2, b1+b2) = f(a1, b1) + f(a2, b2)   (add, sub, neg, casts, ...)
#   "one": linear in each input separately; exactly one Partial input, the rest Replicate (mul)
#   "first": linear in the first input only, the rest Replicate (div by a replicated divisor)
LINEARITY = ("all", "one", "first")


def pointwise_strategies(call: OpCall, linear: str | None = None, n_shard_inputs: int | None = None) -> list[Strategy1D]:
    """Shard any output dim (inputs follow by broadcasting), plus Partial where linear.

    ``n_shard_inputs``: only the first n tensor inputs follow the output (the rest stay
    Replicate), for ops with side tensors that are not elementwise.
    """
    out = call.outs[0]
    ins = call.ins
    out_idx = [i for i, o in enumerate(call.outs) if o is not None]
    strategies = [replicate_all(call)]
    for d in range(out.ndim):
        placements = []
        for i, t in enumerate(ins):
            k = aligned_dim(out.ndim, t.shape, out.shape, d) if n_shard_inputs is None or i < n_shard_inputs else None
            placements.append(R if k is None else Shard(k))
        outs = tuple(Shard(d) if i in out_idx and call.outs[i].shape == out.shape else (None if call.outs[i] is None else R)
                     for i in range(len(call.outs)))
        if any(isinstance(o, Shard) for o in outs):
            strategies.append(Strategy1D(outs, tuple(placements)))
    strategies += _partial_strategies(call, linear)
    return strategies


def _partial_strategies(call: OpCall, linear: str | None) -> list[Strategy1D]:
    if linear is None or not call.ins:
        return []
    outs = tuple(None if o is None else P for o in call.outs)
    n = len(call.ins)
    if linear == "all":
        return [Strategy1D(outs, (P,) * n)]
    if linear == "one":
        return [Strategy1D(outs, tuple(P if j == i else R for j in range(n))) for i in range(n)]
    if linear == "first":
        return [Strategy1D(outs, (P,) + (R,) * (n - 1))]
    raise RuleError(f"unknown linearity {linear!r}; expected one of {LINEARITY}", fix="pass one of them or None")


def einsum_strategies(spec: str, call: OpCall, n_tensors: int | None = None) -> list[Strategy1D]:
    """Single-mesh-dim strategies of a matmul-like op declared by an einsum string.

    A letter kept in the output: shard it everywhere it appears (inputs without it stay
    Replicate). A contracted letter: shard the inputs on it, the output is Partial(sum).
    Linear in each input: one Partial input with the others Replicate gives a Partial output.
    """
    lhs, rhs = spec.replace(" ", "").split("->")
    operands = lhs.split(",")
    n = n_tensors if n_tensors is not None else len(call.ins)
    if len(operands) != n:
        raise RuleError(f"einsum rule {spec!r} for {call.op} names {len(operands)} operands, the call has {n} tensors",
                        fix="give one operand per tensor input in the einsum string (n_tensors: the leading ones)")
    out_outs = lambda p: tuple(p if i == 0 else (None if o is None else R) for i, o in enumerate(call.outs))  # noqa: E731
    strategies = [replicate_all(call)]
    for letter in dict.fromkeys("".join(operands)):
        ins = tuple(Shard(op.index(letter)) if letter in op else R for op in operands)
        out = Shard(rhs.index(letter)) if letter in rhs else P
        strategies.append(Strategy1D(out_outs(out), ins))
    for i in range(n):
        strategies.append(Strategy1D(out_outs(P), tuple(P if j == i else R for j in range(n))))
    return strategies
