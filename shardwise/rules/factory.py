"""Factory ops: tensors made from sizes and scalars (new_* also take a tensor, used only for
its dtype and device).

Any output placement is valid: Shard(d) makes only the local block (sizes from the layout,
arange and eye from its global offset), Replicate makes it all. As partials: zeros are a valid
Partial of every op; a constant or arange v is Partial('sum') when the group-index-0 rank
of every sum mesh dim (the holder) makes v and the others zeros (eye too), and Partial('max'/'min')
when every rank makes v. Uninitialised (empty) outputs are only sharded or replicated.
"""
from __future__ import annotations

import torch

from ..core.layout import Partial, R, Shard
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
SUM = Partial("sum")
PARTIALS = (SUM, Partial("max"), Partial("min"))

ZEROS = [aten.zeros.default, aten.new_zeros.default, aten._efficientzerotensor.default]  # the last: sgn's backward
CONSTS = [
    aten.ones.default, aten.full.default, aten.scalar_tensor.default, aten.new_ones.default,
    aten.new_full.default, aten.arange.default, aten.arange.start, aten.arange.start_step,
]
EMPTIES = [aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
           aten.new_empty_strided.default]
ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
EYES = [aten.eye.default, aten.eye.m]  # ones on the diagonal: each rank makes its block of it
# positional index of the shape-carrying args
SIZE_ARG = {op: 0 for op in (aten.zeros.default, aten.ones.default, aten.full.default,
                             aten.empty.memory_format, aten.empty_strided.default, aten._efficientzerotensor.default)}
SIZE_ARG.update({op: 1 for op in (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
                                  aten.new_empty.default, aten.new_empty_strided.default)})
STRIDE_ARG = {aten.empty_strided.default: 1, aten.new_empty_strided.default: 2}
ZERO_KWARGS = ("dtype", "layout", "device", "pin_memory")


# -- strategies ---------------------------------------------------------------------------------
def _input_options(call: OpCall, p) -> list[tuple]:
    """new_*'s tensor input is never read, so any placement of it works: offer Replicate and the
    output's own placement (no redistribution either way); a Replicate output also accepts any
    input placement."""
    if not call.ins:
        return [()]
    src = call.ins[0]
    own = [Shard(d) for d in range(src.ndim)] + list(PARTIALS)
    if p == R:
        opts = [R] + own
    else:
        opts = [R] + ([p] if p in own else [])
    return [(q,) for q in opts]


def _strategies(partials):
    def strategies(call: OpCall) -> list[Strategy1D]:
        outs = [R] + [Shard(d) for d in range(call.out.ndim)] + list(partials)
        return [Strategy1D((p,), ins) for p in outs for ins in _input_options(call, p)]

    strategies.__name__ = "factory[partial]" if partials else "factory[shard-only]"
    return strategies


# -- local calls --------------------------------------------------------------------------------
def local_strides(stride, shape) -> list[int]:
    """Dense strides for ``shape`` in the dim order of the global ``stride`` (0 strides kept)."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    out, s = [0] * len(shape), 1
    for d in reversed(order):
        if stride[d]:  # a 0 stride (broadcast dim) takes no room
            out[d], s = s, s * max(shape[d], 1)
    return out


def _arange_args(call: OpCall, offset: int, n: int) -> tuple:
    """(start, end, step) of the block of ``n`` values starting at global index ``offset``."""
    if call.op is aten.arange.default:
        start, step = 0, 1
    else:
        start = call.arg(0, "start")
        step = call.arg(2, "step", 1) if call.op is aten.arange.start_step else 1
    lo = start + offset * step
    if n == 0 or all(isinstance(v, int) for v in (start, step)):
        return lo, lo + n * step, step
    return lo, lo + (n - 0.5) * step, step  # half a step short: no rounding can add an element


def eye_block(rows: int, cols: int, row0: int, col0: int, **kwargs) -> torch.Tensor:
    """Rows [row0, row0 + rows) and columns [col0, col0 + cols) of the identity: a one where the
    global row equals the global column, i.e. on the local diagonal at offset row0 - col0."""
    out = torch.zeros(rows, cols, **kwargs)
    out.diagonal(row0 - col0).fill_(1)
    return out


def _is_holder(ctx: LocalCtx) -> bool:
    """Does this rank hold the value of a Partial('sum') output (group index 0 on sum dims)?"""
    partial = [p for p in ctx.strategy.outs[0] if isinstance(p, Partial)]
    return all(c == 0 for p, c in zip(partial, ctx.partial_group_index(0)) if p == SUM)


def _zeros_call(ctx: LocalCtx, shape) -> LocalCall:
    """Non-holder ranks of a Partial('sum') constant: zeros of the same local shape and dtype."""
    call = ctx.call
    kw = {k: v for k, v in call.kwargs.items() if k in ZERO_KWARGS}
    kw["dtype"] = call.out.dtype
    if call.ins:
        return LocalCall(aten.new_zeros.default, (call.arg(0, "self"), shape), kw)
    return LocalCall(aten.zeros.default, (shape,), kw)


def _factory_local(ctx: LocalCtx) -> LocalCall:
    call, op = ctx.call, ctx.call.op
    shape = ctx.local_out_shape(0)
    if (op in CONSTS or op in EYES) and not _is_holder(ctx):
        return _zeros_call(ctx, shape)
    if op in EYES:
        kw = {k: v for k, v in call.kwargs.items() if k in ZERO_KWARGS}
        return LocalCall(eye_block, (*shape, *ctx.out_offset(0)), kw)
    args, kwargs = list(call.args), dict(call.kwargs)
    if op in SIZE_ARG:
        _put(args, kwargs, SIZE_ARG[op], "size", shape)
    if op in STRIDE_ARG:
        _put(args, kwargs, STRIDE_ARG[op], "stride", local_strides(call.arg(STRIDE_ARG[op], "stride"), shape))
    if op in ARANGES and any(isinstance(p, Shard) for p in ctx.strategy.outs[0]):
        start, end, step = _arange_args(call, ctx.out_offset(0)[0], shape[0])
        kw = {k: v for k, v in call.kwargs.items() if k not in ("start", "end", "step")}
        return LocalCall(aten.arange.start_step, (start, end, step), kw)
    return LocalCall(op, tuple(args), kwargs)


def _put(args: list, kwargs: dict, i: int, name: str, value) -> None:
    """Replace positional-or-keyword arg ``i`` / ``name``."""
    if i < len(args):
        args[i] = value
    else:
        kwargs[name] = value


ROWS = (Rule(ZEROS + CONSTS + EYES, _strategies(PARTIALS), _factory_local, blockwise=False),
        Rule(EMPTIES, _strategies(()), _factory_local, blockwise=False))
