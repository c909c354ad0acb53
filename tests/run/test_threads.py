"""Threads backend: every primitive against a reference, and failures that never hang."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from shardwise.core.errors import CollectiveError, RankFailedError
from shardwise.core.mesh import Mesh
from shardwise.run import current, run_threads

from . import _reference as ref

MESHES = [(2,), (3,), (2, 2), (2, 3), (1, 2)]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_every_primitive_matches_reference(shape):
    mesh = Mesh(shape)
    outputs = run_threads(ref.program, mesh, timeout=30)
    n_checks = ref.check(mesh, outputs)
    assert n_checks == mesh.size * len(ref.cases(mesh))


def test_reference_values_by_hand():
    """A tiny hand-computed case, so the reference itself is checked too."""
    mesh = Mesh((2, 2))

    def fn(rank):
        c = current()
        x = torch.tensor([float(rank), 10.0 * rank + 1])
        st = torch.tensor([[rank, 1], [2 * rank, 3]], dtype=torch.bfloat16)
        return (
            c.all_reduce(x, 0), c.all_reduce(x, 1, "max"), c.all_gather(x, 1),
            c.reduce_scatter(st, 0), c.all_to_all(st, 1), c.send_recv(x, 0), c.reduce_scatter(st, 1, "min"),
        )

    out = run_threads(fn, mesh, timeout=10)
    # rank 1 = coord (0, 1): dim-0 group (1, 3), dim-1 group (0, 1)
    ar, mx, ag, rs, a2a, sr, rsmin = out[1]
    assert torch.equal(ar, torch.tensor([4.0, 42.0]))  # ranks 1 + 3
    assert torch.equal(mx, torch.tensor([1.0, 11.0]))  # max(rank 0, rank 1)
    assert torch.equal(ag, torch.tensor([[0.0, 1.0], [1.0, 11.0]]))
    assert torch.equal(rs, torch.tensor([1.0 + 3.0, 2.0], dtype=torch.bfloat16))  # slot 0 of ranks 1, 3
    assert torch.equal(a2a, torch.tensor([[0, 3], [2, 3]], dtype=torch.bfloat16))  # slot 1 of ranks 0, 1
    assert torch.equal(sr, torch.tensor([3.0, 31.0]))  # from rank 3 (ring of 2)
    assert torch.equal(rsmin, torch.tensor([0, 3], dtype=torch.bfloat16))  # min of slot 1 of ranks 0, 1
    assert rs.dtype == torch.bfloat16 and a2a.dtype == torch.bfloat16


def test_mismatched_shapes_raise():
    def fn(rank):
        current().all_gather(torch.zeros(rank + 1), 0)

    with pytest.raises(CollectiveError, match="got shapes"):
        run_threads(fn, Mesh((2,)), timeout=5)


def test_missing_rank_times_out_naming_it():
    mesh = Mesh((3,))

    def fn(rank):
        if rank == 2:
            return "skipped"  # never joins the all_reduce
        t0 = time.monotonic()
        try:
            current().all_reduce(torch.ones(2), 0)
        except CollectiveError as e:
            return e, time.monotonic() - t0
        return "no error"

    t0 = time.monotonic()
    out = run_threads(fn, mesh, timeout=1.0)
    assert time.monotonic() - t0 < 3.0
    assert out[2] == "skipped"
    for rank in (0, 1):
        err, waited = out[rank]
        assert type(err) is CollectiveError, (rank, err)
        assert err.missing == (2,)
        assert "rank(s) [2] did not arrive" in str(err)
        assert "all_reduce" in str(err) and "timed out" in str(err)
        assert 0.5 < waited < 2.5


def test_missing_rank_timeout_propagates_from_run_threads():
    def fn(rank):
        if rank != 2:
            current().all_gather(torch.ones(1), 0)

    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[2\] did not arrive") as ei:
        run_threads(fn, Mesh((3,)), timeout=1.0)
    assert time.monotonic() - t0 < 3.0
    assert ei.value.missing == (2,)


def test_failing_rank_reraised_and_others_stop():
    mesh = Mesh((2, 2))
    seen = {}

    def fn(rank):
        c = current()
        if rank == 1:
            time.sleep(0.1)
            raise ValueError("bad shard on purpose")
        try:
            c.all_reduce(torch.ones(3), 0)
            c.all_reduce(torch.ones(3), 1)
            c.barrier()
        except RankFailedError as e:
            seen[rank] = e
            raise

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad shard on purpose") as ei:
        run_threads(fn, mesh, timeout=30.0)  # far longer than the test may take
    assert time.monotonic() - t0 < 2.0
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "rank 1" in notes
    # every other rank stopped with an error naming rank 1, none is left running
    assert set(seen) == {0, 2, 3}
    assert all(e.rank == 1 and "rank 1 failed" in str(e) for e in seen.values())
    assert not [t for t in threading.enumerate() if t.name.startswith("shardwise-rank")]
