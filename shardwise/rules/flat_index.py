"""Ops that address a tensor by its row-major (flat) order: take, put, masked_scatter (and its
backward), nonzero_static.

``take(self, index)`` reads ``self.flatten()[index]``: the output has the index's shape, so it
shards with the index on any dim (self whole); a Partial self passes through (selection commutes
with sum/max/min); and a self sharded on dim 0 holds one contiguous run of flat positions, so each
rank reads the positions in its run and 0 elsewhere: a Partial(sum) output (as index.Tensor's
sharded-vocabulary form). ``put(self, index, source, accumulate)`` writes ``source`` at flat
positions: self sharded on dim 0 with the pairs whole (each rank writes those in its run, a spare
slot takes the rest); overwriting is linear in (self, source) together and commutes with max/min,
accumulating is linear, so with accumulate the (index, source) pairs may shard alike into a
Partial(sum) self.

``masked_scatter(self, mask, source)`` fills the mask's true positions with ``source``'s leading
elements in row-major order over the WHOLE broadcast mask: a position's source element is the count
of true entries before it, which for any sharded dim depends on the other ranks' masks (a data-
dependent prefix count no local call can see), so self, mask and source stay whole; only the
Partial forms are exact (linear in (self, source) together, commuting with max/min).
``masked_scatter_backward(grad, mask, sizes)`` is ``grad[mask]`` padded with zeros to ``sizes``:
the same prefix count places every element, so only Partials pass (selection and the zero padding
are alike on every part). ``nonzero_static(self, size)`` lists the nonzero coordinates in row-major
order, padded to ``size`` rows: where a shard's rows start depends on the count of nonzeros before
it, and the padding sits after the last of the whole tensor's, so self stays whole.
"""
from __future__ import annotations

import math

import torch

from ..core.layout import Partial, R, Shard
from .common import P, replicate_all
from .indexing import local_positions, pad_spare
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
PARTIALS = (P, Partial("max"), Partial("min"))


def _run_offset(ctx: LocalCtx) -> int:
    """Where this rank's flat run of self (sharded on dim 0) starts."""
    t = ctx.call.ins[0]
    return ctx.in_offset(0, 0) * math.prod(t.shape[1:])


def take_strategies(call: OpCall) -> list[Strategy1D]:
    src, index = call.ins
    st = [replicate_all(call)] + [Strategy1D((p,), (p, R)) for p in PARTIALS]
    st += [Strategy1D((Shard(d),), (R, Shard(d))) for d in range(index.ndim)]
    if src.ndim and src.dtype != torch.bool:
        st.append(Strategy1D((P,), (Shard(0), R)))
    return st


def take_in_shard(src, index, offset: int, numel: int):
    """``take`` of a self holding flat positions [offset, offset + its numel) of ``numel``: the others read 0."""
    n = src.numel()
    return aten.take.default(pad_spare(src.reshape(-1), 0), local_positions(index, offset, n, numel))


def take_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if not call.ins[0].ndim or not ctx.in_layout(0).sharders(0):
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(take_in_shard, (*call.args[:2], _run_offset(ctx), call.ins[0].numel), {})


def put_strategies(call: OpCall) -> list[Strategy1D]:
    src, index, source = call.ins
    accumulate = call.arg(3, "accumulate", False)
    st = [replicate_all(call)]
    if src.dtype != torch.bool:
        st += [Strategy1D((p,), (p, R, p)) for p in ((P,) if accumulate else PARTIALS)]
    if accumulate and src.dtype != torch.bool and index.shape == source.shape:
        st += [Strategy1D((P,), (P, Shard(d), Shard(d))) for d in range(index.ndim)]
    if src.ndim:
        st.append(Strategy1D((Shard(0),), (Shard(0), R, R)))
    return st


def put_in_shard(src, index, source, accumulate: bool, offset: int, numel: int):
    """``put`` into a self holding flat positions [offset, offset + its numel) of ``numel``: pairs
    elsewhere write a spare slot, dropped after."""
    n = src.numel()
    out = aten.put.default(pad_spare(src.reshape(-1), 0), local_positions(index, offset, n, numel), source, accumulate)
    return aten.slice.Tensor(out, 0, 0, n).view(src.shape)


def put_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if not call.ins[0].ndim or not ctx.in_layout(0).sharders(0):
        return LocalCall(call.op, call.args, call.kwargs)
    src, index, source = call.args[:3]
    return LocalCall(put_in_shard, (src, index, source, call.arg(3, "accumulate", False), _run_offset(ctx),
                                    call.ins[0].numel), {})


def masked_scatter_strategies(call: OpCall) -> list[Strategy1D]:
    """ins (self, mask, source): whole (see the module's note), or Partial self and source."""
    st = [replicate_all(call)]
    if call.ins[0].dtype != torch.bool:
        st += [Strategy1D((p,), (p, R, p)) for p in PARTIALS]
    return st


def masked_scatter_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """ins (grad_output, mask): whole, or a Partial gradient."""
    return [replicate_all(call)] + [Strategy1D((p,), (p, R)) for p in PARTIALS]


def whole_strategies(call: OpCall) -> list[Strategy1D]:
    """nonzero_static: self whole (see the module's note)."""
    return [replicate_all(call)]


ROWS = (
    Rule(aten.take.default, take_strategies, take_local, blockwise=False),
    Rule(aten.put.default, put_strategies, put_local, blockwise=False),
    Rule(aten.masked_scatter.default, masked_scatter_strategies, blockwise=False),
    Rule(aten.masked_scatter_backward.default, masked_scatter_backward_strategies, blockwise=False),
    Rule(aten.nonzero_static.default, whole_strategies, blockwise=False),
)
