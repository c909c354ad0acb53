"""The fuzzer's op catalogue: each op picks operands among the values so far, may add
parameters, and writes one line of ``forward``. An op returns None when no value suits it.

Ops are listed simplest first (choices shrink towards the first). Shapes stay small (sizes
1..7: uneven and smaller than a mesh dim) and ranks 1..4.
"""
from __future__ import annotations

import math

from .program import Builder, Val

MAX_RANK, MAX_SIZE = 4, 7


def size(b: Builder) -> int:
    return b.c.int(1, MAX_SIZE)


def shape(b: Builder, lo: int = 1, hi: int = 3) -> tuple:
    return tuple(size(b) for _ in range(b.c.int(lo, hi)))


def dim(b: Builder, v: Val) -> int:
    """A dim of ``v``, sometimes spelled negative."""
    d = b.c.int(0, v.rank - 1)
    return d - v.rank if b.c.coin(0.2) else d


# -- pointwise -------------------------------------------------------------------------
UNARY = ("torch.tanh({})", "torch.sigmoid({})", "F.gelu({})", "{} * 0.5", "torch.sin({})", "F.silu({})",
         "({} + 0.25)", "{}.square()", "torch.rsqrt({}.square() + 1)", "torch.exp({}.clamp(max=2.0))",
         "torch.relu({})", "{}.clamp(-0.5, 0.5)", "{}.abs()")
TYING = ("torch.relu", ".clamp(-", ".abs(")  # create equal elements (zeros, clamp bounds, |x| = |-x|)


def unary(b: Builder):
    a = b.pick()
    fn = b.c.choice(UNARY)
    return b.emit(fn.format(a.name), a.shape, any(t in fn for t in TYING), a)


def broadcastable(b: Builder, s: tuple) -> tuple:
    """A shape that broadcasts against ``s``: leading dims dropped, some dims set to 1."""
    s = s[b.c.int(0, len(s) - 1):]
    return tuple(1 if b.c.coin(0.3) else n for n in s)


def bshape(s: tuple, t: tuple):
    """The broadcast of two shapes, or None."""
    out = []
    for i in range(1, max(len(s), len(t)) + 1):
        x, y = (s[-i] if i <= len(s) else 1), (t[-i] if i <= len(t) else 1)
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(reversed(out))


BINARY = ("{} + {}", "{} * {}", "{} - {}", "{} / (torch.sigmoid({}) + 0.5)")


def binary(b: Builder, with_param: bool = False):
    a = b.pick()
    other = b.pick(lambda v: v is not a and bshape(a.shape, v.shape) is not None and len(bshape(a.shape, v.shape)) <= MAX_RANK)
    if other is not None and not with_param and b.c.coin(0.5):
        rhs, out, args = other.name, bshape(a.shape, other.shape), (a, other)
    else:
        s = broadcastable(b, a.shape)
        rhs, out, args = b.param(s), a.shape, (a,)
    lhs = a.name
    if b.c.coin(0.3):
        lhs, rhs = rhs, lhs
    return b.emit(b.c.choice(BINARY).format(lhs, rhs), out, False, *args)


# -- reductions ------------------------------------------------------------------------
def reduce(b: Builder):
    a = b.pick(lambda v: v.rank >= 1)
    dims = sorted({b.c.int(0, a.rank - 1) for _ in range(b.c.int(1, 2))})
    keep = b.c.coin(0.5)
    if not keep and len(dims) >= a.rank:
        keep = True
    out = tuple(1 if i in dims else n for i, n in enumerate(a.shape)) if keep else \
        tuple(n for i, n in enumerate(a.shape) if i not in dims)
    d = dims[0] if len(dims) == 1 else tuple(dims)
    fns = ["{}.sum({}, keepdim={})", "{}.mean({}, keepdim={})", "torch.logsumexp({}, {}, keepdim={})",
           "{}.var({}, correction=0, keepdim={})", "torch.linalg.vector_norm({}, 2, {}, keepdim={})"]
    if not a.tied:
        fns += ["{}.amax({}, keepdim={})", "{}.amin({}, keepdim={})"]
    return b.emit(b.c.choice(fns).format(a.name, d, keep), out, False, a)


GLOBAL = ("{0} - {0}.mean()", "{0} / ({0}.square().sum() + 1).sqrt()", "{0} * {0}.sum()")


