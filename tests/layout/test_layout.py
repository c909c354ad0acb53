"""Mesh, placements and Layout: local shapes/offsets against torch, and bad input errors.

Run: python -m pytest tests/layout/test_layout.py -q -p no:cacheprovider
"""
import itertools

import pytest
import torch

import shardwise as sw
from shardwise.core.layout import chunk_bounds, normalize_placements


def _chunks(t, n, dim):
    """torch.chunk semantics padded to exactly n pieces (trailing pieces empty)."""
    c = -(-t.shape[dim] // n)
    idx = [min(i * c, t.shape[dim]) for i in range(1, n)]
    pieces = list(torch.tensor_split(t, idx, dim=dim))
    real = torch.chunk(t, n, dim=dim) if t.shape[dim] else ()
    for a, b in zip(real, pieces):  # the non-empty ones are exactly torch.chunk's
        assert torch.equal(a, b)
    return pieces


def _local(x, layout, mesh, r):
    for d, (off, n) in enumerate(layout.shard_bounds(mesh, r)):
        x = x.narrow(d, off, n)
    return x


@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 8, 12])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_1d_mesh_matches_torch_chunk(size, n):
    mesh = sw.Mesh((n,))
    x = torch.arange(size * 3).reshape(size, 3)
    layout = sw.Layout(x.shape, x.dtype, [sw.Shard(0)], mesh)
    want = _chunks(x, n, 0)
    for r in range(n):
        assert layout.local_shape(mesh, r) == tuple(want[r].shape)
        off = layout.local_offset(mesh, r)
        assert off[1] == 0 and torch.equal(x[off[0]:off[0] + want[r].shape[0]], want[r])
        assert chunk_bounds(size, n, r)[1] == want[r].shape[0]


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2), (1, 4)])
@pytest.mark.parametrize("shape", [(12, 6), (7, 5), (2, 3), (0, 4)])
def test_nested_2d_mesh_matches_nested_chunks(mesh_shape, shape):
    mesh = sw.Mesh(mesh_shape)
    x = torch.arange(max(1, torch.Size(shape).numel())).reshape(-1)[: torch.Size(shape).numel()].reshape(shape)
    specs = itertools.product([sw.Replicate(), sw.Shard(0), sw.Shard(1), sw.Partial()], repeat=2)
    for spec in specs:
        layout = sw.Layout(shape, x.dtype, spec, mesh)
        for r in range(mesh.size):
            want = x
            for m, p in enumerate(spec):  # mesh dim 0 splits first: nested in mesh-dim order
                if isinstance(p, sw.Shard):
                    want = _chunks(want, mesh.shape[m], p.dim)[mesh.coord(r)[m]]
            got = _local(x, layout, mesh, r)
            assert layout.local_shape(mesh, r) == tuple(want.shape), (spec, r)
            assert torch.equal(got, want), (spec, r)


def test_empty_shards_and_offsets():
    mesh = sw.Mesh((4,))
    layout = sw.Layout((2, 5), torch.float32, [sw.Shard(0)])
    assert [layout.local_shape(mesh, r) for r in range(4)] == [(1, 5), (1, 5), (0, 5), (0, 5)]
    assert [layout.local_offset(mesh, r)[0] for r in range(4)] == [0, 1, 2, 2]
    nested = sw.Layout((5,), torch.float32, [sw.Shard(0), sw.Shard(0)])
    mesh2 = sw.Mesh((2, 2))
    # 5 -> [3, 2] -> [[2, 1], [1, 1]]
    assert [nested.local_shape(mesh2, r) for r in range(4)] == [(2,), (1,), (1,), (1,)]
    assert [nested.local_offset(mesh2, r) for r in range(4)] == [(0,), (2,), (3,), (4,)]


def test_mesh_basics():
    mesh = sw.Mesh((2, 3), ("dp", "tp"))
    assert mesh.size == 6 and mesh.ndim == 2
    assert [mesh.coord(r) for r in range(6)] == list(itertools.product(range(2), range(3)))
    assert all(mesh.rank(mesh.coord(r)) == r for r in range(6))
    assert mesh.group("tp", 4) == (3, 4, 5) and mesh.group("dp", 4) == (1, 4)
    assert mesh.groups(0) == ((0, 3), (1, 4), (2, 5))
    assert mesh.dim_index("tp") == 1 and mesh.dim_index(-1) == 1


def test_placements_are_canonical_and_hashable():
    assert sw.Shard(0) == sw.Shard(0) and len({sw.Shard(1), sw.Shard(1), sw.Replicate(), sw.Partial()}) == 3
    assert sw.Partial() == sw.Partial("sum") and repr(sw.Partial("max")) == "Partial('max')"
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    assert normalize_placements([sw.Shard(-1), sw.Replicate()], mesh, 3) == (sw.Shard(2), sw.Replicate())
    assert normalize_placements({"tp": sw.Shard(0)}, mesh, 2) == (sw.Replicate(), sw.Shard(0))
    layout = sw.Layout((4, 4), torch.float32, [sw.Shard(-1), sw.Replicate()])
    assert layout.placements == (sw.Shard(1), sw.Replicate())
    assert hash(layout) == hash(sw.Layout((4, 4), torch.float32, [sw.Shard(1), sw.Replicate()]))



