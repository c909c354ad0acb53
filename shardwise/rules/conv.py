"""Convolutions (1-d, 2-d, 3-d; stride, padding, dilation, groups; transposed): forward and backward.

``convolution(x [N, Cin, *S], w [Cout, Cin/g, *K] (transposed: [Cin, Cout/g, *K]), bias [Cout])``.
Strategies on one mesh dim:

- batch: x and the output sharded on N; weight and bias Replicate. Backward: grad_weight and
  grad_bias Partial (they sum over the batch).
- output channels (column-parallel, groups == 1): weight and bias sharded on Cout, x Replicate.
- input channels (row-parallel, groups == 1): x and weight sharded on Cin, output Partial (the
  bias Partial too: one rank holds it, as for addmm).
- groups (grouped and depthwise, groups > 1): x, weight, bias and output sharded in whole
  groups (``Shard(d, unit=channels per group)``); the local call runs on its local groups.
- linear: x Partial (bias Partial) or weight Partial (bias Partial) -> output Partial.
- spatial (not transposed): x and output sharded on one spatial dim (H, W, the length of a
  1-d signal); each rank reads the rows its outputs' windows cover through a halo exchange
  (rules/halo.py) and convolves them with that dim's padding made explicit. The backward
  runs the local convolution_backward on the same block and sends the gradient of borrowed
  rows back to their owners (grad_weight, grad_bias Partial). Exact for uneven chunks and any
  stride/dilation; a spatial dim is sharded by one mesh dim only.

Chunks that come out empty (fewer channels or groups than ranks) give zeros of the planned
local shape instead of a kernel error.
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from . import halo
from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
FWD, BWD = aten.convolution.default, aten.convolution_backward.default
HALO = "halo"


# -- argument access ---------------------------------------------------------------------------
def _params(call: OpCall):
    """(stride, padding, dilation, transposed, output_padding, groups) of either op."""
    k = 0 if call.op is FWD else 1
    names = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")
    return tuple(call.arg(3 + k + j, n) for j, n in enumerate(names))


def _xw(call: OpCall):
    """(input, weight) metas of either op."""
    return (call.ins[0], call.ins[1]) if call.op is FWD else (call.ins[1], call.ins[2])


def _channels(call: OpCall):
    """(groups, in channels per group, out channels per group)."""
    x, w = _xw(call)
    _, _, _, transposed, _, g = _params(call)
    cin = x.shape[1]
    cout = w.shape[1] * g if transposed else w.shape[0]
    return g, cin // g, cout // g


def _per_dim(v, nd: int) -> list:
    """stride/padding/dilation as one value per spatial dim (aten accepts one value for all)."""
    v = list(v)
    return v * nd if len(v) == 1 else v


def _windows(call: OpCall) -> list:
    x, w = _xw(call)
    nd = x.ndim - 2
    stride, padding, dilation, _, _, _ = (_per_dim(v, nd) if i < 3 else v for i, v in enumerate(_params(call)))
    return [halo.Window(x.shape[2 + j], w.shape[2 + j], stride[j], padding[j], dilation[j]) for j in range(nd)]


# -- strategies --------------------------------------------------------------------------------
def _forward_options(call: OpCall) -> list:
    """(x, weight, bias, out) placements per strategy, bias as if present."""
    x, w = _xw(call)
    _, _, _, transposed, _, g = _params(call)
    _, cin_g, cout_g = _channels(call)
    opts = [(Shard(0), R, R, Shard(0)), (P, R, P, P), (R, P, P, P)]
    if g == 1:
        opts.append((R, Shard(1 if transposed else 0), Shard(0), Shard(1)))  # output channels
        opts.append((Shard(1), Shard(0 if transposed else 1), P, P))  # input channels
    else:
        wu = cin_g if transposed else cout_g
        opts.append((Shard(1, unit=cin_g), Shard(0, unit=wu), Shard(0, unit=cout_g), Shard(1, unit=cout_g)))
        opts.append((Shard(1), Shard(0), Shard(0), Shard(1)))  # plain chunks, where they hold whole groups
    if not transposed:
        opts += [(Shard(d), R, R, Shard(d)) for d in range(2, x.ndim)]
    return opts


def forward_strategies(call: OpCall) -> list[Strategy1D]:
    has_bias = len(call.ins) == 3
    out = [replicate_all(call)]
    for xp, wp, bp, op in _forward_options(call):
        tag = HALO if isinstance(xp, Shard) and xp.dim >= 2 else ""
        out.append(Strategy1D((op,), (xp, wp) + ((bp,) if has_bias else ()), tag))
    return out


def _backward_options(call: OpCall) -> list:
    """(grad_out, x, weight) -> (grad_input, grad_weight, grad_bias) placements."""
    x, _ = _xw(call)
    _, _, _, transposed, _, g = _params(call)
    _, cin_g, cout_g = _channels(call)
    opts = [((Shard(0), Shard(0), R), (Shard(0), P, P)), ((P, R, R), (P, P, P))]
    if g == 1:
        wo, wi = (1, 0) if transposed else (0, 1)
        opts.append(((Shard(1), R, Shard(wo)), (P, Shard(wo), Shard(0))))  # output channels
        opts.append(((R, Shard(1), Shard(wi)), (Shard(1), Shard(wi), R)))  # input channels
    else:
        wu = cin_g if transposed else cout_g
        go, xi = Shard(1, unit=cout_g), Shard(1, unit=cin_g)
        opts.append(((go, xi, Shard(0, unit=wu)), (xi, Shard(0, unit=wu), Shard(0, unit=cout_g))))
        opts.append(((Shard(1), Shard(1), Shard(0)), (Shard(1), Shard(0), Shard(0))))  # plain, whole groups
    if not transposed:
        opts += [((Shard(d), Shard(d), R), (Shard(d), P, P)) for d in range(2, x.ndim)]
    return opts


def backward_strategies(call: OpCall) -> list[Strategy1D]:
    out = [replicate_all(call)]
    for ins, outs in _backward_options(call):
        outs = tuple(None if o is None else p for o, p in zip(call.outs, outs))
        tag = HALO if isinstance(ins[1], Shard) and ins[1].dim >= 2 else ""
        out.append(Strategy1D(outs, ins, tag))
    return out


def _halo_dims(ctx_or_strategy, x_index: int) -> list:
    """[(tensor dim, mesh dim)] of the spatial dims the input is sharded on."""
    st = ctx_or_strategy
    return [(p.dim, m) for m, p in enumerate(st.ins[x_index]) if isinstance(p, Shard) and p.dim >= 2]


def whole_groups(tensors, mesh) -> bool:
    """Do the chunks of every (layout, dim, unit) in ``tensors`` hold whole units, the same
    units on each rank? Plain channel shards of a grouped op are right only then (e.g. 8
    channels in 4 groups on 2 ranks: 4 + 4 channels, 2 + 2 groups)."""
    for rank in range(mesh.size):
        ranges = set()
        for lay, dim, unit in tensors:
            try:
                off, n = lay.local_offset(mesh, rank, dim), lay.local_shape(mesh, rank)[dim]
            except ValueError:  # a unit shard nested in a plain chunk that is not whole units
                return False
            if off % unit or n % unit:
                return False
            ranges.add((off // unit if n else None, n // unit))
        if len(ranges) > 1:
            return False
    return True


def _channel_units(call: OpCall) -> list:
    """(dim, unit) of the channel dim of each tensor input and output, in ins + outs order."""
    _, _, _, transposed, _, _ = _params(call)
    _, cin_g, cout_g = _channels(call)
    wu = cin_g if transposed else cout_g
    if call.op is FWD:
        return [(1, cin_g), (0, wu), (0, cout_g)][:len(call.ins)] + [(1, cout_g)]
    return [(1, cout_g), (1, cin_g), (0, wu), (1, cin_g), (0, wu), (0, cout_g)]


def _plain_groups_ok(call: OpCall, st, mesh) -> bool:
    lays = st.in_layouts(call) + st.out_layouts(call)
    tensors = [(lay, d, u) for lay, (d, u) in zip(lays, _channel_units(call))
               if lay is not None and any(isinstance(p, Shard) and p.dim == d for p in lay.placements)]
    plain = any(isinstance(p, Shard) and p.dim == d and p.unit == 1 and u > 1 for lay, d, u in tensors
                for p in lay.placements)
    return not plain or whole_groups(tensors, mesh)


def valid(call: OpCall, st, mesh) -> bool:
    """A spatial dim is sharded by one mesh dim only (a halo is exchanged within one group);
    plain channel shards of a grouped conv cut whole groups (``whole_groups``)."""
    dims = [d for d, _ in _halo_dims(st, 0 if call.op is FWD else 1)]
    if len(dims) != len(set(dims)):
        return False
    return _channels(call)[0] == 1 or _plain_groups_ok(call, st, mesh)


# -- local calls -------------------------------------------------------------------------------
def _local_groups(ctx: LocalCtx, x_index: int) -> int:
    g, cin_g, _ = _channels(ctx.call)
    if g == 1:
        return 1
    return ctx.local_in_shape(x_index)[1] // cin_g


def _halo_plans(ctx: LocalCtx, x_index: int, out_layout) -> tuple:
    """This rank's halo exchanges as plain tuples (the program prints them as literals)."""
    wins = _windows(ctx.call)
    x = ctx.in_layout(x_index)
    return tuple(halo.HaloPlan.of(x, out_layout, d, m, wins[d - 2], ctx.mesh, ctx.rank).args()
                 for d, m in _halo_dims(ctx.strategy, x_index))


