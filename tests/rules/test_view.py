"""View, shape and indexing rules checked numerically on meshes (2,), (3,), (2, 2) with even and
uneven sizes (dims of 5, 7, 3, 15, a dim smaller than the mesh), plus a chain of views run
rank by rank with the planned local shapes checked at every step.

Run: python -m pytest tests/rules/test_view.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.run.shards import collect, distribute
from shardwise.core.layout import PLACEMENT_TYPES, Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, load_all
from shardwise.rules.registry import LocalCtx, OpCall, expand, run_local
from shardwise.rules.view import view_groups
from shardwise.tools.verify import verify_rule

aten = torch.ops.aten
R, P, PMAX, PMIN = Replicate(), Partial(), Partial("max"), Partial("min")
S = Shard


def x(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


def tried(report, mesh=(2,)) -> set:
    """(ins, outs) per strategy tried on ``mesh``, as tuples of n-d placement tuples (1-d: bare)."""
    bare = (lambda ps: ps[0]) if len(mesh) == 1 else (lambda ps: ps)
    return {(tuple(bare(p) for p in r.strategy.ins), tuple(None if p is None else bare(p) for p in r.strategy.outs))
            for r in report.results if r.mesh == mesh}


def check(op, *args, expect=(), absent=(), mesh=(2,), **kwargs):
    """Every strategy passes, and (ins, outs) pairs in ``expect`` / ``absent`` are (not) offered on
    ``mesh``; ``outs`` may be one placement standing for every output."""
    report = verify_rule(op, *args, **kwargs)
    assert report.ok, report
    assert {r.mesh for r in report.results} == {(2,), (3,), (2, 2)}
    got = tried(report, mesh)
    n_out = len(report.call.outs)

    def key(ins, outs):
        one = isinstance(outs, PLACEMENT_TYPES)  # a placement is a tuple of its fields: test it first
        return tuple(ins), (outs,) * n_out if one else tuple(outs)

    for ins, outs in expect:
        assert key(ins, outs) in got, f"missing {ins} -> {outs} on {mesh}\n{report}"
    for ins, outs in absent:
        assert key(ins, outs) not in got, f"unexpected {ins} -> {outs} on {mesh}\n{report}"
    return report


PASS = [([p], p) for p in (P, PMAX, PMIN)]  # Partial pass-through of a one-input op


# -- view / reshape ---------------------------------------------------------------------------
def test_view_groups():
    assert view_groups((5, 6), (30,)) == [([0, 1], [0])]
    assert view_groups((15, 4), (3, 5, 4)) == [([0], [0, 1]), ([1], [2])]
    assert view_groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]
    assert view_groups((1, 5, 1), (5,)) == [([1], [0])]
    assert view_groups((0, 3), (3, 0)) == []


def test_view_merge_even_and_uneven():
    # (6, 5) -> (30,): chunks line up on (2,) and (3,), not on (2, 2) nested (3+3 rows split 2/1)
    r = check(aten.view.default, x(6, 5), [30], expect=[([S(0)], S(0))] + PASS)
    assert ((S(0),), (S(0),)) in tried(r, (3,))
    assert (((S(0), S(0)),), ((S(0), S(0)),)) not in tried(r, (2, 2))
    # (5, 6) -> (30,): 5 rows never split evenly into 30 elements on 2 or 3 ranks
    r = check(aten.view.default, x(5, 6), [30], expect=PASS, absent=[([S(0)], S(0)), ([S(1)], S(0))])
    assert ((S(0),), (S(0),)) not in tried(r, (3,))


def test_view_split_even_and_uneven():
    check(aten.view.default, x(5, 6), [5, 2, 3], expect=[([S(0)], S(0)), ([S(1)], S(1))] + PASS,
          absent=[([S(1)], S(2))])
    r = check(aten.view.default, x(15, 4), [3, 5, 4], expect=[([S(1)], S(2))], absent=[([S(0)], S(0))])
    assert ((S(0),), (S(0),)) in tried(r, (3,))  # 15 rows / 3 = 5 = one block of (5, 4)
    check(aten._unsafe_view.default, x(6, 4), [4, -1], expect=[([S(0)], S(0))])
    check(aten.reshape.default, x(4, 6), [2, 2, 6], expect=[([S(0)], S(0)), ([S(1)], S(2))])


def test_view_size_one_and_empty_dims():
    check(aten.view.default, x(1, 5), [5], expect=[([S(1)], S(0))])
    check(aten.view.default, x(5), [1, 5, 1], expect=[([S(0)], S(1))])
    check(aten.view.default, x(0, 3), [3, 0], expect=PASS)


def test_view_bfloat16():
    check(aten.view.default, x(4, 6, dtype=torch.bfloat16), [2, 2, 6], expect=[([S(0)], S(0))] + PASS)


def test_flatten_unflatten():
    check(aten.flatten.using_ints, x(4, 4, 5), 1, 2, expect=[([S(0)], S(0)), ([S(1)], S(1))] + PASS)
    check(aten.unflatten.int, x(4, 30), -1, [6, 5], expect=[([S(0)], S(0)), ([S(1)], S(1))] + PASS)
    # 15 -> 8 + 7 elements on 2 ranks are not whole rows of 5: dropped by shape-sensitive expansion
    check(aten.unflatten.int, x(4, 15), 1, [3, 5], expect=[([S(0)], S(0))], absent=[([S(1)], S(1))])


def test_view_permute_expand_chain_local_shapes():
    """The issue's case: Shard(0) (2, 10, 40) viewed, permuted and expanded on a new leading dim."""
    load_all()
    steps = [(aten.view.default, ([2, 10, 4, 10],)), (aten.permute.default, ([0, 2, 1, 3],)),
             (aten.expand.default, ([3, 2, 4, 10, 10],))]
    for shape, start in (((2,), [S(0)]), ((3,), [S(0)]), ((2, 2), [S(0), S(2)]), ((2, 2), [S(2), S(0)])):
        mesh, t = Mesh(shape), x(2, 10, 40)
        place, locs = (tuple(start),), distribute(t, mesh, start)
        for op, rest in steps:
            want = op(t, *rest)
            call = OpCall.from_values(op, (t,) + rest, {}, want)
            rule = DEFAULT.get(op)
            st = next(s for s in expand(call, rule, mesh) if s.ins == place)
            new = []
            for rank in range(mesh.size):
                ctx = LocalCtx(call, st, mesh, rank)
                out = run_local(rule.local_call(ctx), [locs[rank]])
                assert list(out.shape) == ctx.local_out_shape(0), (op, shape, rank)
                new.append(out)
            t, place, locs = want, st.outs, new
        # Shard(0) ends on the batch dim (1 after the new leading dim); Shard(2) on the 4-dim (2)
        assert place == ((tuple({S(0): S(1), S(2): S(2)}[p] for p in start)),), place
        assert torch.equal(collect(locs, mesh, place[0]), t), (shape, start)