def global_reduce(b: Builder):
    """A whole-tensor reduction (0-d) broadcast back: every shard needs every other's part."""
    a = b.pick()
    fns = GLOBAL + (() if a.tied else ("{0} * {0}.amax()",))
    return b.emit(b.c.choice(fns).format(a.name), a.shape, False, a)


# -- matmul / einsum -------------------------------------------------------------------
def linear(b: Builder):
    a = b.pick()
    n = size(b)
    if b.c.coin(0.5):
        w = b.param((a.shape[-1], n))
        return b.emit(f"{a.name} @ {w}", a.shape[:-1] + (n,), False, a)
    w, bias = b.param((n, a.shape[-1])), b.param((n,))
    return b.emit(f"F.linear({a.name}, {w}, {bias})", a.shape[:-1] + (n,), False, a)


def matmul(b: Builder):
    """Two values: ``a @ other^T`` (attention scores) or a batched matmul."""
    a = b.pick(lambda v: v.rank >= 2)
    if a is None:
        return None
    other = b.pick(lambda v: v.rank >= 2 and v.shape[-2] == a.shape[-1] and bshape(a.shape[:-2], v.shape[:-2]) is not None)
    if other is not None and b.c.coin(0.5):
        out = bshape(a.shape[:-2], other.shape[:-2]) + (a.shape[-2], other.shape[-1])
        return b.emit(f"{a.name} @ {other.name}", out, False, a, other) if len(out) <= MAX_RANK else None
    other = b.pick(lambda v: v.shape == a.shape)
    return b.emit(f"{a.name} @ {other.name}.transpose(-1, -2)", a.shape[:-1] + (a.shape[-2],), False, a, other)


def einsum(b: Builder):
    """``a`` against a new parameter: every dim of ``a`` shared (kept or contracted) or summed
    on its own, the parameter adds 0-2 dims; output dims in random order."""
    a = b.pick()
    letters = "abcd"[: a.rank]
    shared = b.c.subset(letters)
    new = "wxyz"[: b.c.int(0 if shared else 1, 2)]
    sizes = {**dict(zip(letters, a.shape)), **{k: size(b) for k in new}}
    p_letters = "".join(b.c.shuffled(shared + list(new)))
    keep = [k for k in letters if b.c.coin(0.75)] + [k for k in new if b.c.coin(0.8)]
    if not keep or len(keep) > MAX_RANK:
        return None
    out = "".join(b.c.shuffled(keep))
    w = b.param(tuple(sizes[k] for k in p_letters))
    return b.emit(f'torch.einsum("{letters},{p_letters}->{out}", {a.name}, {w})',
                  tuple(sizes[k] for k in out), False, a)


# -- norms and softmax -----------------------------------------------------------------
def layer_norm(b: Builder):
    """Always affine: an unweighted LayerNorm output sums to exactly zero, and a kink (relu,
    a > 0) on such a value would turn float noise into a wrong-looking gradient. Never over
    one element or equal ones (tied): the variance is 0, x - mean is rounding noise and
    rstd = 1 / sqrt(eps) = 316 scales it into gradients of ~1e-5 that differ per summation
    order (fuzz seed 200014, on one device as much as sharded). Nor over two: the output is
    exactly +-1, its input gradient 0 in exact arithmetic and noise in float (seed 500127)."""
    a = b.pick(lambda v: not v.tied and math.prod(v.shape[-2:]) >= 3)
    if a is None:
        return None
    n = b.c.int(1, min(2, a.rank)) if a.shape[-1] >= 3 else 2
    ns = a.shape[-n:]
    w, bias = b.param(ns, 0.5, 1.0), b.param(ns)
    return b.emit(f"F.layer_norm({a.name}, {ns!r}, {w}, {bias})", a.shape, False, a)


def softmax(b: Builder):
    a = b.pick()
    fn = b.c.choice(("torch.softmax({}, {})", "F.log_softmax({}, {})"))
    return b.emit(fn.format(a.name, dim(b, a)), a.shape, False, a)


# -- views -----------------------------------------------------------------------------
def permute(b: Builder):
    a = b.pick(lambda v: v.rank >= 2)
    if a is None:
        return None
    if b.c.coin(0.5):
        i, j = b.c.int(0, a.rank - 1), b.c.int(0, a.rank - 1)
        s = list(a.shape)
        s[i], s[j] = s[j], s[i]
        return b.emit(f"{a.name}.transpose({i}, {j})", tuple(s), False, a)
    perm = b.c.shuffled(range(a.rank))
    return b.emit(f"{a.name}.permute({', '.join(map(str, perm))})", tuple(a.shape[p] for p in perm), False, a)


