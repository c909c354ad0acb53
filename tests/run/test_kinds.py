"""Adding a collective kind is one record (shardwise/core/collective_kinds.py) plus the Collectives method both
backends implement: a toy broadcast from group member 0, registered here, runs through
lower/redistribute.apply_step on the threads backend and on gloo, its bytes and cost from
its record (docs/architecture.md, "Where a change goes")."""
from __future__ import annotations

import pytest
import torch

from shardwise.core import collective_kinds as kinds
from shardwise.core.cost import CostModel, sent_bytes
from shardwise.core.collective_kinds import Kind, RedistStep
from shardwise.core.layout import Layout, R
from shardwise.lower.redistribute import apply_step, step_call
from shardwise.search.paths import _Shapes, _step_bytes
from shardwise.core.mesh import Mesh
from shardwise.run import current, run_threads
from shardwise.run.distributed import activate
from shardwise.run.launch import spawn

SHAPE = (3, 5)


def _bcast0(x, mesh_dim):
    """The program's call of the toy kind: group member 0's tensor on every member."""
    return current().broadcast(x.contiguous(), mesh_dim, 0)


def _register() -> Kind:
    """The whole of the new kind: one record (ring-pipelined: each rank forwards the buffer once)."""
    return kinds.register(Kind("toy_broadcast", True, sent=lambda n, e: e, rounds=lambda n: n - 1, chunk="src",
                               call=_bcast0, args=lambda st, mesh, rank, sizes: (st.mesh_dim,), method="broadcast"))


@pytest.fixture
def toy():
    k = _register()
    yield k
    del kinds.KINDS[k.name]


def _step(mesh: Mesh, m: int) -> RedistStep:
    lay = Layout(SHAPE, torch.float32, (R,) * mesh.ndim)
    nbytes = _step_bytes("toy_broadcast", lay.placements, lay.placements, m, _Shapes(SHAPE, torch.float32, mesh))
    return RedistStep("toy_broadcast", m, lay, lay, bytes=nbytes)


def _run_step(rank: int, mesh: Mesh, m: int):
    x = torch.arange(15.0).reshape(SHAPE) + 100 * rank
    return apply_step(x, _step(mesh, m), current(), rank, mesh)


def _gloo_body(rank):
    _register()  # a spawned child imports this module afresh: the record is registered here too
    mesh = Mesh((2,))
    with activate(mesh):
        return _run_step(rank, mesh, 0)


def test_toy_kind_from_its_record_on_threads(toy):
    mesh = Mesh((2, 3), ("dp", "tp"))
    for m in (0, 1):
        step, n = _step(mesh, m), mesh.shape[m]
        fn, args = step_call(step, mesh, 4)
        assert fn is _bcast0 and args == (m,) and step.is_collective
        assert step.bytes == sent_bytes("toy_broadcast", n, 15, 4) == 60
        cost = CostModel(bandwidth=1e9, latency=1e-5)
        assert cost.step_time(step, mesh) == pytest.approx(1e-5 * (n - 1) + 60 / 1e9)
        assert CostModel.rounds("toy_broadcast", n) == n - 1 and sent_bytes("toy_broadcast", 1, 15, 4) == 0
        outs = run_threads(lambda rank: _run_step(rank, mesh, m), mesh)
        for rank, out in enumerate(outs):
            root = mesh.group(m, rank)[0]
            assert torch.equal(out, torch.arange(15.0).reshape(SHAPE) + 100 * root), (m, rank)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_toy_kind_on_gloo(toy):
    outs = spawn(_gloo_body, 2, timeout=90)
    for out in outs:
        assert torch.equal(out, torch.arange(15.0).reshape(SHAPE))


def test_unknown_kind_is_typed():
    from shardwise.core.errors import ShardingError

    with pytest.raises(ShardingError, match="unknown collective kind 'nope'") as e:
        sent_bytes("nope", 2, 1, 4)
    assert "register" in e.value.fix
