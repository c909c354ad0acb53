"""pm.save's guarantees and errors on the threads backend: an interrupted save keeps the previous
checkpoint, DTensor views equal the shards (or name the parameter DTensor cannot express), and
loads that cannot be honoured fail early with a ShardingError.

    python -m pytest tests/checkpoint/test_save.py -q
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.api import CheckpointException

import shardwise as sw
from shardwise import Replicate as R, Shard as S

from .helpers import assert_bitwise, batch, fake_steps, mlp, snapshot


def _pm(mesh, params, hidden=5, seed=0):
    x, _ = batch()
    return sw.parallelize(mlp(hidden=hidden, seed=seed), mesh, (x,), loss_fn=lambda o, y: ((o - y) ** 2).mean(),
                          param_placements=params)


FSDP3 = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)], "2.bias": [S(0)]}


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    pm = _pm(sw.Mesh((3,), ("dp",)), FSDP3)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    fake_steps(pm, opt)
    path = tmp_path / "ck"
    pm.save(path, optimizer=opt)
    saved = snapshot(pm, opt)
    fake_steps(pm, opt, seed=5)  # the state moves on, then its save fails half way through a file
    calls = []
    real = dcp_fs._write_item

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            args[1].write(b"half a tensor")
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", failing)
    with pytest.raises(CheckpointException) as info:
        pm.save(path, optimizer=opt)
    assert "disk full" in str(info.value.failures)
    monkeypatch.undo()
    assert len(calls) == 3
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the half-written save was not cleaned up"
    other = _pm(sw.Mesh((2,), ("dp",)), {"0.weight": [S(1)]}, seed=9)
    opt_o = other.optimizer(torch.optim.AdamW, lr=1.0)
    other.load(path, optimizer=opt_o)
    assert_bitwise(snapshot(other, opt_o), saved)
    # a completed save replaces it
    pm.save(path, optimizer=opt)
    other.load(path, optimizer=opt_o)
    assert_bitwise(snapshot(other, opt_o), snapshot(pm, opt))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_to_dtensors_match_the_shards():
    """Every rank's DTensor holds that rank's shard at DTensor's offset for it (uneven and nested)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = sw.Mesh((2, 2), ("a", "b"))
    pm = _pm(mesh, {"0.weight": [S(0), S(0)], "0.bias": [S(0), R()], "2.weight": [R(), S(1)], "2.bias": [S(0), S(0)]})
    full = pm.state_dict()
    for rank in range(mesh.size):
        dts = pm.to_dtensors(rank)
        assert set(dts) == set(full)
        for key, d in dts.items():
            assert d.shape == full[key].shape and d.device_mesh.mesh_dim_names == ("a", "b")
            assert tuple(d.device_mesh.get_coordinate()) == mesh.coord(rank)
            shape, offset = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
            assert tuple(d.to_local().shape) == tuple(shape)
            region = full[key]
            for dim, (o, n) in enumerate(zip(offset, shape)):
                region = region.narrow(dim, o, n)
            assert torch.equal(d.to_local(), region), (key, rank)
            assert d.to_local().data_ptr() == pm.shards[rank][key].data_ptr()  # a view, not a copy


def test_placements_dtensor_cannot_express_are_named():
    pm = _pm(sw.Mesh((2,), ("tp",)), {"0.weight": [S(0, groups=3)]}, hidden=6)
    with pytest.raises(sw.ShardingError, match=r"parameter '0.weight'.*groups=3|parameter '0.weight'.*parts"):
        pm.to_dtensors(0)
    # a unit shard whose blocks fall on DTensor's chunk bounds is expressible, one that does not is named
    assert set(_pm(sw.Mesh((2,), ("tp",)), {"0.weight": [S(0, unit=3)]}, hidden=6).to_dtensors(1)) >= {"0.weight"}
    bad = _pm(sw.Mesh((2,), ("tp",)), {"0.weight": [S(0, unit=2)]}, hidden=6)  # 4 + 2 rows, DTensor 3 + 3
    with pytest.raises(sw.ShardingError, match="parameter '0.weight'"):
        bad.to_dtensors(0)
    with pytest.raises(sw.ShardingError, match="torch backend"):
        bad.dtensor_state()


