"""Losses: nll_loss and nll_loss2d (forward and backward), mse_loss (forward and backward).

Input ``[C]`` / ``[N, C]`` / ``[N, C, H, W]`` (2d), target without the class dim. The
output is ``-weight[t] * input[..., t, ...]`` per element (0 where t == ignore_index),
summed for 'sum', and for 'mean' divided by the total weight ``sum(weight[t])`` over
non-ignored targets. Strategies (one mesh dim):

- a batch dim (N, H, W) sharded on input/target: 'none' -> output sharded alike; 'sum' ->
  output and total weight Partial; 'mean' -> see ``nll_loss_global_mean``.
- the class dim sharded on input (and weight): every rank sees only its classes, targets
  outside them count as ignored (``_local_targets``) -> output Partial (sum over ranks).
- input Partial (the loss is linear in the input; the total weight does not depend on it).

'mean' cannot be a Partial sum divided by a constant known to the rule: the total weight
depends on the targets. The local fn computes the local weighted sum and local total
weight, all-reduces the total weight over the mesh dims that shard the input, and divides:
output Partial('sum') of ``local_sum / global_total_weight``, total weight Replicate. This
is exact for uneven shards and any number of ignored targets per shard (invariant 4), and
the backward receives the global total weight, so its local computation is exact too.

mse_loss: 'none' is pointwise; 'sum'/'mean' shard any dim -> Partial, 'mean' as the local
sum divided by the GLOBAL element count (static), and its backward likewise.
"""
from __future__ import annotations

import math

import torch

from ..core import scope
from .common import P, R, aligned_dim, pointwise_strategies, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D
from ..core.layout import Layout, Shard
from ..core.collective_kinds import RedistStep
from ..core.cost import sent_bytes

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2
FORWARD = [aten.nll_loss_forward.default, aten.nll_loss2d_forward.default]
BACKWARD = [aten.nll_loss_backward.default, aten.nll_loss2d_backward.default]


OFFSETS = "offsets"  # class-sharded: local targets are shifted by the shard's class offset


def _dims(ndim: int):
    """(class dim of the input, [(input dim, target dim) for every batch-like dim])."""
    if ndim <= 1:
        return 0, []
    return 1, [(0, 0)] + [(d, d - 1) for d in range(2, ndim)]


def forward_strategies(call: OpCall) -> list[Strategy1D]:
    x, red = call.ins[0], call.arg(3, "reduction", MEAN)
    has_w = len(call.ins) == 3
    w = (R,) if has_w else ()
    cd, bdims = _dims(x.ndim)
    out = [replicate_all(call)]
    for d, td in bdims:
        o = Shard(td) if red == NONE else P
        tw = P if red == SUM else R  # 'none' gives total weight 0 on every rank; 'mean' all-reduces it
        out.append(Strategy1D((o, tw), (Shard(d), Shard(td)) + w))
    out.append(Strategy1D((P, R if red == MEAN else P), (Shard(cd), R) + ((Shard(0),) if has_w else ()), OFFSETS))
    out.append(Strategy1D((P, R), (P, R) + w))
    if has_w and red != MEAN:  # linear in the weight, and so is the total weight
        out.append(Strategy1D((P, P), (R, R, P)))
    return out


def backward_strategies(call: OpCall) -> list[Strategy1D]:
    # ins: grad_output, self, target, [weight], total_weight
    x, red = call.ins[1], call.arg(4, "reduction", MEAN)
    has_w = len(call.ins) == 5
    w = (R,) if has_w else ()
    cd, bdims = _dims(x.ndim)
    out = [replicate_all(call)]
    for d, td in bdims:
        g = Shard(td) if red == NONE else R
        out.append(Strategy1D((Shard(d),), (g, Shard(d), Shard(td)) + w + (R,)))
    out.append(Strategy1D((Shard(cd),), (R, Shard(cd), R) + ((Shard(0),) if has_w else ()) + (R,), OFFSETS))
    out.append(Strategy1D((P,), (P, R, R) + w + (R,)))  # linear in grad_output
    if has_w:
        out.append(Strategy1D((P,), (R, R, R, P, R)))  # linear in the weight (total weight given)
    return out


