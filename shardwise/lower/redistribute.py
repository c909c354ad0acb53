"""Redistribution on one rank: run the steps search/paths.py plans.

``apply_step`` pads uneven chunks to the group's largest chunk before each collective and
narrows after; every size comes from ``Layout``, never from guessing.
"""
from __future__ import annotations

import dataclasses

import torch

from ..core.cost import CostModel
from ..core.errors import ShardingError
from ..core.collective_kinds import RedistStep, kind as kind_of
from ..core.layout import Layout, Shard
from ..core.mesh import Mesh
from ..search.paths import grouped_dims, plan_redistribute
from ..core.scope import current, using
from . import comm as comm_ops

def _members(layout: Layout, mesh: Mesh, group) -> list:
    """Local shapes of every member of ``group`` under ``layout``."""
    return [layout.local_shape(mesh, r) for r in group]


def _open(layout: Layout, opens: tuple) -> Layout:
    """``layout`` with each dim in ``opens`` unflattened into (groups, part): a shard in groups
    becomes a plain shard of the part dim, so the plain collectives apply."""
    g_of = dict(opens)
    shift = lambda e: e + sum(d < e for d, _ in opens)  # noqa: E731
    shape = [x for e, s in enumerate(layout.shape) for x in ((g_of[e], s // g_of[e]) if e in g_of else (s,))]
    pls = [Shard(shift(p.dim) + 1, p.unit) if isinstance(p, Shard) and p.dim in g_of
           else p.on(shift(p.dim)) if isinstance(p, Shard) else p for p in layout.placements]
    return Layout(shape, layout.dtype, pls)


def _opened_dim(dim, opens: tuple):
    if dim is None:
        return None
    return dim + sum(d < dim for d, _ in opens) + (dim in dict(opens))


def step_call(step: RedistStep, mesh: Mesh, rank: int) -> tuple:
    """The per-rank call ``(fn, args)`` of one step, with plain args (lower/comm.py); ``fn(local, *args)``."""
    opens = grouped_dims(step)
    if opens:  # run the plain step on the opened-up tensor (comm.regrouped)
        inner = dataclasses.replace(step, src=_open(step.src, opens), dst=_open(step.dst, opens),
                                    src_dim=_opened_dim(step.src_dim, opens), dst_dim=_opened_dim(step.dst_dim, opens))
        fn, args = step_call(inner, mesh, rank)
        local = step.src.local_shape(mesh, rank)
        return comm_ops.regrouped, (tuple((d, g, local[d] // g) for d, g in opens), fn.__name__, *args)
    k, group = kind_of(step.kind), mesh.group(step.mesh_dim, rank)
    if k.args is None:
        raise ShardingError(f"collective kind {k.name!r} has no program call", fix="give its Kind call= and args=")
    sizes = lambda lay, d: tuple(s[d] for s in _members(lay, mesh, group))  # noqa: E731
    return comm_ops.call_of(k), k.args(step, mesh, rank, sizes)


def _check_shape(local, layout: Layout, mesh: Mesh, rank: int, what: str):
    want = layout.local_shape(mesh, rank)
    if tuple(local.shape) != want:
        raise ShardingError(
            f"rank {rank}: {what} expects a local tensor of shape {list(want)} for {layout} on mesh "
            f"{mesh.shape} {mesh.names}, got shape {list(local.shape)}",
            fix="pass the local shard of this rank (Layout.local_shape gives its shape)",
        )


def apply_step(local: torch.Tensor, step: RedistStep, comm, rank: int, mesh: Mesh | None = None) -> torch.Tensor:
    """Run one step on this rank. ``mesh`` defaults to ``comm.mesh`` (local kinds need no comm)."""
    if mesh is None:
        if comm is None:
            raise ShardingError(f"rank {rank}: apply_step({step!r}) needs a mesh or collectives")
        mesh = comm.mesh
    _check_shape(local, step.src, mesh, rank, repr(step))
    fn, args = step_call(step, mesh, rank)
    if step.is_collective:
        if comm is None:
            raise ShardingError(f"rank {rank}: {step!r} needs collectives but none were given")
        if comm.mesh != mesh:
            raise ShardingError(f"{step!r} is planned for mesh {mesh} but the collectives run on {comm.mesh}")
        with using(comm):
            return fn(local, *args)
    return fn(local, *args)


def redistribute_local(local: torch.Tensor, layout: Layout, dst_placements, mesh: Mesh, comm=None,
                       rank: int | None = None, cost_model: CostModel | None = None) -> torch.Tensor:
    """This rank's part of redistributing ``layout`` to ``dst_placements``.

    ``comm`` defaults to the current collectives (``shardwise.core.scope.current()``)
    and ``rank`` to ``comm.rank``; a plan of local steps only needs neither comm nor backend.
    """
    steps = plan_redistribute(layout, dst_placements, mesh, cost_model)
    if comm is None and (rank is None or any(s.is_collective for s in steps)):
        comm = current()
    rank = comm.rank if rank is None else rank
    for step in steps:
        local = apply_step(local, step, comm, rank, mesh)
    dst = steps[-1].dst if steps else layout
    _check_shape(local, dst, mesh, rank, "redistribution result")
    return local
