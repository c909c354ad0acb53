"""Mesh: an n-d array of ranks with named dims, ranks in row-major order."""
from __future__ import annotations

import math
from functools import cached_property
from typing import Sequence

from .errors import ShardingError


class Mesh:
    """``Mesh((2, 2), ("dp", "tp"))``: four ranks; rank = row-major index of the coordinate.
    Frozen and hashable by (shape, names): plans and caches are keyed by it."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __init__(self, shape: int | Sequence[int], names: str | Sequence[str] | None = None):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape:
            raise ShardingError("mesh shape is empty", fix="give at least one mesh dim, e.g. Mesh((2,))")
        for i, s in enumerate(shape):
            if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
                raise ShardingError(f"mesh shape {shape} has size {s!r} at mesh dim {i}; every mesh dim needs a "
                                    "positive int size", fix="use positive sizes, e.g. Mesh((2, 2), ('dp', 'tp'))")
        names = tuple(f"d{i}" for i in range(len(shape))) if names is None else (
            (names,) if isinstance(names, str) else tuple(names))
        if len(names) != len(shape):
            raise ShardingError(f"mesh shape {shape} has {len(shape)} dims but {len(names)} names were given: "
                                f"{names}", fix="give one name per mesh dim")
        if any(not isinstance(n, str) or not n for n in names):
            raise ShardingError(f"mesh dim names must be non-empty strings, got {names}", fix="e.g. ('dp', 'tp')")
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ShardingError(f"mesh dim names {names} repeat {dup}; each mesh dim needs a unique name",
                                fix="rename the duplicates, e.g. ('dp', 'tp')")
        self.__dict__.update(shape=shape, names=names)

    def __setattr__(self, name, value=None):
        raise AttributeError(f"Mesh is frozen (a cache key); build a new Mesh instead of setting {name!r}")

    __delattr__ = __setattr__

    # -- basic facts ---------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and (self.shape, self.names) == (other.shape, other.names)

    def __hash__(self) -> int:
        return hash((self.shape, self.names))

    def __repr__(self) -> str:
        return f"Mesh({self.shape}, {self.names})"

    def dim_index(self, dim: int | str) -> int:
        """Mesh dim by name or index (negative allowed)."""
        if isinstance(dim, str):
            if dim not in self.names:
                raise ShardingError(f"unknown mesh dim name {dim!r}; this mesh has {self.names}",
                                    fix=f"use one of {self.names}")
            return self.names.index(dim)
        if not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise ShardingError(f"mesh dim {dim!r} out of range for a {self.ndim}-d mesh", fix=f"use {self.names}")
        return dim % self.ndim

    # -- rank <-> coordinate ---------------------------------------------------
    def coord(self, rank: int) -> tuple[int, ...]:
        try:
            if rank >= 0:
                return self._coords[rank]
        except IndexError:
            pass
        raise ShardingError(f"rank {rank} out of range for mesh {self.shape}", fix=f"use 0..{self.size - 1}")

    @cached_property
    def _coords(self) -> tuple:
        """Every rank's coordinate, made once (asked for per rank and layout by the planners)."""
        out = []
        for rank in range(self.size):
            c = []
            for s in reversed(self.shape):
                c.append(rank % s)
                rank //= s
            out.append(tuple(reversed(c)))
        return tuple(out)

    def rank(self, coord: Sequence[int]) -> int:
        coord = tuple(coord)
        if len(coord) != self.ndim or any(not 0 <= c < s for c, s in zip(coord, self.shape)):
            raise ShardingError(f"coordinate {coord} is not on mesh {self.shape}", fix="one index < size per dim")
        r = 0
        for c, s in zip(coord, self.shape):
            r = r * s + c
        return r

    def group(self, mesh_dim: int | str, rank: int) -> tuple[int, ...]:
        """Ranks along ``mesh_dim`` that share every other coordinate with ``rank``, in order."""
        m = self.dim_index(mesh_dim)
        c = list(self.coord(rank))
        out = []
        for i in range(self.shape[m]):
            c[m] = i
            out.append(self.rank(c))
        return tuple(out)

    def groups(self, mesh_dim: int | str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``mesh_dim``, ordered by their first rank."""
        return self._groups[self.dim_index(mesh_dim)]

    @cached_property
    def _groups(self):
        out = []
        for m in range(self.ndim):
            seen = {}
            for r in range(self.size):
                g = self.group(m, r)
                seen.setdefault(g, None)
            out.append(tuple(seen))
        return tuple(out)

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.size:
            raise ShardingError(f"mesh {self.shape} has {self.size} ranks but the process group has world size "
                                f"{world_size}", fix=f"launch {self.size} processes (e.g. shardwise run --nproc "
                                f"{self.size}) or use a mesh whose sizes multiply to {world_size}")
