"""as_strided and as_strided_scatter in the forms models produce; unfold and unfold_backward.

``as_strided(x, size, stride, offset)`` reads element i of its output at address offset + sum(i_l stride_l)
of x's storage. Traced graphs hold it where a decomposition or functionalisation made it over a fresh
tensor (an adaptive average pool's mean, HF Swin's pooler; the zeros its backward scatters into), so this
rule reads the address against x's row-major layout, and its local call makes the local piece contiguous
first (the program may hand it a strided view): the same element on every rank whatever x's local strides.
A traced input that is itself a non-contiguous view would read other elements on one device; a rule sees
no strides (TensorMeta is shape and dtype), so this cannot be told apart here: graphs hold as_strided over
fresh tensors only (decompositions, functionalisation), and the rule relies on that.

Sharding is offered only where the strided view is independent over a dim: output dim j with stride
u * (row-major stride of input dim k), size S_k / u, while no other output dim and not the offset moves
along the outer part of dim k read as (S_k / u, u). Then the address is, without carries, the row-major
address of coordinates that are affine in the output index (``Coords``), so a rank's chunk of dim k in
blocks of u (``Shard(k, unit=u)``) holds exactly the elements its chunk of output dim j reads, and the
local strides and offset are the same coordinates over the local shape. Everything else is Replicate
(plus the Partial pass-throughs of a read: it only selects elements).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.layout import Partial, R, Shard
from .common import replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


def row_major(shape) -> list[int]:
    """Contiguous strides of ``shape``."""
    return [math.prod(shape[k + 1:]) for k in range(len(shape))]


def _refine(shape, splits: dict) -> list[int]:
    """``shape`` with each dim k of ``splits`` read as (S_k // u, u)."""
    out = []
    for k, s in enumerate(shape):
        out += [s // splits[k], splits[k]] if k in splits else [s]
    return out


def _digits(a: int, strides: list) -> tuple:
    """Coordinates of address ``a`` over row-major ``strides`` (the first one unbounded)."""
    return tuple([a // strides[0]] + [a % strides[r - 1] // strides[r] for r in range(1, len(strides))])


@dataclass(frozen=True)
class Coords:
    """An as_strided view in the coordinates of its input's dims, dim k of ``splits`` read as
    (S_k // u, u): ``steps[l]`` is how far output dim l moves in each refined dim, ``start`` the offset's
    coordinates, ``where[k]`` the refined index of dim k's outer part."""

    refined: tuple
    steps: tuple
    start: tuple
    where: dict

    @staticmethod
    def of(in_shape, splits: dict, size, stride, offset) -> "Coords | None":
        """None when some output element's address carries between coordinates (the view is not
        affine in them), or a size is 0."""
        if 0 in in_shape or 0 in size or any(in_shape[k] % u for k, u in splits.items()):
            return None
        refined = _refine(in_shape, splits)
        where = {k: k + sum(d < k for d in splits) for k in range(len(in_shape))}
        strides = row_major(refined)
        steps = tuple(_digits(st, strides) if n > 1 else (0,) * len(refined) for n, st in zip(size, stride))
        start = _digits(offset or 0, strides)
        for r, extent in enumerate(refined):
            if start[r] + sum((n - 1) * v[r] for n, v in zip(size, steps)) >= extent:
                return None
        return Coords(tuple(refined), steps, start, where)

    def aligned(self, j: int, k: int, size) -> bool:
        """Does output dim j walk the outer part of input dim k alone, from 0, over all of it?"""
        r = self.where[k]
        unit = tuple(int(q == r) for q in range(len(self.refined)))
        others = any(v[r] for l, v in enumerate(self.steps) if l != j)
        return self.steps[j] == unit and self.start[r] == 0 and not others and size[j] == self.refined[r]

    def local(self, local_in_shape, splits: dict) -> tuple[list[int], int]:
        """(strides, offset) over the row-major layout of the rank's piece of shape ``local_in_shape``."""
        strides = row_major(_refine(local_in_shape, splits))
        at = lambda v: sum(a * b for a, b in zip(v, strides))  # noqa: E731
        return [at(v) for v in self.steps], at(self.start)


def _view_args(call: OpCall, first: int) -> tuple:
    """(size, stride, storage_offset) of as_strided (first = 1) or as_strided_scatter (first = 2)."""
    return (list(call.arg(first, "size")), list(call.arg(first + 1, "stride")),
            call.arg(first + 2, "storage_offset"))


def _candidates(in_shape, size, stride, offset) -> list[tuple[int, int, int]]:
    """(output dim j, input dim k, unit u) that may be sharded alike, each checked on its own."""
    cs, out = row_major(in_shape), []
    for j, (n, st) in enumerate(zip(size, stride)):
        for k, s in enumerate(in_shape):
            if n < 2 or cs[k] == 0 or st % cs[k] or st == 0:
                continue
            u = st // cs[k]
            if s % u == 0 and s // u == n:
                c = Coords.of(in_shape, {k: u}, size, stride, offset)
                if c is not None and c.aligned(j, k, size):
                    out.append((j, k, u))
    return out


def _shard(k: int, u: int) -> Shard:
    return Shard(k, u) if u > 1 else Shard(k)


def _non_overlapping(size, stride) -> bool:
    """No two output elements share an address (a scatter's writes are then order-free)."""
    dims = sorted((st, n) for n, st in zip(size, stride) if n > 1)
    return all(b[0] >= a[0] * a[1] for a, b in zip(dims, dims[1:])) and all(st > 0 for st, _ in dims)


def as_strided_strategies(call: OpCall) -> list[Strategy1D]:
    size, stride, offset = _view_args(call, 1)
    st = [replicate_all(call)] + [Strategy1D((p,), (p,)) for p in PARTIALS]
    return st + [Strategy1D((Shard(j),), (_shard(k, u),)) for j, k, u in _candidates(call.ins[0].shape, size, stride,
                                                                                           offset)]


def as_strided_scatter_strategies(call: OpCall) -> list[Strategy1D]:
    """ins (self, src): self and the output alike, src as the view."""
    size, stride, offset = _view_args(call, 2)
    st = [replicate_all(call)]
    if not _non_overlapping(size, stride):
        return st
    st += [Strategy1D((p,), (p, p)) for p in PARTIALS]
    return st + [Strategy1D((_shard(k, u),), (_shard(k, u), Shard(j)))
                 for j, k, u in _candidates(call.ins[0].shape, size, stride, offset)]


def _splits(placements) -> dict | None:
    """Input dim -> unit of its shards, from the viewed input's placements (None when two mesh dims cut it
    differently)."""
    out: dict = {}
    for p in placements:
        if isinstance(p, Shard):
            if out.setdefault(p.dim, p.unit) != p.unit or p.groups != 1:
                return None
    return out


def _valid(first: int):
    """n-d combinations: every sharded input dim with one unit, and the view aligned with all of them at
    once (each pair was checked alone)."""
    def valid(call: OpCall, st, mesh) -> bool:
        size, stride, offset = _view_args(call, first)
        splits = _splits(st.ins[0])
        if not splits:
            return splits is not None
        c = Coords.of(call.ins[0].shape, splits, size, stride, offset)
        view = st.outs[0] if first == 1 else st.ins[1]
        pairs = [(p, q.dim) for p, q in zip(view, st.ins[0]) if isinstance(q, Shard)]
        return c is not None and all(isinstance(p, Shard) and c.aligned(p.dim, k, size) for p, k in pairs)
    return valid


def as_strided_rows(x: torch.Tensor, size, stride, storage_offset=None) -> torch.Tensor:
    """as_strided over ``x``'s row-major layout: the same elements whatever strides the piece arrived with."""
    x = x.contiguous()
    return aten.as_strided.default(x, size, stride, x.storage_offset() + (storage_offset or 0))


def as_strided_scatter_rows(x: torch.Tensor, src: torch.Tensor, size, stride, storage_offset=None) -> torch.Tensor:
    """as_strided_scatter over ``x``'s row-major layout. Its output copies x's storage layout (strides and
    storage offset) and reads ``storage_offset`` in that storage, as as_strided does: a piece that is a
    view into a larger buffer (a local slice) starts at its own offset."""
    x = x.contiguous()
    return aten.as_strided_scatter.default(x, src, size, stride, x.storage_offset() + (storage_offset or 0))


def _local_view(ctx: LocalCtx, first: int) -> tuple[list, list, int]:
    """The rank's (size, stride, offset): the same coordinates over its piece's shape."""
    size, stride, offset = _view_args(ctx.call, first)
    splits = _splits(ctx.strategy.ins[0])
    if not splits:
        return size, stride, offset or 0
    c = Coords.of(ctx.call.ins[0].shape, splits, size, stride, offset)
    strides, local_offset = c.local(ctx.local_in_shape(0), splits)
    local_size = ctx.local_out_shape(0) if first == 1 else ctx.local_in_shape(1)
    return local_size, [s if n < 2 else t for n, s, t in zip(size, stride, strides)], local_offset


def as_strided_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(as_strided_rows, (ctx.call.arg(0, "self"), *_local_view(ctx, 1)), {})


def as_strided_scatter_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(as_strided_scatter_rows, (ctx.call.arg(0, "self"), ctx.call.arg(1, "src"),
                                               *_local_view(ctx, 2)), {})


# -- unfold / unfold_backward: windows along one dim, every other dim sharded alike ----------------
def unfold_strategies(call: OpCall) -> list[Strategy1D]:
    """unfold (self, dimension, size, step): windows of ``dimension`` become a new last dim."""
    n = call.ins[0].ndim
    dim = call.arg(1, "dimension") % max(n, 1)
    st = [replicate_all(call)] + [Strategy1D((p,), (p,)) for p in PARTIALS]
    return st + [Strategy1D((Shard(k),), (Shard(k),)) for k in range(n) if k != dim]


def unfold_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """unfold_backward (grad, input_sizes, dim, size, step): overlapping windows are summed, so of the
    Partials only sum passes."""
    n = len(call.arg(1, "input_sizes"))
    dim = call.arg(2, "dim") % max(n, 1)
    st = [replicate_all(call), Strategy1D((Partial("sum"),), (Partial("sum"),))]
    return st + [Strategy1D((Shard(k),), (Shard(k),)) for k in range(n) if k != dim]


def unfold_backward_local(ctx: LocalCtx) -> LocalCall:
    """input_sizes is a shape arg: the rank's output shape (the unfolded dim stays whole)."""
    c = ctx.call
    return LocalCall(c.op, (c.arg(0, "grad_in"), ctx.local_out_shape(0), c.arg(2, "dim"), c.arg(3, "size"),
                            c.arg(4, "step")), {})


ROWS = (
    Rule(aten.as_strided.default, as_strided_strategies, as_strided_local, valid=_valid(1), shape_sensitive=True,
         blockwise=False),
    Rule(aten.as_strided_scatter.default, as_strided_scatter_strategies, as_strided_scatter_local, valid=_valid(2),
         shape_sensitive=True, blockwise=False),
    Rule(aten.unfold.default, unfold_strategies, blockwise=True),
    Rule(aten.unfold_backward.default, unfold_backward_strategies, unfold_backward_local, blockwise=True),
)
