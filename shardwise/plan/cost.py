"""Alpha-beta cost model: time of a collective on one mesh dim, and of local compute.

A collective over a group of ``n`` ranks takes ``latency * steps + bytes / bandwidth``
where ``bytes`` is what each rank sends and ``steps`` is the number of ring rounds
(``n - 1``; an all-reduce is a reduce-scatter plus an all-gather, so ``2 (n - 1)``).
Local kinds (slices, zero-fills) cost nothing here. Links may differ per mesh dim
(e.g. NVLink inside a node for "tp", the network across nodes for "dp").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import ShardingError

RING_KINDS = ("all_gather", "reduce_scatter", "all_to_all")
LOCAL_KINDS = ("slice", "partial_local", "local")


def _freeze(value):
    """Scalars stay; sequences become tuples; mappings become sorted (name, value) pairs (hashable)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), float(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """Per-mesh-dim link figures and a compute rate.

    ``bandwidth`` (bytes/s) and ``latency`` (s) are each a number for every mesh dim, a
    sequence indexed by mesh dim, or a dict by mesh-dim name (names it lacks use the
    defaults). ``flops`` is the compute rate per rank (flop/s), used for node costs.
    """

    bandwidth: object = 50e9
    latency: object = 5e-6
    flops: float = 100e12

    DEFAULT_BANDWIDTH = 50e9
    DEFAULT_LATENCY = 5e-6

    def __post_init__(self):
        object.__setattr__(self, "bandwidth", _freeze(self.bandwidth))
        object.__setattr__(self, "latency", _freeze(self.latency))
        object.__setattr__(self, "flops", float(self.flops))
        for name in ("bandwidth", "flops"):
            vals = self._values(getattr(self, name))
            if any(v <= 0 for v in vals):
                raise ShardingError(f"CostModel.{name} must be positive, got {getattr(self, name)!r}")
        if any(v < 0 for v in self._values(self.latency)):
            raise ShardingError(f"CostModel.latency must be >= 0, got {self.latency!r}")

    @staticmethod
    def _values(v):
        if isinstance(v, float):
            return (v,)
        return tuple(x[1] if isinstance(x, tuple) else x for x in v)

    def _pick(self, value, default, mesh_dim, mesh):
        if isinstance(value, float):
            return value
        if value and isinstance(value[0], tuple):  # by name
            name = mesh_dim if isinstance(mesh_dim, str) else (mesh.names[mesh_dim] if mesh else None)
            if name is None:
                raise ShardingError(
                    f"CostModel figures are given by mesh-dim name {dict(value)} but mesh dim "
                    f"{mesh_dim!r} was asked for without a mesh", fix="pass mesh=... or a mesh-dim name")
            return dict(value).get(name, default)
        idx = mesh.dim_index(mesh_dim) if mesh is not None else mesh_dim
        if not isinstance(idx, int) or not 0 <= idx < len(value):
            raise ShardingError(f"CostModel has figures for {len(value)} mesh dims {value}; mesh dim {mesh_dim!r} "
                                "has none", fix="give one figure per mesh dim, or a dict by mesh-dim name")
        return value[idx]

    def bandwidth_of(self, mesh_dim=0, mesh=None) -> float:
        return self._pick(self.bandwidth, self.DEFAULT_BANDWIDTH, mesh_dim, mesh)

    def latency_of(self, mesh_dim=0, mesh=None) -> float:
        return self._pick(self.latency, self.DEFAULT_LATENCY, mesh_dim, mesh)

    @staticmethod
    def steps(kind: str, group_size: int) -> int:
        """Latency-bound rounds of ``kind`` over ``group_size`` ranks (ring algorithms)."""
        n = int(group_size)
        if kind in LOCAL_KINDS or n <= 1:
            return 0
        if kind in RING_KINDS:
            return n - 1
        if kind == "all_reduce":
            return 2 * (n - 1)
        if kind == "send_recv":
            return 1
        raise ShardingError(f"unknown collective kind {kind!r}",
                            fix=f"use one of {RING_KINDS + ('all_reduce', 'send_recv') + LOCAL_KINDS}")

    def collective_time(self, kind: str, nbytes: int, group_size: int, mesh_dim=0, mesh=None) -> float:
        """Seconds for ``kind`` where each rank sends ``nbytes`` over ``mesh_dim`` (index or name)."""
        steps = self.steps(kind, group_size)
        if steps == 0:
            return 0.0
        return self.latency_of(mesh_dim, mesh) * steps + nbytes / self.bandwidth_of(mesh_dim, mesh)

    def compute_time(self, flops: float) -> float:
        """Seconds for ``flops`` floating-point operations on one rank."""
        return float(flops) / self.flops
