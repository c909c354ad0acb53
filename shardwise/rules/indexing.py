"""Advanced indexing, its scatter relatives and the backward of slice/select.

``index(self, [i0, None, i2, ...])``: the index tensors broadcast to one shape B. When the
indexed dims of self are adjacent, B replaces them in place in the output; otherwise B comes
first and the dims of self that are not indexed follow (numpy rules). So:
  - a dim of self that is not indexed can be sharded: the output is sharded on its dim;
  - the index tensors can be sharded on a dim of B (those of size 1 there stay Replicate):
    the output is sharded on B's dim (self Replicate);
  - self sharded on an indexed dim: each rank looks up the indices inside its range and
    gives 0 elsewhere -> Partial('sum') (the vocab-parallel embedding trick);
  - Partial self passes through (selection commutes with sum/max/min).
``index_put`` / ``scatter*`` / ``index_add`` write into self: dims that positions are not
read from can be sharded on every tensor alike; overwriting is linear in (self, values)
together and commutes with max/min; accumulating is linear, so index tensors sharded with
their values and a Partial self give a Partial('sum') output (each rank adds its share).
``index_fill`` / ``index_copy`` write whole slices along ``dim``: the other dims shard, and ``dim``
too, each rank writing the positions that fall in its range (a spare slice takes the others).
``_unsafe_masked_index`` / ``_unsafe_masked_index_put_accumulate`` are index / index_put(accumulate)
under a mask that follows the indexed result.
``slice_backward`` / ``select_backward`` / ``slice_scatter`` / ``select_scatter``: every
dim but the sliced one can be sharded (the sliced one too when the slice is the whole dim);
zero-filling is Partial-safe since every part is zero there alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.layout import Partial, R, Shard
from .common import aligned_dim, groups_on, local_parts, replicate_all, slice_parts, whole_slice
from .registry import DEFAULT, LocalCall, LocalCtx, OpCall, Registry, Rule, Strategy1D, TensorMeta

aten = torch.ops.aten
P = Partial("sum")
PARTIALS = (P, Partial("max"), Partial("min"))
MASK_DTYPES = (torch.bool, torch.uint8)


# -- advanced-indexing geometry ------------------------------------------------------------
@dataclass(frozen=True)
class Advanced:
    """Where self's dims and the broadcast index dims land in ``self[indices]``."""

    positions: tuple  # self dim indexed by each present index tensor (in call.ins order)
    bshape: tuple  # broadcast shape of the index tensors
    start: int  # output dim of bshape[0]
    kept: dict  # self dim that is not indexed -> output dim


def _out_shape(g: Advanced, shape: tuple) -> tuple:
    """Shape of ``self[indices]`` for a self of ``shape``."""
    out = [0] * (len(g.kept) + len(g.bshape))
    for k, d in g.kept.items():
        out[d] = shape[k]
    out[g.start:g.start + len(g.bshape)] = g.bshape
    return tuple(out)


