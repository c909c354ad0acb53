"""Shared helpers for rule tests: run the verifier and assert the expected strategies exist."""
from __future__ import annotations

import shardwise.tools.verify as verify


def strategies_1d(report) -> set:
    """Single-mesh-dim strategies tried on mesh (2,), as (ins, outs) tuples of placements."""
    return {(tuple(p[0] for p in r.strategy.ins), tuple(None if p is None else p[0] for p in r.strategy.outs))
            for r in report.results if r.mesh == (2,)}


def check(op, *args, expect=(), absent=(), meshes=verify.DEFAULT_MESHES, **kwargs):
    """verify_rule(op, ...) must pass on every strategy of every mesh, offer each (ins, outs)
    in ``expect`` and none in ``absent``."""
    report = verify.verify_rule(op, *args, meshes=meshes, **kwargs)
    assert report.ok, report.error or "\n".join(map(str, report.failures))
    assert {r.mesh for r in report.results} == set(meshes), report
    got = strategies_1d(report)
    for ins, outs in expect:
        assert (tuple(ins), tuple(outs)) in got, f"missing {list(ins)} -> {list(outs)}\n{report}"
    for ins, outs in absent:
        assert (tuple(ins), tuple(outs)) not in got, f"unexpected {list(ins)} -> {list(outs)}\n{report}"
    return report
