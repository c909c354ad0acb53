"""Reductions: rules as a table of where each op reads its dims and how partials combine.

One mesh dim, input ``x`` reduced over the dims ``red``:
  * a kept dim ``d`` may be sharded: input Shard(d) -> outputs Shard(d') (d' shifts left past
    the reduced dims when keepdim=False);
  * a reduced dim may be sharded when the partial results combine with a Partial op: sum and
    mean -> Partial('sum') (mean = local sum / GLOBAL count, never an average of partials, so
    uneven shards stay exact), amax/amax-like -> Partial('max'/'min');
  * a Partial input passes through when the op commutes with the partial op (sum, mean,
    cumsum with 'sum'; amax/max with 'max'; amin/min with 'min').
Ops whose partial results do not combine with sum/max/min (prod, all/any, std/var,
logsumexp, median/mode/kthvalue, argmax, max.dim's indices) only shard kept dims: a sharded
reduced dim would need a cross-rank step inside the op (global offsets for indices, a global
mean for var, a 'prod'/bool Partial for prod and all/any).
Vector norms combine for ords 1 and 0 (sum) and +-inf (max/min); powsum (sum |x|^p) always
sums. Scans (cumsum, cumprod, cummax, ...) shard every dim but the scanned one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.layout import Partial, R, Shard
from .common import replicate_all
from .registry import KW_ONLY, LocalCall, LocalCtx, OpCall, Rule, Strategy1D
from .softmax import all_but_dim_strategies

aten = torch.ops.aten


@dataclass(frozen=True)
class Reduce:
    """Where an op keeps its reduced dims and keepdim, and which Partial ops it produces/passes."""

    dim: tuple | None = (1, "dim")  # (position, name[, default]) of the dims arg; None: every dim
    keepdim: tuple | None = (2, "keepdim")
    partial: str | None = None  # output Partial op when a reduced dim is sharded
    linear: str | None = None  # Partial op that passes from the input through to the outputs
    empty_all: bool = True  # dim=[] reduces every dim (all/any.dims: reduces none)


ALL = Reduce(dim=None, keepdim=None)
_VAR = {"correction": Reduce(keepdim=(KW_ONLY, "keepdim")), "dim": Reduce(keepdim=(3, "keepdim")), "default": ALL}

REDUCTIONS: dict = {
    aten.sum.default: Reduce(None, None, "sum", "sum"),
    aten.sum.dim_IntList: Reduce(partial="sum", linear="sum"),
    aten.mean.default: Reduce(None, None, "sum", "sum"),
    aten.mean.dim: Reduce(partial="sum", linear="sum"),
    aten.amax.default: Reduce(partial="max", linear="max"),
    aten.amin.default: Reduce(partial="min", linear="min"),
    aten.max.default: Reduce(None, None, "max", "max"),
    aten.min.default: Reduce(None, None, "min", "min"),
    aten.max.dim: Reduce(), aten.min.dim: Reduce(),
    aten.argmax.default: Reduce(), aten.argmin.default: Reduce(),
    aten.prod.default: ALL, aten.prod.dim_int: Reduce(),
    aten.all.default: ALL, aten.all.dim: Reduce(), aten.all.dims: Reduce(empty_all=False),
    aten.any.default: ALL, aten.any.dim: Reduce(), aten.any.dims: Reduce(empty_all=False),
    aten.logsumexp.default: Reduce(),
    aten.nansum.default: Reduce(partial="sum"),  # no pass-through: NaNs in parts do not add up
    aten.linalg__powsum.default: Reduce((2, "dim"), (3, "keepdim"), "sum"),  # sum |x|^ord: additive
    aten.median.default: ALL, aten.nanmedian.default: ALL,
    aten.median.dim: Reduce(), aten.nanmedian.dim: Reduce(),
    aten.mode.default: Reduce((1, "dim", -1)), aten.kthvalue.default: Reduce((2, "dim", -1), (3, "keepdim")),
    **{getattr(getattr(aten, name), ov): spec for name in ("std", "var", "var_mean", "std_mean")
       for ov, spec in _VAR.items()},
}

# aminmax: (min, max) over the kw-only dim (None: every dim); a sharded reduced dim gives each
# output its own Partial, so no single Partial input passes through to both.
AMINMAX = Reduce(dim=(KW_ONLY, "dim"), keepdim=(KW_ONLY, "keepdim"))

# Vector norms: the ords whose per-shard norms combine with a Partial op (ord is arg 1).
NORM_PARTIAL = {1: "sum", 0: "sum", math.inf: "max", -math.inf: "min"}
NORMS = {
    aten.linalg_vector_norm.default: Reduce((2, "dim"), (3, "keepdim")),
    aten.norm.Scalar: ALL,
    aten.norm.ScalarOpt_dim: Reduce((2, "dim"), (3, "keepdim")),
    aten.norm.ScalarOpt_dim_dtype: Reduce((2, "dim"), (3, "keepdim")),
}
# Scans: each slice along ``dim`` on its own; cumsum is also linear.
SCANS = [aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
         aten.cummin.default]


# -- strategies --------------------------------------------------------------------------
def reduced_dims(call: OpCall, spec: Reduce) -> tuple[tuple, bool] | None:
    """(sorted reduced dims, keepdim), or None when the output shape disagrees (be safe)."""
    x = call.ins[0]
    dims = None if spec.dim is None else call.arg(*spec.dim)
    dims = [dims] if isinstance(dims, int) else dims
    keep = bool(call.arg(*spec.keepdim, False)) if spec.keepdim else False
    if x.ndim == 0:
        red = ()
    elif dims is None or (len(dims) == 0 and spec.empty_all):
        red = tuple(range(x.ndim))
    else:
        red = tuple(sorted({d % x.ndim for d in dims}))
    want = [1 if d in red else s for d, s in enumerate(x.shape) if keep or d not in red]
    return (red, keep) if all(o is None or list(o.shape) == want for o in call.outs) else None


def out_dim(d: int, red: tuple, keep: bool) -> int:
    """Output index of kept input dim ``d``."""
    return d if keep else d - sum(r < d for r in red)


def _one(call: OpCall, out, x_placement) -> Strategy1D:
    outs = tuple(None if o is None else out for o in call.outs)
    return Strategy1D(outs, (x_placement,) + (R,) * (len(call.ins) - 1))


def reduce_strategies_for(call: OpCall, spec: Reduce, partial: str | None) -> list[Strategy1D]:
    out = [replicate_all(call)]
    found = reduced_dims(call, spec)
    if found is None:
        return out
    red, keep = found
    for d in range(call.ins[0].ndim):
        if d not in red:
            out.append(_one(call, Shard(out_dim(d, red, keep)), Shard(d)))
        elif partial:
            out.append(_one(call, Partial(partial), Shard(d)))
    if spec.linear:
        out.append(_one(call, Partial(spec.linear), Partial(spec.linear)))
    return out


def reduce_strategies(call: OpCall) -> list[Strategy1D]:
    spec = REDUCTIONS[call.op]
    return reduce_strategies_for(call, spec, spec.partial)


def aminmax_strategies(call: OpCall) -> list[Strategy1D]:
    """Kept dims shard both outputs; a sharded reduced dim gives (Partial('min'), Partial('max'))."""
    out = reduce_strategies_for(call, AMINMAX, None)
    found = reduced_dims(call, AMINMAX)
    for d in found[0] if found else ():
        out.append(Strategy1D((Partial("min"), Partial("max")), (Shard(d),)))
    return out


def _norm_ord(call: OpCall) -> float:
    p = call.arg(1, "ord" if call.op == aten.linalg_vector_norm.default else "p", 2)
    return 2.0 if p is None else float(p)


def norm_strategies(call: OpCall) -> list[Strategy1D]:
    """Kept dims always; a sharded reduced dim where the ord's norms combine (1, 0, +-inf).
    Other ords would need a norm-aware Partial (sum of |x|^p, then the root): see powsum."""
    return reduce_strategies_for(call, NORMS[call.op], NORM_PARTIAL.get(_norm_ord(call)))


def _foreach_op(call: OpCall) -> str | None:
    if call.op == aten._foreach_norm.Scalar:
        return NORM_PARTIAL.get(float(call.arg(1, "ord", 2)))
    return {aten._foreach_powsum.Scalar: "sum", aten._foreach_max.default: "max"}[call.op]


def foreach_strategies(call: OpCall) -> list[Strategy1D]:
    """Each output is a scalar over all dims of one tensor: Shard(d) on every tensor that has
    dim d gives that tensor's result as Partial; the rest stay Replicate."""
    out = [replicate_all(call)]
    op = _foreach_op(call)
    if op is None:
        return out
    for d in range(max((t.ndim for t in call.ins), default=0)):
        has = [t.ndim > d for t in call.ins]
        outs = tuple(Partial(op) if h else R for h in has)
        out.append(Strategy1D(outs, tuple(Shard(d) if h else R for h in has)))
    return out


