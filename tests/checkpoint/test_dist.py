"""Checkpoints on 2 real gloo processes (torch backend) and between shardwise and DTensor / FSDP2 jobs.

    python -m pytest tests/checkpoint/test_dist.py -q -m dist --durations=0

One spawn runs every process-side check: a torch-backend ParallelModule saves after 2 AdamW steps
(each rank writes only its shards: the files are checked here), another with other placements loads
it and takes a further step; the first one's DTensor state goes through dcp.save; an FSDP2
(fully_shard) job saves its own checkpoint and loads one written by a threads-backend module with
grouped shards. The parent then loads the FSDP2 and DTensor checkpoints with other placements.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise import Shard as S
from shardwise.run.launch import spawn
from tests.parallel.harness import assert_close

from .helpers import ADAMW, adamw, assert_bitwise, batch, fake_steps, mlp, mse, snapshot, train, train_one_device

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

HIDDEN, STEPS = 5, 2
FSDP = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(0)], "2.bias": [S(0)]}  # 5 = 3 + 2, 3 = 2 + 1
MEGATRON = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)]}
GROUPED = {"0.weight": [S(0, groups=3)], "0.bias": [S(0, groups=3)], "2.weight": [S(1, groups=3)]}


def _pm(params, seed=0, hidden=HIDDEN, backend="threads", mesh=None):
    x, _ = batch()
    data = {0: [S(0)]} if mesh is None else None  # data parallel where the module trains here
    return sw.parallelize(mlp(hidden=hidden, seed=seed), mesh or sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse,
                          input_placements=data, param_placements=params, backend=backend)


def _fsdp2_model(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = mlp(hidden=6, seed=seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.clone() for k, v in msd.items()}, "optim": copy.deepcopy(osd)}


def _fsdp2_job(rank, paths):
    """Train 2 steps under FSDP2 and save (path B); a fresh FSDP2 model loads path C."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp2_model(seed=0)
    x, y = batch()
    for _ in range(STEPS):
        mse(model(x[rank * 3:(rank + 1) * 3]), y[rank * 3:(rank + 1) * 3]).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=paths["B"])
    saved = _full(model, opt)
    model2, opt2 = _fsdp2_model(seed=5)
    msd, osd = get_state_dict(model2, opt2)  # initialises the optimizer state to load into
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=paths["C"])
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    return {"B": saved, "C": _full(model2, opt2)}


def _rank_body(rank, paths):
    x, y = batch()
    pm = _pm(FSDP, backend="torch")
    opt = pm.optimizer(torch.optim.AdamW, **ADAMW)
    losses = train(pm, opt, (x,), (y,), STEPS)
    pm.save(paths["A"], optimizer=opt)
    saved = snapshot(pm, opt)
    dcp.save(pm.dtensor_state(opt), checkpoint_id=paths["D"])
    other = _pm(MEGATRON, seed=3, backend="torch")
    opt2 = other.optimizer(torch.optim.AdamW, lr=5.0)
    other.load(paths["A"], optimizer=opt2)
    loaded = snapshot(other, opt2)
    more = train(other, opt2, (x,), (y,), 1)
    return {"losses": losses + more, "A": saved, "A_loaded": loaded, "after": other.state_dict(),
            "fsdp2": _fsdp2_job(rank, paths)}


