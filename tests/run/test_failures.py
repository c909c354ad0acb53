"""Ranks that fail cleanly: a rank raising mid-step stops every other rank within a bounded
time with an error naming it and the node it was at, on the threads backend and on gloo
processes; a collective called on some ranks only raises CollectiveError naming the others.

    python -m pytest tests/run/test_failures.py -q
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import shardwise as sw
from shardwise.core.errors import RankFailedError
from shardwise.run.backend import ThreadsBackend

from .torchrun_step import break_node

MEGATRON = {"0.weight": [sw.Shard(0)], "0.bias": [sw.Shard(0)], "2.weight": [sw.Shard(1)]}


def mlp_module(mesh, backend):
    """A Megatron MLP on ``mesh`` (tensor parallel on its last dim) and its data, one step done."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    dims = mesh.ndim
    placements = {n: [sw.Replicate()] * (dims - 1) + p for n, p in MEGATRON.items()}
    pm = sw.parallelize(model, mesh, (x,), loss_fn=lambda o, t: ((o - t) ** 2).mean(), backend=backend,
                        param_placements=placements)
    pm.step(x, y)
    return pm, x, y


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_threads_rank_raising_mid_step_stops_the_others(shape):
    mesh = sw.Mesh(shape)
    pm, x, y = mlp_module(mesh, ThreadsBackend(mesh, timeout=60.0))  # far longer than the test may take
    bad = mesh.size - 1
    break_node(pm, bad, "addmm_1")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"deliberate failure on rank {bad}") as ei:
        pm.step(x, y)
    assert time.monotonic() - t0 < 10.0
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert f"raised on rank {bad} at node 'addmm_1' (threads backend)" in notes
    # every other rank stopped in the all-reduce that needed rank `bad`'s partial sums
    stopped = notes.split("the other ranks stopped: ")[1]
    others = [r for r in range(mesh.size) if r != bad and bad in mesh.group(mesh.ndim - 1, r)]
    for r in others:
        assert f"rank {r} at node 'all_reduce'" in stopped, notes
    assert not [t for t in threading.enumerate() if t.name.startswith("shardwise-rank")]


def test_threads_rank_failed_error_names_rank_and_node(monkeypatch):
    """What a stopped rank raises: RankFailedError with the failed rank and its node."""
    mesh = sw.Mesh((3,))
    pm, x, y = mlp_module(mesh, ThreadsBackend(mesh, timeout=60.0))
    break_node(pm, 1, "addmm_1")
    seen = {}
    run = pm._executable(pm.plan).runnable(0)  # what the next run calls on rank 0 (after the first run: its Replay)
    original = type(run).__call__

    def spy(self, *args):
        try:
            return original(self, *args)
        except RankFailedError as e:
            seen[0] = e
            raise

    monkeypatch.setattr(type(run), "__call__", spy)
    with pytest.raises(ValueError):
        pm.step(x, y)
    err = seen[0]
    assert err.rank == 1 and err.node == "addmm_1"
    assert "stopped in all_reduce because rank 1 failed at node 'addmm_1' (ValueError: deliberate failure" in str(err)


# -- gloo processes (shardwise.run.launch.spawn) -------------------------------------
GLOO_TIMEOUT_S = 20.0  # the collectives' timeout when a peer's failure is what stops them
SHORT_TIMEOUT_S = 3.0  # when nobody fails and a rank simply does not come


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _outcome(fn):
    """Run ``fn``: (exception or None, seconds taken); what a rank reports to the parent."""
    t0 = time.monotonic()
    try:
        fn()
        err = None
    except Exception as e:  # noqa: BLE001 - the parent checks it
        err = e
    return err, time.monotonic() - t0