def _local_targets(target, ignore_index, class_offset: int, n_classes: int):
    """Targets of the local class range shifted to local ids; all others become ignored (-1)."""
    keep = (target >= class_offset) & (target < class_offset + n_classes) & (target != ignore_index)
    return torch.where(keep, target - class_offset, torch.full_like(target, -1)), -1


def nll_loss_class_shard(op, x, target, weight, reduction, ignore_index, class_offset):
    """nll_loss over the local classes only: other classes' targets contribute 0."""
    target, ignore_index = _local_targets(target, ignore_index, class_offset, x.shape[_dims(x.ndim)[0]])
    return op(x, target, weight, reduction, ignore_index)


def nll_loss_global_mean(op, x, target, weight, ignore_index, class_offset, class_sharded, mesh_dims):
    """'mean' on a shard: local weighted sum / GLOBAL total weight (all-reduced over ``mesh_dims``).

    Returns (Partial('sum') loss, Replicate total weight)."""
    if class_sharded:
        target, ignore_index = _local_targets(target, ignore_index, class_offset, x.shape[_dims(x.ndim)[0]])
    total, total_weight = op(x, target, weight, SUM, ignore_index)
    if total_weight.device.type != "meta":  # shape-only runs (meta tensors) have no collectives
        for m in mesh_dims:
            total_weight = scope.current().all_reduce(total_weight, m, "sum")
    return total / total_weight, total_weight


def nll_loss_backward_class_shard(op, grad, x, target, weight, reduction, ignore_index, total_weight, class_offset):
    """Gradient for the local classes: targets of other classes give zero rows."""
    target, ignore_index = _local_targets(target, ignore_index, class_offset, x.shape[_dims(x.ndim)[0]])
    return op(grad, x, target, weight, reduction, ignore_index, total_weight)


def forward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    x, target, weight = call.args[0], call.args[1], call.arg(2, "weight")
    red, ignore = call.arg(3, "reduction", MEAN), call.arg(4, "ignore_index", -100)
    cd = _dims(x.ndim)[0]
    placements = ctx.strategy.ins[0]
    class_sharded = Shard(cd) in placements
    offset = ctx.in_offset(0, cd)
    if red == MEAN:
        mesh_dims = tuple(m for m, p in enumerate(placements) if isinstance(p, Shard))
        if mesh_dims:
            return LocalCall(nll_loss_global_mean, (call.op, x, target, weight, ignore, offset, class_sharded,
                                                    mesh_dims), {})
    if class_sharded:
        return LocalCall(nll_loss_class_shard, (call.op, x, target, weight, red, ignore, offset), {})
    return LocalCall(call.op, call.args, call.kwargs)


def backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    x = call.args[1]
    cd = _dims(x.ndim)[0]
    if Shard(cd) not in ctx.strategy.ins[1]:
        return LocalCall(call.op, call.args, call.kwargs)
    names = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
    args = [call.arg(i, n) for i, n in enumerate(names)]
    return LocalCall(nll_loss_backward_class_shard, (call.op, *args, ctx.in_offset(1, cd)), {})


# -- mse_loss: (self - target)^2, summed or averaged over the broadcast shape ---------------------
def _aligned(out_shape, d, tensors):
    return tuple(R if (k := aligned_dim(len(out_shape), t.shape, out_shape, d)) is None else Shard(k) for t in tensors)


def _broadcast_shape(call: OpCall, first: int = 0) -> tuple:
    return tuple(torch.broadcast_shapes(*(t.shape for t in call.ins[first:first + 2])))


