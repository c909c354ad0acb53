"""View, shape and indexing ops: data movement, so shardings follow the dims through the op.

Every op here only moves (or drops) elements, so it commutes with any elementwise reduction:
Partial(sum/max/min) inputs give Partial outputs of the same op (zero-filling ops such as
tril keep that property because every part is zeroed alike). Index tensors stay Replicate
unless a strategy shards them explicitly.
"""
from __future__ import annotations

import math

import torch

from ..core.errors import ShardingError
from ..core.layout import Partial, R, Replicate, Shard
from .common import aligned_dim, groups_on, local_parts, replicate_all, slice_parts, whole_slice
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


# -- helpers ------------------------------------------------------------------------------
def _norm(d: int, ndim: int) -> int:
    """Normalise a possibly negative dim (0-d tensors accept dims -1 and 0)."""
    return d % max(ndim, 1)


def _outs(call: OpCall, p) -> tuple:
    return tuple(None if o is None else p for o in call.outs)


def _single(call: OpCall, pairs, partials=PARTIALS) -> list[Strategy1D]:
    """Strategies of an op whose first tensor input carries the data (other inputs Replicate).

    ``pairs``: (input dim, output dim) with Shard(input dim) -> Shard(output dim) on every
    tensor output. Adds the all-Replicate strategy and the Partial pass-throughs.
    """
    rest = (R,) * (len(call.ins) - 1)
    as_shard = lambda x: x if isinstance(x, Shard) else Shard(x)  # noqa: E731 - pairs may carry units
    st = [replicate_all(call)]
    st += [Strategy1D(_outs(call, as_shard(d)), (as_shard(k),) + rest) for k, d in pairs]
    st += [Strategy1D(_outs(call, p), (p,) + rest) for p in partials]
    return st


# -- view / reshape / flatten / unflatten -------------------------------------------------
def view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Split ``src`` -> ``dst`` into groups of contiguous dims with equal products.

    Size-1 dims outside a group are skipped, so every group starts on a dim of size > 1 on
    both sides. Elements of a group are contiguous in both shapes, so sharding the leading
    input dim of a group gives the same flat ranges as sharding its leading output dim,
    whenever the chunk sizes line up (shape-sensitive expansion checks that per rank).
    """
    if 0 in src or 0 in dst:
        return []
    groups, i, j = [], 0, 0
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            return groups
        gi, go, pi, po = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                pi, gi, i = pi * src[i], gi + [i], i + 1
            else:
                po, go, j = po * dst[j], go + [j], j + 1
        groups.append((gi, go))


def _reshape_strategies(call: OpCall) -> list[Strategy1D]:
    """Shard a group's leading dim onto the other side's leading dim. For pure merges and
    splits also any dim of the many side: a shard of dim k of [.., k, ..] merged is, in the
    merged dim, ``groups`` = product of the dims before k (each rank holds its chunk of every
    row of them) in whole blocks of ``unit`` = product of the dims after k, and a split is the
    reverse. When an earlier mesh dim already split the outer dims, ``_reshape_valid`` checks
    which spelling is each rank's block on the n-d mesh."""
    src, dst = call.ins[0].shape, call.out.shape
    pairs = []
    for gi, go in view_groups(src, dst):
        if len(go) == 1:  # merge
            for j, k in enumerate(gi):
                unit, groups = math.prod(src[d] for d in gi[j + 1:]), math.prod(src[d] for d in gi[:j])
                pairs += [(k, go[0]), (k, Shard(go[0], unit)), (k, Shard(go[0], unit, groups))]
        elif len(gi) == 1:  # split: the reverse
            for j, d in enumerate(go):
                unit, groups = math.prod(dst[e] for e in go[j + 1:]), math.prod(dst[e] for e in go[:j])
                pairs += [(gi[0], d), (Shard(gi[0], unit), d), (Shard(gi[0], unit, groups), d)]
        else:
            pairs.append((gi[0], go[0]))
    return _single(call, list(dict.fromkeys(pairs)))


def _flat_run(bounds, sizes):
    """(start, length) of a block of a row-major group in its flat index space, or None when the
    block is not one contiguous run. ``bounds``: (offset, length) per dim."""
    if any(n == 0 for _, n in bounds):
        return (0, 0)
    p = next((j for j, (_, n) in enumerate(bounds) if n != 1), len(bounds) - 1)
    if any(bounds[j] != (0, sizes[j]) for j in range(p + 1, len(bounds))):
        return None
    strides = [math.prod(sizes[j + 1:]) for j in range(len(sizes))]
    return sum(o * st for (o, _), st in zip(bounds, strides)), bounds[p][1] * strides[p]


