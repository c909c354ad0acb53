"""``im2col`` / ``col2im`` (``F.unfold`` / ``F.fold``, each the other's backward).

im2col turns (N, C, H, W) into (N, C*kh*kw, L): for each of the L sliding blocks, a column of
every channel's kh*kw window values, channel-major (row c*kh*kw + i of a column is channel c).
col2im is its adjoint: it adds each column's values back into their window positions of an
(N, C, H, W) output.

* The batch dim shards on both (one image, its columns).
* A shard of C maps to a shard of the columns' dim 1 in whole blocks of kh*kw
  (``Shard(1, unit=kh*kw)``), and back for col2im.
* Both are linear: Partial in, Partial out.
* col2im also takes its blocks (dim L) sharded: each rank adds its blocks' values into a zero
  output, a Partial sum (the blocks overlap, so no output shard is exact). The local call
  places its blocks at their offset among L zero blocks (the kernel checks L against
  output_size), which costs a full-sized input per rank, as the Partial output does anyway.
* The spatial dims stay whole: a block's window reads rows across chunk boundaries (sharding
  them would take a halo exchange, as convolutions do in rules/halo.py; not done here).
"""
from __future__ import annotations

import math

import torch

from ..core.layout import Shard
from .common import P, replicate_all
from .pool import empty_safe, local as empty_safe_local
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
BLOCKS = "blocks"  # col2im with its blocks (dim L) sharded: the local call needs this rank's offset


def _window(call: OpCall) -> int:
    """kh*kw: the rows of a column one channel gives."""
    return math.prod(call.arg(1 if call.op is aten.im2col.default else 2, "kernel_size"))


def im2col_strategies(call: OpCall) -> list[Strategy1D]:
    x = call.ins[0]
    c = x.ndim - 3  # (N, C, H, W) or (C, H, W)
    out = [replicate_all(call), Strategy1D((P,), (P,)),
           Strategy1D((Shard(c, unit=_window(call)),), (Shard(c),))]
    return out + ([Strategy1D((Shard(0),), (Shard(0),))] if c else [])


def col2im_strategies(call: OpCall) -> list[Strategy1D]:
    cols = call.ins[0]
    c = cols.ndim - 2  # (N, C*kh*kw, L) or (C*kh*kw, L)
    out = [replicate_all(call), Strategy1D((P,), (P,)),
           Strategy1D((Shard(c),), (Shard(c, unit=_window(call)),)),
           Strategy1D((P,), (Shard(c + 1),), BLOCKS)]
    return out + ([Strategy1D((Shard(0),), (Shard(0),))] if c else [])


def col2im_blocks(cols: torch.Tensor, length: int, offset: int, *args) -> torch.Tensor:
    """col2im of this rank's blocks [offset, offset + local) among ``length`` blocks, the others zero."""
    full = cols.new_zeros(cols.shape[:-1] + (length,))
    full.narrow(-1, offset, cols.shape[-1]).copy_(cols)
    return aten.col2im.default(full, *args)


def col2im_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    blocks = call.ins[0].ndim - 1
    if not any(isinstance(p, Shard) and p.dim == blocks for p in ctx.in_layout(0).placements):
        return empty_safe_local(ctx)
    names = ("output_size", "kernel_size", "dilation", "padding", "stride")
    args = tuple(call.arg(i + 1, n) for i, n in enumerate(names))
    shapes, dtypes = (tuple(ctx.local_out_shape(0)),), (call.outs[0].dtype,)
    return LocalCall(empty_safe, (col2im_blocks, shapes, dtypes, call.args[0], call.ins[0].shape[blocks],
                                  ctx.in_offset(0, blocks), *args), {})


ROWS = (Rule(aten.im2col.default, im2col_strategies, empty_safe_local, blockwise=False),
        Rule(aten.col2im.default, col2im_strategies, col2im_local, blockwise=False))
