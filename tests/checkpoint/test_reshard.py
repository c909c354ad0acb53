"""Sharded checkpoints on the threads backend: save on one mesh and placements, load on another,
parameters and AdamW state (exp_avg, exp_avg_sq, step) bit for bit; training then continues as on
one device. Grouped (groups=3) and unit (unit=8) shards, uneven and empty shards included.

    python -m pytest tests/checkpoint/test_reshard.py -q --durations=0
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardwise as sw
from shardwise import Replicate as R, Shard as S, recipes
from shardwise.module.checkpoint import ShardChunks, apply_groups, rank_chunks
from shardwise.module.checkpoint.chunks import writes
from tests.models import zoo
from tests.parallel.harness import assert_close

from .helpers import ADAMW, adamw, assert_bitwise, batch, fake_steps, mlp, snapshot, train, train_one_device

LR = 1e-2


def lm(seed=0):
    return zoo.transformer(batch=4, seq=8, seed=seed)


def test_fsdp_4_to_megatron_2x2_and_one_device(tmp_path):
    """(4,) FSDP-style after 2 AdamW steps -> (2, 2) data x Megatron tensor parallel, and -> one
    device: bitwise equal; a further step equals one device's."""
    model, inputs, targets, loss_fn = lm()
    ref = copy.deepcopy(model)
    ref_opt = adamw(ref.parameters())
    pm = sw.parallelize(copy.deepcopy(model), sw.Mesh((4,), ("dp",)), inputs, loss_fn=loss_fn,
                        input_placements={0: [S(0)]}, param_placements=recipes.fsdp(model, "dp"))
    opt = pm.optimizer(torch.optim.AdamW, **ADAMW)
    train(pm, opt, inputs, targets, 2)
    train_one_device(ref, ref_opt, inputs, targets, loss_fn, 2)
    saved = snapshot(pm, opt)
    # the full optimizer state is what one device's AdamW holds, in its format
    want = ref_opt.state_dict()
    assert saved["optim"]["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            assert_close(saved["optim"]["state"][i][k], v, f"optimizer state {i}.{k}", rtol=1e-4, atol=1e-6)
    pm.save(tmp_path / "ck", optimizer=opt)

    other = lm(seed=7).model  # other weights: the load has to overwrite every one
    megatron = sw.parallelize(copy.deepcopy(other), sw.Mesh((2, 2), ("dp", "tp")), inputs, loss_fn=loss_fn,
                              input_placements={0: {"dp": S(0)}},
                              param_placements=recipes.megatron(other, "tp", family="gpt"))
    assert any(p.groups == 3 for spec in megatron.specs.values() for p in spec if isinstance(p, S))
    one = sw.parallelize(copy.deepcopy(other), sw.Mesh((1,), ("d",)), inputs, loss_fn=loss_fn)
    opts = {}
    for name, target in {"megatron": megatron, "one": one}.items():
        opts[name] = target.optimizer(torch.optim.AdamW, lr=123.0)  # hyperparameters come from the checkpoint
        target.load(tmp_path / "ck", optimizer=opts[name])
        assert_bitwise(snapshot(target, opts[name]), saved, name)
    # plain torch on one device reads the same checkpoint with DCP's own state-dict helpers
    plain = copy.deepcopy(other)
    plain_opt = adamw(plain.parameters())
    msd, osd = get_state_dict(plain, plain_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    set_state_dict(plain, plain_opt, model_state_dict=msd, optim_state_dict=osd)
    assert_bitwise(plain.state_dict(), saved["model"], "plain")
    assert_bitwise(plain_opt.state_dict(), saved["optim"], "plain")

    # a further step equals one device's (the module that trained continuously)
    ref_loss = train_one_device(ref, ref_opt, inputs, targets, loss_fn, 1)[0]
    losses = {"megatron": train(megatron, opts["megatron"], inputs, targets, 1)[0],
              "plain": train_one_device(plain, plain_opt, inputs, targets, loss_fn, 1)[0]}
    for name, loss in losses.items():
        assert_close(loss, ref_loss, f"{name}: loss after loading")
    for name, state in {"megatron": megatron.state_dict(), "plain": plain.state_dict()}.items():
        for k, v in ref.state_dict().items():
            assert_close(state[k], v, f"{name}: {k} after a step from the checkpoint", rtol=1e-4, atol=1e-5)


# (mesh shape, names, placements) over mlp(hidden=24): uneven, empty, nested, unit and grouped shards
GROUPED = ((2, 2), ("dp", "tp"), {"0.weight": {"dp": S(0, unit=8)}, "0.bias": {"tp": S(0, groups=3)},
                                  "2.weight": {"dp": S(0), "tp": S(1, groups=3)}, "2.bias": {"dp": S(0)}})
PLAIN3 = ((3,), ("dp",), {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)], "2.bias": [S(0)]})
UNIT4 = ((4,), ("dp",), {"0.weight": [S(0, unit=8)], "0.bias": [S(0, groups=3)], "2.weight": [S(1, groups=3)],
                         "2.bias": [R()]})
NESTED = ((2, 2), ("a", "b"), {"0.weight": [S(0), S(0)], "0.bias": [S(0), S(0)], "2.weight": [S(1), S(0)],
                               "2.bias": [R(), S(0)]})