def _no_padding(padding, plans, nd: int) -> list:
    """The padding with the halo'd dims' made 0 (their blocks carry it as explicit zeros)."""
    if not plans:
        return padding
    padding = _per_dim(padding, nd)
    for p in plans:
        padding[p.dim - 2] = 0
    return padding


def conv_local(x, w, bias, stride, padding, dilation, transposed, output_padding, groups, plans, out_shape):
    """One rank's convolution: halo'd blocks for sharded spatial dims, zeros for empty chunks."""
    plans = [halo.HaloPlan(*p) for p in plans]
    for p in plans:  # every member takes part in the exchange, an empty chunk too
        x = halo.halo_gather(x, p)
    if groups == 0 or 0 in out_shape or x.shape[1] == 0:
        out = x.new_zeros(out_shape)
        return out if bias is None or 0 in out_shape else out + bias.reshape([-1] + [1] * (len(out_shape) - 2))
    return aten.convolution.default(x, w, bias, stride, _no_padding(padding, plans, x.ndim - 2), dilation, transposed,
                                    output_padding, groups)


def conv_backward_local(grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                        mask, plans, shapes):
    """One rank's convolution_backward: the forward's halo'd block, then the gradient of the
    borrowed rows sent back to their owners (reverse order of the exchanges)."""
    plans = [halo.HaloPlan(*p) for p in plans]
    for p in plans:  # every member takes part in the exchanges, an empty chunk too
        x = halo.halo_gather(x, p)
    if groups == 0 or 0 in grad.shape or x.shape[1] == 0:
        gi, gw, gb = (None if s is None else grad.new_zeros(s) for s in (x.shape if mask[0] else None,) + shapes[1:])
    else:
        padding = _no_padding(padding, plans, x.ndim - 2)
        gi, gw, gb = aten.convolution_backward.default(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                                                       output_padding, groups, mask)
    if gi is not None:
        for p in reversed(plans):
            gi = halo.halo_scatter_add(gi, p)
    return gi, gw, gb


