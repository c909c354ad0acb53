"""What a process group measures of its links: each collective's time at a few message sizes, on
each mesh dim's groups (or the whole group), fitted to the cost model's alpha-beta form.

Every rank of the world runs every measurement (gloo groups are made by every rank, ``new_group``);
a timing is the slowest rank's median over repeats, each repeat started together (a barrier).
``fit`` solves ``t = latency * rounds(n) + sent / bandwidth`` by least squares over the sizes,
(robustly: links.fit), with ``sent`` the bytes each rank sends by core/collective_kinds.py's ring formulas: the cost
model prices a collective by the same terms (core/cost.py ``collective_time``).
"""
from __future__ import annotations

import statistics
import time

import torch

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
NUMELS = (1, 1024, 65536, 1 << 20)  # float32 elements per rank's tensor
QUICK_NUMELS = (1, 16384, 1 << 20)


def _call(kind: str, x: torch.Tensor, n: int, group):
    """One collective of ``kind`` over ``group`` (``n`` ranks) on the tensor ``x`` and its buffers."""
    import torch.distributed as dist

    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        out = torch.empty(n * x.numel())
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if kind == "reduce_scatter":
        big = x.repeat(n)
        out = torch.empty_like(x)
        return lambda: dist.reduce_scatter_tensor(out, big, group=group)
    if kind == "all_to_all":
        y = x.repeat(n)
        out = torch.empty_like(y)
        return lambda: dist.all_to_all_single(out, y, group=group)
    raise ValueError(kind)


def time_collective(kind: str, numel: int, n: int, group, reps: int) -> float:
    """The slowest rank's median seconds of one ``kind`` on ``numel`` elements per rank."""
    import torch.distributed as dist

    fn = _call(kind, torch.ones(max(1, numel)), n, group)
    fn()
    samples = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank of the world, so all groups agree
    return float(t.item())


def sent(kind: str, n: int, numel: int) -> int:
    """Bytes each rank sends for ``kind`` of a tensor of ``numel`` float32 elements per rank, as the
    cost model counts them (the gathered / scattered tensor is ``n`` such pieces)."""
    from ...core.cost import sent_bytes

    whole = numel if kind == "all_reduce" else numel * n
    return sent_bytes(kind, n, whole, 4)


def fit(points: list, rounds: int) -> tuple[float, float]:
    """(latency per round, bandwidth) of ``t = latency * rounds + sent / bandwidth`` through
    ``points`` ([[bytes sent, seconds], ...]), robust to a stall on a loaded machine: the latency is
    the fastest of the smaller half of the messages (they are latency-bound), the bandwidth the
    least-squares slope through what is left of every point (the large messages weigh most)."""
    pts = sorted((float(x), float(t)) for x, t in points)
    small = pts[: max(1, len(pts) // 2)]
    alpha = min(t for _, t in small)
    num = sum(x * max(t - alpha, 0.0) for x, t in pts)
    den = sum(x * x for x, _ in pts)
    if num <= 0 or den <= 0:  # every message as fast as the smallest: the largest one's average rate
        num, den = pts[-1][1], max(pts[-1][0], 1.0)
    return alpha / max(rounds, 1), den / num


def groups_of(mesh_shape: tuple, names: tuple):
    """Per mesh dim name, the rank groups along it (row-major ranks), or {"*": whole world}."""
    from ...core.mesh import Mesh

    mesh = Mesh(tuple(mesh_shape), tuple(names))
    return {name: mesh.groups(name) for name in names}


def measure(world: int, mesh_shape, names, numels, reps: int, tick=lambda label: None) -> dict:
    """{dim name ("*" without a mesh): {kind: {latency_s, bandwidth, points, group_size}}}."""
    import torch.distributed as dist

    from ...core.cost import CostModel

    rank = dist.get_rank()
    dims = {"*": [tuple(range(world))]} if mesh_shape is None else groups_of(mesh_shape, names)
    out: dict = {}
    for dim, groups in dims.items():
        if len(groups[0]) < 2:  # a mesh dim of size 1 has nothing to measure
            continue
        made = [dist.new_group(list(g)) if len(groups) > 1 or len(g) < world else None for g in groups]
        mine = next(i for i, g in enumerate(groups) if rank in g)
        n = len(groups[mine])
        out[dim] = {}
        for kind in KINDS:
            pts = [[sent(kind, n, numel), time_collective(kind, numel, n, made[mine], reps)] for numel in numels]
            a, b = fit(pts, CostModel.rounds(kind, n))
            out[dim][kind] = {"latency_s": a, "bandwidth": b, "points": pts, "group_size": n}
            tick(f"{kind} on {dim if dim != '*' else 'the world'} ({n} ranks)")
    return out
