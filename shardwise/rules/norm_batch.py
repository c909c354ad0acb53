"""Batch norm (training and eval) and group norm, forward and backward.

Batch norm normalises each channel (dim 1) over every other dim. Strategies on one mesh dim:

- channels sharded: input and output on dim 1, weight/bias/running and saved statistics on
  dim 0. No communication: each rank owns whole channels.
- a reduced dim sharded (the batch, or a spatial dim), training: the local call sums its
  chunk per channel, all-reduces the sums over the mesh dims that shard reduced dims and
  divides by the GLOBAL count (invariant 4), then all-reduces the centred squares the same
  way: mean and biased variance are one device's, whatever the chunk sizes (SyncBatchNorm
  semantics by construction). Saved statistics, the updated running statistics (unbiased
  variance, count / (count - 1)) and the weight/bias gradients come out Replicate. The
  backward all-reduces sum(grad) and sum(grad * x_hat) once and forms grad_input locally.
- a reduced dim sharded, eval: per-channel affine, so nothing to reduce in the forward; the
  backward's weight/bias gradients are Partial.
- the backward is linear in grad_output: Partial in, Partial out.

Group norm normalises each (sample, group): the batch shards (statistics [N, G] on dim 0),
and channels shard in whole groups (``Shard(1, unit=C/G)``, statistics on dim 1). Its N, C
and group args become local. The statistics' all-reduces are stated to the plan (``comm``).
"""
from __future__ import annotations

import math

import torch

from ..core import scope
from ..core.cost import CostModel, sent_bytes
from ..core.collective_kinds import RedistStep
from ..core.layout import Layout, Partial, Replicate, Shard
from .common import P, R, replicate_all
from .conv import whole_groups
from .pool import empty_safe
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
SYNC = "sync"  # a strategy whose local call all-reduces the statistics

# op -> (training: arg position or a constant, momentum position or None)
BN_FORWARD = {
    aten.native_batch_norm.default: (5, 6),
    aten._native_batch_norm_legit_functional.default: (5, 6),
    aten._native_batch_norm_legit.no_stats: (3, 4),
    aten._native_batch_norm_legit_no_training.default: (False, 5),
    aten._batch_norm_with_update_functional.default: (True, 5),  # outs: + reserve (empty) before the running stats
}
BN_BACKWARD = aten.native_batch_norm_backward.default
# batch_norm_backward: native's args (its save_var is the saved invstd on CPU, 'update' the training flag) + reserve
BN_BACKWARDS = (BN_BACKWARD, aten.batch_norm_backward.default)
GN_FORWARD, GN_BACKWARD = aten.native_group_norm.default, aten.native_group_norm_backward.default


def _training(call: OpCall) -> bool:
    pos = BN_FORWARD[call.op][0] if call.op in BN_FORWARD else 7
    return bool(pos) if isinstance(pos, bool) else bool(call.arg(pos, "training" if call.op in BN_FORWARD else "train"))


def _x_index(call: OpCall) -> int:
    return 1 if call.op in BN_BACKWARDS else 0


def _per_channel(t, channels: int, p):
    """Placement of a per-channel tensor (weight, statistics): ``p``; empty ones (eval's saved
    statistics) stay Replicate."""
    return p if t is not None and t.ndim == 1 and t.shape[0] == channels else R


def bn_strategies(call: OpCall) -> list[Strategy1D]:
    xi = _x_index(call)
    x = call.ins[xi]
    c, train = x.shape[1], _training(call)
    fwd = call.op not in BN_BACKWARDS
    out = [replicate_all(call)]
    # channels
    ins = tuple(Shard(1) if i <= xi else _per_channel(t, c, Shard(0)) for i, t in enumerate(call.ins))
    outs = tuple(None if o is None else (Shard(1) if i == 0 else _per_channel(o, c, Shard(0)))
                 for i, o in enumerate(call.outs))
    out.append(Strategy1D(outs, ins))
    # reduced dims
    for d in [0] + list(range(2, x.ndim)):
        ins = tuple(Shard(d) if i <= xi else R for i in range(len(call.ins)))
        rest = R if (fwd or train) else P
        outs = tuple(None if o is None else (Shard(d) if i == 0 else rest) for i, o in enumerate(call.outs))
        out.append(Strategy1D(outs, ins, SYNC if train else ""))
    if not fwd:
        out.append(Strategy1D(tuple(None if o is None else P for o in call.outs),
                              (P,) + (R,) * (len(call.ins) - 1)))
    return out


def _sync_dims(ctx: LocalCtx) -> tuple:
    return tuple(m for m, t in enumerate(ctx.strategy.tags) if t == SYNC)


def _count(x) -> int:
    return x.shape[0] * math.prod(x.shape[2:])


def _all_reduce(t: torch.Tensor, mesh_dims: tuple) -> torch.Tensor:
    for m in mesh_dims:
        t = scope.current().all_reduce(t.contiguous(), m, "sum")
    return t


def _bcast(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (ndim - 2))


