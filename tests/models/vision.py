"""Small vision models for end-to-end tests: a ResNet with BatchNorm, a convolutional net for
channel tensor parallelism, a stack of convolutions for spatial (halo) sharding and a
ViT-style patch embedding. Tiny sizes with odd extents so shards come out uneven.

    python -c "from tests.models import vision; print(vision.resnet())"
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise import Shard


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a shortcut (1x1 conv + bn when the shape changes), as in ResNet."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 5, width: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet(batch: int = 5, seed: int = 0):
    """(model in train mode, images [batch, 3, 9, 9], labels)."""
    torch.manual_seed(seed)
    model = TinyResNet().train()
    g = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(batch, 3, 9, 9, generator=g), torch.randint(0, 5, (batch,), generator=g)


class ChannelNet(nn.Module):
    """Column-parallel conv, depthwise conv (shards by group), GroupNorm in whole groups, then a
    row-parallel conv (Partial output): Megatron's MLP pattern on channels."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.dw = nn.Conv2d(width, width, 3, padding=1, groups=width)
        self.norm = nn.GroupNorm(4, width)
        self.conv2 = nn.Conv2d(width, 4, 1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.norm(F.gelu(self.dw(F.relu(self.conv1(x)))))
        x = self.pool(self.up(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


CHANNEL_TP = {"conv1.weight": {"tp": Shard(0)}, "conv1.bias": {"tp": Shard(0)}, "dw.weight": {"tp": Shard(0)},
              "dw.bias": {"tp": Shard(0)}, "norm.weight": {"tp": Shard(0)}, "norm.bias": {"tp": Shard(0)},
              "conv2.weight": {"tp": Shard(1)}}


def channel_net(batch: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return ChannelNet(), torch.randn(batch, 3, 7, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)


class ConvStack(nn.Module):
    """Convolutions and pools whose windows overlap shard boundaries: 3x3, a max pool (ceil
    mode), a strided dilated 5x5, an average pool, a 1-d conv over the width, so a
    height-sharded image needs halos of 1 to 4 rows."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.pool1 = nn.MaxPool2d(3, 1, 1, ceil_mode=True)
        self.c2 = nn.Conv2d(4, 4, 5, stride=2, padding=3, dilation=2)
        self.pool2 = nn.AvgPool2d(3, 1, 1)
        self.c3 = nn.Conv2d(4, 3, (1, 3), padding=(0, 1))

    def forward(self, x):
        return self.c3(self.pool2(torch.tanh(self.c2(self.pool1(F.relu(self.c1(x)))))))


def conv_stack(batch: int = 2, height: int = 20, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = ConvStack()
    x = torch.randn(batch, 2, height, 9, generator=g)
    with torch.no_grad():
        shape = model(x).shape
    return model, x, torch.randn(shape, generator=g)


class PatchEmbedNet(nn.Module):
    """ViT's patch embedding (conv with kernel = stride = patch), tokens plus a position
    embedding, a row-parallel MLP layer, layer norm, mean over tokens, a classifier."""

    def __init__(self, dim: int = 10, patch: int = 4, image: int = 12, hidden: int = 14, classes: int = 4):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, dim) * 0.1)
        self.fc = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        tokens = self.proj(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(F.gelu(self.norm(self.fc(tokens))).mean(1))


PATCH_TP = {"proj.weight": {"tp": Shard(0)}, "proj.bias": {"tp": Shard(0)}, "pos": {"tp": Shard(2)},
            "fc.weight": {"tp": Shard(1)}}


def patch_embed(batch: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return PatchEmbedNet(), torch.randn(batch, 3, 12, 12, generator=g), torch.randint(0, 4, (batch,), generator=g)


class InstanceNet(nn.Module):
    """A conv (no bias: instance norm cancels it, and a gradient that is zero in exact
    arithmetic is float noise AdamW would amplify) + InstanceNorm + a classifier."""

    def __init__(self, track: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=track)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.norm(self.conv(x))).mean((2, 3)))


def instance_net(track: bool = False, batch: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(batch, 3, 6, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)
    return InstanceNet(track).train(), x, y
