"""Layout-level helpers on per-rank values (lists of local tensors in rank order).

``collect`` is the reference reassembly: it is written without the redistribution code so
tests can check one against the other.
"""
from __future__ import annotations

import torch

from ..core.errors import ShardingError
from ..core.layout import Layout, Partial, PlacementSpec, Shard, normalize_placements
from ..lower.redistribute import redistribute_local
from ..search.paths import plan_redistribute
from ..core.mesh import Mesh
from .collectives import reduce_list
from .inputs import global_shape
from .threads import run_threads

__all__ = ["distribute", "collect", "redistribute", "plan_redistribute"]


def distribute(tensor: torch.Tensor, mesh: Mesh, placements: PlacementSpec) -> list[torch.Tensor]:
    """Each rank's local tensor of ``tensor`` under ``placements``.

    Partial('sum'): the rank at group index 0 of every sum mesh dim holds the value, the
    others zeros; Partial('max'/'min'): every rank holds it.
    """
    layout = Layout(tensor.shape, tensor.dtype, placements, mesh)
    sums = [m for m, p in enumerate(layout.placements) if p == Partial("sum")]
    out = []
    for r in range(mesh.size):
        local = layout.local_view(tensor, mesh, r)
        coord = mesh.coord(r)
        out.append(torch.zeros_like(local) if any(coord[m] for m in sums) else local.clone())
    return out


def _check_count(locals_, mesh: Mesh, what: str):
    if len(locals_) != mesh.size:
        raise ShardingError(
            f"{what}: got {len(locals_)} local tensor(s) but mesh {mesh.shape} {mesh.names} has "
            f"{mesh.size} ranks and expects one local tensor per rank",
            fix="pass a list of local tensors in rank order",
        )


def _combine(ts: list, p) -> torch.Tensor:
    if isinstance(p, Shard) and p.groups > 1:  # every member holds its chunk of each part
        d, g = p.dim, p.groups
        return torch.cat([t.unflatten(d, (g, t.shape[d] // g)) for t in ts], dim=d + 1).flatten(d, d + 1)
    if isinstance(p, Shard):
        return torch.cat(ts, dim=p.dim)
    if isinstance(p, Partial):
        return reduce_list(ts, p.op)
    return ts[0]


def collect(locals_: list[torch.Tensor], mesh: Mesh, placements: PlacementSpec) -> torch.Tensor:
    """The full tensor from every rank's local tensor (Partial is reduced with its op).

    Mesh dims are undone innermost (last) first: Shard concatenates in group order,
    Partial reduces, Replicate takes the first member.
    """
    locals_ = list(locals_)
    _check_count(locals_, mesh, "collect")
    placements = normalize_placements(placements, mesh, locals_[0].dim(), "collect")
    parts = {mesh.coord(r): t for r, t in enumerate(locals_)}
    for m in reversed(range(mesh.ndim)):
        groups: dict = {}
        for c in sorted(parts):
            groups.setdefault(c[:m], []).append(parts[c])
        parts = {k: _combine(ts, placements[m]) for k, ts in groups.items()}
    return parts[()]


def redistribute(locals_: list[torch.Tensor], mesh: Mesh, src_placements: PlacementSpec,
                 dst_placements: PlacementSpec) -> list[torch.Tensor]:
    """Every rank's local tensor under ``dst_placements`` (runs on the threads backend)."""
    locals_ = list(locals_)
    _check_count(locals_, mesh, "redistribute")
    src = normalize_placements(src_placements, mesh, locals_[0].dim(), "source placements")
    layout = Layout(global_shape({r: tuple(t.shape) for r, t in enumerate(locals_)}, mesh, src), locals_[0].dtype, src)
    plan_redistribute(layout, dst_placements, mesh)  # validate dst once, before any thread starts
    return run_threads(lambda r: redistribute_local(locals_[r], layout, dst_placements, mesh), mesh)