def test_placements_are_tuples_of_their_fields():
    """Placements hash and compare as their field tuples (what the planners' dict keys cost),
    with the frozen dataclasses' hash values, kinds apart, unordered, picklable, always true."""
    import copy
    import pickle

    ps = [sw.Shard(1), sw.Shard(1, unit=4), sw.Shard(0, groups=3), sw.Replicate(), sw.Partial(), sw.Partial("max")]
    fields = [(1, 1, 1), (1, 4, 1), (0, 1, 3), (), ("sum",), ("max",)]
    assert [hash(p) for p in ps] == [hash(f) for f in fields]
    assert len(set(ps)) == len(ps) and sw.Shard(1) == sw.Shard(1) and sw.Partial() == sw.Partial("sum")
    assert sw.Replicate() != sw.Partial() and sw.Shard(0) != sw.Replicate() and all(ps)
    assert [(p.dim, p.unit, p.groups) for p in ps[:3]] == fields[:3] and ps[5].op == "max"
    assert pickle.loads(pickle.dumps(ps)) == ps and copy.deepcopy(ps) == ps
    assert [type(p) for p in pickle.loads(pickle.dumps(ps))] == [type(p) for p in ps]
    with pytest.raises(TypeError):
        sorted([sw.Shard(1), sw.Shard(0)])
    assert normalize_placements(sw.Shard(-1), sw.Mesh((2,)), 2) == (sw.Shard(1),)  # a bare one, not a sequence
    with pytest.raises(sw.ShardingError, match="needs a positive int"):
        sw.Shard(0, unit=0)
    with pytest.raises(sw.ShardingError, match="unknown Partial op"):
        sw.Partial("mean")

# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 2)])
def test_too_few_placements(mesh_shape):
    mesh = sw.Mesh(mesh_shape)
    x = torch.zeros(4, 4)
    calls = [
        lambda: sw.Layout(x.shape, x.dtype, [sw.Shard(0)], mesh),
        lambda: sw.Layout(x.shape, x.dtype, [sw.Shard(0)]).local_shape(mesh, 0),
        lambda: sw.distribute(x, mesh, [sw.Shard(0)]),
        lambda: sw.plan_redistribute(sw.Layout(x.shape, x.dtype, [sw.Shard(0)]), [sw.Replicate()] * 2, mesh),
        lambda: sw.plan_redistribute(sw.Layout(x.shape, x.dtype, [sw.Replicate()] * 2), [sw.Shard(0)], mesh),
    ]
    for call in calls:
        with pytest.raises(sw.ShardingError) as e:
            call()
        msg = str(e.value)
        assert isinstance(e.value, ValueError)
        assert "1 placement" in msg and "Shard(0)" in msg, msg
        assert str(mesh.shape) in msg and "2 dims" in msg and "one placement per mesh dim" in msg, msg
    with pytest.raises(sw.ShardingError, match=r"Shard\(0\).*2 dims"):
        sw.distribute(x, mesh, sw.Shard(0))  # a bare placement is not broadcast to every mesh dim
    with pytest.raises(sw.ShardingError, match=r"single placement Shard\(0\).*2 dims"):
        normalize_placements(sw.Shard(0), mesh, 2)


def test_shard_dim_out_of_range():
    mesh = sw.Mesh((2,))
    with pytest.raises(sw.ShardingError, match=r"Shard\(2\).*out of range for a 2-d tensor") as e:
        sw.distribute(torch.zeros(4, 4), mesh, [sw.Shard(2)])
    assert "[-2, 1]" in str(e.value)
    with pytest.raises(sw.ShardingError, match=r"Shard\(-3\).*2-d"):
        sw.Layout((4, 4), torch.float32, [sw.Shard(-3)])
    with pytest.raises(sw.ShardingError, match=r"0-d tensor"):
        sw.Layout((), torch.float32, [sw.Shard(0)], mesh)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (-1, 2), (2, -3)])
def test_bad_mesh_size(shape):
    with pytest.raises(sw.ShardingError) as e:
        sw.Mesh(shape)
    assert str(shape) in str(e.value) and "positive" in str(e.value)


def test_duplicate_mesh_names():
    with pytest.raises(sw.ShardingError, match=r"\('dp', 'dp'\) repeat \['dp'\]"):
        sw.Mesh((2, 2), ("dp", "dp"))
    with pytest.raises(sw.ShardingError, match="2 dims but 1 names"):
        sw.Mesh((2, 2), ("dp",))


def test_unknown_partial_op():
    with pytest.raises(sw.ShardingError, match=r"unknown Partial op 'mean'.*\('sum', 'max', 'min'\)"):
        sw.Partial("mean")
    assert isinstance(sw.ShardingError("x"), ValueError)


def test_collect_and_redistribute_need_one_local_per_rank():
    mesh = sw.Mesh((2, 2))
    locs = [torch.zeros(2)] * 3
    for fn in (lambda: sw.collect(locs, mesh, [sw.Replicate()] * 2),
               lambda: sw.redistribute(locs, mesh, [sw.Replicate()] * 2, [sw.Shard(0), sw.Replicate()])):
        with pytest.raises(sw.ShardingError, match=r"got 3 local tensor\(s\) but mesh \(2, 2\).*4 ranks"):
            fn()