def forward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    x, w = call.args[0], call.args[1]
    bias = call.arg(2, "bias")
    stride, padding, dilation, transposed, output_padding, _ = _params(call)
    plans = _halo_plans(ctx, 0, ctx.out_layout(0))
    return LocalCall(conv_local, (x, w, bias, stride, padding, dilation, transposed, output_padding,
                                  _local_groups(ctx, 0), plans, tuple(ctx.local_out_shape(0))), {})


def backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    grad, x, w = call.args[0], call.args[1], call.args[2]
    stride, padding, dilation, transposed, output_padding, _ = _params(call)
    mask = list(call.arg(10, "output_mask"))
    shapes = tuple(None if o is None else tuple(ctx.local_out_shape(i)) for i, o in enumerate(call.outs))
    bias_sizes = call.arg(3, "bias_sizes")
    if bias_sizes is not None and call.outs[2] is not None:
        bias_sizes = [shapes[2][0]]
    out_layout = ctx.in_layout(0)  # grad_output has the forward output's layout
    plans = _halo_plans(ctx, 1, out_layout)
    return LocalCall(conv_backward_local, (grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                                           output_padding, _local_groups(ctx, 1), mask, plans, shapes), {})


def _comm(x_index: int, out_of):
    def comm(call: OpCall, st, mesh) -> list:
        """The halo exchanges of a spatially sharded strategy (the backward exchanges twice)."""
        x = st.in_layouts(call)[x_index]
        out = out_of(call, st)
        wins = _windows(call)
        steps = []
        for d, m in _halo_dims(st, x_index):
            steps += halo.steps(x, out, d, m, wins[d - 2], mesh)
        return steps * (2 if call.op is BWD and call.outs[0] is not None else 1)

    return comm


ROWS = (Rule(FWD, forward_strategies, forward_local, valid=valid, blockwise=False,
             comm=_comm(0, lambda call, st: st.out_layouts(call)[0])),
        Rule(BWD, backward_strategies, backward_local, valid=valid, blockwise=False,
             comm=_comm(1, lambda call, st: st.in_layouts(call)[0])))
