"""The modelled step: the one time both planners minimise and ``Plan.stats()`` reports.

    t = step_time(prop, cost, bucket_bytes)     # StepTime(comm_s, compute_s); t.total_s

Communication is every collective as the program runs it (paths.edge_times: gradients reduced
in their buckets, a program argument gathered again for backward counted again, one latency
per coalesced FSDP gather call, the collectives an op's local call runs itself); compute is each
node on its busiest rank (flops.node_time: the cost model's roofline of its flops and bytes).
Nothing is overlapped. The ILP's objective (ilp.plan_cost) is this plus tie-breakers far below
any real time; propagation's FSDP-or-sharded choice (fsdp.py) compares two plans by it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .flops import node_time
from .paths import edge_times


@dataclass(frozen=True)
class StepTime:
    comm_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s


def step_time(prop, cost, bucket_bytes) -> StepTime:
    """The modelled step of the Propagation ``prop`` under the cost model ``cost`` (module docstring)."""
    comm = sum(map(sum, edge_times(prop, cost, bucket_bytes)))
    compute = sum(node_time(cost, np_.call, np_.strategy, prop.mesh) for np_ in prop.nodes.values())
    return StepTime(comm, compute)
