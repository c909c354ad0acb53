"""Shared helpers for rule tests: run the verifier and assert the expected strategies exist.

``strict_lay_out`` replaces ``shardwise.verify.lay_out`` while these tests run: it lays out
Partial inputs with the semantics ``collect`` assumes (locals identical along every mesh dim
that is Replicate for the tensor). verify.lay_out draws fresh random parts per group of each
Partial mesh dim, so on a (2, 2) mesh a ``[Partial(), Replicate()]`` input differs along the
Replicate dim and valid strategies such as mm's ``(P, R) x (R, P) -> (P, P)`` fail there.
"""
from __future__ import annotations

import torch

import shardwise.verify as verify
from shardwise.layout import Layout, Partial


def _parts(x: torch.Tensor, n: int, op: str, gen: torch.Generator) -> list[torch.Tensor]:
    """verify's random parts; for 16-bit floats, power-of-two fractions of x (x/2, x/4, ..., rest)
    whose sum is exact, as random parts lose most of the precision of a bf16 value to rounding."""
    if op != "sum" or x.dtype not in (torch.bfloat16, torch.float16) or n == 1:
        return verify._partial_parts(x, n, op, gen)
    parts = [x / 2 ** (i + 1) for i in range(n - 1)]
    return parts + [x / 2 ** (n - 1)]


def strict_lay_out(x: torch.Tensor, mesh, placements, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-rank locals of ``x``: full-size parts keyed by the coords on the Partial mesh dims
    (split outermost mesh dim first, as collect reduces innermost first), then sliced."""
    pdims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    parts = {(): x}
    for m in pdims:
        parts = {k + (c,): part for k, v in parts.items()
                 for c, part in enumerate(_parts(v, mesh.shape[m], placements[m].op, gen))}
    lay = Layout(x.shape, x.dtype, placements)
    out = []
    for rank in range(mesh.size):
        coord = mesh.coord(rank)
        t = parts[tuple(coord[m] for m in pdims)]
        for d, (off, n) in enumerate(lay.shard_bounds(mesh, rank)):
            t = t.narrow(d, off, n)
        out.append(t.clone())
    return out


def strategies_1d(report) -> set:
    """Single-mesh-dim strategies tried on mesh (2,), as (ins, outs) tuples of placements."""
    return {(tuple(p[0] for p in r.strategy.ins), tuple(None if p is None else p[0] for p in r.strategy.outs))
            for r in report.results if r.mesh == (2,)}


def check(op, *args, expect=(), meshes=verify.DEFAULT_MESHES, **kwargs):
    """verify_rule(op, ...) must pass on every strategy, and offer each (ins, outs) in ``expect``."""
    saved, verify.lay_out = verify.lay_out, strict_lay_out
    try:
        report = verify.verify_rule(op, *args, meshes=meshes, **kwargs)
    finally:
        verify.lay_out = saved
    assert report.ok, report.error or "\n".join(map(str, report.failures))
    got = strategies_1d(report)
    for ins, outs in expect:
        assert (tuple(ins), tuple(outs)) in got, f"missing {list(ins)} -> {list(outs)}\n{report}"
    return report
