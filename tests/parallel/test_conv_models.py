"""Vision models against one device (loss, every gradient, parameters and buffers after AdamW
steps): a ResNet with BatchNorm in train mode under data parallelism with uneven batches
(running statistics included), channel tensor parallelism on a (2, 2) mesh, a height-sharded
image on 3 ranks (halo exchanges), and a ViT-style patch embedding data and tensor parallel.

Run: python -m pytest tests/parallel/test_conv_models.py -q -p no:cacheprovider
"""
import copy

import pytest
import torch.nn.functional as F

import shardwise as sw
from shardwise import Shard as S

from shardwise.lower.rows import node_rows

from ..models import vision
from .harness import assert_close, check_training


def collectives(pm):
    return pm.plan.stats()["collectives"]


@pytest.mark.parametrize("dp,batch", [(2, 5), (4, 7), (4, 3)])
def test_resnet_batchnorm_data_parallel(dp, batch):
    """BatchNorm trains: statistics over the whole (uneven; on 4 ranks with 3 images one rank
    holds none) batch, so loss, gradients, weights and running statistics equal one device's
    after 2 steps, with no model change."""
    model, x, y = vision.resnet(batch)
    pm = check_training(model, sw.Mesh((dp,), ("dp",)), (x,), (y,), F.cross_entropy, steps=2,
                        input_placements={0: [S(0)]})
    # every activation stays batch-sharded: only all-reduces (statistics, gradients, loss)
    assert set(collectives(pm)) == {"all_reduce"}
    assert int(pm.state_dict()["stem.1.num_batches_tracked"]) == 2


def test_channel_tensor_parallel_2x2():
    """Column-parallel conv, depthwise conv and GroupNorm by whole groups, row-parallel 1x1 conv
    on "tp"; batch on "dp"."""
    model, x, y = vision.channel_net()
    tp = {n: {"tp": p["tp"]} for n, p in vision.CHANNEL_TP.items()}
    pm = check_training(model, sw.Mesh((2, 2), ("dp", "tp")), (x,), (y,), F.cross_entropy, steps=2,
                        input_placements={0: {"dp": S(0)}}, param_placements=tp)
    channel_ops = ("convolution", "native_group_norm")
    rows = [r for r in node_rows(pm.plan) if r.op.startswith(channel_ops)]
    assert len(rows) == 8  # 3 convolutions and a group norm, forward and backward ...
    # ... every one channel-sharded on "tp" and fed without communication
    assert all(not r.collectives for r in rows), pm.plan.summary()
    assert [r.outs[0][1] for r in rows if r.op == "convolution"] == [S(1), S(1), sw.Partial()], pm.plan.summary()


def test_height_sharded_halo_3_ranks():
    """An image 20 rows high on 3 ranks (7, 7, 6): every conv and pool keeps the height sharded
    and reads its neighbours' rows through send_recv halo exchanges, counted by plan.stats()."""
    model, x, y = vision.conv_stack()
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    pm = check_training(model, sw.Mesh((3,), ("sp",)), (x,), (y,), mse, steps=2,
                        input_placements={0: [S(2)]}, target_placements={0: [S(2)]})
    c = collectives(pm)
    assert c.get("send_recv", 0) >= 4, c  # c1, c2 forward; their backward's gather and return
    assert "all_gather" not in c and "all_to_all" not in c, pm.plan.summary()
    assert "halo" in pm.plan.summary()


@pytest.mark.parametrize("mesh,tp", [((2,), False), ((2, 2), True)])
def test_vit_patch_embedding(mesh, tp):
    model, x, y = vision.patch_embed()
    names = ("dp", "tp")[:len(mesh)]
    kwargs = {"input_placements": {0: {"dp": S(0)}}}
    if tp:
        kwargs["param_placements"] = vision.PATCH_TP
    pm = check_training(model, sw.Mesh(mesh, names), (x,), (y,), F.cross_entropy, steps=2, **kwargs)
    if tp:
        assert "all_gather" not in collectives(pm), pm.plan.summary()


@pytest.mark.parametrize("track", [False, True])
def test_instance_norm_data_parallel(track):
    """InstanceNorm runs batch norm on [1, N*C, H, W]: the batch shard arrives there as
    Shard(1, unit=C) and batch norm takes it as is (no communication for activations); with
    running statistics tracked they update as on one device."""
    model, x, y = vision.instance_net(track)
    pm = check_training(model, sw.Mesh((2,), ("dp",)), (x,), (y,), F.cross_entropy, steps=2,
                        input_placements={0: [S(0)]})
    assert set(collectives(pm)) == {"all_reduce"}, pm.plan.summary()


def test_hugging_face_vit_and_resnet_data_parallel():
    """Hugging Face ViT (patch embedding conv) and ResNet (BatchNorm in train mode, running
    statistics compared) with tiny configs, batch 5 on ("dp", 2)."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (5,), generator=g)
    logits_ce = lambda out, t: F.cross_entropy(out.logits, t)  # noqa: E731
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3))
    resnet = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)).train()
    for model, size in ((vit, 16), (resnet, 32)):
        x = torch.randn(5, 3, size, size, generator=g)
        # eps: the attention key bias's gradient is zero in exact arithmetic (softmax ignores a
        # per-query constant), float noise that AdamW's m / sqrt(v) would blow up to a full step
        pm = check_training(model, sw.Mesh((2,), ("dp",)), (x,), (y,), logits_ce, steps=2,
                            input_placements={0: [S(0)]}, optim_kwargs={"eps": 1e-2})
        assert set(collectives(pm)) == {"all_reduce"}, pm.plan.summary()


def test_forward_in_train_mode_updates_running_statistics():
    """pm(x) in training mode normalises with the batch's statistics and updates the running
    ones, as model(x) does; after pm.eval() the running ones are used."""
    model, x, _ = vision.resnet(5)
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [S(0)]})
    assert_close(pm(x), ref(x), "train-mode forward")
    state = pm.state_dict()
    for n, t in ref.state_dict().items():
        assert_close(state[n], t, f"{n} after a train-mode forward")
    pm.eval()
    ref.eval()
    assert_close(pm(x), ref(x), "eval-mode forward")