def _block(extents, sizes):
    """A rank's block of a row-major dim group in its flat index space, as (groups, offset,
    length): ``length`` elements at ``offset`` of each of ``groups`` equal parts; None when it
    has no such shape. ``extents``: Layout.extents of the group's dims (a dim in groups counts
    as its (groups, part) dims). Leading whole dims make the groups; the rest is one run."""
    bounds, dims = [], []
    for (g, o, n), s in zip(extents, sizes):
        if g > 1:
            bounds.append((0, g))
            dims.append(g)
        bounds.append((o, n))
        dims.append(s // g)
    if any(n == 0 for _, n in bounds):
        return (1, 0, 0)
    a = 0
    while a < len(dims) and bounds[a] == (0, dims[a]):
        a += 1
    if a == len(dims):
        return (1, 0, math.prod(dims))
    run = _flat_run(bounds[a:], dims[a:])
    return None if run is None else (math.prod(dims[:a]), *run)


def _canonical(layout, mesh) -> bool:
    """No unit shard of ``layout`` splits exactly like the shard without unit (Layout.canonical)."""
    return layout.canonical(mesh).placements == layout.placements


def _coordinate_ranks(mesh, dims) -> list:
    """One rank per distinct coordinate on mesh dims ``dims`` (the others 0): a value whose
    extents vary only with those coordinates is the same on the ranks left out."""
    ranks = [0]
    for m in sorted(set(dims)):
        step = math.prod(mesh.shape[m + 1:])
        ranks = [r + i * step for r in ranks for i in range(mesh.shape[m])]
    return ranks


def _reshape_valid(call: OpCall, st, mesh) -> bool:
    """Every rank's input block of every dim group is exactly its output block. Memoised on
    plain values, with Partial read as Replicate (the same blocks): expanding a view on an
    n-d mesh asks for every combination of placements."""
    key = (call.ins[0].shape, call.out.shape, _unreduced(st.ins[0]), _unreduced(st.outs[0]), mesh.shape)
    if key not in _VALID:
        if len(_VALID) >= 1 << 16:
            _VALID.clear()
        try:
            _VALID[key] = _blocks_match(call, st, mesh)
        except ShardingError:  # a unit that does not divide the dim (or a nested chunk of it)
            _VALID[key] = False
    return _VALID[key]


_VALID: dict = {}


def _unreduced(placements) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _blocks_match(call: OpCall, st, mesh) -> bool:
    src, dst = st.in_layouts(call)[0], st.out_layouts(call)[0]
    if not (_canonical(src, mesh) and _canonical(dst, mesh)):
        return False
    for gi, go in view_groups(src.shape, dst.shape):
        # a group's blocks vary only with the coordinates of the mesh dims that shard its dims
        dims = [m for m, p in enumerate(src.placements) if isinstance(p, Shard) and p.dim in gi]
        dims += [m for m, p in enumerate(dst.placements) if isinstance(p, Shard) and p.dim in go]
        for rank in _coordinate_ranks(mesh, dims):
            ie, oe = src.extents(mesh, rank), dst.extents(mesh, rank)
            a = _block([ie[d] for d in gi], [src.shape[d] for d in gi])
            b = _block([oe[d] for d in go], [dst.shape[d] for d in go])
            if a is None or b is None or (a != b and a[2] + b[2] > 0):
                return False
    return True


def _view_local(ctx: LocalCtx) -> LocalCall:
    # the local output shape replaces the sizes (any -1 is resolved by it as well)
    # reshape, not view: a local tensor that came out of a collective is laid out for its own
    # shape, and may not allow the view the traced graph made of the global tensor's memory.
    return LocalCall(aten.reshape.default, (ctx.call.arg(0, "self"), ctx.local_out_shape(0)), {})


def _unflatten_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    dim = _norm(call.arg(1, "dim"), call.ins[0].ndim)
    n = len(call.arg(2, "sizes"))
    return LocalCall(call.op, (call.arg(0, "self"), dim, ctx.local_out_shape(0)[dim:dim + n]), {})


# -- expand ---------------------------------------------------------------------------------
def _expand_strategies(call: OpCall) -> list[Strategy1D]:
    """Shard any output dim; the input follows where it is not broadcast (a size-1 input dim
    stays Replicate and each rank expands it to its local extent)."""
    out, src = call.out, call.ins[0]
    st = [replicate_all(call)]
    for d in range(out.ndim):
        k = aligned_dim(out.ndim, src.shape, out.shape, d)
        st.append(Strategy1D((Shard(d),), (R if k is None else Shard(k),)))
    return st + [Strategy1D((p,), (p,)) for p in PARTIALS]


def _expand_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call  # the local output shape replaces the sizes
    return LocalCall(call.op, (call.args[0], ctx.local_out_shape(0), *call.args[2:]), dict(call.kwargs))


# -- pure dim remapping: permute, transpose, t, unsqueeze, squeeze ----------------------------
def _permute(call):
    n = call.ins[0].ndim
    dims = [_norm(d, n) for d in call.arg(1, "dims")]
    return _single(call, [(k, d) for d, k in enumerate(dims)])


def _transpose(call):
    n = call.ins[0].ndim
    a, b = _norm(call.arg(1, "dim0"), n), _norm(call.arg(2, "dim1"), n)
    swap = {a: b, b: a}
    return _single(call, [(k, swap.get(k, k)) for k in range(n)])


def _t(call):
    n = call.ins[0].ndim
    return _single(call, [(k, n - 1 - k) for k in range(n)])


def _unsqueeze(call):
    n = call.ins[0].ndim
    dim = call.arg(1, "dim") % (n + 1)
    return _single(call, [(k, k + (k >= dim)) for k in range(n)])


def squeezed_dims(call: OpCall) -> list[int]:
    """Input dims the op squeezes: only dims of GLOBAL size 1 (squeezing another dim is a no-op,
    even where a shard makes its local size 1)."""
    src = call.ins[0]
    if call.op is aten.squeeze.default:
        cand = range(src.ndim)
    elif call.op is aten.squeeze.dim:
        cand = [call.arg(1, "dim")]
    else:
        cand = call.arg(1, "dim")
    return sorted({_norm(d, src.ndim) for d in cand if src.ndim and src.shape[_norm(d, src.ndim)] == 1})


def _squeeze(call):
    gone = squeezed_dims(call)
    kept = [k for k in range(call.ins[0].ndim) if k not in gone]
    return _single(call, [(k, d) for d, k in enumerate(kept)])


def _squeeze_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(aten.squeeze.dims, (ctx.call.arg(0, "self"), squeezed_dims(ctx.call)), {})


# -- split / chunk / unbind / cat / stack ---------------------------------------------------
def _split(call):
    """Split sizes stay global along the split dim, so only the other dims may be sharded;
    except that k equal pieces of a dim split in k groups are each a plain shard."""
    n = call.ins[0].ndim
    dim = _norm(call.arg(2, "dim", 0), n)
    st = _single(call, [(k, k) for k in range(n) if k != dim])
    k = _equal_pieces(call.outs, dim, call.ins[0].ndim)
    if k:
        st.append(Strategy1D(_outs(call, Shard(dim)), (Shard(dim, groups=k),)))
    return st


def _equal_pieces(pieces, dim: int, ndim: int) -> int:
    """How many ``pieces`` there are when at least two, all ``ndim``-d and of one nonzero size
    along ``dim`` (the parts of a dim split in groups); else 0."""
    sizes = {t.shape[dim] if t is not None and t.ndim == ndim else None for t in pieces}
    return len(pieces) if len(pieces) > 1 and len(sizes) == 1 and not sizes & {None, 0} else 0


def _split_local(ctx: LocalCtx) -> LocalCall:
    """Split along a dim in groups: every part's local chunk (which may be empty)."""
    call = ctx.call
    dim = _norm(call.arg(2, "dim", 0), call.ins[0].ndim)
    if not ctx.in_layout(0).sharders(dim):
        return LocalCall(call.op, call.args, call.kwargs)
    k = len(call.outs)
    return LocalCall(aten.split_with_sizes.default,
                     (call.arg(0, "self"), [ctx.local_in_shape(0)[dim] // k] * k, dim), {})


def _drop_dim(call):
    """unbind / select: every dim but ``dim`` (gone from the outputs) may stay sharded."""
    n = call.ins[0].ndim
    dim = _norm(call.arg(1, "dim", 0), n)
    return _single(call, [(k, k - (k > dim)) for k in range(n) if k != dim])


def _legacy_empty(t, out_ndim: int) -> bool:
    """cat skips 1-d empty inputs next to n-d ones; they cannot be sharded on a dim they lack."""
    return t.shape == (0,) and out_ndim != 1


def _joined(call: OpCall, in_dim_of) -> list[Strategy1D]:
    """cat/stack: ``in_dim_of(out_dim)`` is the input dim feeding it (None: the joined dim)."""
    out = call.out
    st = [replicate_all(call)]
    for d in range(out.ndim):
        k = in_dim_of(d)
        if k is not None:
            ins = tuple(R if _legacy_empty(t, out.ndim) else Shard(k) for t in call.ins)
            st.append(Strategy1D((Shard(d),), ins))
    return st + [Strategy1D((p,), (p,) * len(call.ins)) for p in PARTIALS]


def _cat(call):
    """Also: k pieces of one size, each a plain shard along the joined dim, make a dim split
    in k groups (the gradient of a fused [q|k|v] split)."""
    dim = _norm(call.arg(1, "dim", 0), call.out.ndim)
    st = _joined(call, lambda d: None if d == dim else d)
    k = _equal_pieces(call.ins, dim, call.out.ndim)
    if k:
        st.append(Strategy1D((Shard(dim, groups=k),), (Shard(dim),) * k))
    return st


def _stack(call):
    dim = _norm(call.arg(1, "dim", 0), call.out.ndim)
    return _joined(call, lambda d: None if d == dim else d - (d > dim))


# -- slicing and indexing -------------------------------------------------------------------
def _slice(call):
    """Every dim but the sliced one may stay sharded (it too when kept whole); and whole parts of a
    dim split in groups (``slice_parts``: q of a fused [q|k|v]) are sliced from each rank's chunk."""
    src = call.ins[0]
    dim = _norm(call.arg(1, "dim", 0), src.ndim)
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    st = _single(call, [(k, k) for k in range(src.ndim) if k != dim or whole_slice(src.shape[dim], start, end, step)])
    parts = slice_parts(src.shape[dim], start, end, step)
    if parts is not None:
        k, m = parts
        st.append(Strategy1D((Shard(dim, groups=m) if m > 1 else Shard(dim),), (Shard(dim, groups=k),)))
    return st


def _slice_local(ctx: LocalCtx) -> LocalCall:
    """A dim split in groups: this rank's chunk of the parts sliced (common.local_parts). Otherwise
    the call as it is (a sharded dim it slices whole)."""
    call = ctx.call
    dim = _norm(call.arg(1, "dim", 0), call.ins[0].ndim)
    k = groups_on(ctx.in_layout(0), dim)
    if k == 1:
        return LocalCall(call.op, call.args, call.kwargs)
    start, end = local_parts(call.ins[0].shape[dim], k, ctx.local_in_shape(0)[dim], call.arg(2, "start"),
                             call.arg(3, "end"))
    return LocalCall(call.op, (call.arg(0, "self"), dim, start, end, 1), {})


def _narrow(call):
    src = call.ins[0]
    dim = _norm(call.arg(1, "dim"), src.ndim)
    start, length = call.arg(2, "start"), call.arg(3, "length")
    whole = whole_slice(src.shape[dim], start, start % max(src.shape[dim], 1) + length)
    return _single(call, [(k, k) for k in range(src.ndim) if k != dim or whole])


def _narrow_local(ctx: LocalCtx) -> LocalCall:
    """Length is a shape arg: the local output extent. A sharded dim is narrowed whole: start 0."""
    call = ctx.call
    dim = _norm(call.arg(1, "dim"), call.ins[0].ndim)
    sharded = bool(ctx.in_layout(0).sharders(dim))
    start = 0 if sharded else call.arg(2, "start")
    return LocalCall(call.op, (call.arg(0, "self"), dim, start, ctx.local_out_shape(0)[dim]), {})


def _index_select(call):
    """Shard self off the indexed dim, or shard the 1-d index (picks a slice of the output)."""
    src, index = call.ins
    dim = _norm(call.arg(1, "dim"), src.ndim)
    st = _single(call, [(k, k) for k in range(src.ndim) if k != dim])
    if index.ndim == 1 and src.ndim:
        st.append(Strategy1D((Shard(dim),), (R, Shard(0))))
    return st


def _gather(call):
    """out[..i..] = self[..index[..i..]..] along dim; elsewhere positions must line up, so a
    dim other than ``dim`` is sharded on both only where self and index have the same size."""
    src, index = call.ins
    dim = _norm(call.arg(1, "dim"), src.ndim)
    st = _single(call, [])
    for d in range(index.ndim):
        if d != dim and d < src.ndim and src.shape[d] == index.shape[d]:
            st.append(Strategy1D((Shard(d),), (Shard(d), Shard(d))))
    if index.ndim:
        st.append(Strategy1D((Shard(dim),), (R, Shard(dim))))
    return st


# -- tril / triu / constant_pad_nd ----------------------------------------------------------
def _tri(call):
    n = call.ins[0].ndim
    return _single(call, [(k, k) for k in range(n)])


def _tri_local(ctx: LocalCtx) -> LocalCall:
    """Keep j - i <= k globally: locally j' - i' <= k + row_offset - col_offset."""
    off = ctx.in_offset(0)
    diag = ctx.call.arg(1, "diagonal", 0) + off[-2] - off[-1]
    return LocalCall(ctx.call.op, (ctx.call.arg(0, "self"), diag), {})


def _pad(call):
    """Shard the dims the pad list leaves alone; padding with v is Partial('sum')-safe only for
    v == 0 (each part would add v), always for max/min (every part holds v)."""
    n = call.ins[0].ndim
    pad = list(call.arg(1, "pad"))
    padded = {n - 1 - i // 2 for i, p in enumerate(pad) if p}
    value = call.arg(2, "value", 0)
    partials = PARTIALS if value == 0 else PARTIALS[1:]
    return _single(call, [(k, k) for k in range(n) if k not in padded], partials)


def _flip(call):
    """A flipped dim is reversed whole (rank i's block would come from its mirror rank): only
    the dims left alone stay sharded. cumsum's and cumprod's backward flip the scanned dim."""
    n = call.ins[0].ndim
    flipped = {_norm(d, n) for d in call.arg(1, "dims")}
    return _single(call, [(k, k) for k in range(n) if k not in flipped])


# -- the table: one Rule row per op family -----------------------------------------------------
ROWS = [
    Rule([aten.view.default, aten._unsafe_view.default, aten.reshape.default], _reshape_strategies, _view_local,
         shape_sensitive=True, valid=_reshape_valid, blockwise=True, shape_only=True),
    Rule(aten.flatten.using_ints, _reshape_strategies, shape_sensitive=True, valid=_reshape_valid, blockwise=True,
         shape_only=True),
    Rule(aten.unflatten.int, _reshape_strategies, _unflatten_local, shape_sensitive=True, valid=_reshape_valid,
         blockwise=True, shape_only=True),
    Rule(aten.expand.default, _expand_strategies, _expand_local, blockwise=True),
    Rule(aten.permute.default, _permute, blockwise=True),
    Rule(aten.transpose.int, _transpose, blockwise=True),
    Rule(aten.t.default, _t, blockwise=True),
    Rule(aten.unsqueeze.default, _unsqueeze, blockwise=True),
    Rule([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims], _squeeze, _squeeze_local, blockwise=True),
    Rule([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], _split, _split_local, blockwise=True),
    Rule(aten.unbind.int, _drop_dim, blockwise=True),
    Rule(aten.cat.default, _cat, blockwise=True),
    Rule(aten.stack.default, _stack, blockwise=True),
    Rule(aten.slice.Tensor, _slice, _slice_local, blockwise=True),
    Rule([aten.narrow.default, aten.narrow_copy.default], _narrow, _narrow_local, blockwise=True),
    Rule(aten.select.int, _drop_dim, blockwise=True),
    Rule(aten.index_select.default, _index_select, blockwise=True),
    Rule(aten.gather.default, _gather, blockwise=True),
    Rule([aten.tril.default, aten.triu.default], _tri, _tri_local, blockwise=True),
    Rule(aten.constant_pad_nd.default, _pad, blockwise=True),
    Rule(aten.flip.default, _flip, blockwise=True),
]
