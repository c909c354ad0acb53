"""rot90, channel_shuffle, _chunk_cat, block_diag, zero, resize_as (rules/rearrange.py): every strategy verified
on meshes (2,), (3,), (2, 2) with uneven sizes; the dims each op reverses or joins stay whole.

    python -m pytest tests/rules/test_rearrange.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.errors import ShardingError
from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX = Replicate(), Partial(), Partial("max")


def _r(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("k", [0, 1, 2, 3, -1, 5])
def test_rot90_moves_the_unflipped_dim(k):
    """k = 1: input dim a becomes output dim b; k = 3: b becomes a; k = 2 flips both; batch dim 2 always."""
    moved = {0: [((S(0),), (S(0),)), ((S(1),), (S(1),))], 1: [((S(0),), (S(1),))], 2: [], 3: [((S(1),), (S(0),))]}[k % 4]
    flipped = {0: [], 1: [((S(1),), (S(0),)), ((S(0),), (S(0),))], 2: [((S(0),), (S(0),)), ((S(1),), (S(1),))],
               3: [((S(0),), (S(1),)), ((S(1),), (S(1),))]}[k % 4]
    check(aten.rot90.default, _r(5, 7, 3), k, [0, 1], expect=moved + [((S(2),), (S(2),)), ((P,), (P,))], absent=flipped)


def test_rot90_other_dims():
    check(aten.rot90.default, _r(3, 5, 7), 1, [2, 0], expect=[((S(2),), (S(0),)), ((S(1),), (S(1),))],
          absent=[((S(0),), (S(2),))])


def test_channel_shuffle_keeps_whole_blocks():
    """12 channels in 3 groups of 4: a chunk of every group is a run of whole 3-blocks of the output, a run
    of whole groups a chunk of every 4-block; a plain chunk of the channels stays whole."""
    check(aten.channel_shuffle.default, _r(5, 12, 3), 3,
          expect=[((S(0),), (S(0),)), ((S(2),), (S(2),)), ((S(1, groups=3),), (S(1, unit=3),)),
                  ((S(1, unit=4),), (S(1, groups=4),)), ((PMAX,), (PMAX,))],
          absent=[((S(1),), (S(1),))])
    # 3 groups of 5 over 2 and 3 ranks: uneven chunks of each group, and ranks holding a single group
    check(aten.channel_shuffle.default, _r(3, 15, 2, 2), 3, expect=[((S(1, unit=5),), (S(1, groups=5),))])


def test_chunk_cat_shards_the_leading_dims():
    ts = [_r(5, 7, 3), _r(5, 4)]
    check(aten._chunk_cat.default, ts, 1, 3, expect=[((S(0), S(0)), (S(0),)), ((P, P), (P,))],
          absent=[((S(1), S(1)), (S(1),))])
    check(aten._chunk_cat.default, [_r(3, 5, 6), _r(3, 5, 2)], 2, 2, expect=[((S(1), S(1)), (S(1),))])


def test_block_diag_is_replicated_or_partial():
    check(aten.block_diag.default, [_r(5, 3), _r(2, 4), _r(3)], expect=[((R, R, R), (R,)), ((P, P, P), (P,))])


def test_zero_follows_self():
    check(aten.zero.default, _r(5, 7), expect=[((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,))])


def test_resize_as_same_shape():
    check(aten.resize_as.default, _r(5, 7), _r(5, 7), expect=[((S(1), S(1)), (S(1),)), ((P, R), (P,))],
          absent=[((S(0), R), (S(0),))])


def test_resize_as_that_changes_the_shape_is_refused():
    from shardwise.rules import DEFAULT, OpCall, load_all

    load_all()
    x, t = _r(5, 7), _r(7, 5)
    call = OpCall.from_values(aten.resize_as.default, (x, t), {}, aten.resize_as.default(x.clone(), t))
    with pytest.raises(ShardingError, match="changes the shape") as e:
        DEFAULT.get(aten.resize_as.default).strategies(call)
    assert e.value.fix