def bn_train_sync(x, weight, bias, running_mean, running_var, momentum, eps, mesh_dims, count, n_outs, dtypes):
    """Training batch norm on a chunk of the reduced dims: exact global statistics by
    all-reduced sums over ``mesh_dims`` divided by the global ``count``."""
    dims = [0] + list(range(2, x.ndim))
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    mean = _all_reduce(xf.sum(dims), mesh_dims) / count
    xc = xf - _bcast(mean, x.ndim)
    var = _all_reduce((xc * xc).sum(dims), mesh_dims) / count
    invstd = torch.rsqrt(var + eps)
    y = xc * _bcast(invstd, x.ndim)
    if weight is not None:
        y = y * _bcast(weight.to(acc), x.ndim)
    if bias is not None:
        y = y + _bcast(bias.to(acc), x.ndim)
    outs = [y, mean, invstd]
    if n_outs >= 5:
        unbiased = var * (count / (count - 1)) if count > 1 else torch.full_like(var, float("nan"))
        outs += [(1 - momentum) * running_mean + momentum * mean.to(running_mean.dtype),
                 (1 - momentum) * running_var + momentum * unbiased.to(running_var.dtype)]
    if n_outs == 6:  # _batch_norm_with_update_functional: an empty reserve before the running stats
        outs.insert(3, x.new_empty((0,), dtype=dtypes[3]))
    return tuple(o.to(d) for o, d in zip(outs, dtypes))


def bn_backward_sync(grad, x, weight, running_mean, running_var, save_mean, save_invstd, mask, mesh_dims, count,
                     dtypes):
    """Training batch-norm backward on a chunk of the reduced dims: sum(grad) and
    sum(grad * x_hat) all-reduced once (stacked), grad_input formed locally (the running
    statistics are unused in training, as in the kernel)."""
    dims = [0] + list(range(2, x.ndim))
    acc = torch.promote_types(x.dtype, torch.float32)
    g = grad.to(acc)
    xhat = (x.to(acc) - _bcast(save_mean.to(acc), x.ndim)) * _bcast(save_invstd.to(acc), x.ndim)
    sums = _all_reduce(torch.stack([g.sum(dims), (g * xhat).sum(dims)]), mesh_dims)
    sg, sgx = sums[0], sums[1]
    gi = gw = gb = None
    if mask[0]:
        scale = save_invstd.to(acc) if weight is None else save_invstd.to(acc) * weight.to(acc)
        gi = _bcast(scale, x.ndim) * (g - _bcast(sg / count, x.ndim) - xhat * _bcast(sgx / count, x.ndim))
        gi = gi.to(dtypes[0])
    if mask[1]:
        gw = sgx.to(dtypes[1])
    if mask[2]:
        gb = sg.to(dtypes[2])
    return gi, gw, gb


def _plain(ctx: LocalCtx) -> LocalCall:
    """The op itself, with empty results where this rank's chunk is empty."""
    call = ctx.call
    shapes = tuple(None if o is None else tuple(ctx.local_out_shape(i)) for i, o in enumerate(call.outs))
    dtypes = tuple(None if o is None else o.dtype for o in call.outs)
    return LocalCall(empty_safe, (call.op, shapes, dtypes, *call.args), dict(call.kwargs))


def bn_forward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    dims = _sync_dims(ctx)
    if not dims:
        return _plain(ctx)
    names = ("input", "weight", "bias", "running_mean", "running_var")
    x, w, b, rm, rv = (call.arg(i, n) for i, n in enumerate(names))
    if call.op is aten._native_batch_norm_legit.no_stats:
        rm = rv = None
    mom_pos = BN_FORWARD[call.op][1]
    momentum = call.arg(mom_pos, "momentum")
    eps = call.arg(mom_pos + 1, "eps")
    dtypes = tuple(o.dtype for o in call.outs)
    return LocalCall(bn_train_sync, (x, w, b, rm, rv, momentum, eps, dims, _count(call.ins[0]),
                                     len(call.outs), dtypes), {})


def bn_backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    dims = _sync_dims(ctx)
    if not dims:
        return _plain(ctx)
    names = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_invstd", "train",
             "eps", "output_mask")
    a = {n: call.arg(i, n) for i, n in enumerate(names)}
    dtypes = tuple(o.dtype if o is not None else None for o in call.outs)
    return LocalCall(bn_backward_sync, (a["grad_out"], a["input"], a["weight"], a["running_mean"], a["running_var"],
                                        a["save_mean"], a["save_invstd"], list(a["output_mask"]), dims,
                                        _count(call.ins[1]), dtypes), {})


def bn_comm(call: OpCall, st, mesh) -> list:
    """The statistics' all-reduces of a sync strategy: two of [C] forward, one of [2, C] backward."""
    c = call.ins[_x_index(call)].shape[1]
    shapes = [(c,), (c,)] if call.op not in BN_BACKWARDS else [(2, c)]
    cost, steps = CostModel(), []
    for m, tag in enumerate(st.tags):
        if tag != SYNC:
            continue
        n = mesh.shape[m]
        for shape in shapes:
            pl = tuple(Partial("sum") if k == m else Replicate() for k in range(mesh.ndim))
            src = Layout(shape, torch.float32, pl)
            nbytes = sent_bytes("all_reduce", n, math.prod(shape), 4)
            steps.append(RedistStep("all_reduce", m, src, src.with_placements((R,) * mesh.ndim), op="sum",
                                    bytes=nbytes, time=cost.collective_time("all_reduce", nbytes, n, m, mesh)))
    return steps


