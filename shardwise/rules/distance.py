"""Pairwise distances: ``_cdist_forward(x1 [*b1, P, M], x2 [*b2, R, M]) -> [*B, P, R]`` (B: b1 and
b2 broadcast, which may differ in length): a batch dim of the output with the inputs that hold it
whole (an input broadcast along it is replicated), P rows of x1 or R rows of x2 (the other
replicated); the feature dim M stays whole (a p-norm is not a sum of parts).
``_cdist_backward(grad, x1, x2, p, cdist) -> grad_x1``: the same dims; over R, and over a batch
dim x1 is broadcast along, grad_x1 is a sum of parts (Partial).

``_pdist_forward(x [N, M], p) -> [N (N - 1) / 2]``: the distances of every pair of rows, in the
condensed upper triangle. Rows stay whole: each output entry needs two rows, and a rank's rows
own no contiguous run of the condensed output. The feature dim M shards only where the p-norm's
parts combine exactly: p = 1 and p = 0 (a sum of |d| or of d != 0: Partial('sum')) and p = inf (a
max: Partial('max')); p = 2 and other p take a root of the sum, which no partial form gives.
``_pdist_backward(grad, x, p, pdist)`` with the global pdist is elementwise in the features for
every p (each feature's gradient is |d|^(p-1) sign(d) / pdist^(p-1) times grad): M shards; it is
linear in grad."""
from __future__ import annotations

import torch

from ..core.layout import Partial, Shard
from .common import P, R, replicate_all
from .pool import local as empty_safe_local  # an empty chunk gives an empty result, not a kernel error
from .registry import OpCall, Rule, Strategy1D

aten = torch.ops.aten


def _batch_dim(x, d: int, batch: tuple):
    """The dim of ``x`` that holds output batch dim ``d`` whole, or None (missing or broadcast)."""
    j = d - (len(batch) - (x.ndim - 2))
    return j if j >= 0 and x.shape[j] == batch[d] else None


def cdist_strategies(call: OpCall) -> list[Strategy1D]:
    x1, x2 = call.ins
    batch = tuple(call.outs[0].shape[:-2])
    out = [replicate_all(call)]
    for d in range(len(batch)):
        j1, j2 = _batch_dim(x1, d, batch), _batch_dim(x2, d, batch)
        out.append(Strategy1D((Shard(d),), (R if j1 is None else Shard(j1), R if j2 is None else Shard(j2))))
    out += [Strategy1D((Shard(len(batch)),), (Shard(x1.ndim - 2), R)),
            Strategy1D((Shard(len(batch) + 1),), (R, Shard(x2.ndim - 2)))]
    return out


def cdist_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """ins: grad, x1, x2, cdist (grad and cdist shaped as the forward's output); out: grad_x1."""
    _, x1, x2, _ = call.ins
    batch = tuple(call.ins[0].shape[:-2])
    out = [replicate_all(call)]
    for d in range(len(batch)):
        j1, j2 = _batch_dim(x1, d, batch), _batch_dim(x2, d, batch)
        x2_p = R if j2 is None else Shard(j2)
        out.append(Strategy1D((P,) if j1 is None else (Shard(j1),),
                              (Shard(d), R if j1 is None else Shard(j1), x2_p, Shard(d))))
    rows, cols = Shard(len(batch)), Shard(len(batch) + 1)
    out += [Strategy1D((Shard(x1.ndim - 2),), (rows, Shard(x1.ndim - 2), R, rows)),
            Strategy1D((P,), (cols, R, Shard(x2.ndim - 2), cols))]
    return out


def pdist_strategies(call: OpCall) -> list[Strategy1D]:
    p = call.arg(1, "p", 2.0)
    out = [replicate_all(call)]
    combine = {0.0: P, 1.0: P, float("inf"): Partial("max")}.get(float(p))
    if combine is not None:
        out.append(Strategy1D((combine,), (Shard(1),)))
    return out


def pdist_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """ins: grad [N (N - 1) / 2], x [N, M], pdist (as grad); out: grad_x."""
    return [replicate_all(call), Strategy1D((Shard(1),), (R, Shard(1), R)), Strategy1D((P,), (P, R, R))]


ROWS = (Rule(aten._cdist_forward.default, cdist_strategies, empty_safe_local, blockwise=False),
        Rule(aten._cdist_backward.default, cdist_backward_strategies, empty_safe_local, blockwise=False),
        Rule(aten._pdist_forward.default, pdist_strategies, empty_safe_local, blockwise=True),
        Rule(aten._pdist_backward.default, pdist_backward_strategies, empty_safe_local, blockwise=True))
