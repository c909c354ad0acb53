"""diagonal, diagonal_copy, diagonal_scatter, diag_embed, diagonal_backward: the two diagonal dims whole,
every other dim sharded alike between input and output.

``diagonal(x, offset, dim1, dim2)`` drops dim1 and dim2 and appends the diagonal as the last dim, so the
other dims keep their order and renumber past the dropped ones; ``diag_embed`` is the reverse (the input's
last dim becomes the diagonal of two output dims). With both diagonal dims whole on every rank the offset
stays global: no local args to rewrite (beyond the output size of diagonal_backward). Every op here only
moves elements or fills zeros alike on every part, so Partial(sum/max/min) passes through.
``torch.diag`` and ``torch.diagflat`` reach aten as diagonal_copy and diag_embed (with a view first).
"""
from __future__ import annotations

import torch

from ..core.layout import Partial, R, Shard
from .common import replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


def _pair(d1: int, d2: int, ndim: int) -> tuple[int, int]:
    return d1 % max(ndim, 1), d2 % max(ndim, 1)


def kept_dims(ndim: int, d1: int, d2: int) -> list[int]:
    """The dims of an ``ndim``-d tensor other than the diagonal pair, in order: the k-th of them is
    dim k of the diagonal's output (and the k-th non-diagonal dim of diag_embed's output)."""
    return [k for k in range(ndim) if k not in (d1, d2)]


def _strategies(call: OpCall, pairs, partial_ins: int) -> list[Strategy1D]:
    """Replicate, Shard(a) of the data input(s) <-> Shard(b) of the output for each (out dim, in dims)
    of ``pairs``, and the Partial pass-throughs over the first ``partial_ins`` inputs."""
    st = [replicate_all(call)]
    for out_dim, in_dims in pairs:
        st.append(Strategy1D((Shard(out_dim),), tuple(Shard(k) if k is not None else R for k in in_dims)))
    rest = (R,) * (len(call.ins) - partial_ins)
    return st + [Strategy1D((p,), (p,) * partial_ins + rest) for p in PARTIALS]


def diagonal_strategies(call: OpCall) -> list[Strategy1D]:
    """diagonal / diagonal_copy (self, offset, dim1, dim2): kept dim k of self is output dim i."""
    n = call.ins[0].ndim
    d1, d2 = _pair(call.arg(2, "dim1", 0), call.arg(3, "dim2", 1), n)
    return _strategies(call, [(i, (k,)) for i, k in enumerate(kept_dims(n, d1, d2))], 1)


def diagonal_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """diagonal_backward (grad, input_sizes, offset, dim1, dim2): the output is input_sizes with the
    gradient on its diagonal; grad dim i feeds kept output dim k."""
    n = len(call.arg(1, "input_sizes"))
    d1, d2 = _pair(call.arg(3, "dim1"), call.arg(4, "dim2"), n)
    return _strategies(call, [(k, (i,)) for i, k in enumerate(kept_dims(n, d1, d2))], 1)


def diagonal_backward_local(ctx: LocalCtx) -> LocalCall:
    """input_sizes is a shape arg: the rank's output shape (the diagonal dims stay whole)."""
    c = ctx.call
    return LocalCall(c.op, (c.arg(0, "grad_output"), ctx.local_out_shape(0), c.arg(2, "offset"), c.arg(3, "dim1"),
                            c.arg(4, "dim2")), {})


def diagonal_scatter_strategies(call: OpCall) -> list[Strategy1D]:
    """diagonal_scatter (self, src, offset, dim1, dim2): self and the output alike, src as the diagonal."""
    n = call.ins[0].ndim
    d1, d2 = _pair(call.arg(3, "dim1", 0), call.arg(4, "dim2", 1), n)
    return _strategies(call, [(k, (k, i)) for i, k in enumerate(kept_dims(n, d1, d2))], 2)


def diag_embed_strategies(call: OpCall) -> list[Strategy1D]:
    """diag_embed (self, offset, dim1, dim2): self's last dim is the diagonal of output dims dim1, dim2
    (normalised against the output's ndim); self's dim i (not the last) is the i-th other output dim."""
    n_out = call.out.ndim
    d1, d2 = _pair(call.arg(2, "dim1", -2), call.arg(3, "dim2", -1), n_out)
    return _strategies(call, [(k, (i,)) for i, k in enumerate(kept_dims(n_out, d1, d2))], 1)


ROWS = (
    Rule([aten.diagonal.default, aten.diagonal_copy.default], diagonal_strategies, blockwise=True),
    Rule(aten.diagonal_backward.default, diagonal_backward_strategies, diagonal_backward_local, blockwise=True),
    Rule(aten.diagonal_scatter.default, diagonal_scatter_strategies, blockwise=True),
    Rule(aten.diag_embed.default, diag_embed_strategies, blockwise=True),
)