# -- expand / dim remapping ---------------------------------------------------------------------
def test_expand():
    check(aten.expand.default, x(4, 1, 5), [3, 4, 7, 5],
          expect=[([R], S(0)), ([S(0)], S(1)), ([R], S(2)), ([S(2)], S(3))] + PASS)
    check(aten.expand.default, x(1, 3), [-1, 3], expect=[([S(1)], S(1))])


def test_permute_transpose_t():
    check(aten.permute.default, x(2, 3, 5), [2, 0, 1], expect=[([S(2)], S(0)), ([S(0)], S(1)), ([S(1)], S(2))] + PASS)
    check(aten.transpose.int, x(3, 5, 2), 0, -1, expect=[([S(0)], S(2)), ([S(2)], S(0)), ([S(1)], S(1))] + PASS)
    check(aten.t.default, x(3, 5), expect=[([S(0)], S(1)), ([S(1)], S(0))] + PASS)
    check(aten.t.default, x(5), expect=[([S(0)], S(0))])
    check(aten.permute.default, x(1, 3, 2), [1, 0, 2], expect=[([S(0)], S(1))])  # a sharded size-1 dim


def test_unsqueeze_squeeze():
    check(aten.unsqueeze.default, x(3, 5), 1, expect=[([S(0)], S(0)), ([S(1)], S(2))] + PASS)
    check(aten.unsqueeze.default, x(3, 5), -1, expect=[([S(1)], S(1))])
    check(aten.squeeze.default, x(3, 1, 5), expect=[([S(0)], S(0)), ([S(2)], S(1))] + PASS)
    check(aten.squeeze.dims, x(1, 3, 1), [0, 2], expect=[([S(1)], S(0))])
    # dim 0 has global size 3: a no-op, even on mesh (3,) where each rank's local size is 1
    r = check(aten.squeeze.dim, x(3, 4), 0, expect=[([S(0)], S(0))])
    assert ((S(0),), (S(0),)) in tried(r, (3,))
    check(aten.squeeze.dim, x(3, 1, 5), 1, expect=[([S(2)], S(1))], absent=[([S(1)], S(1))])


# -- split / cat family --------------------------------------------------------------------------
def test_split_chunk_unbind():
    check(aten.split.Tensor, x(5, 7), 3, 1, expect=[([S(0)], S(0))] + PASS, absent=[([S(1)], S(1))])
    check(aten.split_with_sizes.default, x(5, 7), [2, 3], expect=[([S(1)], S(1))], absent=[([S(0)], S(0))])
    check(aten.chunk.default, x(5, 7), 3, -1, expect=[([S(0)], S(0))], absent=[([S(1)], S(1))])
    check(aten.unbind.int, x(3, 5, 2), 1, expect=[([S(0)], S(0)), ([S(2)], S(1))] + PASS)