def _fail_mid_step_body(rank):
    """Rank 1 raises at a node before the step's all-reduce and then stays alive (waiting for
    rank 0's word), so rank 0 can only stop by noticing the failure record, not a lost peer."""
    from shardwise.run.backend import TorchBackend

    mesh = sw.Mesh((2,))
    pm, x, y = mlp_module(mesh, TorchBackend(mesh, timeout=GLOO_TIMEOUT_S))
    if rank == 1:
        break_node(pm, 1, "addmm_1")
    err, took = _outcome(lambda: pm.step(x, y))
    if rank == 0:
        _store().set("test/rank0_stopped", "1")
    else:
        _store().wait(["test/rank0_stopped"])
    return {"type": type(err).__name__, "msg": str(err), "notes": getattr(err, "__notes__", []),
            "rank": getattr(err, "rank", None), "node": getattr(err, "node", None), "took": took}


def _rank0_only_state_dict_body(rank):
    """Rank 0 calls the collective pm.state_dict() alone; rank 1 is alive, busy elsewhere."""
    from shardwise.run.backend import TorchBackend

    mesh = sw.Mesh((2,))
    pm, _, _ = mlp_module(mesh, TorchBackend(mesh, timeout=SHORT_TIMEOUT_S))
    if rank == 1:
        _store().wait(["test/rank0_stopped"])
        return None
    err, took = _outcome(pm.state_dict)
    _store().set("test/rank0_stopped", "1")
    return {"type": type(err).__name__, "msg": str(err), "missing": getattr(err, "missing", None), "took": took}


@pytest.mark.dist
@pytest.mark.slow  # the default run sees the same under torch's launcher (test_launch_script.py)
@pytest.mark.timeout(180)
def test_gloo_rank_raising_mid_step_stops_the_others():
    from shardwise.run.launch import spawn

    t0 = time.monotonic()
    r0, r1 = spawn(_fail_mid_step_body, 2, timeout=120)
    assert r1["type"] == "ValueError" and "deliberate failure on rank 1" in r1["msg"]
    assert "shardwise: raised on rank 1 at node 'addmm_1' (torch backend)" in r1["notes"]
    assert r0["type"] == "RankFailedError", r0
    assert r0["rank"] == 1 and r0["node"] == "addmm_1"
    assert "because rank 1 failed at node 'addmm_1' (ValueError: deliberate failure on rank 1)" in r0["msg"]
    assert "shardwise: raised on rank 0 at node 'all_reduce' (torch backend)" in r0["notes"]
    assert r0["took"] < GLOO_TIMEOUT_S / 2  # stopped by the failure record, well before the timeout
    assert time.monotonic() - t0 < 120


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_gloo_state_dict_on_rank0_only_raises_within_the_timeout():
    from shardwise.run.launch import spawn

    r0, r1 = spawn(_rank0_only_state_dict_body, 2, timeout=120)
    assert r1 is None
    assert r0["type"] == "CollectiveError", r0
    assert r0["missing"] == (1,)
    assert "timed out after 3.0s; rank(s) [1] did not arrive" in r0["msg"]
    assert "all_gather on mesh dim 0 over ranks [0, 1]" in r0["msg"]
    assert SHORT_TIMEOUT_S - 0.5 < r0["took"] < SHORT_TIMEOUT_S + 5.0


# -- helpers ------------------------------------------------------------------------------
def test_failed_node_reads_the_program_line_that_raised():
    import torch.fx as fx

    from shardwise.run.collectives import failed_node

    def boom(x):
        raise RuntimeError("no")

    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    b = g.call_function(boom, (a,))
    b.name = "mm_3_unchecked"  # a debug program's raw node: named without the suffix
    g.output(b)
    gm = fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(RuntimeError) as ei:
        gm(torch.ones(1))
    assert failed_node(ei.value, gm) == "mm_3"
    assert failed_node(RuntimeError("not from a program"), gm) is None


def test_default_timeout_from_the_environment(monkeypatch):
    from shardwise.run.collectives import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, default_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert default_timeout() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert default_timeout() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=TIMEOUT_ENV):
            default_timeout()
