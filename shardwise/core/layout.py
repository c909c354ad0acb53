"""Placements and Layout: the one place where local shapes and offsets are computed.

Local extents follow torch.chunk: a dim of size ``s`` split ``n`` ways gives chunks of
``ceil(s / n)``; trailing chunks are smaller or empty. When several mesh dims shard the
same tensor dim, they nest in mesh-dim order (mesh dim 0 splits first).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Mapping, Sequence, Union

import torch

from .errors import ShardingError
from .mesh import Mesh

PARTIAL_OPS = ("sum", "max", "min")


class _Placement(tuple):
    """A placement is an immutable tuple of its fields: Shard(d, unit, groups) is (d, unit, groups),
    Replicate() is (), Partial(op) is (op,). The planners hash and compare tuples of placements
    millions of times as dict keys; a tuple's hash and == run in C, a dataclass's in Python (this
    cut the ILP's worst fuzz programs' planning time by ~15-25%). The hash is the field tuple's, as
    the frozen dataclasses' was, so dict and set orders are what they were. Kinds never compare
    equal to each other (their field tuples differ in length); a placement is unordered and always
    true. ``isinstance(p, tuple)`` is True: code that takes "a placement or a list of them" tests
    for a placement first (``isinstance(x, PLACEMENT_TYPES)``)."""

    __slots__ = ()

    def __bool__(self) -> bool:  # Replicate() is an empty tuple
        return True

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (type(self), tuple(self))

    def __lt__(self, other):
        return NotImplemented

    __le__ = __gt__ = __ge__ = __lt__


class Shard(_Placement):
    """Split tensor dim ``dim`` across the mesh dim (torch.chunk semantics).

    ``unit``: chunk in whole blocks of ``unit`` elements (torch.chunk of ``size // unit``
    blocks). A flatten of a sharded dim with the dims after it yields such a shard: rows of
    a batch of 5 sequences of 8 split 3 + 2 sequences, i.e. 24 + 16 of 40 rows, not 20 + 20.

    ``groups``: the dim is ``groups`` equal parts laid end to end (a fused [q|k|v] projection),
    each split on its own; a rank holds its chunk of every part, in part order. Megatron's
    column-parallel GPT-2 ``c_attn`` is ``Shard(1, groups=3)``: every rank gets whole heads
    of q, k and v. Such a shard is not one contiguous run, so it cannot nest with another
    mesh dim's shard of the same tensor dim.
    """

    __slots__ = ()

    def __new__(cls, dim: int, unit: int = 1, groups: int = 1):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ShardingError(f"Shard(dim) needs an int dim, got {dim!r}", fix="e.g. Shard(0)")
        for name, v in (("unit", unit), ("groups", groups)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ShardingError(f"Shard({name}=...) needs a positive int, got {v!r}")
        return tuple.__new__(cls, (dim, unit, groups))

    dim = property(itemgetter(0), doc="the tensor dim split")
    unit = property(itemgetter(1), doc="whole blocks of this many elements")
    groups = property(itemgetter(2), doc="equal parts, each split on its own")

    def __repr__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)}" for k in ("unit", "groups") if getattr(self, k) != 1)
        return f"Shard({self.dim}{extra})"

    @property
    def block(self) -> tuple[int, int]:
        """(unit, groups): how the chunks are cut; (1, 1) for a plain shard."""
        return self[1], self[2]

    def on(self, dim: int) -> "Shard":
        """The same cut on another tensor dim."""
        return Shard(dim, self[1], self[2])


class Replicate(_Placement):
    """Every rank of the mesh dim holds the whole value."""

    __slots__ = ()

    def __new__(cls):
        return tuple.__new__(cls, ())

    def __repr__(self) -> str:
        return "Replicate()"


class Partial(_Placement):
    """Every rank holds a partial value; the full value is their reduction with ``op``."""

    __slots__ = ()

    def __new__(cls, op: str = "sum"):
        if op not in PARTIAL_OPS:
            raise ShardingError(
                f"unknown Partial op {op!r}; expected one of {PARTIAL_OPS}",
                fix="use Partial('sum'), Partial('max') or Partial('min')",
            )
        return tuple.__new__(cls, (op,))

    op = property(itemgetter(0), doc="the reduction: sum, max or min")

    def __repr__(self) -> str:
        return f"Partial({self.op!r})" if self.op != "sum" else "Partial()"


Placement = Union[Shard, Replicate, Partial]
PlacementSpec = Union[Placement, Sequence[Placement], Mapping[Union[str, int], Placement]]  # normalize_placements'
PLACEMENT_TYPES = (Shard, Replicate, Partial)
R = Replicate()


def chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """(start, length) of chunk ``i`` of ``n`` of a dim of ``size`` (torch.chunk semantics)."""
    c = -(-size // n) if size else 0
    start = min(i * c, size)
    return start, max(0, min(c, size - start))


def normalize_placements(spec: PlacementSpec, mesh: Mesh, ndim: int, what: str = "tensor") -> tuple:
    """Turn a user spec into one validated placement per mesh dim, shard dims normalised: the one
    normaliser of placements (users', rules', the planner's; Layout's without a mesh shares its
    per-placement check, ``_normal``).

    ``spec``: a sequence with one placement per mesh dim, a mapping from mesh-dim name (or
    index) to placement where missing dims are Replicate, or a bare placement on a 1-d mesh.
    A tuple that is already normal is returned as it is (the planner asks thousands of times).
    """
    if (type(spec) is tuple and len(spec) == mesh.ndim
            and all(type(p) in (Replicate, Partial) or (type(p) is Shard and 0 <= p.dim < ndim) for p in spec)):
        return spec
    if isinstance(spec, PLACEMENT_TYPES):
        if mesh.ndim != 1:
            raise ShardingError(
                f"{what}: got a single placement {spec!r} but mesh {mesh.shape} {mesh.names} has "
                f"{mesh.ndim} dims and needs one placement per mesh dim",
                fix=f"give a list of {mesh.ndim} placements, or a dict by mesh-dim name such as "
                f"{{{mesh.names[0]!r}: {spec!r}}}",
            )
        spec = (spec,)
    if isinstance(spec, Mapping):
        out = [R] * mesh.ndim
        for k, p in spec.items():
            try:
                out[mesh.dim_index(k)] = p
            except ShardingError as e:
                raise ShardingError(f"{what}: {e}") from None
        spec = out
    if not isinstance(spec, Sequence) or isinstance(spec, str):
        raise ShardingError(f"{what}: placements must be a list or a dict by mesh-dim name, got {spec!r}")
    spec = tuple(spec)
    if len(spec) != mesh.ndim:
        raise ShardingError(
            f"{what}: got {len(spec)} placement(s) {list(spec)} but mesh {mesh.shape} {mesh.names} has "
            f"{mesh.ndim} dims and expects exactly one placement per mesh dim",
            fix=f"give {mesh.ndim} placements (use Replicate() for mesh dims that do not split it), or a "
            f"dict by mesh-dim name",
        )
    return tuple(_normal(p, ndim, f"{what}: placement {p!r} for mesh dim {mesh.names[m]!r}", f"{what}: ")
                 for m, p in enumerate(spec))


def _normal(p, ndim: int, where: str, prefix: str = ""):
    """One placement checked for a ``ndim``-d tensor, its shard dim made non-negative."""
    if not isinstance(p, PLACEMENT_TYPES):
        raise ShardingError(f"{where} is not Shard/Replicate/Partial",
                            fix="use sw.Shard(dim), sw.Replicate() or sw.Partial()")
    if isinstance(p, Shard):
        if not -ndim <= p.dim < max(ndim, 0) or ndim == 0:
            raise ShardingError(
                f"{prefix}{p!r} is out of range for a {ndim}-d tensor",
                fix=f"use a dim in [{-ndim}, {ndim - 1}]" if ndim else "a 0-d tensor can only be "
                "Replicate() or Partial()",
            )
        if p[0] < 0:
            p = p.on(p[0] % ndim)
    return p


@dataclass(frozen=True)
class Layout:
    """Global shape + dtype + one placement per mesh dim. The global shape is the only shape stored."""

    shape: tuple
    dtype: torch.dtype
    placements: tuple

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, placements: PlacementSpec, mesh: Mesh | None = None):
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ShardingError(f"layout shape {shape} has a negative size")
        if isinstance(placements, PLACEMENT_TYPES):
            placements = (placements,)
        if mesh is not None:
            placements = normalize_placements(placements, mesh, len(shape))
        else:
            placements = tuple(_normal(p, len(shape), f"placement {p!r}", f"shape {shape}: ")
                               for p in placements)
        _check_blocks(shape, placements)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "placements", placements)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_ext"}  # the extents memo stays behind

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"Layout({list(self.shape)}, {dt}, {list(self.placements)})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def with_placements(self, placements: PlacementSpec) -> "Layout":
        return Layout(self.shape, self.dtype, placements)

    def check(self, mesh: Mesh, what: str = "tensor") -> "Layout":
        """Validate against ``mesh`` (one placement per mesh dim, dims in range)."""
        normalize_placements(self.placements, mesh, self.ndim, what)
        return self

    def extents(self, mesh: Mesh, rank: int) -> list[tuple[int, int, int]]:
        """(groups, offset, length) per tensor dim for ``rank``: the single source of local
        extents. The rank holds ``[g * part + offset, + length)`` of every part ``g`` of the
        dim (``part = size // groups``); a dim not split in groups is one part. A tensor dim's
        extent depends only on the rank's coordinates on the mesh dims that shard it, so it is
        worked out once per such coordinates and layout (``_dim_extents``) and looked up."""
        coord = mesh.coord(rank)
        out = []
        for dims, table in self._tables(mesh):
            e = table[()] if not dims else table[(coord[dims[0]],) if len(dims) == 1 else tuple(coord[m] for m in dims)]
            if len(e) == 2:  # (mesh dim, chunk size): a unit that does not divide this rank's chunk
                m, size = e
                raise ShardingError(
                    f"{self}: {self.placements[m]!r} on mesh dim {m} splits a chunk of {size} elements, not a "
                    f"multiple of {self.placements[m].unit}", fix="nest unit shards only inside chunks that are "
                    "whole blocks")
            out.append(e)
        return out

    def _tables(self, mesh: Mesh) -> tuple:
        """``_tables`` of this layout on ``mesh``'s shape, kept on the layout for the last mesh shape."""
        got = self.__dict__.get("_ext")
        if got is None or got[0] != mesh.shape:
            if len(self.placements) != mesh.ndim:
                self.check(mesh)
            got = (mesh.shape, _tables(self.shape, self.placements, mesh.shape))
            object.__setattr__(self, "_ext", got)
        return got[1]

    def local_shapes(self, mesh: Mesh) -> tuple:
        """Every rank's local shape, in rank order (``local_shape`` of each)."""
        return tuple(self.local_shape(mesh, r) for r in range(mesh.size))

    def shard_bounds(self, mesh: Mesh, rank: int) -> list[tuple[int, int]]:
        """(offset, length) per tensor dim for ``rank``; a dim split in groups has no single
        offset, so asking for it is an error (rules that need offsets refuse such shards)."""
        out = []
        for d, (g, off, n) in enumerate(self.extents(mesh, rank)):
            self._one_run(d, g, rank)
            out.append((off, n))
        return out

    def _one_run(self, d: int, groups: int, rank: int) -> None:
        if groups != 1:
            raise ShardingError(f"{self}: dim {d} is split in {groups} groups, so rank {rank}'s part of it is not "
                                "one contiguous run", fix="redistribute it to a plain Shard first")

    def local_shape(self, mesh: Mesh, rank: int) -> tuple[int, ...]:
        return tuple(g * n for g, _, n in self.extents(mesh, rank))

    def local_offset(self, mesh: Mesh, rank: int, dim: int | None = None) -> tuple[int, ...] | int:
        """Where ``rank``'s chunk starts: a tuple over dims, or the int for ``dim`` alone."""
        if dim is None:
            return tuple(o for o, _ in self.shard_bounds(mesh, rank))
        d = dim % self.ndim
        g, off, _ = self.extents(mesh, rank)[d]
        self._one_run(d, g, rank)
        return off

    def local_view(self, tensor: torch.Tensor, mesh: Mesh, rank: int) -> torch.Tensor:
        """``rank``'s chunk of the full ``tensor`` (a view, except for dims split in groups,
        which are copied together; Partial/Replicate dims keep everything)."""
        for d, (g, off, n) in enumerate(self.extents(mesh, rank)):
            if g == 1:
                tensor = tensor.narrow(d, off, n)
            else:
                tensor = tensor.unflatten(d, (g, self.shape[d] // g)).narrow(d + 1, off, n).flatten(d, d + 1)
        return tensor

    def local_numel(self, mesh: Mesh, rank: int) -> int:
        return math.prod(self.local_shape(mesh, rank))

    def max_local_numel(self, mesh: Mesh) -> int:
        """The most elements any rank holds. Each mesh dim shards one tensor dim at most, so the
        dims' extents vary with disjoint coordinates and the largest product is the product of
        each dim's largest extent (``local_numel`` on every rank, without visiting them)."""
        tables = self._tables(mesh)
        if any(len(e) == 2 for _, table in tables for e in table.values()):
            return max(self.local_numel(mesh, r) for r in range(mesh.size))  # raises the rank's error
        return math.prod(max(g * n for g, _, n in table.values()) for _, table in tables)

    def uniform(self, mesh: Mesh) -> bool:
        """True when every rank holds the same local shape (every shard even, as on most meshes)."""
        return all(len({e if len(e) == 2 else (e[0], e[2]) for e in table.values()}) == 1
                   for _, table in self._tables(mesh))

    def canonical(self, mesh: Mesh) -> "Layout":
        """This layout with every unit shard that splits its dim exactly as the shard without unit
        would (the same extents on every rank) spelled as that shard: the one spelling rules
        expect (rules/view.py takes no other), so a unit given where it changes nothing, e.g.
        whole heads on a tensor-parallel size that divides them, plans as the plain shard."""
        out = self
        for m, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.unit > 1:
                plain = out.with_placements(out.placements[:m] + (Shard(p.dim, 1, p.groups),) + out.placements[m + 1:])
                if plain._tables(mesh)[p.dim] == out._tables(mesh)[p.dim]:
                    out = plain
        return out

    def partial_dims(self) -> tuple[int, ...]:
        return tuple(m for m, p in enumerate(self.placements) if isinstance(p, Partial))

    def sharders(self, dim: int) -> tuple[int, ...]:
        """Mesh dims that shard tensor dim ``dim``, in nesting order."""
        return tuple(m for m, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)


_TABLES: dict = {}  # (shape, placements, mesh shape) -> per tensor dim (sharding mesh dims, extents by coordinates)
_TABLES_MAX = 1 << 16


def _tables(shape: tuple, placements: tuple, mesh_shape: tuple) -> tuple:
    """Per tensor dim: (the mesh dims that shard it, in nesting order; {their coordinates:
    (groups, offset, length), or (mesh dim, chunk size) where a unit does not divide the chunk}).
    Made once per layout and mesh shape: the planners ask for local shapes of the same layouts
    on every rank, millions of times on a large mesh."""
    key = (shape, placements, mesh_shape)
    got = _TABLES.get(key)
    if got is None:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        got = _TABLES[key] = tuple(_dim_extents(size, d, placements, mesh_shape) for d, size in enumerate(shape))
    return got


def _dim_extents(size: int, d: int, placements: tuple, mesh_shape: tuple) -> tuple:
    """Tensor dim ``d``'s entry of ``_tables``: torch.chunk semantics, nested in mesh-dim order."""
    dims = tuple(m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)
    table = {}
    for coords in itertools.product(*(range(mesh_shape[m]) for m in dims)):
        ext = (1, 0, size)
        for m, c in zip(dims, coords):
            p, (_, off, n) = placements[m], ext
            n //= p.groups  # nesting under groups is refused at construction
            if n % p.unit:
                ext = (m, n)
                break
            start, length = chunk_bounds(n // p.unit, mesh_shape[m], c)
            ext = (p.groups, off + start * p.unit, length * p.unit)
        table[coords] = ext
    return dims, table


def _check_blocks(shape: tuple, placements: tuple) -> None:
    """Units and groups must divide their dim; a dim split in groups has no other sharder."""
    for m, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        if shape[p.dim] % (p.unit * p.groups):
            raise ShardingError(f"{p!r} needs dim {p.dim} of shape {shape} to be a multiple of "
                                f"{p.unit * p.groups} (unit {p.unit} x groups {p.groups})",
                                fix="use a unit/groups that divides the dim")
        others = [q for k, q in enumerate(placements) if k != m and isinstance(q, Shard) and q.dim == p.dim]
        if p.groups > 1 and others:
            raise ShardingError(f"{p!r} on mesh dim {m} splits dim {p.dim} in groups, which another mesh dim "
                                f"shards too ({list(placements)}); parts in groups cannot nest",
                                fix="shard that tensor dim on one mesh dim only, or drop groups")


def replicated(ndim_mesh: int) -> tuple:
    return (R,) * ndim_mesh
