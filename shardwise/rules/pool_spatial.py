"""Max and average pools with a spatial dim sharded: halo exchanges, as for convolutions.

A pool's output row reads a window of input rows like a convolution's (rules/halo.py), so a
rank gathers the rows its outputs' windows cover, with the padding made explicit: -inf for
max pools, zeros for average pools (exact only where the padding counts in the divisor, or
the sharded dim has none, and without ceil_mode, whose clipped last window changes the
divisor), then pools the block with no padding on that dim. Max-pool indices are positions
in the GLOBAL plane: the block's are translated by its offset. The backwards read only the
input's shape, so they skip the forward exchange: the gradient of the block comes from the
kernel on an empty block of the right shape, and the rows borrowed from neighbours go back to
their owners (``halo_scatter_add``).
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from . import halo
from .registry import LocalCall, LocalCtx, OpCall, Strategy1D

aten = torch.ops.aten
HALO = "halo"
MAX = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3}
MAX_BACKWARD = {aten.max_pool2d_with_indices_backward.default: 2, aten.max_pool3d_with_indices_backward.default: 3}
AVG = {aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}
AVG_BACKWARD = {aten.avg_pool2d_backward.default: 2, aten.avg_pool3d_backward.default: 3}
SPATIAL = {**MAX, **MAX_BACKWARD, **AVG, **AVG_BACKWARD}
_FWD = {**MAX, **AVG}


def _per_dim(v, k: int) -> list:
    v = [v] if isinstance(v, int) else list(v)
    return v * k if len(v) == 1 else v


def _args(call: OpCall) -> dict:
    """kernel, stride, padding, dilation, ceil_mode, count_include_pad of any of the ops."""
    k = SPATIAL[call.op]
    o = 0 if call.op in _FWD else 1  # backwards take grad_output first
    kernel = _per_dim(call.arg(1 + o, "kernel_size"), k)
    stride = call.arg(2 + o, "stride", []) or kernel
    out = {"kernel": kernel, "stride": _per_dim(stride, k), "padding": _per_dim(call.arg(3 + o, "padding", 0), k)}
    if call.op in MAX or call.op in MAX_BACKWARD:
        out.update(dilation=_per_dim(call.arg(4 + o, "dilation", 1), k), ceil_mode=call.arg(5 + o, "ceil_mode", False),
                   count_include_pad=True)
    else:
        out.update(dilation=[1] * k, ceil_mode=call.arg(4 + o, "ceil_mode", False),
                   count_include_pad=call.arg(5 + o, "count_include_pad", True))
    return out


def _x(call: OpCall):
    return call.ins[0 if call.op in _FWD else 1]


def windows(call: OpCall) -> list:
    x, a, k = _x(call), _args(call), SPATIAL[call.op]
    return [halo.Window(x.shape[x.ndim - k + j], a["kernel"][j], a["stride"][j], a["padding"][j], a["dilation"][j])
            for j in range(k)]


def spatial_strategies(call: OpCall) -> list[Strategy1D]:
    """x (and grad_output, indices) sharded on a spatial dim, the output alike."""
    x, k, a = _x(call), SPATIAL[call.op], _args(call)
    out = []
    for j in range(k):
        d = x.ndim - k + j
        avg = call.op in AVG or call.op in AVG_BACKWARD
        if avg and (a["ceil_mode"] or (a["padding"][j] and not a["count_include_pad"])):
            continue  # the divisor would count explicit padding or lose its clipping
        outs = tuple(None if o is None else Shard(d) for o in call.outs)
        out.append(Strategy1D(outs, tuple(Shard(d) for _ in call.ins), HALO))
    return out


def halo_dims(st, x_index: int) -> list:
    return [(p.dim, m) for m, p in enumerate(st.ins[x_index]) if isinstance(p, Shard) and st.tags[m] == HALO]


def valid(call: OpCall, st, mesh) -> bool:
    """A spatial dim is sharded by one mesh dim only."""
    dims = [d for d, _ in halo_dims(st, 0 if call.op in _FWD else 1)]
    return len(dims) == len(set(dims))


def _plans(ctx: LocalCtx) -> tuple:
    """This rank's halo exchanges as plain tuples; the output layout is the forward output's."""
    call, x_index = ctx.call, 0 if ctx.call.op in _FWD else 1
    out = ctx.out_layout(0) if call.op in _FWD else ctx.in_layout(0)
    wins, x = windows(call), ctx.in_layout(x_index)
    first = x.ndim - SPATIAL[call.op]
    return tuple(halo.HaloPlan.of(x, out, d, m, wins[d - first], ctx.mesh, ctx.rank).args()
                 for d, m in halo_dims(ctx.strategy, x_index))


def _unpadded(padding, plans, k: int, ndim: int) -> list:
    padding = list(padding)
    for p in plans:
        padding[p.dim - (ndim - k)] = 0
    return padding


def _reindex(idx: torch.Tensor, src: tuple, dst: tuple, shift: tuple) -> torch.Tensor:
    """Flat plane positions in a block of shape ``src`` -> in a plane of shape ``dst``, the
    block starting at ``shift`` (negative to go back)."""
    out = torch.zeros_like(idx)
    rest = idx
    for j in reversed(range(len(src))):
        coord = rest % src[j] + shift[j]
        rest = rest // src[j]
        stride = 1
        for n in dst[j + 1:]:
            stride *= n
        out = out + coord * stride
    return out


def _shift(plans, ndim: int, k: int) -> tuple:
    """Where the block starts in the global plane, per pooled dim (0 where not halo'd)."""
    shift = [0] * k
    for p in plans:
        shift[p.dim - (ndim - k)] = p.need[0]
    return tuple(shift)


def pool_halo(op, x, args: tuple, plans, k: int, global_plane: tuple, shapes: tuple):
    """One rank's pool on a spatially sharded input: halo'd block, pool, global indices."""
    plans = [halo.HaloPlan(*p) for p in plans]
    is_max = op in MAX
    for p in plans:  # every member takes part in the exchange, an empty chunk too
        x = halo.halo_gather(x, p, float("-inf") if is_max else 0.0)
    if 0 in shapes[0]:
        outs = tuple(x.new_zeros(s, dtype=torch.int64 if i else x.dtype) for i, s in enumerate(shapes))
        return outs if is_max else outs[0]
    kernel, stride, padding, *rest = args
    res = op(x.contiguous(), kernel, stride, _unpadded(padding, plans, k, x.ndim), *rest)
    if not is_max:
        return res
    out, idx = res
    return out, _reindex(idx, tuple(x.shape[x.ndim - k:]), global_plane, _shift(plans, x.ndim, k))


def pool_backward_halo(op, grad, x, args: tuple, indices, plans, k: int, global_plane: tuple):
    """One rank's pool backward: the kernel on an (empty) block of the halo'd shape (only its
    shape is read), then the gradient of borrowed rows back to their owners."""
    plans = [halo.HaloPlan(*p) for p in plans]
    first = x.ndim - k
    block = list(x.shape[first:])
    for p in plans:
        block[p.dim - first] = p.need[1] - p.need[0]
    xb = x.new_empty(tuple(x.shape[:first]) + tuple(block))
    if 0 in grad.shape or 0 in xb.shape:
        g = xb.new_zeros(xb.shape)
    else:
        kernel, stride, padding, *rest = args
        padding = _unpadded(padding, plans, k, x.ndim)
        if indices is not None:
            shift = tuple(-s for s in _shift(plans, x.ndim, k))
            local_idx = _reindex(indices.contiguous(), global_plane, tuple(block), shift)
            g = op(grad.contiguous(), xb, kernel, stride, padding, *rest, local_idx)
        else:
            g = op(grad.contiguous(), xb, kernel, stride, padding, *rest)
    for p in reversed(plans):
        g = halo.halo_scatter_add(g, p)
    return g


def local(ctx: LocalCtx) -> LocalCall | None:
    """The halo'd local call, or None where no spatial dim is sharded."""
    call = ctx.call
    plans = _plans(ctx)
    if not plans:
        return None
    k = SPATIAL[call.op]
    shapes = tuple(None if o is None else tuple(ctx.local_out_shape(i)) for i, o in enumerate(call.outs))
    x_meta = _x(call)
    plane = tuple(x_meta.shape[x_meta.ndim - k:])
    if call.op in _FWD:
        return LocalCall(pool_halo, (call.op, call.args[0], _op_args(call), plans, k, plane, shapes), {})
    indices = call.arg(7, "indices") if call.op in MAX_BACKWARD else None
    return LocalCall(pool_backward_halo, (call.op, call.args[0], call.args[1], _op_args(call), indices, plans, k,
                                          plane), {})


def _op_args(call: OpCall) -> tuple:
    """(kernel, stride, padding, *the op's remaining non-tensor args) in its schema order."""
    a = _args(call)
    if call.op in MAX or call.op in MAX_BACKWARD:
        return (a["kernel"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    o = 0 if call.op in _FWD else 1
    return (a["kernel"], a["stride"], a["padding"], a["ceil_mode"], a["count_include_pad"],
            call.arg(6 + o, "divisor_override"))


def comm(call: OpCall, st, mesh) -> list:
    x_index = 0 if call.op in _FWD else 1
    x = st.in_layouts(call)[x_index]
    out = st.out_layouts(call)[0] if call.op in _FWD else st.in_layouts(call)[0]
    wins, first = windows(call), x.ndim - SPATIAL[call.op]
    steps = []
    for d, m in halo_dims(st, x_index):
        steps += halo.steps(x, out, d, m, wins[d - first], mesh)
    return steps
