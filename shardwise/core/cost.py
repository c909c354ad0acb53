"""The one cost model: what the planners minimise and what the plan report prints. Below the
pipeline (beside core/collective_kinds.py): search/ and lower/ (paths, redistribute) and rules' ``Rule.comm`` read it.

Communication (alpha-beta, per mesh dim). A collective over a group of ``n`` ranks takes
``latency * rounds + bytes / bandwidth``; ``bytes`` is what each rank sends
(``sent_bytes``: the ring formulas below) and ``rounds`` the ring's latency-bound rounds
(``n - 1``; an all-reduce is a reduce-scatter plus an all-gather, ``2 (n - 1)``; one
``send_recv`` is one round). Local kinds (slices, zero-fills) cost nothing. Bandwidth and
latency may differ per mesh dim, by name: ``CostModel(bandwidth={"tp": 450e9, "dp": 50e9})``.

    Bytes each rank sends and ring rounds per kind: its record in shardwise/core/collective_kinds.py (all_gather,
    reduce_scatter, all_to_all: (n - 1) * the padded chunk; all_reduce: 2 (n - 1) * ceil(numel / n)).

Compute (roofline). A node's time on the busiest rank is
``max(flops / flops_rate, bytes moved / memory_bandwidth)`` (search/flops.py counts both from
the local shapes); ``memory_bandwidth=None`` models flops only. Collectives an op runs
inside its local call (``Rule.comm``: halo exchanges, BatchNorm statistics, ring
attention's send/recvs, nll_loss's total weight) are priced like any other collective:
search/flops.py's ``node_time`` is compute plus those.

Memory. Optimizer state per rank is ``optimizer_state`` times the parameter bytes (AdamW's
two moments: 2.0, the default; SGD with momentum 1.0; plain SGD 0.0).

The API both planners and the report use (stable):

    cost = CostModel(bandwidth=50e9, latency=5e-6, flops=100e12,   # generic: GPU-like
                     memory_bandwidth=None, optimizer_state=2.0)
    cost = CostModel.for_device("cpu")               # parallelize's default: the model's device
    cost = CostModel.preset("h100", slow=("dp",))   # "cpu", "a100", "h100"; slow dims: network
    cost = CostModel.from_profile("profile.json")    # measured by `shardwise calibrate` (core/profile.py)
    cost.efficiency(kind, size) -> share of the peak  # the profile's curve at that kernel size
    cost.collective_time(kind, nbytes, group_size, mesh_dim, mesh) -> s
    CostModel.rounds(kind, group_size) -> latency-bound rounds
    cost.step_time(step, mesh) -> s              # one RedistStep (or Rule.comm step)
    cost.comm_time(steps, mesh) -> s             # several
    cost.bucketed_time(step, mesh, bucket_bytes) -> s   # a gradient's step inside a bucket
    cost.compute_time(flops, nbytes=0) -> s
    cost.op_comm(rule, call, st, mesh) -> [steps]    # Rule.comm's steps, [] when none
    cost.optimizer_bytes(param_bytes) -> bytes
    sent_bytes(kind, group_size, numel, itemsize) -> bytes

Figures (presets; ``CostModel.preset(name, **overrides)`` replaces any of them):
- "cpu": one core of the development machine (Intel Xeon, 2 cores shared by several processes),
  torch 2.13, one thread: fp32 matmul 1024^3 at 78 GFLOP/s, a streaming multiply-by-2 at 4.7 GB/s
  (read + write); the threads backend's all_reduce on 2 ranks (best of three, loaded machine):
  one float in 89 us (2 rounds), 4 MiB in 5.0 ms: latency 50 us, bandwidth 1 GB/s.
- "a100": A100 SXM 80GB datasheet: 312 TFLOP/s bf16 dense (tensor cores), 2.0 TB/s HBM2e;
  NVLink 3 600 GB/s both directions (300 GB/s sent per GPU); slow dims: 200 Gb/s HDR
  InfiniBand per GPU (25 GB/s), latency 5 us (NVLink 2 us).
- "h100": H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3; NVLink 4 900 GB/s
  both directions (450 GB/s per GPU); slow dims: 400 Gb/s NDR InfiniBand (50 GB/s), 5 us
  (NVLink 2 us).
  "a100" and "h100" hold 80 GiB a rank (``device_memory``, PRESET_MEMORY); "cpu" none.
``parallelize`` without ``cost_model`` prices with the preset of the device the model's
parameters live on (``CostModel.for_device``): "cpu" for a CPU model, "a100" / "h100" for a
CUDA device so named, and the generic ``CostModel()`` otherwise (a model on the meta device, an
unnamed GPU): 100 TFLOP/s, 50 GB/s and 5 us on every dim, flops only, at which replicated
compute looks almost free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from . import collective_kinds as kinds
from .errors import ShardingError
from .profile import PRESET_SOURCES  # where each preset's figures came from

BUCKETED = ("all_reduce", "reduce_scatter")  # the kinds lower/buckets.py coalesces

# name -> (flops, memory_bandwidth, fast bandwidth, fast latency, slow bandwidth, slow latency)
PRESETS = {
    "cpu": (78e9, 4.7e9, 1e9, 50e-6, 1e9, 50e-6),
    "a100": (312e12, 2.0e12, 300e9, 2e-6, 25e9, 5e-6),
    "h100": (989e12, 3.35e12, 450e9, 2e-6, 50e9, 5e-6),
}
# a preset's device memory (bytes per rank): what parallelize(memory_budget=None) budgets from
# (less module/options.DEVICE_MEMORY_RESERVE); "cpu" has none (the host's memory is not modelled)
PRESET_MEMORY = {"a100": 80 * 2 ** 30, "h100": 80 * 2 ** 30}


@dataclass(frozen=True)
class Gpu:
    """One accelerator and the links around it, as CostModel.cluster prices a cluster of them
    (figures and their sources: docs/calculator.md). Rates are per GPU; ``link_*``: the
    node's GPU-to-GPU link (bytes each GPU sends per second), ``network_*``: each GPU's own
    link between nodes; efficiencies: achieved shares of the peaks (CostModel's)."""

    name: str
    flops_bf16: float  # dense tensor-core peak, flop/s
    flops_fp32: float  # dense TF32 tensor-core peak (float32 matmuls with TF32 allowed)
    memory_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency: float
    network_bandwidth: float
    network_latency: float
    matmul_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    op_overhead: float


GIB = 2 ** 30
# Hopper's achieved matmul share (was 0.79, as on the A100, until 2026-12-07): set on two published FSDP
# runs, torchtitan's Llama 3.1 8B on 8 H100s and llm-foundry's MPT-7B on 8 H100s (+3.8% and -0.9% with
# it; +18.5% and +16.3% at 0.79), and checked on the held-out runs of tools/cluster/published.py
# (docs/calculator.md, "The published table"). The A100's 0.79 stays (its runs: -1% to +14%)
HOPPER_MATMUL = 0.62
GPUS = {
    "h100": Gpu("H100 SXM5 80GB", 989e12, 494.5e12, 3.35e12, 80 * GIB, 450e9, 2e-6, 50e9, 5e-6,
                HOPPER_MATMUL, 0.35, 0.80, 4e-6),
    # Meta's Grand Teton H100 (torchtitan's published benchmarks): 96 GB HBM2e at 2.4 TB/s, 500 W; its peak
    # lies "between SXM and NVL" (their note): the NVL's dense bf16 figure, the lower end, is taken
    "h100-hbm2e": Gpu("H100 96GB HBM2e 500W", 835e12, 417.5e12, 2.4e12, 96 * GIB, 450e9, 2e-6, 50e9, 5e-6,
                      HOPPER_MATMUL, 0.35, 0.80, 4e-6),
    "h200": Gpu("H200 SXM 141GB", 989e12, 494.5e12, 4.8e12, 141e9, 450e9, 2e-6, 50e9, 5e-6,
                HOPPER_MATMUL, 0.35, 0.80, 4e-6),
    "a100": Gpu("A100 SXM4 80GB", 312e12, 156e12, 2.039e12, 80 * GIB, 300e9, 2e-6, 25e9, 5e-6,
                0.79, 0.50, 0.80, 4e-6),
}


def sent_bytes(kind: str, group_size: int, numel: int, itemsize: int) -> int:
    """Bytes each rank sends for one ``kind`` over ``group_size`` ranks (the table above)."""
    k, n = kinds.kind(kind), int(group_size)
    return k.sent(n, int(numel)) * itemsize if k.communicates and n > 1 else 0


def _gpu(gpu) -> Gpu:
    if isinstance(gpu, Gpu):
        return gpu
    if gpu not in GPUS:
        raise ShardingError(f"unknown GPU {gpu!r}", fix=f"use one of {sorted(GPUS)}, or pass a Gpu(...)")
    return GPUS[gpu]


def _freeze(value):
    """Scalars stay; sequences become tuples; mappings become sorted (name, value) pairs (hashable)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), float(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """Per-mesh-dim link figures, a compute rate and the optimizer's state (module docstring).

    ``bandwidth`` (bytes/s) and ``latency`` (s) are each a number for every mesh dim, a
    sequence indexed by mesh dim, or a dict by mesh-dim name (names it lacks use the
    defaults). ``flops``: flop/s per rank; ``memory_bandwidth``: bytes/s per rank or None
    (compute time from flops alone); ``optimizer_state``: optimizer bytes per parameter byte.
    """

    bandwidth: object = 50e9
    latency: object = 5e-6
    flops: float = 100e12
    memory_bandwidth: float | None = None
    optimizer_state: float = 2.0
    default_bandwidth: float = 50e9  # for mesh dims a by-name ``bandwidth`` does not name
    default_latency: float = 5e-6
    # achieved shares of the peaks by op class (flops.op_class): contractions, attention (None:
    # as contractions), and the memory bandwidth every op reads and writes at; a fixed cost per kernel
    matmul_efficiency: float = 1.0
    attention_efficiency: float | None = None
    memory_efficiency: float = 1.0
    op_overhead: float = 0.0
    # mesh dims whose groups span nodes: {name: ranks of one group inside one node}; their
    # collectives run hierarchically, inside nodes on ``bandwidth``, between them on these
    node_ranks: object = ()
    network_bandwidth: float | None = None
    network_latency: float | None = None
    overlap: bool = False  # price what the program overlaps as overlap (search/steptime.py)
    device_memory: float | None = None  # bytes one rank can hold (a GPU's memory), for ``fits``
    # measured (CostModel.from_profile): efficiency curves by op class, ((kind, ((size, share), ...)), ...),
    # read by ``efficiency`` in place of the scalars; alpha-beta fits per collective kind,
    # ((mesh-dim name or "*", kind, latency per round, bandwidth), ...); where the figures came from
    curves: tuple = ()
    collectives: tuple = ()
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "bandwidth", _freeze(self.bandwidth))
        object.__setattr__(self, "latency", _freeze(self.latency))
        object.__setattr__(self, "node_ranks", tuple(sorted((str(k), int(v)) for k, v in dict(self.node_ranks).items())))
        object.__setattr__(self, "flops", float(self.flops))
        for name in ("memory_bandwidth", "attention_efficiency", "network_bandwidth", "network_latency",
                     "device_memory"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("optimizer_state", "default_bandwidth", "default_latency", "matmul_efficiency",
                     "memory_efficiency", "op_overhead"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "overlap", bool(self.overlap))
        object.__setattr__(self, "curves", tuple((str(k), tuple((float(x), float(y)) for x, y in pts))
                                                 for k, pts in self.curves))
        object.__setattr__(self, "collectives", tuple((str(d), str(k), float(a), float(b))
                                                      for d, k, a, b in self.collectives))
        if any(y <= 0 or y > 1 or x <= 0 for _, pts in self.curves for x, y in pts) or \
                any(not pts for _, pts in self.curves):
            raise ShardingError(f"CostModel.curves hold (size > 0, share in (0, 1]) points, got {self.curves!r}",
                                fix="build it with CostModel.from_profile from what shardwise calibrate wrote")
        positive = ("bandwidth", "flops", "default_bandwidth", "matmul_efficiency", "memory_efficiency")
        positive += tuple(n for n in ("memory_bandwidth", "attention_efficiency", "network_bandwidth", "device_memory")
                          if getattr(self, n) is not None)
        for name in positive:
            if any(v <= 0 for v in self._values(getattr(self, name))):
                raise ShardingError(f"CostModel.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("matmul_efficiency", "memory_efficiency", "attention_efficiency"):
            if getattr(self, name) is not None and getattr(self, name) > 1:
                raise ShardingError(f"CostModel.{name} is a share of the peak, at most 1; got {getattr(self, name)}")
        for name in ("latency", "optimizer_state", "default_latency", "op_overhead"):
            if any(v < 0 for v in self._values(getattr(self, name))):
                raise ShardingError(f"CostModel.{name} must be >= 0, got {getattr(self, name)!r}")
        if any(k < 1 for _, k in self.node_ranks):
            raise ShardingError(f"CostModel.node_ranks needs at least one rank per node, got {dict(self.node_ranks)}")
        if self.node_ranks and self.network_bandwidth is None:
            raise ShardingError("CostModel.node_ranks names mesh dims that span nodes but network_bandwidth is None",
                                fix="give network_bandwidth (bytes/s per rank between nodes), or use "
                                    "CostModel.cluster(gpu, mesh, gpus_per_node)")

    @classmethod
    def preset(cls, name: str, slow=(), **overrides) -> "CostModel":
        """The figures of ``name`` (PRESETS; module docstring); mesh dims named in ``slow``
        get the preset's network link instead of its fast one; ``overrides`` replace fields."""
        if name not in PRESETS:
            raise ShardingError(f"unknown cost preset {name!r}", fix=f"use one of {sorted(PRESETS)}")
        fl, mem, bw, lat, slow_bw, slow_lat = PRESETS[name]
        fields = {"flops": fl, "memory_bandwidth": mem, "bandwidth": bw, "latency": lat,
                  "device_memory": PRESET_MEMORY.get(name), "source": f"preset {name}: {PRESET_SOURCES[name]}"}
        if slow:
            names = [slow] if isinstance(slow, str) else list(slow)
            fields.update(bandwidth={n: slow_bw for n in names}, latency={n: slow_lat for n in names},
                          default_bandwidth=bw, default_latency=lat)
        return cls(**{**fields, **overrides})

    @classmethod
    def from_profile(cls, path, dtype: str = "float32", **overrides) -> "CostModel":
        """The figures ``shardwise calibrate`` measured and wrote to ``path`` (a profile: core/profile.py),
        or a profile dict: efficiency curves by kernel size, a kernel's fixed cost, alpha-beta per
        collective kind and mesh dim; ``dtype``: whose matmul curves (a dtype name); ``overrides``
        replace fields."""
        from . import profile as prof

        data = path if isinstance(path, dict) else prof.read(path)
        fields = prof.cost_fields(data, dtype, where=str(path) if not isinstance(path, dict) else "profile")
        if {"bandwidth", "latency"} & set(overrides) and "collectives" not in overrides:
            fields["collectives"] = ()  # a link figure given overrides the measured fits, not the other way
        return cls(**{**fields, **overrides})

    @classmethod
    def cluster(cls, gpu: str | Gpu, mesh, gpus_per_node: int = 8, compute_dtype=None, **overrides) -> "CostModel":
        """A cluster of ``gpu`` (a GPUS name or a Gpu) with ``gpus_per_node`` GPUs per node, ranks
        numbered node by node, laid out as ``mesh`` (row-major): a mesh dim whose groups stay
        inside a node uses the node's link; one whose groups span nodes (``node_ranks``: how many
        of a group share a node) runs hierarchically over the network too. Achieved rates by op
        class, a kernel's fixed cost, communication overlapped as the program overlaps it, the
        GPU's memory for ``fits``. ``compute_dtype``: float32 matmuls at the TF32 rate, else bf16's."""
        import torch

        g = _gpu(gpu)
        if gpus_per_node < 1 or (mesh.size > gpus_per_node and mesh.size % gpus_per_node):
            raise ShardingError(f"{mesh.size} GPUs cannot fill nodes of {gpus_per_node}",
                                fix="use a GPU count that is a multiple of --gpus-per-node")
        spans = {}
        for m, name in enumerate(mesh.names):
            stride = math.prod(mesh.shape[m + 1:])
            if stride * mesh.shape[m] > gpus_per_node:  # the group leaves the node
                spans[name] = max(1, min(mesh.shape[m], gpus_per_node // stride))
        fields = dict(bandwidth=g.link_bandwidth, latency=g.link_latency, default_bandwidth=g.link_bandwidth,
                      default_latency=g.link_latency,
                      flops=g.flops_fp32 if compute_dtype == torch.float32 else g.flops_bf16,
                      memory_bandwidth=g.memory_bandwidth, matmul_efficiency=g.matmul_efficiency,
                      attention_efficiency=g.attention_efficiency, memory_efficiency=g.memory_efficiency,
                      op_overhead=g.op_overhead, node_ranks=spans, network_bandwidth=g.network_bandwidth,
                      network_latency=g.network_latency, overlap=True, device_memory=g.memory_bytes)
        return cls(**{**fields, **overrides})

    @classmethod
    def for_device(cls, device_type: str, name: str = "") -> "CostModel":
        """The default cost model for a model whose parameters live on ``device_type`` (a
        torch.device's type; ``name``: a CUDA device's name): its preset, else ``CostModel()``."""
        if device_type == "cpu":
            return cls.preset("cpu")
        for preset, marks in (("h100", ("H100", "H200", "H800")), ("a100", ("A100", "A800"))):
            if device_type == "cuda" and any(m in name for m in marks):
                return cls.preset(preset)
        return cls()

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
        return self._pick(self.bandwidth, self.default_bandwidth, mesh_dim, mesh)

    def latency_of(self, mesh_dim=0, mesh=None) -> float:
        return self._pick(self.latency, self.default_latency, mesh_dim, mesh)

    @staticmethod
    def rounds(kind: str, group_size: int) -> int:
        """Latency-bound rounds of ``kind`` over ``group_size`` ranks (ring algorithms)."""
        k, n = kinds.kind(kind), int(group_size)
        return k.rounds(n) if k.communicates and n > 1 else 0

    # -- communication ----------------------------------------------------------------------------
    def collective_time(self, kind: str, nbytes: int, group_size: int, mesh_dim=0, mesh=None) -> float:
        """Seconds for ``kind`` where each rank sends ``nbytes`` over ``mesh_dim`` (index or name);
        hierarchically where the dim's groups span nodes (``node_ranks``: ``hierarchical``)."""
        rounds = self.rounds(kind, group_size)
        if rounds == 0:
            return 0.0
        k = self.ranks_per_node(mesh_dim, mesh)
        if k is not None and k < group_size:
            return self.hierarchical(kind, nbytes, group_size, k, mesh_dim, mesh)
        fit = self._fit(kind, mesh_dim, mesh) if self.collectives else None
        if fit is not None:
            return fit[0] * rounds + nbytes / fit[1]
        return self.latency_of(mesh_dim, mesh) * rounds + nbytes / self.bandwidth_of(mesh_dim, mesh)

    def _fit(self, kind: str, mesh_dim, mesh):
        """(latency per round, bandwidth) measured for ``kind`` on ``mesh_dim`` (by name, else "*"), or None."""
        name = mesh_dim if isinstance(mesh_dim, str) else (mesh.names[mesh_dim] if mesh is not None else None)
        found = {d: (a, b) for d, k, a, b in self.collectives if k == kind}
        return found.get(name, found.get("*"))

    def ranks_per_node(self, mesh_dim=0, mesh=None) -> int | None:
        """Ranks of one group of ``mesh_dim`` inside one node, for a dim whose groups span nodes; None otherwise."""
        if not self.node_ranks:
            return None
        name = mesh_dim if isinstance(mesh_dim, str) else (mesh.names[mesh_dim] if mesh is not None else None)
        return dict(self.node_ranks).get(name)

    def hierarchical(self, kind: str, nbytes: int, n: int, k: int, mesh_dim=0, mesh=None) -> float:
        """A collective over ``n`` ranks, ``k`` per node on ``N = n / k`` nodes, each rank with its
        own network link (rail-aligned NICs): what crosses nodes goes over the network, the rest
        over the node's link. With ``c`` the chunk of the ring formulas (``nbytes = (n - 1) c``, an
        all_reduce twice that): all_gather / reduce_scatter send ``(N - 1) c`` between nodes and
        ``(k - 1) N c`` inside them (inter-node exchange among rail peers, then inside each node),
        an all_reduce twice both; an all_to_all ``(n - k) c`` and ``(k - 1) c``; a send_recv
        crosses nodes. Latency: ``k - 1`` rounds inside, ``N - 1`` between (twice for all_reduce)."""
        nodes = max(1, n // k)
        per = 2 if kind == "all_reduce" else 1
        c = nbytes / (per * (n - 1))
        if kind == "send_recv":
            slow, fast, r_slow, r_fast = nbytes, 0.0, 1, 0
        elif kind == "all_to_all":
            slow, fast, r_slow, r_fast = (n - k) * c, (k - 1) * c, nodes - 1, k - 1
        else:
            slow, fast = per * (nodes - 1) * c, per * (k - 1) * nodes * c
            r_slow, r_fast = per * (nodes - 1), per * (k - 1)
        net_lat = self.network_latency if self.network_latency is not None else self.latency_of(mesh_dim, mesh)
        return (slow / self.network_bandwidth + fast / self.bandwidth_of(mesh_dim, mesh)
                + r_slow * net_lat + r_fast * self.latency_of(mesh_dim, mesh))

    def step_time(self, step, mesh) -> float:
        """Seconds of one redistribution step (``.kind``, ``.bytes``, ``.mesh_dim``) on ``mesh``."""
        m = step.mesh_dim
        return self.collective_time(step.kind, step.bytes, mesh.shape[m], m, mesh)

    def comm_time(self, steps, mesh) -> float:
        return sum(self.step_time(s, mesh) for s in steps)

    def bucketed_time(self, step, mesh, bucket_bytes: int | None) -> float:
        """Seconds of a graph output's step (a gradient) when the program coalesces such steps
        into buckets of ``bucket_bytes`` (lower/buckets.py), one launch per bucket: the
        bandwidth term in full, the latency in proportion to the share of a bucket it fills."""
        t = self.step_time(step, mesh)
        if not bucket_bytes or step.kind not in BUCKETED:
            return t
        m = step.mesh_dim
        latency = self.collective_time(step.kind, 0, mesh.shape[m], m, mesh)
        return t - latency * (1.0 - min(1.0, step.bytes / bucket_bytes))

    @staticmethod
    def op_comm(rule, call, st, mesh) -> list:
        """The collectives ``rule``'s local call runs itself under ``st`` (Rule.comm), or []."""
        fn = getattr(rule, "comm", None)
        return list(fn(call, st, mesh) or ()) if fn is not None else []

    # -- compute and memory -----------------------------------------------------------------------
    def compute_time(self, flops: float, nbytes: float = 0, kind: str = "matmul") -> float:
        """Seconds for one kernel of ``flops`` operations reading and writing ``nbytes`` on one
        rank (roofline at the achieved rates of its op class ``kind``: search/flops.op_class),
        plus ``op_overhead``."""
        t = float(flops) / (self.flops * self.efficiency(kind, flops))
        if self.memory_bandwidth is not None:
            t = max(t, float(nbytes) / (self.memory_bandwidth * self.efficiency("memory", nbytes)))
        return t + self.op_overhead

    def efficiency(self, kind: str, size: float) -> float:
        """The achieved share of the peak for one kernel of op class ``kind`` ("matmul", "attention":
        ``size`` in flops; "memory": in bytes; "other" kernels' flops as matmuls): the measured curve
        at ``size`` where the model has one (from_profile), else the scalar figure."""
        if self.curves and size > 0:
            curves = dict(self.curves)
            curve = curves.get(kind) or (curves.get("matmul") if kind == "attention" else None)
            if curve:
                from .profile import interpolate

                return interpolate(curve, float(size))
        if kind == "memory":
            return self.memory_efficiency
        return self.attention_efficiency if kind == "attention" and self.attention_efficiency else self.matmul_efficiency

    def optimizer_bytes(self, param_bytes: int) -> int:
        """Optimizer state per rank for ``param_bytes`` of local parameters."""
        return int(round(self.optimizer_state * param_bytes))

