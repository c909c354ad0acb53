"""One per-rank program exercising every collective, and its reference computed here.

The same ``program`` runs on the threads backend and on real gloo processes; the test
checks both against ``expected`` (computed from the inputs alone, with plain torch ops)
and against each other.
"""
from __future__ import annotations

import torch

from shardwise.core.mesh import Mesh
from shardwise.run.collectives import current

OPS = ("sum", "max", "min")
SHIFTS = (1, -1, 2, 0)
PRIMS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")
# name -> dtype; "f32r" is non-integer random data, the others are small integers (exact
# in every dtype, so sums do not depend on the reduction order).
KINDS = {
    "f32": torch.float32,
    "f32r": torch.float32,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "i64": torch.int64,
    "i16": torch.int16,  # gloo has no int16: exercises the backend's dtype fallback
}


def inputs(rank: int, m: int, kind: str, n: int, noncontig: bool = False):
    """(x [3, 2], stacked [n, 3, 2]) for ``rank`` on mesh dim ``m``; different on every rank."""
    g = torch.Generator().manual_seed(7919 * m + 104729 * rank + 17 * len(kind) + ord(kind[-1]))
    if kind == "f32r":
        x, st = torch.randn(2, 3, generator=g), torch.randn(n, 2, 3, generator=g)
    else:
        x = torch.randint(-40, 41, (2, 3), generator=g).to(KINDS[kind])
        st = torch.randint(-40, 41, (n, 2, 3), generator=g).to(KINDS[kind])
    if noncontig:  # same logical values as a (transposed) strided view
        return x.t().contiguous().t(), st.transpose(1, 2).contiguous().transpose(1, 2)
    return x, st


def cases(mesh: Mesh, kinds=tuple(KINDS)):
    """Every (mesh dim, kind, noncontig, primitive, arg) the program runs, in program order."""
    out = []
    for m in range(mesh.ndim):
        for kind in kinds:
            for nc in ((False, True) if kind == "f32r" else (False,)):
                for op in OPS:
                    out.append((m, kind, nc, "all_reduce", op))
                    out.append((m, kind, nc, "reduce_scatter", op))
                out.append((m, kind, nc, "all_gather", None))
                out.append((m, kind, nc, "all_to_all", None))
                for s in SHIFTS:
                    out.append((m, kind, nc, "send_recv", s))
    return out


def program(rank: int, kinds=tuple(KINDS)) -> dict:
    """Per-rank body: run every case through the current collectives; results by case."""
    c = current()
    assert c.rank == rank
    res, aliased = {}, []
    for case in cases(c.mesh, kinds):
        m, kind, nc, prim, arg = case
        x, st = inputs(rank, m, kind, c.group_size(m), nc)
        if prim == "all_reduce":
            got, src = c.all_reduce(x, m, arg), x
        elif prim == "reduce_scatter":
            got, src = c.reduce_scatter(st, m, arg), st
        elif prim == "all_gather":
            got, src = c.all_gather(x, m), x
        elif prim == "all_to_all":
            got, src = c.all_to_all(st, m), st
        else:
            got, src = c.send_recv(x, m, arg), x
        if got.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
            aliased.append(case)
        res[case] = got
    c.barrier()
    return {"results": res, "aliased": aliased, "group_index": [c.group_index(m) for m in range(c.mesh.ndim)]}


def _reduce(ts, op):
    s = torch.stack(ts)
    if op == "sum":
        # integer kinds: exact in any order; keep the dtype (stack.sum promotes ints to int64)
        return s.sum(0, dtype=s.dtype) if s.dtype.is_floating_point else s.sum(0).to(s.dtype)
    return s.amax(0) if op == "max" else s.amin(0)


def expected(mesh: Mesh, rank: int, case):
    m, kind, nc, prim, arg = case
    group = mesh.group(m, rank)
    n, i = len(group), group.index(rank)
    xs = [inputs(r, m, kind, n, nc)[0] for r in group]
    sts = [inputs(r, m, kind, n, nc)[1] for r in group]
    if prim == "all_reduce":
        return _reduce(xs, arg)
    if prim == "reduce_scatter":
        return _reduce([st[i] for st in sts], arg)
    if prim == "all_gather":
        return torch.stack(xs)
    if prim == "all_to_all":
        return torch.stack([st[i] for st in sts])
    return xs[(i - arg) % n]


def check(mesh: Mesh, outputs: list, kinds=tuple(KINDS)) -> int:
    """Assert every rank's results equal the reference; returns the number of checks."""
    assert len(outputs) == mesh.size
    count = 0
    for rank, out in enumerate(outputs):
        assert out["aliased"] == [], f"rank {rank}: results alias their inputs: {out['aliased']}"
        assert out["group_index"] == list(mesh.coord(rank))
        for case in cases(mesh, kinds):
            got, exp = out["results"][case], expected(mesh, rank, case)
            where = f"rank {rank} case {case}"
            assert got.dtype == exp.dtype, f"{where}: dtype {got.dtype} != {exp.dtype}"
            assert got.shape == exp.shape, f"{where}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
            if case[1] == "f32r" and case[3] in ("all_reduce", "reduce_scatter") and case[4] == "sum":
                torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6, msg=where)
            else:
                assert torch.equal(got, exp), f"{where}:\n got {got}\n expected {exp}"
            count += 1
    return count


def assert_same(mesh: Mesh, a: list, b: list) -> None:
    """Two backends' outputs of ``program`` are bit-identical.

    Except sums of non-integer floats over groups of more than two: backends may add in
    a different order (gloo's ring vs the threads backend's rank order), so those match
    to rounding only. With two members a + b == b + a, so they match exactly.
    """
    assert len(a) == len(b) == mesh.size
    for rank, (x, y) in enumerate(zip(a, b)):
        assert x["results"].keys() == y["results"].keys()
        for case, t in x["results"].items():
            u = y["results"][case]
            where = f"rank {rank} case {case}"
            assert t.dtype == u.dtype and t.shape == u.shape, where
            m, kind, _, prim, arg = case
            if kind == "f32r" and arg == "sum" and mesh.shape[m] > 2:
                torch.testing.assert_close(t, u, rtol=1e-6, atol=1e-6, msg=where)
            else:
                assert torch.equal(t, u), where