def advanced(ndim: int, indices) -> Advanced | None:
    """Geometry of ``self[indices]`` for a ``ndim``-d self; None for boolean masks (their
    output size depends on the data) or when nothing is indexed."""
    present = [(k, t) for k, t in enumerate(indices) if t is not None]
    if not present or any(t.dtype in MASK_DTYPES for _, t in present):
        return None
    positions = tuple(k for k, _ in present)
    bshape = tuple(torch.broadcast_shapes(*(t.shape for _, t in present)))
    adjacent = positions == tuple(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    rest = [k for k in range(ndim) if k not in positions]
    before = [k for k in rest if adjacent and k < start]
    kept = {k: k for k in before}
    kept.update({k: len(before) + len(bshape) + j for j, k in enumerate(rest[len(before):])})
    return Advanced(positions, bshape, start, kept)


def _index_dims(idx: list, bshape: tuple, b: int) -> tuple:
    """Placements of the index tensors sharded on broadcast dim ``b`` (Replicate where broadcast)."""
    out = []
    for t in idx:
        k = aligned_dim(len(bshape), t.shape, bshape, b)
        out.append(R if k is None else Shard(k))
    return tuple(out)


def _values_dim(values: TensorMeta, target: tuple, d: int):
    """Placement of ``values`` (broadcast to ``target``) when ``target`` is sharded on ``d``."""
    k = aligned_dim(len(target), values.shape, target, d)
    return R if k is None else Shard(k)


# -- index / _unsafe_index ---------------------------------------------------------------------
def index_strategies(call: OpCall) -> list[Strategy1D]:
    src, idx = call.ins[0], call.ins[1:]
    rest = (R,) * len(idx)
    st = [replicate_all(call)] + [Strategy1D((p,), (p,) + rest) for p in PARTIALS]
    g = advanced(src.ndim, call.arg(1, "indices"))
    if g is None:
        return st
    st += [Strategy1D((Shard(d),), (Shard(k),) + rest) for k, d in g.kept.items()]
    st += [Strategy1D((Shard(g.start + b),), (R,) + _index_dims(idx, g.bshape, b)) for b in range(len(g.bshape))]
    if src.dtype != torch.bool:
        st += [Strategy1D((P,), (Shard(k),) + rest) for k in g.positions]
    return st


def local_positions(index, offset: int, n: int, full: int):
    """Global positions ``index`` along a dim of ``full`` elements (negative from the end) as
    positions in this rank's [offset, offset + n): those outside point at ``n``, one spare slot
    past the end (a zero slice to read, or a slice to write and drop)."""
    i = torch.where(index < 0, index + full, index) - offset
    return torch.where((i >= 0) & (i < n), i, torch.full_like(i, n))


def pad_spare(src, dim: int):
    """``src`` with one zero slice appended along ``dim`` (the spare slot of local_positions)."""
    return aten.constant_pad_nd.default(src, [0, 0] * (src.ndim - 1 - dim) + [0, 1], 0)


def index_in_shard(src, indices, dims, offsets, sizes):
    """``src[indices]`` where ``src`` holds only [offset, offset + local size) of each dim in
    ``dims`` (global ``sizes``, for negative indices): indices outside that range read a zero
    slice padded at the end, so the result is this rank's Partial('sum') part."""
    indices = list(indices)
    for dim, off, full in zip(dims, offsets, sizes):
        n = src.shape[dim]
        src = pad_spare(src, dim)
        indices[dim] = local_positions(indices[dim], off, n, full)
    return aten.index.Tensor(src, indices)


def index_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    src, indices = call.arg(0, "self"), call.arg(1, "indices")
    lay = ctx.in_layout(0)
    dims = [k for k, t in enumerate(indices) if t is not None and lay.sharders(k)]
    if not dims:
        return LocalCall(call.op, call.args, call.kwargs)
    off = ctx.in_offset(0)
    return LocalCall(index_in_shard, (src, list(indices), dims, [off[k] for k in dims],
                                      [src.shape[k] for k in dims]), {})


# -- index_put / _unsafe_index_put -------------------------------------------------------------
def index_put_strategies(call: OpCall) -> list[Strategy1D]:
    src, idx, values = call.ins[0], call.ins[1:-1], call.ins[-1]
    accumulate = call.arg(3, "accumulate", False)
    rest = (R,) * len(idx)
    st = [replicate_all(call)]
    st += [Strategy1D((p,), (p,) + rest + (p,)) for p in (PARTIALS[:1] if accumulate else PARTIALS)]
    g = advanced(src.ndim, call.arg(1, "indices"))
    if g is None:
        return st
    target = _out_shape(g, src.shape)  # values broadcast to self[indices]
    for k, d in g.kept.items():
        st.append(Strategy1D((Shard(k),), (Shard(k),) + rest + (_values_dim(values, target, d),)))
    if accumulate:  # each rank adds its share of (index, value) pairs into its part of self
        for b in range(len(g.bshape)):
            ins = _index_dims(idx, g.bshape, b)
            if any(isinstance(p, Shard) for p in ins):
                st.append(Strategy1D((P,), (P,) + ins + (_values_dim(values, target, g.start + b),)))
    return st


# -- scatter / scatter_add / index_add ---------------------------------------------------------
def _aligned_shards(call: OpCall, dim: int, tensors: tuple) -> list[Strategy1D]:
    """Shard dim k != ``dim`` on every input where the ``tensors`` (positions in call.ins) all have
    self's size on k (positions along k are then the same on all of them)."""
    src = call.ins[0]
    st = []
    for k in range(src.ndim):
        if k != dim and all(call.ins[i].ndim == src.ndim and call.ins[i].shape[k] == src.shape[k] for i in tensors):
            st.append(Strategy1D((Shard(k),), tuple(Shard(k) if i in tensors else R for i in range(len(call.ins)))))
    return st


def scatter_strategies(call: OpCall) -> list[Strategy1D]:
    """scatter.src / scatter.value / scatter_add: ins (self, index[, src])."""
    n = len(call.ins)
    dim = call.arg(1, "dim") % max(call.ins[0].ndim, 1)
    st = [replicate_all(call)] + _aligned_shards(call, dim, tuple(range(n)))
    data = lambda p: tuple(R if i == 1 else p for i in range(n))  # noqa: E731 (index stays Replicate)
    if call.op is aten.scatter_add.default:
        st.append(Strategy1D((P,), data(P)))
        index, src = call.ins[1], call.ins[2]
        if index.ndim and index.shape[dim] == src.shape[dim]:
            st.append(Strategy1D((P,), (P, Shard(dim), Shard(dim))))
    elif call.op is aten.scatter.src:
        st += [Strategy1D((p,), data(p)) for p in PARTIALS]
    else:  # scatter.value: every part gets the value, so sum is safe only for 0
        st += [Strategy1D((p,), data(p)) for p in PARTIALS if p != P or call.arg(3, "value") == 0]
    return st


def index_add_strategies(call: OpCall) -> list[Strategy1D]:
    """ins (self, index [L], source): rows of source added at self rows index along dim."""
    src, index, source = call.ins
    dim = call.arg(1, "dim") % max(src.ndim, 1)
    st = [replicate_all(call)] + _aligned_shards(call, dim, (0, 2))
    st.append(Strategy1D((P,), (P, R, P)))
    if index.ndim == 1 and source.ndim == src.ndim >= 1:
        st.append(Strategy1D((P,), (P, Shard(0), Shard(dim))))
    return st


# -- scatter_reduce.two / index_reduce: reductions by index ----------------------------------------
# reduce -> the Partial it commutes with. (self, src) in parts reduced by the same op: positions a part's
# pairs do not touch keep its part of self, touched ones reduce its pairs (with self unless
# include_self=False), so the parts reduce to the whole call. mean divides by per-position counts and prod
# does not commute with a sum: those keep the indexed dim whole.
REDUCE_PARTIAL = {"sum": P, "amax": Partial("max"), "amin": Partial("min")}


def _reduce_partials(call: OpCall, reduce: str, index_pos: int, pairs_dim) -> list[Strategy1D]:
    """Partial (self, src) with the index Replicate; and with the (index, src) pairs sharded on
    ``pairs_dim`` (positions of index and src in call.ins as Shard(...)), which is exact only when every
    rank reduces into self (include_self): a position only another rank's pairs touch keeps self there."""
    p = REDUCE_PARTIAL.get(reduce)
    if p is None or call.ins[0].dtype == torch.bool:
        return []
    data = tuple(R if i == index_pos else p for i in range(len(call.ins)))
    st = [Strategy1D((p,), data)]
    if pairs_dim is not None and call.arg(5, "include_self", True):
        st.append(Strategy1D((p,), (p,) + pairs_dim))
    return st


def scatter_reduce_strategies(call: OpCall) -> list[Strategy1D]:
    """scatter_reduce.two (self, dim, index, src, reduce, include_self): ins (self, index, src)."""
    src, index, values = call.ins
    dim = call.arg(1, "dim") % max(src.ndim, 1)
    st = [replicate_all(call)] + _aligned_shards(call, dim, (0, 1, 2))
    pairs = (Shard(dim), Shard(dim)) if index.ndim and index.shape[dim] == values.shape[dim] else None
    return st + _reduce_partials(call, call.arg(4, "reduce"), 1, pairs)


def index_reduce_strategies(call: OpCall) -> list[Strategy1D]:
    """index_reduce (self, dim, index [L], source, reduce, include_self): ins (self, index, source)."""
    src, index, source = call.ins
    dim = call.arg(1, "dim") % max(src.ndim, 1)
    st = [replicate_all(call)] + _aligned_shards(call, dim, (0, 2))
    pairs = (Shard(0), Shard(dim)) if index.ndim == 1 and source.ndim == src.ndim >= 1 else None
    return st + _reduce_partials(call, call.arg(4, "reduce"), 1, pairs)


# -- index_fill / index_copy: whole slices along dim written at index ---------------------------
def index_write_strategies(call: OpCall) -> list[Strategy1D]:
    """index_fill.int_Scalar (self, index), .int_Tensor (self, index, value), index_copy (self, index,
    source): every dim but ``dim`` shards self and source alike (index Replicate); ``dim`` itself shards
    self with the index whole, each rank writing the positions in its range (write_in_shard). Writing
    is linear in (self, value or source) together and commutes with max/min; a Scalar fill only with
    max/min, or with sum when the value is 0 (each part gets it)."""
    src = call.ins[0]
    if src.ndim == 0:
        return [replicate_all(call)]
    dim = call.arg(1, "dim") % src.ndim
    n = len(call.ins)
    tensors = (0, 2) if call.op is aten.index_copy.default else (0,)
    st = [replicate_all(call)] + _aligned_shards(call, dim, tensors)
    st.append(Strategy1D((Shard(dim),), (Shard(dim),) + (R,) * (n - 1)))
    scalar_fill = call.op is aten.index_fill.int_Scalar
    if src.dtype != torch.bool:
        data = lambda p: tuple(R if i == 1 else p for i in range(n))  # noqa: E731 (the index stays whole)
        st += [Strategy1D((p,), data(p)) for p in PARTIALS if p != P or not scalar_fill or call.arg(3, "value") == 0]
    return st


def write_in_shard(op, src, dim: int, index, offset: int, size: int, *rest):
    """``op(src, dim, index, *rest)`` (index_fill, index_copy) on a rank holding [offset, offset + n)
    of ``src``'s ``dim`` (``size`` globally): positions elsewhere write a spare slice, dropped after."""
    n = src.shape[dim]
    out = op(pad_spare(src, dim), dim, local_positions(index, offset, n, size), *rest)
    return aten.slice.Tensor(out, dim, 0, n)


def index_write_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    src = call.args[0]
    dim = call.arg(1, "dim") % max(src.ndim, 1)
    if src.ndim == 0 or not ctx.in_layout(0).sharders(dim):
        return LocalCall(call.op, call.args, call.kwargs)
    index, last = call.arg(2, "index"), call.arg(3, "value" if call.op is not aten.index_copy.default else "source")
    return LocalCall(write_in_shard, (call.op, src, dim, index, ctx.in_offset(0, dim), src.shape[dim], last), {})


# -- _unsafe_masked_index / _unsafe_masked_index_put_accumulate: index and index_put under a mask ---
# (as torch's decompositions: _unsafe_index(self, indices clamped).masked_fill(~mask, fill), and
# _unsafe_index_put(self, indices clamped, values.masked_fill(~mask, 0), accumulate=True)). The mask
# broadcasts to the indexed result (to values for the put), so it shards with that result's dims.
def masked_index_strategies(call: OpCall) -> list[Strategy1D]:
    """ins (self, mask, *indices): index.Tensor's strategies with the mask following the output; a
    Partial self or a self sharded on an indexed dim gives a Partial(sum) only when the fill is 0."""
    src, mask, idx = call.ins[0], call.ins[1], call.ins[2:]
    zero = call.arg(3, "fill") == 0
    rest, out = (R,) * len(idx), call.out.shape
    st = [replicate_all(call)] + [Strategy1D((p,), (p, R) + rest) for p in PARTIALS if p != P or zero]
    g = advanced(src.ndim, call.arg(2, "indices"))
    if g is None:
        return st
    st += [Strategy1D((Shard(d),), (Shard(k), _values_dim(mask, out, d)) + rest) for k, d in g.kept.items()]
    for b in range(len(g.bshape)):
        d = g.start + b
        st.append(Strategy1D((Shard(d),), (R, _values_dim(mask, out, d)) + _index_dims(idx, g.bshape, b)))
    if src.dtype != torch.bool and zero:
        st += [Strategy1D((P,), (Shard(k), R) + rest) for k in g.positions]
    return st


def _clamped(indices, shape):
    """Each index clamped to [-size, size - 1] of its dim, as the CPU kernels do (torch's decomposition
    of _unsafe_masked_index clamps from 0 instead, but the kernel reads -1 as the last)."""
    return [None if i is None else i.clamp(min=-s, max=s - 1) for i, s in zip(indices, shape)]


def masked_index_in_shard(src, mask, indices, dims, offsets, shape, fill):
    """_unsafe_masked_index composed, on a ``src`` sharded on indexed ``dims`` (global ``shape``): this
    rank's Partial(sum) part (a fill of 0: the other ranks' parts are 0 there too); with no ``dims``, the
    whole op (an empty local self, which the kernel mis-shapes)."""
    return index_in_shard(src, _clamped(indices, shape), dims, offsets,
                          [shape[k] for k in dims]).masked_fill(~mask, fill)


def masked_index_local(ctx: LocalCtx) -> LocalCall:
    """The kernel, or its composition where self is sharded on an indexed dim or is empty on this rank
    (the CPU kernel returns an empty self's result with the wrong shape: [0, 3, 0] for [0, 3, 7])."""
    call = ctx.call
    src, indices = call.arg(0, "self"), call.arg(2, "indices")
    dims = [k for k, t in enumerate(indices) if t is not None and ctx.in_layout(0).sharders(k)]
    if not dims and 0 not in ctx.local_in_shape(0):
        return LocalCall(call.op, call.args, call.kwargs)
    off = ctx.in_offset(0)
    return LocalCall(masked_index_in_shard, (src, call.arg(1, "mask"), list(indices), dims, [off[k] for k in dims],
                                             list(src.shape), call.arg(3, "fill")), {})


def masked_put_strategies(call: OpCall) -> list[Strategy1D]:
    """ins (self, mask, *indices, values): index_put's accumulate strategies, the mask following the
    values; and self sharded on an indexed dim with the pairs whole (each rank adds those in its range)."""
    src, mask, idx, values = call.ins[0], call.ins[1], call.ins[2:-1], call.ins[-1]
    rest = (R,) * len(idx)
    st = [replicate_all(call), Strategy1D((P,), (P, R) + rest + (P,))]
    g = advanced(src.ndim, call.arg(2, "indices"))
    if g is None:
        return st
    target = _out_shape(g, src.shape)
    pair = lambda d: (_values_dim(mask, target, d), _values_dim(values, target, d))  # noqa: E731
    for k, d in g.kept.items():
        m, v = pair(d)
        st.append(Strategy1D((Shard(k),), (Shard(k), m) + rest + (v,)))
    for b in range(len(g.bshape)):
        ins = _index_dims(idx, g.bshape, b)
        if any(isinstance(p, Shard) for p in ins):
            m, v = pair(g.start + b)
            st.append(Strategy1D((P,), (P, m) + ins + (v,)))
    st += [Strategy1D((Shard(k),), (Shard(k), R) + rest + (R,)) for k in g.positions]
    return st


def masked_put_in_shard(src, mask, indices, values, dims, offsets, shape):
    """_unsafe_masked_index_put_accumulate on a ``src`` sharded on indexed ``dims`` (global ``shape``):
    pairs outside this rank's range add into spare slices, dropped after."""
    indices, local = _clamped(indices, shape), list(src.shape)
    for dim, off in zip(dims, offsets):
        src = pad_spare(src, dim)
        indices[dim] = local_positions(indices[dim], off, local[dim], shape[dim])
    out = aten._unsafe_index_put.default(src, indices, values.masked_fill(~mask, 0), True)
    for dim in dims:
        out = aten.slice.Tensor(out, dim, 0, local[dim])
    return out


def masked_put_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    src, indices = call.arg(0, "self"), call.arg(2, "indices")
    dims = [k for k, t in enumerate(indices) if t is not None and ctx.in_layout(0).sharders(k)]
    if not dims:
        return LocalCall(call.op, call.args, call.kwargs)
    off = ctx.in_offset(0)
    return LocalCall(masked_put_in_shard, (src, call.arg(1, "mask"), list(indices), call.arg(3, "values"), dims,
                                           [off[k] for k in dims], list(src.shape)), {})


# -- slice_backward / select_backward / slice_scatter / select_scatter ------------------------
def _dim_pairs(n: int, dim: int, keep_dim: bool, drop: bool):
    """(output/self dim, grad/src dim) for every sharded dim: all but ``dim`` (kept when
    ``keep_dim``); ``drop``: the grad/src lacks ``dim`` (select)."""
    return [(k, k - (drop and k > dim)) for k in range(n) if k != dim or keep_dim]


def slice_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """As the slice's (view.py): and the gradient of whole parts of a dim split in groups
    (``slice_parts``) is zeros around each rank's chunk of those parts."""
    n = len(call.arg(1, "input_sizes"))
    dim = call.arg(2, "dim") % n
    size, start, end, step = call.out.shape[dim], call.arg(3, "start"), call.arg(4, "end"), call.arg(5, "step")
    pairs = _dim_pairs(n, dim, whole_slice(size, start, end, step), drop=False)
    st = [replicate_all(call)] + [Strategy1D((Shard(k),), (Shard(g),)) for k, g in pairs] + \
        [Strategy1D((p,), (p,)) for p in PARTIALS]
    parts = slice_parts(size, start, end, step)
    if parts is not None:
        k, m = parts
        st.append(Strategy1D((Shard(dim, groups=k),), (Shard(dim, groups=m) if m > 1 else Shard(dim),)))
    return st


def select_backward_strategies(call: OpCall) -> list[Strategy1D]:
    n = len(call.arg(1, "input_sizes"))
    pairs = _dim_pairs(n, call.arg(2, "dim") % n, False, drop=True)
    return [replicate_all(call)] + [Strategy1D((Shard(k),), (Shard(g),)) for k, g in pairs] + \
        [Strategy1D((p,), (p,)) for p in PARTIALS]


def slice_backward_local(ctx: LocalCtx) -> LocalCall:
    """input_sizes is the local output shape; a sharded (whole) sliced dim is sliced whole."""
    grad, _, dim, start, end, step = (ctx.call.arg(i, n) for i, n in enumerate(
        ("grad_output", "input_sizes", "dim", "start", "end", "step")))
    local = ctx.local_out_shape(0)
    d = dim % len(local)
    k = groups_on(ctx.out_layout(0), d)
    if k > 1:  # whole parts of a dim in groups: this rank's chunk of them
        start, end = local_parts(ctx.call.out.shape[d], k, local[d], start, end)
    elif ctx.out_layout(0).sharders(d):
        start, end = 0, local[d]
    return LocalCall(ctx.call.op, (grad, local, dim, start, end, step), {})


def select_backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    return LocalCall(call.op, (call.arg(0, "grad_output"), ctx.local_out_shape(0), call.arg(2, "dim"),
                               call.arg(3, "index")), {})


def _scatter_into(call: OpCall, pairs) -> list[Strategy1D]:
    """slice_scatter / select_scatter: ins (self, src); out is self's shape."""
    st = [replicate_all(call)] + [Strategy1D((Shard(k),), (Shard(k), Shard(g))) for k, g in pairs]
    return st + [Strategy1D((p,), (p, p)) for p in PARTIALS]


def slice_scatter_strategies(call: OpCall) -> list[Strategy1D]:
    n = call.ins[0].ndim
    dim = call.arg(2, "dim", 0) % n
    whole = whole_slice(call.ins[0].shape[dim], call.arg(3, "start"), call.arg(4, "end"), call.arg(5, "step", 1))
    return _scatter_into(call, _dim_pairs(n, dim, whole, drop=False))


def select_scatter_strategies(call: OpCall) -> list[Strategy1D]:
    n = call.ins[0].ndim
    return _scatter_into(call, _dim_pairs(n, call.arg(2, "dim") % n, False, drop=True))


def slice_scatter_local(ctx: LocalCtx) -> LocalCall:
    """A sharded (whole) sliced dim is replaced whole: bounds 0..local size."""
    call = ctx.call
    src, val, dim = call.arg(0, "self"), call.arg(1, "src"), call.arg(2, "dim", 0) % call.ins[0].ndim
    start, end, step = call.arg(3, "start"), call.arg(4, "end"), call.arg(5, "step", 1)
    if ctx.in_layout(0).sharders(dim):
        start, end = 0, ctx.local_in_shape(0)[dim]
    return LocalCall(call.op, (src, val, dim, start, end, step), {})


# -- shardwise.index_aligned: an arange index over the dim it indexes (trace/index_rows.py) ----
def _aligned_axis(idx_meta: TensorMeta, bshape: tuple):
    """The broadcast dim along which the arange index varies (its one non-1 dim)."""
    k = next((k for k, s in enumerate(idx_meta.shape) if s != 1), None)
    return None if k is None else len(bshape) - idx_meta.ndim + k


def index_aligned_strategies(call: OpCall) -> list[Strategy1D]:
    """aten.index's strategies (no Partial-from-sharded-rows one), plus: ``self`` and the arange
    index sharded alike on ``dim`` (their chunks coincide: each rank reads its own rows)."""
    src, idx = call.ins[0], call.ins[1:]
    indices, dim = call.arg(1, "indices"), call.arg(2, "dim")
    rest = (R,) * len(idx)
    st = [replicate_all(call)] + [Strategy1D((p,), (p,) + rest) for p in PARTIALS]
    g = advanced(src.ndim, indices)
    st += [Strategy1D((Shard(d),), (Shard(k),) + rest) for k, d in g.kept.items()]
    st += [Strategy1D((Shard(g.start + b),), (R,) + _index_dims(idx, g.bshape, b)) for b in range(len(g.bshape))]
    b = _aligned_axis(indices[dim], g.bshape)
    if b is not None:
        st.append(Strategy1D((Shard(g.start + b),), (Shard(dim),) + _index_dims(idx, g.bshape, b)))
    return st


def index_aligned_valid(call: OpCall, st, mesh) -> bool:
    """The mesh dims sharding ``self`` on ``dim`` must come first among those sharding the arange
    index (chunks nest in mesh-dim order), so each rank's indices lie in its own rows."""
    indices, dim = call.arg(1, "indices"), call.arg(2, "dim")
    pos = 1 + sum(t is not None for t in indices[:dim])
    own = [m for m, p in enumerate(st.ins[0]) if isinstance(p, Shard) and p.dim == dim]
    idx = [m for m, p in enumerate(st.ins[pos]) if isinstance(p, Shard)]
    return not own or own == idx[:len(own)]


def index_aligned_local(ctx: LocalCtx) -> LocalCall:
    """The rank's rows of ``self`` start at its offset on ``dim``: the arange index is shifted by it."""
    call = ctx.call
    dim = call.arg(2, "dim")
    offset = ctx.in_offset(0, dim) if ctx.in_layout(0).sharders(dim) else 0
    return LocalCall(call.op, (call.args[0], call.args[1], dim, offset), {})


# -- the table: one Rule row per op family ------------------------------------------------------
ROWS = [
    Rule([aten.index.Tensor, aten._unsafe_index.Tensor], index_strategies, index_local, blockwise=False),
    Rule([aten.index_put.default, aten._unsafe_index_put.default], index_put_strategies, blockwise=False),
    Rule([aten.scatter.src, aten.scatter.value, aten.scatter_add.default], scatter_strategies, blockwise=False),
    Rule(aten.index_add.default, index_add_strategies, blockwise=False),
    Rule(aten.scatter_reduce.two, scatter_reduce_strategies, blockwise=False),
    Rule(aten.index_reduce.default, index_reduce_strategies, blockwise=False),
    Rule([aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, aten.index_copy.default], index_write_strategies,
         index_write_local, blockwise=False),
    Rule(aten._unsafe_masked_index.default, masked_index_strategies, masked_index_local, blockwise=False),
    Rule(aten._unsafe_masked_index_put_accumulate.default, masked_put_strategies, masked_put_local, blockwise=False),
    Rule(aten.slice_backward.default, slice_backward_strategies, slice_backward_local, blockwise=False),
    Rule(aten.select_backward.default, select_backward_strategies, select_backward_local, blockwise=False),
    Rule(aten.slice_scatter.default, slice_scatter_strategies, slice_scatter_local, blockwise=False),
    Rule(aten.select_scatter.default, select_scatter_strategies, blockwise=False),
]


def register(registry: Registry = DEFAULT) -> None:
    from ..trace.index_rows import INDEX_ALIGNED

    registry.add(*ROWS, Rule(INDEX_ALIGNED, index_aligned_strategies, index_aligned_local, valid=index_aligned_valid,
                              blockwise=False))