def test_load_errors_are_early_and_named(tmp_path):
    pm = _pm(sw.Mesh((2,), ("dp",)), {"0.weight": [S(0)]})
    with pytest.raises(sw.ShardingError, match="no checkpoint directory"):
        pm.load(tmp_path / "missing")
    wider = _pm(sw.Mesh((2,), ("dp",)), {}, hidden=7)
    wider.save(tmp_path / "wide")
    with pytest.raises(sw.ShardingError, match=r"'0.weight' has shape \(7, 6\) but this model's is \(5, 6\)"):
        pm.load(tmp_path / "wide")
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    pm.save(tmp_path / "no_optim")
    with pytest.raises(sw.ShardingError, match="holds no optimizer state"):
        pm.load(tmp_path / "no_optim", optimizer=opt)
    stranger = torch.optim.AdamW(mlp().parameters())
    with pytest.raises(sw.ShardingError, match="not made by this ParallelModule"):
        pm.save(tmp_path / "x", optimizer=stranger)
    dcp.save({"model": {"0.weight": torch.zeros(5, 6)}}, checkpoint_id=str(tmp_path / "part"), no_dist=True)
    with pytest.raises(sw.ShardingError, match=r"no entry for \['0.bias'"):
        pm.load(tmp_path / "part")


def test_optimizer_is_still_a_torch_optimizer_addressable_by_name():
    mesh = sw.Mesh((3,), ("dp",))
    pm = _pm(mesh, FSDP3)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, sw.ShardedOptimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fake_steps(pm, opt, steps=1)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert opt.names == ["0.weight", "0.bias", "2.weight", "2.bias"] and opt.ranks == [0, 1, 2]
    for rank in range(3):
        st = opt.shard_state("2.weight", rank)
        assert st["exp_avg"].shape == pm.shards[rank]["2.weight"].shape and float(st["step"]) == 1.0
    assert set(opt.named_state()["0.bias"]) == {0, 1, 2}
    with pytest.raises(sw.ShardingError, match="say which one"):
        opt.shard("0.bias")
    with pytest.raises(sw.ShardingError, match="torch.optim.Optimizer subclass"):
        pm.optimizer(lambda params: None)


def test_full_optimizer_state_is_a_copy():
    """Replicated shards gather to themselves: the full state must still not move with training."""
    pm = _pm(sw.Mesh((2,), ("dp",)), {"0.weight": [S(0)]})  # the rest Replicate
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    fake_steps(pm, opt, steps=1)
    full = pm.optimizer_state_dict()  # the last optimizer made by pm.optimizer
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in full["state"].items()}
    fake_steps(pm, opt, steps=1, seed=8)
    assert_bitwise(full["state"], before)
    assert float(opt.shard_state("2.bias", 1)["step"]) == 2.0


def test_parameters_without_saved_state_have_none_after_load(tmp_path):
    """As torch's load_state_dict: the loaded state replaces the optimizer's, also where it is absent."""
    src = _pm(sw.Mesh((2,), ("dp",)), {"0.weight": [S(0)]})
    opt = src.optimizer(torch.optim.AdamW, lr=1e-2)
    for shards in src.shards.values():
        shards["0.weight"].grad = torch.ones_like(shards["0.weight"])
    opt.step()  # only 0.weight had a gradient
    src.save(tmp_path / "ck", optimizer=opt)
    dst = _pm(sw.Mesh((3,), ("dp",)), FSDP3, seed=2)
    opt_d = dst.optimizer(torch.optim.AdamW, lr=1e-2)
    fake_steps(dst, opt_d, steps=1)
    dst.load(tmp_path / "ck", optimizer=opt_d)
    assert [n for n, st in opt_d.named_state().items() if any(st.values())] == ["0.weight"]
    assert_bitwise(snapshot(dst, opt_d), snapshot(src, opt))