def _pm(layout, seed=0):
    shape, names, params = layout
    model = mlp(hidden=24, seed=seed)
    x, _ = batch()
    return sw.parallelize(model, sw.Mesh(shape, names), (x,), loss_fn=lambda o, y: ((o - y) ** 2).mean(),
                          param_placements=params)


def test_grouped_and_unit_shards_round_trip(tmp_path):
    """groups=3 and unit=8 shards (with an empty rank) save and load through plain and nested ones."""
    src = _pm(GROUPED)
    opt = src.optimizer(torch.optim.AdamW, lr=LR)
    fake_steps(src, opt)
    saved = snapshot(src, opt)
    src.save(tmp_path / "a", optimizer=opt)
    md = dcp.FileSystemReader(str(tmp_path / "a")).read_metadata()
    # a grouped shard is several rectangular chunks: 3 parts of 8, each split 4 + 4 over tp
    chunks = md.state_dict_metadata["model.0.bias"].chunks
    assert sorted((c.offsets[0], c.sizes[0]) for c in chunks) == [(i * 4, 4) for i in range(6)]
    # unit=8 over dp: 24 = 3 blocks of 8 split 2 + 1 blocks, each written once (not per tp replica)
    chunks = md.state_dict_metadata["optim.state.0.weight.exp_avg"].chunks
    assert sorted((c.offsets[0], c.sizes[0]) for c in chunks) == [(0, 16), (16, 8)]
    prev, path = saved, tmp_path / "a"
    for i, layout in enumerate([PLAIN3, UNIT4, NESTED]):
        dst = _pm(layout, seed=10 + i)
        opt_d = dst.optimizer(torch.optim.AdamW, lr=1.0)
        dst.load(path, optimizer=opt_d)
        assert_bitwise(snapshot(dst, opt_d), prev, f"into {layout[0]}")
        path = tmp_path / f"b{i}"
        dst.save(path, optimizer=opt_d)


def test_rank_chunks_cover_every_element_once():
    """Writer chunks of every placement tile the tensor exactly once; every rank's chunks are its shard."""
    mesh = sw.Mesh((2, 3), ("a", "b"))
    full = torch.arange(48 * 10.).reshape(48, 10)
    for placements in ([S(0, groups=3), S(1)], [S(0, unit=8), S(0)], [R(), S(0, unit=4, groups=2)],
                       [S(1), S(1)], [R(), R()]):
        lay = sw.Layout(full.shape, full.dtype, placements, mesh)
        locals_ = sw.distribute(full, mesh, placements)
        seen = torch.zeros_like(full)
        sc = ShardChunks(full.shape, full.dtype, [], 0)
        for rank in range(mesh.size):
            for off, t in rank_chunks(lay, mesh, rank, locals_[rank]):
                region = full[off[0]:off[0] + t.shape[0], off[1]:off[1] + t.shape[1]]
                assert torch.equal(t, region), (placements, rank, off)
                if writes(lay, mesh, rank):
                    seen[off[0]:off[0] + t.shape[0], off[1]:off[1] + t.shape[1]] += 1
        assert torch.equal(seen, torch.ones_like(full)), placements
    with pytest.raises(TypeError, match="only carries shards"):
        sc.sum()


def test_dcp_save_and_load_accept_sharded_state_dicts(tmp_path):
    """Users who drive DCP themselves: dcp.save / dcp.load on pm.sharded_state_dict(opt) directly."""
    src = _pm(GROUPED)
    opt = src.optimizer(torch.optim.AdamW, lr=LR)
    fake_steps(src, opt)
    saved = snapshot(src, opt)
    dcp.save(src.sharded_state_dict(opt), checkpoint_id=str(tmp_path / "d"), no_dist=True)
    dst = _pm(NESTED, seed=4)
    opt_d = dst.optimizer(torch.optim.AdamW, lr=7.0)
    fake_steps(dst, opt_d, seed=9)  # state exists (other values), so the dict has tensors to fill
    sd = dst.sharded_state_dict(opt_d)
    dcp.load(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert sd["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    apply_groups(opt_d, sd["optim"]["param_groups"])  # hyperparameters are values, not tensors to fill
    assert_bitwise(snapshot(dst, opt_d), saved)



@pytest.mark.parametrize("cls,kwargs", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                        (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
                                        (torch.optim.SGD, dict(lr=0.1))],
                         ids=["sgd_momentum", "adam_amsgrad", "sgd_plain"])
def test_other_elementwise_optimizers_round_trip(tmp_path, cls, kwargs):
    """Any state laid out like its parameter (momentum_buffer, max_exp_avg_sq) reshards too, plain
    values (plain SGD's momentum_buffer None) come back as they were."""
    src = _pm(GROUPED)
    opt = src.optimizer(cls, **kwargs)
    fake_steps(src, opt)
    src.save(tmp_path / "ck", optimizer=opt)
    dst = _pm(UNIT4, seed=6)
    opt_d = dst.optimizer(cls, lr=5.0)
    dst.load(tmp_path / "ck", optimizer=opt_d)
    assert_bitwise(snapshot(dst, opt_d), snapshot(src, opt))
    assert opt_d.param_groups[0]["lr"] == kwargs["lr"]
