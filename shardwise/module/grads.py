"""Gradient norms and clipping over a sharded model, equal to one device's.

A parameter's gradient is laid out like the parameter (never Partial: the step's plan
reduces partial sums before it hands a gradient out). A rank counts its shard of a
gradient only if it is the first member (coordinate 0) of every mesh dim that does not
shard it: every element of the full gradient is then counted exactly once, however the
parameter is laid out (replicated, FSDP-style Shard(0), 2-d tensor parallel, uneven).
torch's own ``clip_grad_norm_(pm.parameters())`` cannot know this and counts a replicated
shard once per rank (a norm of 1.99 where one device says 1.41 on two ranks).

The per-rank sums are combined with one all-reduce over the mesh (the torch backend) or
directly (the threads backend holds every rank).
"""
from __future__ import annotations

import math

import torch

from ..core.errors import ShardingError
from ..core.layout import Partial, Shard


def _counts(placements, mesh, rank: int, name: str, held=()) -> bool:
    """Whether ``rank`` counts its shard of this gradient (first member of every non-sharding mesh
    dim, save ``held``: dims on which only some ranks hold it at all, a pipeline stage's)."""
    coord = mesh.coord(rank)
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ShardingError(f"the gradient of {name!r} is laid out as {list(placements)}: a Partial gradient "
                                "cannot be held", fix="report this: the step's plan should reduce it")
        if not isinstance(p, Shard) and coord[m] != 0 and m not in held:
            return False
    return True


def _norm_kind(norm_type) -> tuple[float, str]:
    p = float(norm_type)
    if p == math.inf:
        return p, "max"
    if p == -math.inf:
        return p, "min"
    if not p > 0:  # also NaN
        raise ShardingError(f"norm_type {norm_type!r} is not supported for a sharded gradient norm",
                            fix="use a positive p (2.0 by default) or float('inf')")
    return p, "sum"


def _rank_value(pm, rank: int, p: float, op: str) -> torch.Tensor:
    """This rank's contribution: the sum of |g|^p over the shards it counts (or their max/min)."""
    parts = []
    for name, param in pm.named_local_parameters(rank).items():
        g = param.grad
        if g is None or not param.requires_grad or g.numel() == 0:
            continue
        if op == "sum" and not _counts(pm.specs[name], pm.mesh, rank, name, pm.owner_dims):
            continue  # max/min do not mind counting a replica twice
        n = torch.linalg.vector_norm(g.detach(), p).float()
        parts.append(n if op != "sum" else n ** p)
    if op == "sum":
        return torch.stack(parts).sum() if parts else torch.zeros(())
    if not parts:  # nothing here: the identity of the reduction (norms are >= 0)
        return torch.tensor(0.0 if op == "max" else math.inf)
    red = torch.stack(parts)
    return red.max() if op == "max" else red.min()


def grad_norm(pm, norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of every gradient of the model, as one device computes it."""
    p, op = _norm_kind(norm_type)
    values = {r: _rank_value(pm, r, p, op) for r in pm.shards}
    # the parameters' device on every rank (NCCL reduces on the GPU), even on a rank without gradients
    device = next((q.device for q in pm.parameters()), torch.device("cpu"))
    total = pm.backend.reduce({r: v.to(device) for r, v in values.items()}, op)
    return total ** (1.0 / p) if op == "sum" else total


def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> torch.Tensor:
    """Scale every local gradient shard by ``min(1, max_norm / (total + 1e-6))``, as torch does."""
    total = grad_norm(pm, norm_type)
    if error_if_nonfinite and (torch.isnan(total) or torch.isinf(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    grads = [q.grad for q in pm.parameters() if q.grad is not None]
    if foreach and grads:
        torch._foreach_mul_(grads, coef)
    else:
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total
