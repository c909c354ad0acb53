"""Torch backend on real gloo processes, and the local launcher.

Process start-up costs seconds, so each spawn runs many checks: one spawn per world size
runs the whole reference program on every mesh of that size.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.core.errors import CollectiveError, ShardingError
from shardwise.core.mesh import Mesh
from shardwise.run import current, run_threads
from shardwise.run.distributed import TorchCollectives, activate
from shardwise.run.launch import spawn

from . import _reference as ref

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


# -- per-rank bodies (top level: they are pickled into the children) ---------------------
def _dist_body(rank, shapes, wrong_shape):
    out = {"pid": os.getpid(), "backend": dist.get_backend(), "by_mesh": {}}
    for shape in shapes:
        with activate(Mesh(shape)) as c:
            assert current() is c and isinstance(c, TorchCollectives)
            out["by_mesh"][shape] = ref.program(rank)
    try:
        TorchCollectives(Mesh(wrong_shape))
        out["wrong"] = None
    except ShardingError as e:
        out["wrong"] = str(e)
    return out


def _raise_on_rank_1(rank):
    if rank == 1:
        raise ValueError(f"deliberate failure in rank {rank}")
    t = torch.ones(2)
    dist.all_reduce(t)  # rank 0 waits on rank 1, which is gone: must not hang
    return t


def _hang_on_rank_1(rank):
    if rank == 1:
        time.sleep(120)
    return rank


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def _no_children_left(pids):
    assert not multiprocessing.active_children()
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


# -- tests -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nproc, shapes, wrong",
    [
        (2, [(2,), (1, 2)], (3,)),      # a whole-world group, and a size-1 mesh dim
        (4, [(2, 2), (4,)], (2, 3)),    # sub-groups per mesh dim, and a 4-rank ring
    ],
    ids=["world2", "world4"],
)
def test_gloo_matches_reference_and_threads(nproc, shapes, wrong):
    outs = spawn(_dist_body, nproc, shapes, wrong, timeout=90)
    assert [o["backend"] for o in outs] == ["gloo"] * nproc
    for shape in shapes:
        mesh = Mesh(shape)
        got = [o["by_mesh"][shape] for o in outs]
        assert ref.check(mesh, got) == mesh.size * len(ref.cases(mesh))
        ref.assert_same(mesh, got, run_threads(ref.program, mesh, timeout=30))
    # a mesh whose size is not the world size is refused, naming both numbers
    size = Mesh(wrong).size
    for o in outs:
        assert o["wrong"] is not None
        assert f"{size} ranks" in o["wrong"] and f"world size {nproc}" in o["wrong"]
    _no_children_left([o["pid"] for o in outs])


def test_child_error_is_reraised_naming_rank():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="deliberate failure in rank 1") as ei:
        spawn(_raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - t0 < 30
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "raised on rank 1 of 2" in notes
    assert "_raise_on_rank_1" in notes and "Traceback" in notes  # the child's traceback text
    _no_children_left([])


def _unpicklable_result(rank):
    return lambda: rank


def test_unpicklable_result_is_a_typed_error_with_a_fix():
    from shardwise.core.errors import ConfigTypeError
    with pytest.raises(ConfigTypeError, match="cannot be pickled") as ei:
        spawn(_unpicklable_result, 1, timeout=60)
    assert ei.value.fix and "plain Python" in ei.value.fix


def test_hung_child_is_killed_and_named():
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"did not finish within 6.0s and were killed") as ei:
        spawn(_hang_on_rank_1, 2, timeout=6)
    assert time.monotonic() - t0 < 12
    # rank 0 normally finishes; on a badly overloaded machine its start-up may not fit in 6 s
    assert ei.value.missing in ((1,), (0, 1))
    assert f"rank(s) {list(ei.value.missing)} of 2" in str(ei.value)
    _no_children_left([])


def test_torch_collectives_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(CollectiveError, match="not initialised"):
        TorchCollectives(Mesh((2,)))


def _facts_body(rank):
    """As under NCCL alone: the default group cannot move CPU tensors, so facts (input shapes,
    the local steady step's agreement) travel over a gloo group beside it, 2x2 mesh."""
    import copy

    import shardwise as sw
    import shardwise.run.distributed as d
    from shardwise import Shard as S

    d._cpu_capable = lambda: False  # (this process only)
    x = torch.arange(8.0).reshape(4, 2) * (rank + 1)
    with activate(Mesh((2, 2))) as c:
        side = c._facts_pg is not None and c._facts_pg is not dist.group.WORLD
        gathered = c.world_gather(torch.tensor([rank, 10 * rank]))
        whole = c.world_gather(x)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ref_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)) for n in (6, 6, 6, 5)]
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    dp = mesh.coord(rank)[0]
    mine = [(x_.chunk(2)[dp], y_.chunk(2)[dp]) for x_, y_ in batches]
    mse = torch.nn.functional.mse_loss
    pm = sw.parallelize(model, mesh, (mine[0][0],), loss_fn=mse, backend="torch", inputs="local",
                        example_targets=(mine[0][1],), input_placements={0: {"dp": S(0)}},
                        target_placements={0: {"dp": S(0)}})
    steps = []
    for (xb, yb), (xl, yl) in zip(batches, mine):
        loss = pm.step(xl, yl)
        ref_model.zero_grad()
        want = mse(ref_model(xb), yb)
        want.backward()
        grads = pm.gradients()
        steps.append((type(pm._steady).__name__, torch.allclose(loss, want.detach(), rtol=1e-4, atol=1e-6)
                      and all(torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6)
                              for n, p in ref_model.named_parameters())))
        pm.zero_grad()
    return {"side": side, "gathered": gathered, "whole": whole, "steps": steps, "facts": pm.backend.comm.facts_device}


def test_facts_travel_on_a_cpu_group_beside_a_default_group_without_one():
    outs = spawn(_facts_body, 4, timeout=120)
    for rank, out in enumerate(outs):
        assert out["side"], f"rank {rank}: no gloo group beside the default one"
        assert out["gathered"].tolist() == [[r, 10 * r] for r in range(4)], out["gathered"]
        want = torch.stack([torch.arange(8.0).reshape(4, 2) * (r + 1) for r in range(4)])
        assert torch.equal(out["whole"], want)
        assert out["facts"].type == "cpu"
        assert all(ok for _, ok in out["steps"]), f"rank {rank}: {out['steps']}"
        assert [k for k, _ in out["steps"]][2] == "LocalSteadyStep", f"rank {rank}: {out['steps']}"
