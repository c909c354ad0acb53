"""Prefetch pass: FSDP's coalesced, prefetched parameter gathers on a per-rank program.

A parameter (or input) sharded on a data dim is all-gathered where it is first needed, one
call per tensor, so each layer waits for its own weights and a step pays one collective's
latency per weight and phase. FSDP2 gathers one flat buffer per ``fully_shard`` unit instead,
the next unit's while the current one computes. Here the all_gathers of program arguments
(available from the start) are grouped into units: all the gathers of the same unit
(trace/provenance.fsdp_unit: the first consumer's indexed block, ``transformer.h.3``; the rest
of the model is one root unit, as FSDP2's root), phase (forward, or gathered again for
backward), mesh dim and dtype, gathered whole where its first member is read (the cost model
prices one call per such group: search/paths.coalesced_gather). Each unit is

- launched as ONE asynchronous all_gather (``start_all_gather``: every member's shard padded
  to the largest member along its dim, side by side in one flat buffer), one unit ahead: the
  first right after the arguments, each next one just before the previous unit's wait, so
  layer i+1's weights move while layer i computes;
- waited for (``wait_gathers``) just before the first read of any member, each member then
  cut out of the gathered [group size, total] buffer (``gathered``).

A single gather whose launch would land where it is read stays the plain call. A gathered
tensor is dropped after its last read as any program value (FSDP's free after use; the copy
for backward is a gather of its own, lower/program.py's move_key). Every rank forms the same
units and launches in the same order (same graph, decided on positions and padded sizes).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..core.calls import pure
from ..core.scope import current
from . import comm

CAST_OF = "sw_cast_of"  # program node meta: the master placeholder this cast copies (lower/program.py)


def program_argument(n) -> fx.Node | None:
    """The program argument ``n`` is: a placeholder, or the cast of a master placeholder the
    program makes first thing (mixed precision: what FSDP gathers); else None."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "placeholder":
        return n
    return n.args[0] if CAST_OF in n.meta else None


def start_all_gather(members: tuple, mesh_dim: int, splits: tuple):
    """Launch one all_gather of ``members`` (this rank's shards; member i split along
    ``splits[i] = (dim, sizes)``), each padded to its largest size, flat side by side."""
    blocks = [_block(x, d, sizes) for x, (d, sizes) in zip(members, splits)]
    flat = members[0].new_empty(sum(math.prod(b) for b in blocks))
    off = 0
    for x, (d, _), block in zip(members, splits, blocks):
        place = flat.narrow(0, off, math.prod(block)).view(block)
        place.narrow(d, 0, x.shape[d]).copy_(x)
        if x.shape[d] < block[d]:
            place.narrow(d, x.shape[d], block[d] - x.shape[d]).zero_()
        off += math.prod(block)
    return current().start_all_gather(flat, mesh_dim)


def wait_gathers(handle) -> torch.Tensor:
    """The gathered [group size, total] buffer of a launched unit (waits for it)."""
    return handle.wait()


@pure
def gathered(got: torch.Tensor, offset: int, block: tuple, dim: int, sizes: tuple) -> torch.Tensor:
    """One member, whole: each rank's padded block of the buffer narrowed to its size along
    ``dim``, joined along ``dim`` (a new contiguous tensor, as comm.all_gather's)."""
    parts = got.narrow(1, offset, math.prod(block)).view(got.shape[0], *block)
    return torch.cat([parts[k].narrow(dim, 0, s) for k, s in enumerate(sizes)], dim=dim)


def gathered_source(n: fx.Node) -> tuple:
    """(the program argument, the launch node) of a ``gathered`` member node."""
    return n.meta["sw_gathered"]


def _block(x: torch.Tensor, dim: int, sizes: tuple) -> tuple:
    return tuple(x.shape[:dim]) + (max(sizes),) + tuple(x.shape[dim + 1:])


# -- the pass ----------------------------------------------------------------------------
def _prefetchable(nodes: list, pos: dict) -> list:
    gathers = [n for n in nodes if n.op == "call_function" and n.target is comm.all_gather and len(n.args) == 4
               and program_argument(n.args[0]) is not None and n.users]
    return sorted(gathers, key=lambda n: min(pos[u] for u in n.users))


def _unit_key(g: fx.Node) -> tuple:
    step = g.meta.get("sw_step")
    return g.meta.get("sw_unit"), g.args[1], step.src.dtype if step is not None else None


def plan_prefetch(graph: fx.Graph) -> list:
    """[(unit's gather nodes, position it launches after, position of its first read)] in
    launch order (see the module docstring)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    floor = max((i for n, i in pos.items() if program_argument(n) is not None), default=-1)
    units: list = []
    by_key: dict = {}  # a unit's gathers of a phase, mesh dim and dtype: ONE call wherever they are read
    for g in _prefetchable(nodes, pos):
        key = _unit_key(g)
        if key[0] is not None and key in by_key:
            by_key[key].append(g)
        else:
            units.append([g])
            if key[0] is not None:
                by_key[key] = units[-1]
    out, prev_first = [], None
    for unit in units:
        first = min(pos[u] for g in unit for u in g.users)
        at = floor if prev_first is None else max(floor, prev_first - 1)
        if len(unit) > 1 or any(nodes[i].op == "call_function" and nodes[i] not in unit for i in range(at + 1, first)):
            out.append((unit, at, first))
            prev_first = first
    return out


def prefetch_program(graph: fx.Graph, mesh, rank: int) -> fx.Graph:
    """``graph`` with the argument all_gathers coalesced per unit and started one unit ahead
    (``mesh`` and ``rank``: this rank's shard shapes, from each gather's planned step): rewritten
    in place, and returned."""
    plan = plan_prefetch(graph)
    if not plan:
        return graph
    nodes = list(graph.nodes)
    launch_after, wait_before = {}, {}
    for i, (unit, at, first) in enumerate(plan):
        launch_after.setdefault(nodes[at], []).append((i, unit))
        wait_before.setdefault(nodes[first], []).append((i, unit))
    handles = {}
    for n in nodes:
        with graph.inserting_before(n):  # (n: never a gather of a unit, erased below)
            for i, unit in wait_before.get(n, ()):
                got = graph.call_function(wait_gathers, (handles[i],))
                got.name = f"gathers{i}_done"
                off = 0
                for g in unit:
                    x, _, dim, sizes = g.args
                    block = list(g.meta["sw_step"].src.local_shape(mesh, rank))
                    block[dim] = max(sizes)
                    member = graph.call_function(gathered, (got, off, tuple(block), dim, sizes))
                    g.replace_all_uses_with(member)  # every read comes from here on
                    graph.erase_node(g)
                    member.name = g.name  # the erased gather's name (a new one would be suffixed)
                    member.meta["sw_gathered"] = (x, handles[i])
                    off += math.prod(block)
        at = n
        for i, unit in launch_after.get(n, ()):
            mesh_dim = unit[0].args[1]
            with graph.inserting_after(at):
                at = handles[i] = graph.call_function(start_all_gather, (tuple(g.args[0] for g in unit), mesh_dim,
                                                                         tuple((g.args[2], g.args[3]) for g in unit)))
            handles[i].name = f"gathers{i}"
    return graph
