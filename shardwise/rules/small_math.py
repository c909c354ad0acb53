"""Small math ops: trace, count_nonzero, hash_tensor, vdot, linalg_cross, dist, renorm, and linspace /
logspace with tensor endpoints.

Reductions follow rules/reduction.py: kept dims shard, a reduced dim shards where the parts combine with a
Partial op (count_nonzero and trace add up; dist's p-norm only for p in 0, 1 (sum) and +-inf (max/min),
as the vector norms; hash_tensor xors bits, which no Partial op combines). vdot is a contraction, cross
a product per vector (its dim of size 3 whole), renorm a norm per slice along ``dim`` (that dim shards,
every other is read whole by each slice's norm). The tensor-endpoint ranges are factories: any output
placement, each rank cutting its block out of the whole range (torch's linspace rounds by position, so
a block made from its own endpoints would differ in the last bits).
"""
from __future__ import annotations

import functools
import math

import torch

from ..core.layout import Partial, R, Shard
from .common import aligned_dim, einsum_strategies, pointwise_strategies, replicate_all
from .reduction import Reduce, reduce_strategies_for
from .registry import KW_ONLY, LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
SUM = Partial("sum")


# -- trace: the sum of a matrix's diagonal ----------------------------------------------------------
def trace_strategies(call: OpCall) -> list[Strategy1D]:
    """Either dim sharded: each rank sums the diagonal entries in its block, a Partial sum; linear, so a
    Partial sum passes."""
    return [replicate_all(call), Strategy1D((SUM,), (Shard(0),)), Strategy1D((SUM,), (Shard(1),)),
            Strategy1D((SUM,), (SUM,))]


def trace_block(x: torch.Tensor, offset: int) -> torch.Tensor:
    """The global diagonal's entries in a block whose rows start ``offset`` after its columns."""
    return torch.diagonal(x, offset).sum()


def trace_local(ctx: LocalCtx) -> LocalCall:
    """Global entry (j, j) is local (j - r0, j - c0): the local diagonal at offset r0 - c0."""
    if not any(isinstance(p, Shard) for p in ctx.strategy.ins[0]):
        return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
    r0, c0 = ctx.in_offset(0)
    return LocalCall(trace_block, (ctx.call.arg(0, "self"), r0 - c0), {})


# -- count_nonzero, hash_tensor: reductions ----------------------------------------------------------
COUNT = Reduce(dim=(1, "dim"), keepdim=None, partial="sum")  # a sum of (x != 0): nonlinear in x, no pass
HASH = Reduce(dim=(1, "dim"), keepdim=(KW_ONLY, "keepdim"))  # an xor of bits: reduced dims whole


def count_nonzero_strategies(call: OpCall) -> list[Strategy1D]:
    return reduce_strategies_for(call, COUNT, COUNT.partial)


def hash_tensor_strategies(call: OpCall) -> list[Strategy1D]:
    return reduce_strategies_for(call, HASH, None)


# -- vdot, linalg_cross ---------------------------------------------------------------------------
def vdot_strategies(call: OpCall) -> list[Strategy1D]:
    """sum(conj(a) * b): the contracted dim sharded gives a Partial sum; linear in each input."""
    return einsum_strategies("i,i->", call)


def cross_strategies(call: OpCall) -> list[Strategy1D]:
    """Every broadcast dim but ``dim`` (the vectors' 3 components, mixed) shards alike; bilinear: one
    Partial sum input with the other Replicate."""
    dim = call.arg(KW_ONLY, "dim", -1) % call.out.ndim
    return [s for s in pointwise_strategies(call, "one") if s.outs[0] != Shard(dim)]


# -- dist: the p-norm of a - b over every element ---------------------------------------------------
DIST_PARTIAL = {1.0: "sum", 0.0: "sum", math.inf: "max", -math.inf: "min"}


def _p(call: OpCall) -> float:
    return float(call.arg(2, "p", 2))


