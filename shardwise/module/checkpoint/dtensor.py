"""DTensor views of a ParallelModule's shards over a DeviceMesh equal to the shardwise mesh.

A shardwise placement maps one to one onto DTensor's when DTensor's chunking gives every rank
the same piece: Replicate, plain Shard(d) (both chunk as torch.chunk; nested shards split in
mesh-dim order), and a unit shard whose blocks happen to fall on DTensor's chunk bounds. A
shard in groups (a rank holds a piece of every part) has no DTensor form; asking for one
raises a ShardingError naming the parameter (pm.save stores every placement regardless).
"""
from __future__ import annotations

import functools
import weakref

import torch

from ...core.errors import ShardingError
from ...core.layout import Layout, Replicate, Shard
from ...core.mesh import Mesh
from .state import MODEL, OPTIM, full_shapes, layout_of, param_groups, state_kind

_MESHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pm -> its process-group DeviceMesh


@functools.lru_cache(maxsize=256)
def device_mesh(mesh: Mesh, rank: int, device_type: str = "cpu"):
    """A DeviceMesh for ``rank`` without process groups (for one rank of the threads backend)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(mesh.size).reshape(mesh.shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh.names, _init_backend=False, _rank=rank)


def dtensor_placements(layout: Layout, mesh: Mesh, what: str) -> tuple:
    """DTensor placements giving every rank the same piece as ``layout``, or a ShardingError."""
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard) and p.groups > 1:
            raise ShardingError(f"{what}: {p!r} on mesh dim {mesh.names[m]!r} holds a piece of each of {p.groups} "
                                "parts, which no DTensor placement expresses",
                                fix="save it with pm.save / pm.sharded_state_dict() (DCP chunks), or place it "
                                    "without groups")
        if not isinstance(p, (Shard, Replicate)):
            raise ShardingError(f"{what}: {p!r} has no DTensor form here")
        out.append(DShard(p.dim) if isinstance(p, Shard) else DReplicate())
    for rank in range(mesh.size):
        shape, offset = compute_local_shape_and_global_offset(layout.shape, device_mesh(mesh, rank), out)
        ext = layout.extents(mesh, rank)
        if tuple(shape) != tuple(n for _, _, n in ext) or any(
                n and o != off for (_, off, n), o in zip(ext, offset)):
            raise ShardingError(f"{what}: {list(layout.placements)} gives rank {rank} the piece at "
                                f"{[e[1] for e in ext]} of shape {[e[2] for e in ext]}, DTensor's {out} gives "
                                f"{list(offset)} of shape {list(shape)}",
                                fix="save it with pm.save (DCP chunks), or use plain Shard(dim)")
    return tuple(out)


def _dtensor(local: torch.Tensor, layout: Layout, dmesh, placements):
    from torch.distributed.tensor import DTensor

    stride = torch.empty(layout.shape, device="meta").stride()
    return DTensor.from_local(local, dmesh, placements, run_check=False, shape=torch.Size(layout.shape), stride=stride)


def _placements(pm, shapes: dict, name: str, cache: dict, dtype=None):
    lay = layout_of(pm, name, shapes, dtype)
    key = (lay.shape, lay.placements)
    if key not in cache:
        cache[key] = dtensor_placements(lay, pm.mesh, f"parameter {name!r}")
    return lay, cache[key]


def to_dtensors(pm, rank: int | None = None, dmesh=None) -> dict:
    """{state-dict key: DTensor} of ``rank``'s shards (default: the only rank held here)."""
    rank = _rank(pm, rank)
    dmesh = dmesh or device_mesh(pm.mesh, rank, _device(pm, rank))
    shapes, cache, by_name = full_shapes(pm), {}, {}
    for name in dict.fromkeys(pm.aliases.values()):
        lay, pl = _placements(pm, shapes, name, cache)
        by_name[name] = _dtensor(pm.shards[rank][name].detach(), lay, dmesh, pl)
    return {k: by_name[n] for k, n in pm.aliases.items()}


def dtensor_state(pm, optimizer=None) -> dict:
    """{"model": DTensors, "optim": ...} of this process's rank over a DeviceMesh with process groups
    (torch backend; collective the first time: it builds the mesh's groups). dcp.save takes it."""
    if pm.backend.name != "torch":
        raise ShardingError("dtensor_state() needs the torch backend (a DeviceMesh with process groups)",
                            fix="on the threads backend use pm.to_dtensors(rank) for one rank's DTensors")
    rank = _rank(pm, None)
    if pm not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[pm] = init_device_mesh(_device(pm, rank), pm.mesh.shape, mesh_dim_names=pm.mesh.names)
    dmesh = _MESHES[pm]
    out = {MODEL: to_dtensors(pm, rank, dmesh)}
    if optimizer is not None:
        out[OPTIM] = _optim_dtensors(pm, optimizer, rank, dmesh)
    return out


def _optim_dtensors(pm, opt, rank: int, dmesh) -> dict:
    shapes, cache, state = full_shapes(pm), {}, {}
    for name, per_rank in opt.named_state().items():
        entries = per_rank.get(rank) or {}
        out = {}
        for key, v in entries.items():
            kind = state_kind(pm, name, key, {rank: v})
            if kind == "shard":
                lay, pl = _placements(pm, shapes, name, cache, v.dtype)
                v = _dtensor(v.detach(), lay, dmesh, pl)
            out[key] = v  # a scalar stays a plain tensor, as in torch's distributed optimizer state dicts
        if out:
            state[name] = out
    return {"state": state, "param_groups": param_groups(opt)}


def _rank(pm, rank):
    held = sorted(pm.shards)
    if rank is None:
        if len(held) != 1:
            raise ShardingError(f"this process holds ranks {held}; say which rank's DTensors you want",
                                fix="pm.to_dtensors(rank)")
        return held[0]
    if rank not in pm.shards:
        raise ShardingError(f"rank {rank} is not held by this process (it holds {held})")
    return rank


def _device(pm, rank) -> str:
    return next(iter(pm.shards[rank].values())).device.type
