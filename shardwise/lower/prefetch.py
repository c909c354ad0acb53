"""Prefetch pass: FSDP's forward prefetch on a per-rank program.

A parameter (or input) sharded on a data dim is all-gathered where it is first needed, so
each layer waits for its own weights. Here every all_gather of a program argument (available
from the start) is launched asynchronously one gather ahead: the first right after the
arguments, each next one just before the previous gather's result is first read, so layer
i+1's weights move while layer i computes; each result is waited for (``gathered``) just
before its own first read. A gather whose launch would land where it is read stays the plain
call. The gathered tensor is dropped after its last read as any program value.

Every rank forms the same launches in the same order (same graph, decided on positions only).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..scope import current
from . import comm


def start_all_gather(x: torch.Tensor, mesh_dim: int, dim: int, sizes: tuple):
    """Launch comm.all_gather's collective (``x`` padded to the largest member); a handle."""
    return current().start_all_gather(comm._pad(x, dim, max(sizes)).contiguous(), mesh_dim)


def gathered(handle, dim: int, sizes: tuple) -> torch.Tensor:
    """Wait for a started all_gather; the members' pieces, unpadded, joined along ``dim``."""
    got = handle.wait()
    return torch.cat([got[k].narrow(dim, 0, s) for k, s in enumerate(sizes)], dim=dim)


def _prefetchable(nodes: list, pos: dict) -> list:
    gathers = [n for n in nodes if n.op == "call_function" and n.target is comm.all_gather and len(n.args) == 4
               and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and n.users]
    return sorted(gathers, key=lambda n: min(pos[u] for u in n.users))


def plan_prefetch(graph: fx.Graph) -> list:
    """[(gather node, position it launches after, position of its first read)] in launch order."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    floor = max((i for n, i in pos.items() if n.op == "placeholder"), default=-1)
    out, prev_first = [], None
    for g in _prefetchable(nodes, pos):
        first = min(pos[u] for u in g.users)
        at = floor if prev_first is None else max(floor, prev_first - 1)
        if any(nodes[i].op == "call_function" and nodes[i] is not g for i in range(at + 1, first)):
            out.append((g, at, first))
            prev_first = first
    return out


def prefetch_program(graph: fx.Graph) -> fx.Graph:
    """A new graph with the argument all_gathers started one ahead (see the module docstring)."""
    plan = plan_prefetch(graph)
    if not plan:
        return graph
    nodes = list(graph.nodes)
    launch_after, wait_before = {}, {}
    for g, at, first in plan:
        launch_after.setdefault(nodes[at], []).append(g)
        wait_before.setdefault(nodes[first], []).append(g)
    moved = {g for g, _, _ in plan}
    new, env, handles = fx.Graph(), {}, {}
    for n in nodes:
        for g in wait_before.get(n, ()):
            _, _, dim, sizes = g.args
            env[g] = new.call_function(gathered, (handles[g], dim, sizes))
            env[g].name = g.name
        if n not in moved:
            env[n] = new.node_copy(n, lambda a: env[a])
        for g in launch_after.get(n, ()):
            x, mesh_dim, dim, sizes = g.args
            handles[g] = new.call_function(start_all_gather, (env[x], mesh_dim, dim, sizes))
            handles[g].name = f"{g.name}_started"
    return new
