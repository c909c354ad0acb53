"""segment_reduce and its backward: runs of ``data`` along ``axis`` (given by ``lengths`` or
``offsets``) reduced to one value each.

The lengths / offsets are (data's dims before ``axis``..., segments): a dim before ``axis`` shards
data, lengths and output alike (each row has its own segments); a dim after it shards data and
output with the lengths whole. ``axis`` itself stays whole: a segment may cross any shard boundary,
and where a rank's segments start depends on the lengths before it. A Partial data passes through
where the reduction commutes with it: "sum" (with no ``initial``, or 0: each part would add it) and
"mean" without ``initial`` (linear) with Partial(sum); "max"/"min" with Partial(max)/(min) (an
``initial`` is an extra operand of the same max or min on every part). The backward is linear in the
gradient for every reduction (sum and mean spread it, max/min route it to the extremes, prod scales
it by output / data), so a Partial(sum) gradient with output and data whole gives a Partial(sum) one.
"""
from __future__ import annotations

import torch

from ..core.calls import pure
from ..core.layout import Partial, R, Shard
from .common import P, replicate_all
from .registry import KW_ONLY, LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten


def _data_partial(call: OpCall):
    reduce, initial = call.arg(1, "reduce"), call.arg(KW_ONLY, "initial")
    if reduce == "sum" and initial in (None, 0):
        return P
    if reduce == "mean" and initial is None:
        return P
    return {"max": Partial("max"), "min": Partial("min")}.get(reduce)


def _row_shards(call: OpCall, data: int, carried: tuple) -> list[Strategy1D]:
    """Shard each dim d != axis of input ``data`` (and of the output, shaped alike but for axis); the
    inputs in ``carried`` (shaped as the output) with it, the lengths/offsets (the last input) only
    for d < axis."""
    x, n = call.ins[data], len(call.ins)
    axis = call.arg(KW_ONLY, "axis", 0) % max(x.ndim, 1)
    st = []
    for d in range(x.ndim):
        if d != axis:
            ins = tuple(Shard(d) if i in carried or i == data or (i == n - 1 and d < axis) else R for i in range(n))
            st.append(Strategy1D((Shard(d),), ins))
    return st


@pure
def segment_reduce_rows(data, reduce, **kwargs):
    """segment_reduce, also on a rank holding none of the rows before ``axis`` (the CPU kernel takes
    the min of the lengths, which an empty lengths tensor refuses): an empty result of its shape."""
    lengths, offsets = kwargs.get("lengths"), kwargs.get("offsets")
    seg = lengths if lengths is not None else offsets
    if seg is None or seg.numel():
        return aten.segment_reduce.default(data, reduce, **kwargs)
    axis = kwargs.get("axis", 0) % data.ndim
    segments = seg.shape[-1] - (lengths is None)
    return data.new_zeros(data.shape[:axis] + (segments,) + data.shape[axis + 1:])


def segment_reduce_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(segment_reduce_rows, ctx.call.args, dict(ctx.call.kwargs))


def segment_reduce_strategies(call: OpCall) -> list[Strategy1D]:
    """segment_reduce: ins (data, lengths or offsets)."""
    st = [replicate_all(call)] + _row_shards(call, 0, ())
    p = _data_partial(call)
    if p is not None:
        st.append(Strategy1D((p,), (p,) + (R,) * (len(call.ins) - 1)))
    return st


def segment_reduce_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """_segment_reduce_backward: ins (grad, output, data, lengths or offsets)."""
    st = [replicate_all(call)] + _row_shards(call, 2, (0, 1))
    return st + [Strategy1D((P,), (P,) + (R,) * (len(call.ins) - 1))]


ROWS = (
    Rule(aten.segment_reduce.default, segment_reduce_strategies, segment_reduce_local, blockwise=True),
    Rule(aten._segment_reduce_backward.default, segment_reduce_backward_strategies, blockwise=True),
)
