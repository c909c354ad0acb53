"""Margin losses over classes: multi_margin_loss and multilabel_margin_loss (forward and backward).

Input ``[N, C]`` (or ``[C]``: one sample). Each sample's loss compares every class score with its
target class(es) and divides by C, so the class dim stays whole: a class shard would need the
target's score from another rank (multi_margin) or the sample's whole target list, which ends at
its first -1 (multilabel). Strategies (one mesh dim):

- the batch dim sharded on input, target (and multilabel's ``is_target`` output): 'none' ->
  output sharded alike; 'sum' -> Partial('sum'); 'mean' -> the local SUM divided by the GLOBAL
  sample count N (the kernels divide by N for 'mean'), never an average of local means.
- the backward: the same batch shard (grad_output follows for 'none', is a replicated scalar
  otherwise; 'mean' as 'sum' over the global N), and linear in grad_output (Partial in and out).
"""
from __future__ import annotations

import torch

from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D
from ..core.layout import Shard

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2
MULTI, MULTI_BWD = aten.multi_margin_loss.default, aten.multi_margin_loss_backward.default
LABEL, LABEL_BWD = aten.multilabel_margin_loss_forward.default, aten.multilabel_margin_loss_backward.default
# op -> (position of the input, position of the reduction arg)
ARGS = {MULTI: (0, 5), MULTI_BWD: (1, 6), LABEL: (0, 2), LABEL_BWD: (1, 3)}


def _reduction(call: OpCall) -> int:
    return call.arg(ARGS[call.op][1], "reduction", MEAN)


def margin_strategies(call: OpCall) -> list[Strategy1D]:
    xi = ARGS[call.op][0]
    x, red, n = call.ins[xi], _reduction(call), len(call.ins)
    out = [replicate_all(call)]
    if x.ndim == 2:  # input, target (and is_target) on the batch; multi_margin's weight [C] whole
        batch = {xi, xi + 1} | ({3} if call.op is LABEL_BWD else set())  # input, target, is_target
        ins = tuple(Shard(0) if i in batch else R for i in range(n))
        if xi == 1:  # backward: grad_output [N] for 'none', a scalar otherwise
            ins = (Shard(0) if red == NONE else R,) + ins[1:]
            outs = (Shard(0),)
        else:
            outs = (Shard(0) if red == NONE else P,) + ((Shard(0),) if call.op is LABEL else ())
        out.append(Strategy1D(outs, ins))
    if xi == 1:
        out.append(Strategy1D((P,), (P,) + (R,) * (n - 1)))  # linear in grad_output
    return out


def batch_local(op, shapes: tuple, dtypes: tuple, n: int | None, red_pos: int, *args):
    """``op`` on this rank's samples: zeros where it has none (the kernels refuse an empty batch);
    with ``n`` ('mean' on a shard) the op runs with 'sum' and divides by the GLOBAL count ``n``."""
    x = args[ARGS[op][0]]
    if x.shape[0] == 0:
        outs = tuple(x.new_zeros(s, dtype=d) for s, d in zip(shapes, dtypes))
        return outs if len(outs) > 1 else outs[0]
    if n is None:
        return op(*args)
    args = args[:red_pos] + (SUM,) + args[red_pos + 1:]
    got = op(*args)
    if op is LABEL:
        return got[0] / n, got[1]
    return got / n


def margin_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    xi, red_pos = ARGS[call.op]
    names = {MULTI: ("self", "target", "p", "margin", "weight", "reduction"),
             MULTI_BWD: ("grad_output", "self", "target", "p", "margin", "weight", "reduction"),
             LABEL: ("self", "target", "reduction"),
             LABEL_BWD: ("grad_output", "self", "target", "reduction", "is_target")}[call.op]
    defaults = {"p": 1, "margin": 1, "reduction": MEAN}
    args = tuple(call.arg(i, name, defaults.get(name)) for i, name in enumerate(names))
    sharded = any(isinstance(p, Shard) for p in ctx.strategy.ins[xi])
    n = call.ins[xi].shape[0] if sharded and _reduction(call) == MEAN else None
    shapes = tuple(tuple(ctx.local_out_shape(i)) for i in range(len(call.outs)))
    dtypes = tuple(o.dtype for o in call.outs)
    return LocalCall(batch_local, (call.op, shapes, dtypes, n, red_pos, *args), {})


ROWS = (Rule(list(ARGS), margin_strategies, margin_local, blockwise=True),)
