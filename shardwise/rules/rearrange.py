"""Ops that move, fill or lay out elements without arithmetic: rot90, channel_shuffle, _chunk_cat, block_diag,
zero (functional zero_) and resize_as (functional resize_as_).

Each only moves elements or writes zeros alike on every part, so Partial(sum/max/min) inputs pass through
to a Partial output of the same op (zero's zeros are a valid part of any Partial). A dim the op reverses
or interleaves stays whole unless the interleaving keeps whole blocks on each rank (channel_shuffle).
"""
from __future__ import annotations

import math

import torch

from ..core.errors import ShardingError
from ..core.layout import Partial, R, Shard
from .common import pointwise_strategies, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


def _pass_partials(call: OpCall, n_data: int | None = None) -> list[Strategy1D]:
    """Partial p on the first ``n_data`` inputs (all by default), the rest Replicate -> p."""
    n = len(call.ins) if n_data is None else n_data
    return [Strategy1D((p,), (p,) * n + (R,) * (len(call.ins) - n)) for p in PARTIALS]


# -- rot90: a flip and a transpose of the two dims ----------------------------------------------
def rot90_strategies(call: OpCall) -> list[Strategy1D]:
    """rot90(x, k, (a, b)): k = 1 is flip(b) then swap a, b, so input dim a (unflipped) becomes output dim b;
    k = 3 is flip(a) then swap, so input dim b becomes output dim a; k = 2 flips both in place; k = 0 is
    a copy. A flipped dim is reversed whole (a rank's block would come from its mirror rank), so it stays
    whole; the other dims shard alike."""
    n = call.ins[0].ndim
    a, b = (d % n for d in call.arg(2, "dims", [0, 1]))
    k = call.arg(1, "k", 1) % 4
    moved = {0: {a: a, b: b}, 1: {a: b}, 2: {}, 3: {b: a}}[k]
    pairs = [(d, d) for d in range(n) if d not in (a, b)] + list(moved.items())
    return [replicate_all(call)] + [Strategy1D((Shard(o),), (Shard(i),)) for i, o in pairs] + _pass_partials(call)


# -- channel_shuffle: [N, g*c, ...] read as [N, g, c, ...], the g and c dims swapped -------------
def _channels(call: OpCall) -> tuple[int, int]:
    g = call.arg(1, "groups")
    return g, call.ins[0].shape[1] // g


def channel_shuffle_strategies(call: OpCall) -> list[Strategy1D]:
    """Batch and spatial dims shard alike. The channel dim (g groups of c) shards in whole blocks: each
    rank's chunk of every group (Shard(1, groups=g)) is a run of whole g-blocks of the output
    (Shard(1, unit=g)), and a run of whole groups (Shard(1, unit=c)) is each rank's chunk of every
    c-block of the output (Shard(1, groups=c)). A plain chunk of the channels cuts through groups and
    blocks alike: it stays whole."""
    x = call.ins[0]
    st = [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != 1]
    g, c = _channels(call)
    if g > 1 and c > 1:
        st += [Strategy1D((Shard(1, unit=g),), (Shard(1, groups=g),)),
               Strategy1D((Shard(1, groups=c),), (Shard(1, unit=c),))]
    return st + _pass_partials(call)


def channel_shuffle_blocks(x: torch.Tensor, c: int) -> torch.Tensor:
    """channel_shuffle of a rank's run of whole groups of ``c`` channels (its number of groups is local)."""
    groups = x.shape[1] // c
    return x.clone() if groups < 2 else aten.channel_shuffle.default(x, groups)


def channel_shuffle_local(ctx: LocalCtx) -> LocalCall:
    """Groups are global except where the rank holds a run of whole groups (a unit shard of channels)."""
    if not any(isinstance(p, Shard) and p.dim == 1 and p.unit > 1 for p in ctx.strategy.ins[0]):
        return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
    return LocalCall(channel_shuffle_blocks, (ctx.call.arg(0, "self"), _channels(ctx.call)[1]), {})


# -- _chunk_cat: each tensor cut in num_chunks along dim (zero-padded), the chunks' rows joined ----------
def chunk_cat_strategies(call: OpCall) -> list[Strategy1D]:
    """_chunk_cat(tensors, dim, num_chunks): out [*lead, num_chunks, sum of each tensor's flattened chunk].
    The leading dims (before ``dim``, alike on every tensor) shard alike; the chunked dim and the dims
    after it are flattened into one run per tensor and joined, so they stay whole. Zero padding is the
    same on every part: the Partials pass."""
    dim = call.arg(1, "dim") % call.ins[0].ndim
    st = [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d),) * len(call.ins)) for d in range(dim)]
    return st + _pass_partials(call)


def chunk_cat_or_empty(tensors: list, dim: int, num_chunks: int, shape: list) -> torch.Tensor:
    """_chunk_cat of a rank's blocks; a rank whose block of the leading dims is empty (torch refuses empty
    tensors) makes its empty output of ``shape``."""
    if any(t.numel() == 0 for t in tensors):
        return tensors[0].new_zeros(shape)
    return aten._chunk_cat.default(tensors, dim, num_chunks)


def chunk_cat_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if not any(isinstance(p, Shard) for p in ctx.strategy.outs[0]):
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(chunk_cat_or_empty, (call.arg(0, "tensors"), call.arg(1, "dim"), call.arg(2, "num_chunks"),
                                          ctx.local_out_shape(0)), {})


# -- block_diag ---------------------------------------------------------------------------------
def block_diag_strategies(call: OpCall) -> list[Strategy1D]:
    """Output rows (and columns) are the inputs' rows (columns) end to end, as a cat's joined dim: a chunk of
    the output is not a chunk of each input, so both dims stay whole. Zeros off the blocks are the same on
    every part: the Partials pass."""
    return [replicate_all(call)] + _pass_partials(call)


# -- zero, resize_as --------------------------------------------------------------------------------
def zero_strategies(call: OpCall) -> list[Strategy1D]:
    """Zeros of self's shape: any placement of self gives the same placement of zeros (a Partial too)."""
    return pointwise_strategies(call) + _pass_partials(call)


def resize_as_strategies(call: OpCall) -> list[Strategy1D]:
    """resize_as(self, template) where the shapes agree: self unchanged. The template is read for its shape
    alone, so it takes self's placement (the local shapes then agree) or, for a Partial self, Replicate.
    A resize that changes the shape moves elements by the flat order of the whole tensor (and leaves new
    ones uninitialised): refused."""
    x, t = call.ins
    if x.shape != t.shape:
        raise ShardingError(f"resize_as from {list(x.shape)} to {list(t.shape)} changes the shape; shardwise shards "
                            "resize_as only where self and the template have one shape",
                            fix="reshape (or pad and slice) to the new shape explicitly instead of resize_as_")
    st = [replicate_all(call)] + [Strategy1D((Shard(d),), (Shard(d), Shard(d))) for d in range(x.ndim)]
    return st + _pass_partials(call, 1)


ROWS = (
    Rule(aten.rot90.default, rot90_strategies, blockwise=True),
    Rule(aten.channel_shuffle.default, channel_shuffle_strategies, channel_shuffle_local, blockwise=False),
    Rule(aten._chunk_cat.default, chunk_cat_strategies, chunk_cat_local, blockwise=True),
    Rule(aten.block_diag.default, block_diag_strategies, blockwise=True),
    Rule(aten.zero.default, zero_strategies, blockwise=True),
    Rule(aten.resize_as.default, resize_as_strategies, blockwise=True),
)
