"""The modelled step: the one time both planners minimise and ``Plan.stats()`` reports.

    t = step_time(prop, cost, bucket_bytes)     # StepTime; t.total_s, t.compute_s, t.comm_s, t.exposed_comm_s

Compute is each node on its busiest rank (flops.node_time: the cost model's roofline of its flops
and bytes by op class), forward and backward apart. Communication is every collective as the
program runs it (paths.edge_times: gradients reduced in their buckets, a program argument gathered
again for backward counted again, one latency per coalesced FSDP gather call, the collectives an
op's local call runs itself), in three parts by what the program can hide it behind:

- ``overlap_fwd_s``: the coalesced gathers of program arguments (FSDP's parameters) that
  lower/prefetch.py launches one unit ahead, read in forward;
- ``overlap_bwd_s``: those read in backward, and the gradients' reductions the program launches
  as asynchronous buckets (lower/buckets.py) while backward computes;
- ``blocking_s``: everything else (an activation's all_reduce is waited for where it is made).

With ``cost.overlap`` (cluster cost models: CostModel.cluster) a phase's overlappable
communication costs only what its compute does not cover: ``total = compute + blocking +
max(0, overlap_fwd - compute_fwd) + max(0, overlap_bwd - compute_bwd)``; without it (the
default) nothing overlaps and ``total = compute + comm``. The terms add up over nodes and edges,
so a repeated layer's share can be counted once and multiplied (tools/cluster). The ILP's
objective (ilp.plan_cost) is ``total_s`` plus tie-breakers far below any real time, the
``max`` terms linearised with one column each; propagation's FSDP-or-sharded choice (fsdp.py)
compares two plans by it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..core.cost import BUCKETED
from .flops import node_time
from .paths import coalesced_gather, edge_times, edges


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the busiest rank, in additive terms (module docstring)."""

    compute_fwd_s: float = 0.0
    compute_bwd_s: float = 0.0  # backward's own compute, recomputation included
    blocking_s: float = 0.0
    overlap_fwd_s: float = 0.0
    overlap_bwd_s: float = 0.0
    overlap: bool = False
    # the same sums in node and edge order (the parts' sum may differ in the last bit; plans whose
    # times tie exactly must still tie)
    compute_total_s: float | None = None
    comm_total_s: float | None = None

    @property
    def compute_s(self) -> float:
        return self.compute_fwd_s + self.compute_bwd_s if self.compute_total_s is None else self.compute_total_s

    @property
    def comm_s(self) -> float:
        """Every collective's time, hidden or not."""
        return self.blocking_s + self.overlap_fwd_s + self.overlap_bwd_s if self.comm_total_s is None \
            else self.comm_total_s

    @property
    def exposed_comm_s(self) -> float:
        """The communication the step waits for: the blocking part and what compute does not hide."""
        if not self.overlap:
            return self.comm_s
        return (self.blocking_s + max(0.0, self.overlap_fwd_s - self.compute_fwd_s)
                + max(0.0, self.overlap_bwd_s - self.compute_bwd_s))

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    def plus(self, other: "StepTime", times: float = 1.0) -> "StepTime":
        """These terms plus ``times`` x ``other``'s (a repeated layer's share, counted again)."""
        add = {f.name: getattr(self, f.name) + times * getattr(other, f.name) for f in fields(self)
               if f.name not in ("overlap", "compute_total_s", "comm_total_s")}
        return StepTime(**add, overlap=self.overlap)


def edge_phases(prop, bucket_bytes) -> list:
    """Per edge of ``edges(prop)`` (same order): "fwd" or "bwd" where the program overlaps its
    collectives with that phase's compute (module docstring), else "blocking"."""
    nodes = {n.name: n for n in prop.gm.graph.nodes}
    out = []
    for dst, src, steps in edges(prop):
        if dst == "output":  # a graph output's move: a gradient reduced in an async bucket
            async_ = bucket_bytes is not None and all(s.kind in BUCKETED
                                                      for s in steps if s.is_collective)
            out.append("bwd" if async_ else "blocking")
            continue
        consumer = None if dst == src else nodes[dst]
        back = consumer is not None and bool(consumer.meta.get("autograd_backward"))
        prefetched = coalesced_gather(nodes[src], steps, consumer, back, bucket_bytes) is not None
        out.append(("bwd" if back else "fwd") if prefetched else "blocking")
    return out


def step_parts(prop, cost, bucket_bytes, part_of) -> dict:
    """{part: StepTime} of ``prop``'s nodes and edges split by ``part_of(node name)`` (a node's
    part; an edge is its reading node's, a graph output's move its producer's): the terms of
    ``step_time`` apart, summing to them (their ``compute_total_s`` / ``comm_total_s`` left None)."""
    parts: dict = {}
    nodes = {n.name: n for n in prop.gm.graph.nodes}

    def add(part, **terms):
        parts[part] = parts.get(part, StepTime(overlap=bool(getattr(cost, "overlap", False)))).plus(StepTime(**terms))

    for (dst, src, _), phase, times in zip(edges(prop), edge_phases(prop, bucket_bytes),
                                               edge_times(prop, cost, bucket_bytes)):
        t = sum(times)
        key = {"blocking": "blocking_s", "fwd": "overlap_fwd_s", "bwd": "overlap_bwd_s"}[phase]
        add(part_of(src if dst == "output" else dst), **{key: t})
    for name, np_ in prop.nodes.items():
        t = node_time(cost, np_.call, np_.strategy, prop.mesh)
        add(part_of(name), **{"compute_bwd_s" if nodes[name].meta.get("autograd_backward") else "compute_fwd_s": t})
    return parts


def step_time(prop, cost, bucket_bytes, weights: tuple | None = None) -> StepTime:
    """The modelled step of the Propagation ``prop`` under the cost model ``cost`` (module docstring).
    ``weights`` (Planner.objective_weights): (per run of the graph, per graph output's move)
    multipliers when the graph runs several times a step but its outputs are moved once (a
    pipeline's microbatch plan: ``(makespan per microbatch's time, 1 / pipeline ranks)``)."""
    w, w_out = weights or (1.0, 1.0)
    comm = {"blocking": 0.0, "fwd": 0.0, "bwd": 0.0}
    times = edge_times(prop, cost, bucket_bytes)
    if weights is not None:
        times = [[t * (w_out if dst == "output" else w) for t in ts] for (dst, _, _), ts in zip(edges(prop), times)]
    for phase, ts in zip(edge_phases(prop, bucket_bytes), times):
        comm[phase] += sum(ts)
    fwd = bwd = total = 0.0
    nodes = {n.name: n for n in prop.gm.graph.nodes}
    for name, np_ in prop.nodes.items():
        t = node_time(cost, np_.call, np_.strategy, prop.mesh) * w
        total += t
        if nodes[name].meta.get("autograd_backward"):
            bwd += t
        else:
            fwd += t
    return StepTime(fwd, bwd, comm["blocking"], comm["fwd"], comm["bwd"], bool(getattr(cost, "overlap", False)),
                    total, sum(map(sum, times)))
