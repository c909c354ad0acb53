"""Embedding lookup and its dense backward.

Forward ``embedding(weight [V, D], indices [...]) -> [..., D]``:
  indices sharded on any dim -> output sharded on it (weight Replicate); weight Shard(1)
  -> output sharded on its last dim; weight Shard(0) (vocab-parallel) -> each rank looks
  up only the ids of its row range, others give 0 -> output Partial('sum'); weight Partial
  -> output Partial (a lookup is linear in the table).
Backward ``embedding_dense_backward(grad [..., D], indices, V, padding_idx, scale) -> [V, D]``:
  tokens sharded -> Partial('sum') (not with scale_grad_by_freq: its counts are global);
  grad sharded on D -> Shard(1); Replicate grad + indices -> Shard(0) (each rank keeps its
  rows); grad Partial -> Partial.
"""
from __future__ import annotations

import torch

from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D
from ..core.layout import Shard

aten = torch.ops.aten


def embedding_strategies(call: OpCall) -> list[Strategy1D]:
    weight, idx = call.ins
    out = [replicate_all(call)]
    out += [Strategy1D((Shard(d),), (R, Shard(d))) for d in range(idx.ndim)]
    out.append(Strategy1D((Shard(idx.ndim),), (Shard(1), R)))
    out.append(Strategy1D((P,), (Shard(0), R)))
    out.append(Strategy1D((P,), (P, R)))
    return out


def embedding_backward_strategies(call: OpCall) -> list[Strategy1D]:
    grad, idx = call.ins
    scale = call.arg(4, "scale_grad_by_freq", False)
    out = [replicate_all(call)]
    if not scale:
        out += [Strategy1D((P,), (Shard(d), Shard(d))) for d in range(idx.ndim)]
    out.append(Strategy1D((Shard(1),), (Shard(grad.ndim - 1), R)))
    out.append(Strategy1D((Shard(0),), (R, R)))
    out.append(Strategy1D((P,), (P, R)))
    return out


def embedding_vocab_shard(weight, indices, row_offset: int):
    """Lookup in the local rows [row_offset, row_offset + rows): other ids give 0 (a Partial part)."""
    rows = weight.shape[0]
    keep = (indices >= row_offset) & (indices < row_offset + rows)
    if rows == 0:
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    local = torch.where(keep, indices - row_offset, torch.zeros_like(indices))
    out = aten.embedding.default(weight, local)
    return torch.where(keep.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))


def embedding_backward_rows(grad, indices, row_offset: int, rows: int, padding_idx: int, scale_grad_by_freq: bool):
    """Gradient rows [row_offset, row_offset + rows) of the table.

    Ids outside the range go to one extra row, marked as padding so nothing accumulates
    there, and cut off; counts for scale_grad_by_freq stay those of the (whole) indices."""
    keep = (indices >= row_offset) & (indices < row_offset + rows)
    local = torch.where(keep, indices - row_offset, torch.full_like(indices, rows))
    pad = padding_idx - row_offset if padding_idx >= 0 and 0 <= padding_idx - row_offset < rows else rows
    out = aten.embedding_dense_backward.default(grad, local, rows + 1, pad, scale_grad_by_freq)
    return out[:rows]


def embedding_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if Shard(0) not in ctx.strategy.ins[0]:
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(embedding_vocab_shard, (call.args[0], call.args[1], ctx.in_offset(0)[0]), {})


def embedding_backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if Shard(0) not in ctx.strategy.outs[0]:
        return LocalCall(call.op, call.args, call.kwargs)
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    grad, idx, _, pad, scale = (call.arg(i, n) for i, n in enumerate(names))
    rows = (ctx.out_offset(0)[0], ctx.local_out_shape(0)[0])
    return LocalCall(embedding_backward_rows, (grad, idx, *rows, pad, scale), {})


ROWS = (Rule(aten.embedding.default, embedding_strategies, embedding_local, blockwise=False),
        Rule(aten.embedding_dense_backward.default, embedding_backward_strategies, embedding_backward_local,
             blockwise=False))