def dist_strategies(call: OpCall) -> list[Strategy1D]:
    """Any dim of the broadcast shape sharded (each input on its own dim, or Replicate where it broadcasts)
    gives each rank the norm of its block: exact as a Partial only for p in 0, 1 (sums) and +-inf (max,
    min); any other p would need the p-th powers summed before the root."""
    st = [replicate_all(call)]
    op = DIST_PARTIAL.get(_p(call))
    if op is None:
        return st
    a, b = call.ins
    shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
    for d in range(len(shape)):
        ins = tuple(R if k is None else Shard(k) for k in (aligned_dim(len(shape), t.shape, shape, d) for t in (a, b)))
        st.append(Strategy1D((Partial(op),), ins))
    return st


def dist_or_identity(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    """dist of a block; an empty block gives the identity of its Partial op (torch refuses an empty inf-norm)."""
    if a.numel() == 0 or b.numel() == 0:
        return torch.tensor(0.0 if p > 0 else math.inf, dtype=torch.result_type(a, b), device=a.device)
    return torch.dist(a, b, p)


def dist_local(ctx: LocalCtx) -> LocalCall:
    p = _p(ctx.call)
    if math.isfinite(p) or not any(isinstance(q, Shard) for ps in ctx.strategy.ins for q in ps):
        return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
    return LocalCall(dist_or_identity, (ctx.call.arg(0, "self"), ctx.call.arg(1, "other"), p), {})


# -- renorm: each slice along dim rescaled by its own p-norm --------------------------------------
def renorm_strategies(call: OpCall) -> list[Strategy1D]:
    """Slices along ``dim`` are independent (that dim shards); each slice's norm reads every other dim whole."""
    dim = call.arg(2, "dim") % max(call.ins[0].ndim, 1)
    return [replicate_all(call), Strategy1D((Shard(dim),), (Shard(dim),))] if call.ins[0].ndim else [replicate_all(call)]


# -- linspace / logspace with tensor endpoints ------------------------------------------------------
RANGES = [getattr(getattr(aten, name), ov) for name in ("linspace", "logspace")
          for ov in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")]


def range_strategies(call: OpCall) -> list[Strategy1D]:
    """The endpoints (0-d tensors) Replicate; the output any placement: Shard(0) (each rank its block),
    Partial max/min (every rank the whole range), Partial sum (the holder the range, the others zeros)."""
    ins = (R,) * len(call.ins)
    outs = [R, Shard(0), SUM, Partial("max"), Partial("min")]
    return [Strategy1D((p,), ins) for p in outs]


@functools.cache
def range_block(op):
    """A function making elements [offset, offset + length) of ``op``'s whole range."""
    def block(*args, offset: int, length: int, **kwargs):
        return op(*args, **kwargs)[offset:offset + length]

    block.__name__ = block.__qualname__ = f"{op.__name__.replace('.', '_')}_block"
    return block


def range_local(ctx: LocalCtx) -> LocalCall:
    call, n = ctx.call, ctx.local_out_shape(0)[0]
    holder = all(c == 0 for p, c in zip([p for p in ctx.strategy.outs[0] if isinstance(p, Partial)],
                                         ctx.partial_group_index(0)) if p == SUM)
    if not holder:
        kw = {k: v for k, v in call.kwargs.items() if k in ("layout", "device", "pin_memory")}
        return LocalCall(aten.zeros.default, ([n],), {**kw, "dtype": call.out.dtype})
    if not any(isinstance(p, Shard) for p in ctx.strategy.outs[0]):
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(range_block(call.op), call.args, {**call.kwargs, "offset": ctx.out_offset(0)[0], "length": n})


ROWS = (
    Rule(aten.trace.default, trace_strategies, trace_local, blockwise=False),
    Rule([aten.count_nonzero.default, aten.count_nonzero.dim_IntList], count_nonzero_strategies, blockwise=True),
    Rule(aten.hash_tensor.default, hash_tensor_strategies, blockwise=True),
    Rule(aten.vdot.default, vdot_strategies, blockwise=True),
    Rule(aten.linalg_cross.default, cross_strategies, blockwise=True),
    Rule(aten.dist.default, dist_strategies, dist_local, blockwise=True),
    Rule(aten.renorm.default, renorm_strategies, blockwise=True),
    Rule(RANGES, range_strategies, range_local, blockwise=False),
)
