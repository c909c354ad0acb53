"""Per-rank collective calls as they appear in programs: plain args (mesh dim, tensor dim,
member sizes), so a printed program says exactly what moves. Uneven shards are padded to
the group's largest chunk before the collective and narrowed after.

Every result is contiguous. On one device the tensors a step slices (a forward kernel's
saved statistics, say) come out of their kernel contiguous, and some backward kernels read
them as such: ``native_layer_norm_backward`` on CPU reads ``mean``/``rstd`` as contiguous
rows, so a ``narrow`` view of them on a non-leading dim gives wrong gradients. A copy of a
local chunk is cheap next to that; the rule verifier feeds kernels strided views too, to
find kernels that need it for other reasons.

Each runs on the current rank's collectives (``shardwise.core.scope.current()``, set by the runtime).
"""
from __future__ import annotations

import torch

from ..core.calls import pure
from ..core.collective_kinds import KINDS
from ..core.scope import current


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``t`` along ``dim`` to ``size`` (collectives need equal shapes in a group)."""
    if t.shape[dim] == size:
        return t
    out = t.new_zeros(t.shape[:dim] + (size,) + t.shape[dim + 1:])
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def all_gather(x: torch.Tensor, mesh_dim: int, dim: int, sizes: tuple) -> torch.Tensor:
    """Shard(dim) -> Replicate: ``sizes`` are the members' extents along ``dim``."""
    got = current().all_gather(_pad(x, dim, max(sizes)).contiguous(), mesh_dim)
    if len(set(sizes)) == 1:  # even: no padding to drop; one op whatever the group size
        return torch.cat(got.unbind(0), dim=dim)
    return torch.cat([got[k].narrow(dim, 0, s) for k, s in enumerate(sizes)], dim=dim)


def reduce_scatter(x: torch.Tensor, mesh_dim: int, dim: int, sizes: tuple, op: str = "sum") -> torch.Tensor:
    """Partial(op) -> Shard(dim): ``x`` splits into the members' ``sizes`` along ``dim``."""
    comm = current()
    width = max(sizes)
    pieces = torch.stack([_pad(p, dim, width) for p in x.split(list(sizes), dim)])
    return comm.reduce_scatter(pieces, mesh_dim, op).narrow(dim, 0, sizes[comm.group_index(mesh_dim)]).contiguous()


def all_reduce(x: torch.Tensor, mesh_dim: int, op: str = "sum") -> torch.Tensor:
    """Partial(op) -> Replicate."""
    return current().all_reduce(x.contiguous(), mesh_dim, op)


def all_to_all(x: torch.Tensor, mesh_dim: int, src_dim: int, src_sizes: tuple, dst_dim: int,
               dst_sizes: tuple) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim) on one mesh dim: send member k its ``dst_sizes[k]``
    slice along ``dst_dim``; receive member k's ``src_sizes[k]`` rows along ``src_dim``."""
    comm = current()
    wi, wj = max(src_sizes), max(dst_sizes)
    pieces = torch.stack([_pad(_pad(p, src_dim, wi), dst_dim, wj) for p in x.split(list(dst_sizes), dst_dim)])
    got = comm.all_to_all(pieces, mesh_dim)
    mine = dst_sizes[comm.group_index(mesh_dim)]
    if len(set(src_sizes)) == 1 and len(set(dst_sizes)) == 1:  # even: no padding to drop
        return torch.cat(got.unbind(0), dim=src_dim)
    return torch.cat([got[k].narrow(src_dim, 0, s).narrow(dst_dim, 0, mine) for k, s in enumerate(src_sizes)],
                     dim=src_dim)


@pure
def local_slice(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Replicate -> Shard(dim): no communication, this rank's chunk, as a contiguous copy (a
    ``narrow`` view on a non-leading dim breaks kernels that read their input as contiguous)."""
    return x.narrow(dim, start, length).contiguous()


def partial_local(x: torch.Tensor, hold: str) -> torch.Tensor:
    """Replicate -> Partial. ``hold``: "value" (max/min: every member keeps the value), "copy" (sum:
    one member keeps it) or "zeros" (sum: the others). The sum's keeper keeps a copy, not ``x``
    itself: it then holds what the others hold, so all ranks of the group are one rank class
    (search/classes.py) and the plan's figures cost one rank's work. The copy reads the value's
    bytes and writes as many, while the others write as many zeros: one more read on one rank (a
    few microseconds for a block's activation on a GPU), for figures that do not double."""
    if hold == "value":
        return x
    return x.clone() if hold == "copy" else torch.zeros_like(x)


def regrouped(x: torch.Tensor, opens: tuple, kind: str, *args) -> torch.Tensor:
    """Run the plain step ``kind`` (its call's name) with the dims of shards in groups opened up: ``opens`` is
    ((dim, groups, local part length), ...) in ascending dims; each such dim is unflattened
    into (groups, part) for the step and flattened back after."""
    for d, g, n in reversed(opens):
        x = x.unflatten(d, (g, n))
    x = next(f for f in map(call_of, KINDS.values()) if getattr(f, "__name__", None) == kind)(x, *args)
    for d, _, _ in opens:
        x = x.flatten(d, d + 1)
    return x.contiguous()



def call_of(k):
    """The program's call of a kind's record (shardwise/core/collective_kinds.py): a function here, by name, or its own."""
    return globals()[k.call] if isinstance(k.call, str) else k.call