# -- group norm ---------------------------------------------------------------------------------
def gn_strategies(call: OpCall) -> list[Strategy1D]:
    fwd = call.op is GN_FORWARD
    x = call.ins[0 if fwd else 1]
    groups = call.arg(6 if fwd else 8, "group")
    u = x.shape[1] // groups
    cu, gu = Shard(1, unit=u), Shard(0, unit=u)
    out = [replicate_all(call)]
    if fwd:  # ins: x, weight?, bias?; outs: out, mean [N, G], rstd [N, G]
        out.append(Strategy1D((Shard(0),) * 3, (Shard(0),) + (R,) * (len(call.ins) - 1)))
        out.append(Strategy1D((cu, Shard(1), Shard(1)), (cu,) + (gu,) * (len(call.ins) - 1)))
        if u > 1:  # plain channel chunks, where they hold whole groups (gn_valid)
            out.append(Strategy1D((Shard(1),) * 3, (Shard(1),) + (Shard(0),) * (len(call.ins) - 1)))
        return out
    # ins: grad_out, x, mean, rstd, weight?; outs: gi, gw, gb
    per = lambda p, q: tuple(None if o is None else (p if i == 0 else q) for i, o in enumerate(call.outs))  # noqa: E731
    w = (R,) if len(call.ins) == 5 else ()
    out.append(Strategy1D(per(Shard(0), P), (Shard(0),) * 4 + w))
    out.append(Strategy1D(per(cu, gu), (cu, cu, Shard(1), Shard(1)) + ((gu,) if w else ())))
    if u > 1:
        out.append(Strategy1D(per(Shard(1), Shard(0)), (Shard(1),) * 4 + ((Shard(0),) if w else ())))
    out.append(Strategy1D(per(P, P), (P, R, R, R) + w))
    return out


def gn_valid(call: OpCall, st, mesh) -> bool:
    """Plain channel shards must cut whole groups, the same ones in every tensor."""
    fwd = call.op is GN_FORWARD
    x = call.ins[0 if fwd else 1]
    u = x.shape[1] // call.arg(6 if fwd else 8, "group")
    if u == 1:
        return True
    units = ([(1, u)] + [(0, u)] * (len(call.ins) - 1) + [(1, u), (1, 1), (1, 1)] if fwd else
             [(1, u), (1, u), (1, 1), (1, 1)] + [(0, u)] * (len(call.ins) - 4) + [(1, u), (0, u), (0, u)])
    lays = st.in_layouts(call) + st.out_layouts(call)
    tensors = [(lay, d, k) for lay, (d, k) in zip(lays, units)
               if lay is not None and any(isinstance(p, Shard) and p.dim == d for p in lay.placements)]
    if not any(isinstance(p, Shard) and p.unit == 1 and k > 1 and p.dim == d for lay, d, k in tensors
               for p in lay.placements):
        return True
    return whole_groups(tensors, mesh)


def gn_local(ctx: LocalCtx) -> LocalCall:
    """N, C and group become this rank's (arg positions 3-6 forward, 5-8 backward)."""
    call = ctx.call
    fwd = call.op is GN_FORWARD
    xi, base = (0, 3) if fwd else (1, 5)
    groups = call.arg(base + 3, "group")
    n, c = ctx.local_in_shape(xi)[:2]
    args = list(call.args)
    local = {base: n, base + 1: c, base + 3: c // (call.ins[xi].shape[1] // groups)}
    for pos, v in local.items():
        args[pos] = v
    shapes = tuple(None if o is None else tuple(ctx.local_out_shape(i)) for i, o in enumerate(call.outs))
    dtypes = tuple(None if o is None else o.dtype for o in call.outs)
    return LocalCall(group_norm_local, (call.op, shapes, dtypes, *args), dict(call.kwargs))


def group_norm_local(op, shapes: tuple, dtypes: tuple, *args, **kwargs):
    """``op`` with contiguous tensor args (the group-norm CPU kernels refuse (forward) or
    misread (backward) strided ones, such as a local chunk of the channel dim), and empty
    results for an empty chunk."""
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    return empty_safe(op, shapes, dtypes, *args, **kwargs)


# Batch norm is blockwise (channels are independent, and the sync statistics are sums over
# whatever chunks there are), so the planner may restate it for unit shards: InstanceNorm
# runs it on [1, N*C, ...] where a batch shard arrives as Shard(1, unit=C).
ROWS = (Rule(list(BN_FORWARD), bn_strategies, bn_forward_local, comm=bn_comm, blockwise=True),
        Rule(list(BN_BACKWARDS), bn_strategies, bn_backward_local, comm=bn_comm, blockwise=True),
        Rule([GN_FORWARD, GN_BACKWARD], gn_strategies, gn_local, valid=gn_valid, blockwise=False))
