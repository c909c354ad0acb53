"""roll (rules/shift.py): dims not rolled shard alike; a dim rolled by a multiple of its size shards too
(the identity); dims=[] rolls the flat tensor and stays whole. Meshes (2,), (3,), (2, 2), uneven sizes.

    python -m pytest tests/rules/test_shift.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMIN = Replicate(), Partial(), Partial("min")


def test_swin_shifted_windows():
    """Swin: roll (B, H, W, C) by (-s, -s) over (1, 2): batch and channels stay sharded."""
    check(aten.roll.default, torch.randn(5, 7, 7, 3), [-2, -2], [1, 2],
          expect=[((S(0),), (S(0),)), ((S(3),), (S(3),)), ((P,), (P,)), ((PMIN,), (PMIN,))],
          absent=[((S(1),), (S(1),)), ((S(2),), (S(2),))])


def test_a_roll_by_a_whole_turn_keeps_its_dim_sharded():
    # dim 1 rolls by 7 == its size (the identity), dim 2 by 2 of 3; negative dims and a dim named twice
    check(aten.roll.default, torch.randn(5, 7, 3), [7, 2], [1, 2], expect=[((S(1),), (S(1),))],
          absent=[((S(2),), (S(2),))])
    check(aten.roll.default, torch.randn(5, 7, 3), [3, 4, 1], [-2, 1, -1], expect=[((S(1),), (S(1),))],
          absent=[((S(2),), (S(2),))])
    check(aten.roll.default, torch.randn(5, 7, 3), [3, 1], [-2, 1], absent=[((S(1),), (S(1),))])


def test_flat_roll_is_replicated():
    report = check(aten.roll.default, torch.randn(5, 7), [3], expect=[((R,), (R,)), ((P,), (P,))],
                   absent=[((S(0),), (S(0),)), ((S(1),), (S(1),))])
    assert len({r.strategy for r in report.results if r.mesh == (2,)}) == 4  # R and three Partials