def scan_strategies(call: OpCall) -> list[Strategy1D]:
    """Shard any dim but the scan dim; cumsum is linear, so Partial('sum') passes through."""
    out = all_but_dim_strategies(call, call.arg(1, "dim"))
    if call.op == aten.cumsum.default:
        out.append(_one(call, Partial("sum"), Partial("sum")))
    return out


# -- local calls -------------------------------------------------------------------------
def _identity(dtype: torch.dtype, op: str):
    """The neutral element of max/min for ``dtype`` (what an empty shard contributes)."""
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _empty_result(x: torch.Tensor, dim: list, keepdim: bool, fill, dtype=None) -> torch.Tensor:
    shape = [1 if d in dim else s for d, s in enumerate(x.shape) if keepdim or d not in dim]
    return torch.full(shape, fill, dtype=dtype or x.dtype, device=x.device)


def mean_as_partial_sum(x: torch.Tensor, dim: list, keepdim: bool, count: int, dtype: torch.dtype):
    """Mean over dims this rank holds only a shard of: local sum / GLOBAL count, a Partial('sum')."""
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    return (torch.sum(x, dim, keepdim, dtype=acc) / count).to(dtype)


def extreme_or_identity(x: torch.Tensor, dim: list, keepdim: bool, op: str):
    """amax / amin (``op`` 'max' / 'min') of a shard; an empty shard gives the identity of ``op``,
    so Partial(op) stays exact."""
    if any(x.shape[d] == 0 for d in dim):
        return _empty_result(x, dim, keepdim, _identity(x.dtype, op))
    return (torch.amax if op == "max" else torch.amin)(x, dim, keepdim)


