"""Factory rules (zeros, ones, full, arange, scalar_tensor, new_*, empty*) checked on meshes
(2,), (3,), (2, 2) with sizes that divide and sizes that do not.

empty* outputs are uninitialised, so their values cannot be compared with one device: those
ops are checked through expansion (every strategy's local call, run on meta tensors, gives
the planned local shape on every rank), not through the numeric verifier.

Run: python -m pytest tests/rules/test_factory.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, load_all
from shardwise.rules.factory import local_strides
from shardwise.rules.registry import LocalCtx, OpCall, expand, local_shapes_match, run_local
from shardwise.tools.verify import verify_rule

aten = torch.ops.aten
R, P, PMAX, PMIN = Replicate(), Partial(), Partial("max"), Partial("min")
S = Shard
MESHES = ((2,), (3,), (2, 2))


def outs_tried(report, mesh=(2,)) -> set:
    """(ins, out) per strategy tried on a 1-d mesh, as placements."""
    return {(tuple(p[0] for p in r.strategy.ins), r.strategy.outs[0][0]) for r in report.results if r.mesh == mesh}


def check(op, *args, expect_outs=(), **kwargs):
    report = verify_rule(op, *args, **kwargs)
    assert report.ok, report
    assert {r.mesh for r in report.results} == set(MESHES)
    got = {o for _, o in outs_tried(report)}
    for p in expect_outs:
        assert p in got, f"missing output {p}\n{report}"
    return report


@pytest.mark.parametrize("size", [[5, 3], [4, 6], [1, 2]])
def test_zeros_ones_full(size):
    every = [R, S(0), S(1), P, PMAX, PMIN]
    check(aten.zeros.default, size, expect_outs=every)
    check(aten.ones.default, size, expect_outs=every)  # Partial(): holder ranks ones, the others zeros
    check(aten.full.default, size, 2.5, expect_outs=every)


def test_full_dtypes():
    check(aten.full.default, [7], 3, dtype=torch.bfloat16, expect_outs=[S(0), P])
    check(aten.full.default, [5, 2], 4, expect_outs=[S(0), P, PMAX])  # int64 inferred; zeros keep it
    check(aten.ones.default, [3, 5], dtype=torch.bfloat16, expect_outs=[S(1), P])


@pytest.mark.parametrize("args,kwargs", [
    ((7,), {}), ((1, 12, 2), {}), ((2,), {"dtype": torch.float32}), ((0.5, 3.7, 0.3), {}),
    ((10, -3, -3), {}), ((1,), {}),
])
def test_arange(args, kwargs):
    op = {1: aten.arange.default, 2: aten.arange.start, 3: aten.arange.start_step}[len(args)]
    check(op, *args, expect_outs=[R, S(0), P, PMAX, PMIN], **kwargs)


def test_arange_local_blocks():
    """arange(1, 12, 2) on 3 ranks: blocks [1, 3], [5, 7], [9, 11] from the global offsets."""
    load_all()
    want = aten.arange.start_step(1, 12, 2)
    call = OpCall.from_values(aten.arange.start_step, (1, 12, 2), {}, want)
    mesh, rule = Mesh((3,)), DEFAULT.get(aten.arange.start_step)
    st = next(s for s in expand(call, rule, mesh) if s.outs[0] == (S(0),))
    got = [run_local(rule.local_call(LocalCtx(call, st, mesh, r)), []).tolist() for r in range(3)]
    assert got == [[1, 3], [5, 7], [9, 11]]


def test_scalar_tensor():
    check(aten.scalar_tensor.default, 2.5, expect_outs=[R, P, PMAX, PMIN])
    check(aten.scalar_tensor.default, 3, dtype=torch.bfloat16, expect_outs=[P])


def test_new_zeros_ones_full():
    src = torch.randn(2, 3)
    for op, extra in ((aten.new_zeros.default, ()), (aten.new_ones.default, ()), (aten.new_full.default, (1.5,))):
        r = check(op, src, [5, 3], *extra, expect_outs=[R, S(0), S(1), P, PMAX, PMIN])
        got = outs_tried(r)
        # the unused input may keep its own placement: no redistribution needed either way
        assert {((S(0),), S(0)), ((R,), S(1)), ((S(1),), R), ((P,), P), ((PMAX,), R)} <= got, got
    check(aten.new_full.default, torch.zeros(4, dtype=torch.int64), [7], 2.0, expect_outs=[S(0), P])
    check(aten.new_ones.default, torch.randn(3, dtype=torch.bfloat16), [5], expect_outs=[S(0), P])


@pytest.mark.parametrize("op,args", [
    (aten.empty.memory_format, ([5, 3],)),
    (aten.empty_strided.default, ([5, 7], [1, 5])),
    (aten.empty_strided.default, ([3, 4, 5], [20, 5, 1])),
    (aten.new_empty.default, (torch.randn(2), [7, 2])),
    (aten.new_empty_strided.default, (torch.randn(2), [5, 3], [3, 1])),
])
def test_empty_local_shapes(op, args):
    """Values of empty tensors are garbage, so only local shapes are checked (see module doc)."""
    load_all()
    want = op(*args)
    call = OpCall.from_values(op, args, {}, want)
    rule = DEFAULT.get(op)
    for shape in MESHES:
        mesh = Mesh(shape)
        sts = expand(call, rule, mesh)
        assert all(local_shapes_match(call, rule, st, mesh) for st in sts)
        outs = {p for st in sts for p in st.outs[0]}
        assert outs == {R} | {S(d) for d in range(want.ndim)}, outs  # shard any dim, never Partial


def test_local_strides():
    assert local_strides([1, 5], [3, 7]) == [1, 3]  # column-major stays column-major
    assert local_strides([20, 5, 1], [2, 4, 5]) == [20, 5, 1]
    assert local_strides([0, 1], [4, 3]) == [0, 1]