def reshape(b: Builder):
    """Merge two adjacent dims, split one into two factors, or flatten everything."""
    a = b.pick()
    how = b.c.int(0, 2)
    if how == 0 and a.rank >= 2:
        i = b.c.int(0, a.rank - 2)
        s = a.shape[:i] + (a.shape[i] * a.shape[i + 1],) + a.shape[i + 2:]
        expr = f"{a.name}.flatten({i}, {i + 1})" if b.c.coin(0.5) else f"{a.name}.reshape({_sizes(s)})"
        return b.emit(expr, s, False, a)
    if how == 1 and a.rank < MAX_RANK:
        i = b.c.int(0, a.rank - 1)
        fs = [f for f in range(2, a.shape[i]) if a.shape[i] % f == 0]
        if not fs:
            return None
        f = b.c.choice(fs)
        s = a.shape[:i] + (f, a.shape[i] // f) + a.shape[i + 1:]
        expr = f"{a.name}.unflatten({i}, ({f}, {a.shape[i] // f}))" if b.c.coin(0.5) else f"{a.name}.view({_sizes(s)})"
        return b.emit(expr, s, False, a)
    if a.rank >= 2:
        return b.emit(f"{a.name}.reshape(-1)", (math.prod(a.shape),), False, a)
    return None


def expand(b: Builder):
    a = b.pick(lambda v: v.rank < MAX_RANK)
    d = b.c.int(0, a.rank)
    n = b.c.int(1, 4)
    s = a.shape[:d] + (n,) + a.shape[d:]
    return b.emit(f"{a.name}.unsqueeze({d}).expand({_sizes(s)})", s, n > 1, a)


def narrow(b: Builder):
    a = b.pick(lambda v: max(v.shape) >= 2)
    if a is None:
        return None
    d = b.c.choice([i for i, n in enumerate(a.shape) if n >= 2])
    start = b.c.int(0, a.shape[d] - 1)
    length = b.c.int(1, a.shape[d] - start)
    s = a.shape[:d] + (length,) + a.shape[d + 1:]
    index = ", ".join([":"] * d + [f"{start}:{start + length}"])
    expr = f"{a.name}.narrow({d}, {start}, {length})" if b.c.coin(0.5) else f"{a.name}[{index}]"
    return b.emit(expr, s, False, a)


# -- cat / split -----------------------------------------------------------------------
def cat(b: Builder):
    a = b.pick()
    d = b.c.int(0, a.rank - 1)
    like = lambda v: v.rank == a.rank and all(x == y for i, (x, y) in enumerate(zip(v.shape, a.shape)) if i != d)  # noqa: E731
    other = b.pick(lambda v: v is not a and like(v))
    if other is not None and b.c.coin(0.6):
        args, oname, on = (a, other), other.name, other.shape[d]
    else:
        on = size(b)
        args, oname = (a,), b.param(a.shape[:d] + (on,) + a.shape[d + 1:])
    parts = [a.name, oname] if b.c.coin(0.5) else [oname, a.name]
    s = a.shape[:d] + (a.shape[d] + on,) + a.shape[d + 1:]
    if b.c.coin(0.2) and on == a.shape[d] and a.rank < MAX_RANK:
        return b.emit(f"torch.stack([{', '.join(parts)}], {d})", a.shape[:d] + (2,) + a.shape[d:], False, *args)
    return b.emit(f"torch.cat([{', '.join(parts)}], {d})", s, False, *args)


def split(b: Builder):
    a = b.pick(lambda v: max(v.shape) >= 2)
    if a is None:
        return None
    d = b.c.choice([i for i, n in enumerate(a.shape) if n >= 2])
    n = a.shape[d]
    if b.c.coin(0.5):
        first = b.c.int(1, n - 1)
        sizes = [first, n - first]
        expr = f"torch.split({a.name}, {sizes}, {d})"
    else:
        k = b.c.int(1, n - 1)
        sizes = [min(k, n - i) for i in range(0, n, k)]
        expr = f"{a.name}.split({k}, {d})"
    shapes = [a.shape[:d] + (m,) + a.shape[d + 1:] for m in sizes]
    return b.emit_many(expr, shapes, False, a)


# -- scans and order -------------------------------------------------------------------
def cumsum(b: Builder):
    a = b.pick()
    return b.emit(f"{a.name}.cumsum({dim(b, a)})", a.shape, False, a)


def order(b: Builder):
    a = b.pick(lambda v: not v.tied)
    if a is None:
        return None
    d = dim(b, a)
    n = a.shape[d]
    if b.c.coin(0.5):
        k = b.c.int(1, n)
        largest = b.c.coin(0.7)
        s = a.shape[:d % a.rank] + (k,) + a.shape[d % a.rank + 1:]
        return b.emit(f"{a.name}.topk({k}, {d}, largest={largest}).values", s, False, a)
    return b.emit(f"torch.sort({a.name}, {d}, descending={b.c.coin(0.5)}).values", a.shape, False, a)


# -- masks -----------------------------------------------------------------------------
def where(b: Builder):
    """The mask is ``m > 0`` of a value broadcasting against ``a``, never of a value built by
    a relu or a fill (exact zeros would sit on the threshold). The mask does not count as a
    use: a value read only through ``> 0`` passes no gradient, so it stays a sink of the loss."""
    a = b.pick()
    m = b.pick(lambda v: not v.tied and bshape(a.shape, v.shape) == a.shape)
    if m is None:
        return None
    if b.c.coin(0.5):
        return b.emit(f"{a.name}.masked_fill({m.name} > 0, {b.c.choice((0.0, -1.5))})", a.shape, True, a)
    other = b.pick(lambda v: bshape(a.shape, v.shape) == a.shape)
    return b.emit(f"torch.where({m.name} > 0, {a.name}, {other.name})", a.shape, True, a, other)


def attention(b: Builder):
    """``F.scaled_dot_product_attention`` on a value read as [..., seq, head_dim], keys and
    values projected by new parameters, sometimes causal. Not of tied values: over equal keys
    and values the gradient of the scores is 0 in exact arithmetic and rounding noise in float32
    (seed 500342: an input expanded over the sequence; float64 agrees)."""
    a = b.pick(lambda v: v.rank >= 3 and not v.tied)
    if a is None:
        return None
    d = a.shape[-1]
    k, v = b.param((d, d)), b.param((d, d))
    causal = b.c.coin(0.4)
    return b.emit(f"F.scaled_dot_product_attention({a.name}, {a.name} @ {k}, {a.name} @ {v}, is_causal={causal})",
                  a.shape, False, a)


def index(b: Builder):
    """A new index input selecting along one dim (index_select, a[idx] or gather)."""
    a = b.pick()
    d = b.c.int(0, a.rank - 1)
    how = b.c.int(0, 2)
    if how == 2:
        s = tuple(b.c.int(1, n) if i != d else size(b) for i, n in enumerate(a.shape))
        idx = b.input(s, f"torch.randint(0, {a.shape[d]}, {_sizes(s, tuple_=True)}, generator=g)", index=True)
        return b.emit(f"torch.gather({a.name}, {d}, {idx.name})", s, True, a)
    m = size(b)
    idx = b.input((m,), f"torch.randint(0, {a.shape[d]}, ({m},), generator=g)", index=True)
    s = a.shape[:d] + (m,) + a.shape[d + 1:]
    expr = f"{a.name}.index_select({d}, {idx.name})" if how == 0 else f"{a.name}[{', '.join([':'] * d + [idx.name])}]"
    return b.emit(expr, s, m > 1, a)


def embedding(b: Builder):
    """A new index input looked up in a new table. Indices repeat only sometimes (repeated
    rows are ties)."""
    s = shape(b, 1, 2)
    vocab, width = b.c.int(1, 9), size(b)
    n = math.prod(s)
    distinct = n <= vocab and b.c.coin(0.5)
    init = (f"torch.randperm({vocab}, generator=g)[:{n}].reshape({_sizes(s)})" if distinct
            else f"torch.randint(0, {vocab}, {_sizes(s, tuple_=True)}, generator=g)")
    idx = b.input(s, init, index=True)
    table = b.param((vocab, width), 1.0)
    return b.emit(f"F.embedding({idx.name}, {table})", s + (width,), not distinct, idx)


OPS = (unary, binary, reduce, global_reduce, linear, layer_norm, softmax, permute, reshape, einsum, matmul, cat, split,
       narrow, expand, where, order, cumsum, embedding, attention, index)


def _sizes(s: tuple, tuple_: bool = False) -> str:
    body = ", ".join(map(str, s))
    return f"({body},)" if tuple_ and len(s) == 1 else (f"({body})" if tuple_ else body)
