"""Shard(dim, groups=g): a dim made of g equal parts (a fused [q|k|v]), each part split on its
own, through layouts, redistribution and collect; the rules that make and undo such shards."""
import itertools

import pytest
import torch

import shardwise as sw
from shardwise import Partial as P, Replicate as R, Shard as S

aten = torch.ops.aten


def test_every_rank_holds_its_chunk_of_every_part():
    x = torch.arange(15).reshape(1, 15)  # parts [0..4] [5..9] [10..14]
    mesh = sw.Mesh((2,))
    lay = sw.Layout(x.shape, x.dtype, [S(1, groups=3)])
    assert [lay.local_shape(mesh, r) for r in range(2)] == [(1, 9), (1, 6)]  # chunks of 5: 3 + 2
    assert sw.distribute(x, mesh, [S(1, groups=3)])[1].tolist() == [[3, 4, 8, 9, 13, 14]]
    assert lay.extents(mesh, 1) == [(1, 0, 1), (3, 3, 2)]
    assert repr(S(1, groups=3)) == "Shard(1, groups=3)" and S(1, groups=1) == S(1)


def test_no_single_offset_and_no_nesting():
    mesh = sw.Mesh((2,))
    lay = sw.Layout((4, 6), torch.float32, [S(1, groups=3)])
    with pytest.raises(sw.ShardingError, match="not one contiguous run"):
        lay.local_offset(mesh, 0)
    with pytest.raises(sw.ShardingError, match="multiple of 3"):
        sw.Layout((4, 7), torch.float32, [S(1, groups=3)])
    with pytest.raises(sw.ShardingError, match="cannot nest"):
        sw.Layout((4, 6), torch.float32, [S(1, groups=3), S(1)])
    with pytest.raises(sw.ShardingError, match="positive int"):
        S(0, groups=0)


@pytest.mark.parametrize("shape", [(2,), (3,), (2, 2)])
def test_round_trips_through_grouped_shards(shape):
    """Every pair of layouts, uneven parts included (5 per part over 2 or 3 ranks)."""
    mesh = sw.Mesh(shape)
    x = torch.arange(4 * 15, dtype=torch.float32).reshape(4, 15)
    choices = [R(), S(0), S(1), S(1, groups=3), S(1, groups=5), S(0, groups=2)]
    layouts = []
    for pl in itertools.product(choices, repeat=mesh.ndim):
        try:
            sw.distribute(x, mesh, list(pl))
            layouts.append(pl)
        except sw.ShardingError as e:  # only the refused nestings
            assert "cannot nest" in str(e)
    for src, dst in itertools.product(layouts, repeat=2):
        moved = sw.redistribute(sw.distribute(x, mesh, list(src)), mesh, list(src), list(dst))
        for got, want in zip(moved, sw.distribute(x, mesh, list(dst))):
            assert torch.equal(got, want), (src, dst)


def test_partial_to_grouped_is_one_reduce_scatter():
    mesh = sw.Mesh((2,))
    parts = [torch.randn(3, 12), torch.randn(3, 12)]
    lay = sw.Layout((3, 12), torch.float32, [P()])
    assert [s.kind for s in sw.plan_redistribute(lay, [S(1, groups=3)], mesh)] == ["reduce_scatter"]
    out = sw.redistribute(parts, mesh, [P()], [S(1, groups=3)])
    torch.testing.assert_close(sw.collect(out, mesh, [S(1, groups=3)]), parts[0] + parts[1])


@pytest.mark.parametrize("op, args", [
    (aten.split.Tensor, (torch.randn(2, 5, 12), 4, 2)),
    (aten.split_with_sizes.default, (torch.randn(3, 10), [5, 5], 1)),
    (aten.chunk.default, (torch.randn(2, 9), 3, 1)),
    (aten.cat.default, ([torch.randn(2, 5, 4) for _ in range(3)], 2)),
    (aten.cat.default, ([torch.randn(3, 5), torch.randn(3, 5)], 1)),
])
def test_split_and_cat_of_parts_are_verified(op, args):
    """split into the parts of a grouped dim gives plain shards; cat of plain shards of equal
    pieces gives the grouped shard (the backward of a fused split)."""
    report = sw.verify_rule(op, *args)
    assert report.ok, report
    grouped = [r for r in report.results if any(isinstance(p, S) and p.groups > 1
                                                 for pls in r.strategy.ins + r.strategy.outs for p in pls)]
    assert len(grouped) >= 3, report


def test_views_carry_groups():
    """A kept dim keeps its groups; merging a sharded inner dim with the dims before it makes
    groups of them ([b, s] seq-sharded -> [b*s] is every rank's chunk of each sequence); the
    split back undoes it. Every variant is checked against one device by the verifier."""
    def has(report, src, dst):
        return any(r.strategy.ins[0][0] == src and r.strategy.outs[0][0] == dst for r in report.results)

    keep = sw.verify_rule(aten.view.default, torch.randn(16, 12), [2, 8, 12])
    assert keep.ok and has(keep, S(1, groups=3), S(2, groups=3)), keep
    merge = sw.verify_rule(aten.view.default, torch.randn(2, 7, 4), [14, 4])
    assert merge.ok and has(merge, S(1), S(0, groups=2)), merge
    split = sw.verify_rule(aten.view.default, torch.randn(14, 4), [2, 7, 4])
    assert split.ok and has(split, S(0, groups=2), S(1)), split
    nested = sw.verify_rule(aten.view.default, torch.randn(4, 12), [48])
    assert nested.ok and has(nested, S(1), S(0, groups=4)), nested
