"""The one table of collective kinds: each a frozen record read by core/cost.py (``sent``: elements
each rank sends in a group of ``n``; ``rounds``: ring rounds), lower/redistribute.py (``chunk``: the
padded chunk counted, the source's, the destination's or one all-to-all ``piece``; ``args(step,
mesh, rank, sizes)``: the call's plain args), lower/comm.py (``call``: a function there by name, or
a function) and the backends (``method``: the Collectives method). Adding a collective is one record
(``register``) plus that method on both backends (docs/architecture.md, "Where a change goes");
kinds without ``call`` (``send_recv``) run inside a rule's local call, and ``p2p`` (a pipeline's
stage-to-stage message) inside the pipeline runner: both are only priced here.
``RedistStep``: one step of a kind (search/paths.py plans them, rules' ``Rule.comm`` declares them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import ShardingError
from .layout import Layout
from .units import fmt_bytes


@dataclass(frozen=True)
class Kind:
    name: str
    communicates: bool
    sent: Callable = lambda n, numel: 0
    rounds: Callable = lambda n: 0
    chunk: str | None = None
    call: object = None
    args: Callable | None = None
    method: str | None = None


def _slice_args(step, mesh, rank, sizes):
    d = step.dst_dim  # never a dim in groups here (lower/redistribute.step_call opens those)
    off = step.dst.extents(mesh, rank)[d][1] - step.src.extents(mesh, rank)[d][1]
    return d, off, step.dst.local_shape(mesh, rank)[d]


_RING = (lambda n, e: (n - 1) * e, lambda n: n - 1)  # sent, rounds: each member's chunk to the n - 1 others


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("all_gather", True, *_RING, "src", "all_gather", method="all_gather",
         args=lambda st, mesh, rank, sizes: (st.mesh_dim, st.src_dim, sizes(st.src, st.src_dim))),
    Kind("reduce_scatter", True, *_RING, "dst", "reduce_scatter", method="reduce_scatter",
         args=lambda st, mesh, rank, sizes: (st.mesh_dim, st.dst_dim, sizes(st.dst, st.dst_dim), st.op)),
    Kind("all_reduce", True, lambda n, e: 2 * (n - 1) * -(-e // n), lambda n: 2 * (n - 1), "src", "all_reduce",
         args=lambda st, mesh, rank, sizes: (st.mesh_dim, st.op), method="all_reduce"),
    Kind("all_to_all", True, *_RING, "piece", "all_to_all", method="all_to_all",
         args=lambda st, mesh, rank, sizes: (st.mesh_dim, st.src_dim, sizes(st.src, st.src_dim), st.dst_dim,
                                              sizes(st.dst, st.dst_dim))),
    Kind("send_recv", True, lambda n, e: e, lambda n: 1, method="send_recv"),
    # a pipeline's point-to-point message between two stages (run/pipeline.py): one round
    Kind("p2p", True, lambda n, e: e, lambda n: 1, method="send"),
    Kind("slice", False, call="local_slice", args=_slice_args),
    # sum: one member keeps (a copy of) the value so the group's sum is it; max/min: everyone keeps it
    Kind("partial_local", False, call="partial_local",
         args=lambda st, mesh, rank, sizes: ("value" if st.op != "sum" else
                                              "copy" if mesh.coord(rank)[st.mesh_dim] == 0 else "zeros",)),
    Kind("local", False),
)}


def register(kind: Kind) -> Kind:
    """Add ``kind`` to the table (a name already there is replaced: tests register toy kinds)."""
    KINDS[kind.name] = kind
    return kind


def kind(name: str) -> Kind:
    """The record of ``name``; an unknown kind raises with the known ones."""
    k = KINDS.get(name)
    if k is None:
        raise ShardingError(f"unknown collective kind {name!r}", fix=f"use one of {tuple(KINDS)} or register a Kind")
    return k


@dataclass(frozen=True)
class RedistStep:
    """One change of one mesh dim's placement. ``bytes``: sent by each rank (largest group)."""

    kind: str
    mesh_dim: int
    src: Layout
    dst: Layout
    src_dim: int | None = None
    dst_dim: int | None = None
    op: str | None = None
    bytes: int = 0
    time: float = 0.0

    @property
    def is_collective(self) -> bool:
        return kind(self.kind).communicates

    def __repr__(self) -> str:
        m = self.mesh_dim
        what = f"{self.src.placements[m]!r}->{self.dst.placements[m]!r}"
        size = f"{fmt_bytes(self.bytes)}/rank" if self.is_collective else "local"
        return f"{self.kind}(mesh_dim={m}, {what}, {size})"
