"""roll: elements move along the rolled dims, every other dim is sharded alike.

Swin's shifted windows are ``torch.roll(x, shifts=(-s, -s), dims=(1, 2))`` on (batch, H, W, C): batch and
channels stay sharded. A rolled dim's element i comes from i - shift (mod size), so a rank's chunk of it
reads other ranks' chunks: an exchange between neighbours, not a local op. Only a dim whose total shift is
a multiple of its size (the identity) stays sharded, its shift dropped from the local call; any other
rolled dim is whole. Roll moves elements, so Partial(sum/max/min) passes through.
"""
from __future__ import annotations

import torch

from ..core.layout import Partial, R, Shard
from .common import replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten
PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


def _shifts(call: OpCall) -> dict | None:
    """Rolled dim -> total shift modulo its size (a dim may be named twice); None for dims=[] (the flat roll)."""
    x = call.ins[0]
    shifts, dims = list(call.arg(1, "shifts")), list(call.arg(2, "dims", []) or [])
    if not dims:
        return None
    total: dict = {}
    for s, d in zip(shifts, dims, strict=True):
        d %= max(x.ndim, 1)
        total[d] = total.get(d, 0) + s
    return {d: s % x.shape[d] if x.shape[d] else 0 for d, s in total.items()}


def roll_strategies(call: OpCall) -> list[Strategy1D]:
    """Shard any dim not rolled (or rolled by a multiple of its size). dims=[] rolls the flattened tensor:
    an element's new place depends on every dim at once, so nothing can be sharded (Replicate and the
    Partial pass-throughs only)."""
    st = [replicate_all(call)] + [Strategy1D((p,), (p,)) for p in PARTIALS]
    shifts = _shifts(call)
    if shifts is None:
        return st
    return st + [Strategy1D((Shard(k),), (Shard(k),)) for k in range(call.ins[0].ndim) if not shifts.get(k, 0)]


def roll_local(ctx: LocalCtx) -> LocalCall:
    """A sharded dim rolls by a multiple of its size: its shifts are dropped (the identity), the rest kept."""
    c = ctx.call
    x, shifts, dims = c.arg(0, "self"), list(c.arg(1, "shifts")), list(c.arg(2, "dims", []) or [])
    lay = ctx.in_layout(0)
    keep = [(s, d) for s, d in zip(shifts, dims) if not lay.sharders(d % c.ins[0].ndim)]
    if len(keep) == len(dims):
        return LocalCall(c.op, c.args, c.kwargs)
    if not keep:
        return LocalCall(aten.clone.default, (x,), {})
    return LocalCall(c.op, (x, [s for s, _ in keep], [d for _, d in keep]), {})


ROWS = (
    Rule(aten.roll.default, roll_strategies, roll_local, blockwise=True),
)