def test_cat_stack():
    check(aten.cat.default, [x(3, 5), x(2, 5)], expect=[([S(1), S(1)], S(1))] + [([p, p], p) for p in (P, PMAX)],
          absent=[([S(0), S(0)], S(0))])
    check(aten.cat.default, [x(3, 5), x(3, 2)], -1, expect=[([S(0), S(0)], S(0))])
    check(aten.cat.default, [x(0), x(3, 5)], 0, expect=[([R, S(1)], S(1))])  # legacy 1-d empty input
    check(aten.stack.default, [x(3, 5), x(3, 5)], 1, expect=[([S(0), S(0)], S(0)), ([S(1), S(1)], S(2)), ([P, P], P)])
    check(aten.cat.default, [x(3, 5, dtype=torch.bfloat16), x(2, 5, dtype=torch.bfloat16)],
          expect=[([S(1), S(1)], S(1)), ([P, P], P)])


# -- slicing and indexing ---------------------------------------------------------------------------
def test_slice_select_narrow():
    check(aten.slice.Tensor, x(5, 7), 1, 1, 5, expect=[([S(0)], S(0))] + PASS, absent=[([S(1)], S(1))])
    check(aten.slice.Tensor, x(5, 7), 1, 0, 2, 2, absent=[([S(1)], S(1))])
    check(aten.slice.Tensor, x(5, 7), 0, None, 2**62, expect=[([S(0)], S(0)), ([S(1)], S(1))])
    check(aten.slice.Tensor, x(5, 7), 1, -7, None, expect=[([S(1)], S(1))])
    check(aten.select.int, x(5, 7, 3), 1, -2, expect=[([S(0)], S(0)), ([S(2)], S(1))] + PASS)
    check(aten.narrow.default, x(5, 7), 1, 2, 3, expect=[([S(0)], S(0))] + PASS, absent=[([S(1)], S(1))])
    check(aten.narrow.default, x(5, 7), 0, 0, 5, expect=[([S(0)], S(0)), ([S(1)], S(1))])
    check(aten.narrow.default, x(5, 7), 0, -5, 5, expect=[([S(0)], S(0))])


def test_slice_whole_parts_of_a_dim_in_groups():
    """q, k, v of a fused [q|k|v] (Phi-3 slices them): each rank slices its chunk of the parts; 3 parts
    of 5 do not divide over 2 or 3 ranks evenly, and 2 of 6 parts (two groups) stay in groups."""
    for start, end in [(0, 5), (5, 10), (10, None), (-5, None)]:
        check(aten.slice.Tensor, x(2, 15), 1, start, end, expect=[([S(1, groups=3)], S(1))])
    check(aten.slice.Tensor, x(2, 12), 1, 4, 12, expect=[([S(1, groups=3)], S(1, groups=2))])
    check(aten.slice.Tensor, x(2, 12), 1, 0, 6, 2, absent=[([S(1, groups=2)], S(1))])  # a step: no parts


def test_index_select():
    idx = torch.tensor([0, 3, 3, 6, 1])
    check(aten.index_select.default, x(5, 7), 1, idx,
          expect=[([S(0), R], S(0)), ([R, S(0)], S(1)), ([P, R], P), ([PMAX, R], PMAX)],
          absent=[([S(1), R], S(1))])
    check(aten.index_select.default, x(5, 7), 0, torch.tensor(2), expect=[([S(1), R], S(1))])


def test_gather():
    idx = torch.randint(0, 7, (5, 3))
    check(aten.gather.default, x(5, 7), 1, idx, expect=[([S(0), S(0)], S(0)), ([R, S(1)], S(1)), ([P, R], P)])
    # index smaller than self on dim 0: positions do not line up, so dim 0 is not sharded on both
    check(aten.gather.default, x(5, 7), 1, torch.randint(0, 7, (3, 4)), expect=[([R, S(1)], S(1))],
          absent=[([S(0), S(0)], S(0))])
    check(aten.gather.default, x(5, 3), 0, torch.randint(0, 5, (7, 3)), expect=[([S(1), S(1)], S(1)), ([R, S(0)], S(0))])


# -- tril / triu / pad ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [aten.tril.default, aten.triu.default])
def test_tril_triu_shifted_diagonal(op):
    check(op, x(5, 7), 1, expect=[([S(0)], S(0)), ([S(1)], S(1))] + PASS)
    check(op, x(2, 7, 5), -2, expect=[([S(0)], S(0)), ([S(1)], S(1)), ([S(2)], S(2))])
    check(op, x(5, 5, dtype=torch.bfloat16), expect=[([S(0)], S(0)), ([S(1)], S(1))])


def test_constant_pad_nd():
    check(aten.constant_pad_nd.default, x(3, 5), [1, 2], 0.0, expect=[([S(0)], S(0))] + PASS, absent=[([S(1)], S(1))])
    check(aten.constant_pad_nd.default, x(3, 5, 4), [0, 0, 1, -1], 1.5,
          expect=[([S(0)], S(0)), ([S(2)], S(2)), ([PMAX], PMAX), ([PMIN], PMIN)],
          absent=[([P], P), ([S(1)], S(1))])
