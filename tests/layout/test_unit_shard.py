"""Shard(dim, unit=u): torch.chunk of whole blocks of u elements, through layouts and redistribution."""
import itertools

import pytest
import torch

import shardwise as sw
from shardwise import Partial as P, Replicate as R, Shard as S


def test_local_extents_are_whole_blocks():
    lay = sw.Layout((40, 3), torch.float32, [S(0, unit=8)])
    mesh = sw.Mesh((2,))
    assert [lay.local_shape(mesh, r) for r in range(2)] == [(24, 3), (16, 3)]
    assert [lay.local_offset(mesh, r) for r in range(2)] == [(0, 0), (24, 0)]
    nested = sw.Layout((40, 3), torch.float32, [S(0, unit=8), S(0, unit=8)])
    mesh2 = sw.Mesh((2, 2))
    assert [nested.local_shape(mesh2, r)[0] for r in range(4)] == [16, 8, 8, 8]
    assert repr(S(0, unit=8)) == "Shard(0, unit=8)" and S(0, unit=1) == S(0)


def test_bad_units_fail_early():
    with pytest.raises(sw.ShardingError, match="multiple of 8"):
        sw.Layout((30, 3), torch.float32, [S(0, unit=8)])
    with pytest.raises(sw.ShardingError, match="positive int"):
        S(0, unit=0)


@pytest.mark.parametrize("shape", [(2,), (2, 2), (3,)])
def test_round_trips_through_unit_shards(shape):
    mesh = sw.Mesh(shape)
    x = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    choices = [R(), S(0), S(1), S(0, unit=8), S(0, unit=4)]
    layouts = []
    for pl in itertools.product(choices, repeat=mesh.ndim):
        try:  # a unit shard nested in a chunk that is not whole blocks is refused, not truncated
            sw.distribute(x, mesh, list(pl))
            layouts.append(pl)
        except sw.ShardingError as e:
            assert "not a multiple of" in str(e) and isinstance(pl[0], S) and pl[0].dim == 0
    assert len(layouts) >= len(choices) ** mesh.ndim - 4
    for src, dst in itertools.product(layouts, repeat=2):
        moved = sw.redistribute(sw.distribute(x, mesh, list(src)), mesh, list(src), list(dst))
        assert torch.equal(sw.collect(moved, mesh, list(dst)), x), (src, dst)


def test_partial_to_unit_shard_is_one_reduce_scatter():
    mesh = sw.Mesh((2,))
    lay = sw.Layout((40, 3), torch.float32, [P()])
    steps = sw.plan_redistribute(lay, [S(0, unit=8)], mesh)
    assert [s.kind for s in steps] == ["reduce_scatter"]
    parts = [torch.randn(40, 3), torch.randn(40, 3)]
    out = sw.redistribute(parts, mesh, [P()], [S(0, unit=8)])
    assert [t.shape[0] for t in out] == [24, 16]
    torch.testing.assert_close(torch.cat(out), parts[0] + parts[1])


def test_canonical_spells_a_unit_that_changes_nothing_as_the_plain_shard():
    """Layout.canonical: the spelling the rules plan with (rules/view.py takes no other), kept only
    where the unit changes some rank's extents, also under nesting."""
    mesh, mesh2 = sw.Mesh((4,)), sw.Mesh((2, 4))
    assert sw.Layout((32, 3), torch.float32, [S(0, unit=8)]).canonical(mesh).placements == (S(0),)
    uneven = sw.Layout((48, 3), torch.float32, [S(0, unit=8)])  # 6 blocks on 4 ranks: 2, 2, 1, 1 of them
    assert uneven.canonical(mesh) is uneven
    nested = sw.Layout((64, 3), torch.float32, [S(0), S(0, unit=8)])  # every dp chunk 4 blocks, 1 per tp rank
    assert nested.canonical(mesh2).placements == (S(0), S(0))
    inner = sw.Layout((48, 3), torch.float32, [S(1), S(0, unit=4, groups=3)])  # groups are kept
    assert inner.canonical(mesh2).placements == (S(1), S(0, groups=3))
    for lay in (uneven, nested, inner):  # the same extents on every rank, whichever spelling
        m = mesh if lay is uneven else mesh2
        assert all(lay.canonical(m).extents(m, r) == lay.extents(m, r) for r in range(m.size))


def test_user_placements_are_canonical():
    """A parameter given a unit shard that splits it as the plain shard would is planned as that
    one: before, the view after it refused the spelling and the plan moved it by all_to_alls."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mesh, x = sw.Mesh((4,), ("tp",)), torch.randn(3, 4)
    pm = sw.parallelize(model, mesh, (x,), param_placements={"0.weight": [S(0, unit=8)], "2.weight": [S(1, unit=8)]})
    assert pm.specs["0.weight"] == (S(0),) and pm.specs["2.weight"] == (S(1),)