def vector_norm_or_identity(x: torch.Tensor, ord: float, dim: list, keepdim: bool, dtype=None):
    """+-inf norm of a shard; an empty shard gives 0 (max of |x| >= 0) or inf (min)."""
    if any(x.shape[d] == 0 for d in dim):
        out_dtype = dtype or x.abs().dtype
        return _empty_result(x, dim, keepdim, 0.0 if ord > 0 else math.inf, out_dtype)
    return torch.linalg.vector_norm(x, ord, dim, keepdim, dtype=dtype)


def foreach_norm_or_identity(tensors: list, ord: float, dtype=None):
    """_foreach_norm where empty shards give the identity of their Partial op."""
    return [vector_norm_or_identity(t, ord, list(range(t.ndim)), False, dtype) for t in tensors]


def foreach_max_or_identity(tensors: list):
    """_foreach_max where empty shards give the identity of max."""
    return [extreme_or_identity(t, list(range(t.ndim)), False, "max") for t in tensors]


def _shards_reduced(ctx: LocalCtx, red: tuple) -> bool:
    return any(isinstance(p, Shard) and p.dim in red for p in ctx.strategy.ins[0])


def _x_and_red(ctx: LocalCtx, spec: Reduce):
    red, keep = reduced_dims(ctx.call, spec)
    return ctx.call.ins[0], list(red), keep


def local_mean(ctx: LocalCtx) -> LocalCall:
    call, spec = ctx.call, REDUCTIONS[ctx.call.op]
    x, red, keep = _x_and_red(ctx, spec)
    if not _shards_reduced(ctx, tuple(red)):
        return LocalCall(call.op, call.args, call.kwargs)
    count = math.prod(x.shape[d] for d in red)
    return LocalCall(mean_as_partial_sum, (x, red, keep), {"count": count, "dtype": call.out.dtype})


def local_extreme(ctx: LocalCtx) -> LocalCall:
    call, spec = ctx.call, REDUCTIONS[ctx.call.op]
    x, red, keep = _x_and_red(ctx, spec)
    if not _shards_reduced(ctx, tuple(red)):
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(extreme_or_identity, (x, red, keep, spec.partial), {})


def aminmax_or_identity(x: torch.Tensor, dim: list, keepdim: bool):
    """aminmax of a shard; an empty shard gives (the identity of min, the identity of max)."""
    return extreme_or_identity(x, dim, keepdim, "min"), extreme_or_identity(x, dim, keepdim, "max")


def local_aminmax(ctx: LocalCtx) -> LocalCall:
    x, red, keep = _x_and_red(ctx, AMINMAX)
    if not _shards_reduced(ctx, tuple(red)):
        return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
    return LocalCall(aminmax_or_identity, (x, red, keep), {})


def local_norm(ctx: LocalCtx) -> LocalCall:
    call, ord = ctx.call, _norm_ord(ctx.call)
    x, red, keep = _x_and_red(ctx, NORMS[call.op])
    if math.isfinite(ord) or not _shards_reduced(ctx, tuple(red)):
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(vector_norm_or_identity, (x, ord, red, keep), {"dtype": call.kwargs.get("dtype")})


def local_foreach(ctx: LocalCtx) -> LocalCall:
    """Replace the op only where an inf/max result meets a possibly empty shard."""
    call = ctx.call
    sharded = any(isinstance(p, Shard) for ps in ctx.strategy.ins for p in ps)
    if sharded and call.op == aten._foreach_max.default:
        return LocalCall(foreach_max_or_identity, (call.args[0],), {})
    ord = float(call.arg(1, "ord", 2)) if call.op == aten._foreach_norm.Scalar else 2.0
    if math.isfinite(ord) or not sharded:
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(foreach_norm_or_identity, (call.args[0], ord), {"dtype": call.arg(2, "dtype")})


LOCAL = {
    aten.mean.default: local_mean, aten.mean.dim: local_mean,
    aten.amax.default: local_extreme, aten.amin.default: local_extreme,
    aten.max.default: local_extreme, aten.min.default: local_extreme,
}


FOREACH = [aten._foreach_norm.Scalar, aten._foreach_powsum.Scalar, aten._foreach_max.default]


ROWS = (*(Rule(op, reduce_strategies, LOCAL.get(op), blockwise=True) for op in REDUCTIONS),
        Rule(aten.aminmax.default, aminmax_strategies, local_aminmax, blockwise=True),
        Rule(list(NORMS), norm_strategies, local_norm, blockwise=True),
        Rule(FOREACH, foreach_strategies, local_foreach, blockwise=True),
        Rule(SCANS, scan_strategies, blockwise=True))