def mse_strategies(call: OpCall) -> list[Strategy1D]:
    if call.arg(2, "reduction", MEAN) == NONE:
        return pointwise_strategies(call)
    shape = _broadcast_shape(call)
    out = [replicate_all(call)]
    for d in range(len(shape)):  # every element is summed: sharding any dim gives partial sums
        ins = _aligned(shape, d, call.ins)
        if any(isinstance(p, Shard) for p in ins):
            out.append(Strategy1D((P,), ins))
    return out


def mse_backward_strategies(call: OpCall) -> list[Strategy1D]:
    # grad_input = norm * (self - target) * grad_output: linear in grad_output, and in (self - target)
    red, shape = call.arg(3, "reduction", MEAN), call.outs[0].shape
    out = [replicate_all(call)]
    for d in range(len(shape)):
        ins = _aligned(shape, d, call.ins)
        ins = ins if red == NONE else (R,) + ins[1:]
        if any(isinstance(p, Shard) for p in ins):
            out.append(Strategy1D((Shard(d),), ins))
    out += [Strategy1D((P,), (P, R, R)), Strategy1D((P,), (R, P, P))]
    return out


def mse_loss_global_mean(x, target, numel: int):
    """'mean' on a shard: local sum / GLOBAL element count (a Partial('sum') part)."""
    return aten.mse_loss.default(x, target, SUM) / numel


def mse_loss_backward_global_mean(grad, x, target, numel: int):
    """'mean' backward on a shard: the op divides by the local count, so scale by the global one."""
    return aten.mse_loss_backward.default(grad, x, target, SUM) / numel


def _sharded(ctx: LocalCtx, idx) -> bool:
    return any(isinstance(p, Shard) for i in idx for p in ctx.strategy.ins[i])


def mse_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if call.arg(2, "reduction", MEAN) != MEAN or not _sharded(ctx, (0, 1)):
        return LocalCall(call.op, call.args, call.kwargs)
    return LocalCall(mse_loss_global_mean, (call.args[0], call.args[1], math.prod(_broadcast_shape(call))), {})


def mse_backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if call.arg(3, "reduction", MEAN) != MEAN or not _sharded(ctx, (1, 2)):
        return LocalCall(call.op, call.args, call.kwargs)
    numel = math.prod(call.outs[0].shape)
    return LocalCall(mse_loss_backward_global_mean, (*call.args[:3], numel), {})


def nll_comm(call: OpCall, st, mesh) -> list:
    """The all_reduce of the total weight (a scalar) over each mesh dim sharding the input,
    which a sharded 'mean' runs inside its local call (nll_loss_global_mean)."""
    if call.arg(3, "reduction", MEAN) != MEAN:
        return []
    x, n_dims, out = call.ins[0], len(st.ins[0]), []
    for m in (m for m, p in enumerate(st.ins[0]) if isinstance(p, Shard)):
        tw = Layout((), x.dtype, tuple(P if k == m else R for k in range(n_dims)))
        out.append(RedistStep("all_reduce", m, tw, tw.with_placements((R,) * n_dims), op="sum",
                              bytes=sent_bytes("all_reduce", mesh.shape[m], 1, tw.itemsize)))
    return out


ROWS = (Rule(FORWARD, forward_strategies, forward_local, blockwise=True, comm=nll_comm),
        Rule(BACKWARD, backward_strategies, backward_local, blockwise=True),
        Rule(aten.mse_loss.default, mse_strategies, mse_local, blockwise=True),
        Rule(aten.mse_loss_backward.default, mse_backward_strategies, mse_backward_local, blockwise=True))



# -- CTC: aten._ctc_loss (per-sample losses, log_alpha) and its backward, sharded on the batch ------------
# log_probs [T, N, C], padded targets [N, S], lengths [N] (tensors, or int lists in the .default
# overloads): every sample is computed alone, so the batch dim shards everything alike; the mean over
# samples is the graph's own (a partial sum over the global count, invariant 4). Concatenated 1-D
# targets hold no batch dim: replicated. log_alpha is planned at its widest (trace/ctc.py).
CTC_FORWARD = [aten._ctc_loss.default, aten._ctc_loss.Tensor]
CTC_BACKWARD = [aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor]


