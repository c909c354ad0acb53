"""roll, diagonal and as_strided end to end: a small module with Swin's shifted roll over dims (1, 2) and a
diagonal, and a tiny Hugging Face Swin (random weights, no downloads), trained under data parallelism on 2
ranks with an uneven batch of 5: loss and every gradient equal one device's.

    python -m pytest tests/parallel/test_swin.py -q -p no:cacheprovider
"""
import torch

import shardwise as sw
from shardwise import Shard as S

from .harness import check_training

DP = sw.Mesh((2,), ("dp",))


class RollDiagonal(torch.nn.Module):
    """(B, H, W, C) -> rolled back and forth over (H, W) around a linear, then the (H, W) diagonal."""

    def __init__(self, c=3):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(c, c)

    def forward(self, x):
        h = torch.roll(x, shifts=(-2, -2), dims=(1, 2))
        h = torch.roll(torch.tanh(self.lin(h)), shifts=(2, 2), dims=(1, 2)) * x
        d = torch.diagonal(h, offset=1, dim1=1, dim2=2)  # (B, C, 6)
        return d.square().mean() + torch.diag_embed(d).sum(-1).abs().mean()


def test_roll_and_diagonal_data_parallel_uneven_batch():
    x = torch.randn(5, 7, 7, 3)
    pm = check_training(RollDiagonal(), DP, (x,), input_placements={"x": [S(0)]}, steps=2)
    assert set(pm.plan.stats()["collectives"]) <= {"all_reduce"}, pm.plan.summary()


def test_roll_over_a_sharded_dim_moves_it_first():
    """H sharded (7 rows: 4 + 3) and rolled: the roll's rule keeps a rolled dim whole, so the plan moves
    the rows before it (no local roll of a piece), and the step is still exact."""
    x = torch.randn(5, 7, 7, 3)
    pm = check_training(RollDiagonal(), DP, (x,), input_placements={"x": [S(1)]})
    rolls = [line for line in pm.plan.summary().splitlines() if " roll " in line]
    assert rolls and not any("[S(1)] -> [S(1)]" in line or "[S(2)] -> [S(2)]" in line for line in rolls), rolls


class Pooler(torch.nn.Module):
    """Swin's pooler on its own: AdaptiveAvgPool1d(1) over tokens is a mean and an as_strided; its backward
    scatters into flat zeros [B * C] (as_strided_scatter), sharded in blocks of C per row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.pool, self.head = torch.nn.Linear(6, 16), torch.nn.AdaptiveAvgPool1d(1), torch.nn.Linear(16, 3)

    def forward(self, x):
        pooled = self.pool(self.lin(x).transpose(1, 2))  # (B, 16, 1)
        return self.head(torch.flatten(pooled, 1)).square().mean()


def test_pooler_as_strided_data_parallel_uneven_batch():
    """5 rows on 2 ranks: rank 1's piece of the flat zeros is a slice at offset 48 of the gathered buffer
    (as_strided_scatter once wrote its rows before that offset: lin's gradients off by 5e-2)."""
    pm = check_training(Pooler(), DP, (torch.randn(5, 4, 6),), input_placements={"x": [S(0)]})
    lines = [line for line in pm.plan.summary().splitlines() if "as_strided_scatter" in line]
    assert lines and "S(0, unit=16)" in lines[0], lines


def _tiny_swin():
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    cfg = SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[2, 2],
                     window_size=2, num_labels=3, mlp_ratio=2.0, drop_path_rate=0.0)
    return SwinForImageClassification(cfg)


def test_tiny_swin_data_parallel_uneven_batch():
    """Shifted windows (roll), relative position bias (index_put), the pooler's as_strided pair."""
    model = _tiny_swin()
    x, y = torch.randn(5, 3, 16, 16), torch.randint(0, 3, (5,))
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.logits, y)  # noqa: E731
    check_training(model, DP, (x,), (y,), loss_fn=loss_fn, input_placements={0: [S(0)]})