def _by_name(full_optim: dict, names: list) -> dict:
    """One device's optimizer state ({index: ...}) keyed by parameter name, as FSDP2's full state is."""
    return {names[i]: st for i, st in full_optim["state"].items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_ckpt")
    paths = {k: str(root / k) for k in "ABCD"}
    grouped = _pm(GROUPED, seed=1, hidden=6, mesh=sw.Mesh((2,), ("tp",)))
    opt = grouped.optimizer(torch.optim.AdamW, **ADAMW)
    fake_steps(grouped, opt)
    grouped.save(paths["C"], optimizer=opt)
    return paths, snapshot(grouped, opt), spawn(_rank_body, 2, paths, timeout=240)


def test_each_rank_writes_only_its_shards(world):
    paths, _, _ = world
    md = dcp.FileSystemReader(paths["A"]).read_metadata()
    mesh, model = sw.Mesh((2,), ("dp",)), mlp(hidden=HIDDEN)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    payload, stored = {}, {}  # file -> tensor bytes written into it, bytes of its items
    for index, info in md.storage_data.items():
        stored[info.relative_path] = stored.get(info.relative_path, 0) + info.length
        entry = md.state_dict_metadata[index.fqn]
        if not hasattr(entry, "chunks"):
            continue  # hyperparameters (bytes) live with the coordinator
        chunk = next(c for c in entry.chunks if c.offsets == index.offset)
        name = index.fqn.split(".", 2)[-1].rsplit(".", 1)[0] if index.fqn.startswith("optim.") else index.fqn[6:]
        if len(chunk.sizes):  # a shard: written by the rank whose chunk it is
            lay = sw.Layout(shapes[name], torch.float32, FSDP[name], mesh)
            owner = next(r for r in range(2) if lay.local_offset(mesh, r) == tuple(chunk.offsets))
            assert tuple(chunk.sizes) == lay.local_shape(mesh, owner), index
        else:  # a scalar (AdamW's step): written once, by rank 0
            owner = 0
        assert info.relative_path == f"__{owner}_0.distcp", (index, info.relative_path)
        numel = int(torch.Size(chunk.sizes).numel())
        payload[info.relative_path] = payload.get(info.relative_path, 0) + 4 * numel
    # rank 0 holds 3 of 5 hidden units and 2 of 3 outputs, rank 1 the rest: params + exp_avg + exp_avg_sq
    want = {0: 3 * (3 * 6 + 3 + 2 * 5 + 2) + 4, 1: 3 * (2 * 6 + 2 + 1 * 5 + 1)}  # + 4 steps on rank 0
    for rank, floats in want.items():
        f = f"__{rank}_0.distcp"
        assert payload[f] == 4 * floats, (f, payload)
        # the file is exactly its rank's items (each a torch.save record of one chunk)
        assert os.path.getsize(os.path.join(paths["A"], f)) == stored[f], (f, stored)
    assert sorted(os.listdir(paths["A"])) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]


def test_torch_backend_save_loads_on_other_placements(world):
    paths, _, outs = world
    assert_bitwise(outs[1]["A"], outs[0]["A"], "ranks agree")
    for rank, out in enumerate(outs):
        assert_bitwise(out["A_loaded"], out["A"], f"rank {rank}")
    # a further step after loading equals one device's third step
    model = mlp(hidden=HIDDEN)
    x, y = batch()
    ref_losses = train_one_device(model, adamw(model.parameters()), (x,), (y,), mse, STEPS + 1)
    for i, (got, want) in enumerate(zip(outs[0]["losses"], ref_losses)):
        assert_close(got, want, f"step {i} loss")
    for k, v in model.state_dict().items():
        assert_close(outs[0]["after"][k], v, f"{k} after a step from the checkpoint")
    # threads backend, another mesh: the same checkpoint, and the DTensor one saved by dtensor_state
    for path in (paths["A"], paths["D"]):
        pm = _pm({"0.weight": [S(1), S(0)], "2.weight": [S(0), S(1)]}, seed=8, mesh=sw.Mesh((2, 2), ("a", "b")))
        opt = pm.optimizer(torch.optim.AdamW, lr=1.0)
        pm.load(path, optimizer=opt)
        assert_bitwise(snapshot(pm, opt), outs[0]["A"], path)


def test_fsdp2_checkpoint_loads_into_other_placements(world):
    paths, _, outs = world
    want = outs[0]["fsdp2"]["B"]
    for params, mesh in [(GROUPED, sw.Mesh((2,), ("tp",))), ({"0.weight": [S(1)]}, sw.Mesh((3,), ("dp",))),
                         ({}, sw.Mesh((1,), ("d",)))]:
        pm = _pm(params, seed=4, hidden=6, mesh=mesh)
        opt = pm.optimizer(torch.optim.AdamW, lr=1.0)
        pm.load(paths["B"], optimizer=opt)
        got = snapshot(pm, opt)
        assert_bitwise(got["model"], want["model"], f"model on {mesh}")
        names = [n for n, _ in pm.model.named_parameters()]
        assert_bitwise(_by_name(got["optim"], names), want["optim"]["state"], f"optimizer on {mesh}")
        assert got["optim"]["param_groups"][0]["lr"] == ADAMW["lr"]


def test_fsdp2_job_loads_a_shardwise_checkpoint(world):
    _, saved, outs = world
    names = [n for n, _ in mlp(hidden=6).named_parameters()]
    for rank, out in enumerate(outs):
        got = out["fsdp2"]["C"]
        assert_bitwise(got["model"], saved["model"], f"rank {rank}")
        assert_bitwise(got["optim"]["state"], _by_name(saved["optim"], names), f"rank {rank}")