def _padded_targets(call: OpCall, i: int) -> bool:
    return call.args[i].ndim == 3 and call.args[i + 1].ndim == 2


def ctc_strategies(call: OpCall) -> list[Strategy1D]:
    out = [replicate_all(call)]
    if _padded_targets(call, 0):
        lengths = (Shard(0), Shard(0)) if call.op is aten._ctc_loss.Tensor else ()
        out.append(Strategy1D((Shard(0), Shard(0)), (Shard(1), Shard(0)) + lengths))
    return out


def ctc_backward_strategies(call: OpCall) -> list[Strategy1D]:
    # ins: grad [N], log_probs, targets, (input_lengths, target_lengths), neg_log_likelihood, log_alpha
    out = [replicate_all(call)]
    if _padded_targets(call, 1):
        lengths = (Shard(0), Shard(0)) if call.op is aten._ctc_loss_backward.Tensor else ()
        out.append(Strategy1D((Shard(1),), (Shard(0), Shard(1), Shard(0)) + lengths + (Shard(0), Shard(0))))
    n_rest = len(call.ins) - 1
    out.append(Strategy1D((P,), (P,) + (R,) * n_rest))  # linear in the losses' gradient
    return out


def ctc_loss_fixed(op, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity, width: int):
    """The op, its log_alpha padded to the planned ``width`` (the widest its targets allow; entries
    past a sample's ``2 * target_length + 1`` are never read)."""
    if log_probs.device.type == "meta":  # shape-only runs: the op has no meta kernel (its width is data)
        n = log_probs.shape[1]
        return log_probs.new_empty((n,)), log_probs.new_empty((n, log_probs.shape[0], width))
    losses, alpha = op(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    return losses, torch.nn.functional.pad(alpha, (0, width - alpha.shape[-1]), value=-math.inf)


def _local_lengths(ctx: LocalCtx, lengths, batch_input: int, batch_dim: int):
    """An int-list lengths argument cut to this rank's samples (a tensor one is sliced by the plan)."""
    if isinstance(lengths, torch.Tensor) or not any(isinstance(p, Shard) for p in ctx.strategy.ins[batch_input]):
        return lengths
    start = ctx.in_offset(batch_input, batch_dim)
    return list(lengths)[start:start + ctx.local_in_shape(batch_input)[batch_dim]]


_CTC_NAMES = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "zero_infinity")


def ctc_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    lp, tg, il, tl, blank, zi = (call.arg(i, n, False) for i, n in enumerate(_CTC_NAMES))
    if call.op is aten._ctc_loss.default:
        il, tl = _local_lengths(ctx, il, 0, 1), _local_lengths(ctx, tl, 0, 1)
    return LocalCall(ctc_loss_fixed, (call.op, lp, tg, il, tl, blank, zi, ctx.local_out_shape(1)[-1]), {})


_CTC_BACKWARD_NAMES = ("grad", "log_probs", "targets", "input_lengths", "target_lengths", "neg_log_likelihood",
                       "log_alpha", "blank", "zero_infinity")


def ctc_backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if call.op is aten._ctc_loss_backward.Tensor:
        return LocalCall(call.op, call.args, call.kwargs)
    args = [call.arg(i, n, False) for i, n in enumerate(_CTC_BACKWARD_NAMES)]
    args[3], args[4] = _local_lengths(ctx, args[3], 1, 1), _local_lengths(ctx, args[4], 1, 1)
    return LocalCall(call.op, tuple(args), {})


ROWS += (Rule(CTC_FORWARD, ctc_strategies, ctc_local, blockwise=True),
         Rule(CTC_BACKWARD, ctc_backward_strategies, ctc_backward_local, blockwise=True))
