"""The *_copy ops and the unsafe splits (rules/copies.py): each takes its view op's rule, so it offers the
view's strategies (checked here against the view's own, strategy for strategy) and every one of them is
exact on meshes (2,), (3,), (2, 2) with uneven sizes; the rank's call is the copy op, a fresh tensor.

    python -m pytest tests/rules/test_copies.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, LocalCtx, OpCall, load_all
from shardwise.rules.copies import VIEW_OF
from shardwise.rules.registry import expand, run_local
from tests.rules._rulecheck import check, strategies_1d

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _r(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


CASES = [
    (aten.expand_copy.default, (_r(5, 1, 3), [5, 7, 3]), [((S(0),), (S(0),)), ((R,), (S(1),)), ((P,), (P,))]),
    (aten.as_strided_copy.default, (_r(5, 6, 7), [5, 3, 7], [42, 14, 1], 7), [((S(0),), (S(0),))]),
    (aten.view_copy.default, (_r(5, 6, 7), [5, 42]), [((S(0),), (S(0),)), ((S(2),), (S(1, groups=6),))]),
    (aten.permute_copy.default, (_r(5, 3, 7), [2, 0, 1]), [((S(0),), (S(1),)), ((S(2),), (S(0),))]),
    (aten.split_with_sizes_copy.default, (_r(5, 7), [2, 5], 1), [((S(0),), (S(0), S(0)))]),
    (aten.split_copy.Tensor, (_r(7, 5), 3), [((S(1),), (S(1),) * 3)]),
    (aten.unbind_copy.int, (_r(5, 3, 7), 1), [((S(2),), (S(1),) * 3)]),
    (aten.squeeze_copy.default, (_r(5, 1, 7),), [((S(2),), (S(1),))]),
    (aten.squeeze_copy.dim, (_r(5, 1, 7), 1), [((S(2),), (S(1),))]),
    (aten.squeeze_copy.dims, (_r(5, 1, 7), [0, 1]), [((S(0),), (S(0),))]),
    (aten.unsqueeze_copy.default, (_r(5, 7), 1), [((S(1),), (S(2),))]),
    (aten.transpose_copy.int, (_r(5, 3, 7), 0, 2), [((S(0),), (S(2),))]),
    (aten.t_copy.default, (_r(5, 7),), [((S(0),), (S(1),))]),
    (aten.alias_copy.default, (_r(5, 7),), [((S(1),), (S(1),)), ((P,), (P,))]),
    (aten.detach_copy.default, (_r(5, 7),), [((S(0),), (S(0),))]),
    (aten.unfold_copy.default, (_r(5, 7), 1, 3, 2), [((S(0),), (S(0),))]),
    (aten.select_copy.int, (_r(5, 3, 7), 1, 2), [((S(2),), (S(1),))]),
    (aten.slice_copy.Tensor, (_r(5, 7), 1, 2, 6), [((S(0),), (S(0),))]),
    (aten.unsafe_split.Tensor, (_r(5, 7), 2, 1), [((S(0),), (S(0),) * 4)]),
    (aten.unsafe_split_with_sizes.default, (_r(6, 5), [2, 2, 2]), [((S(1),), (S(1),) * 3), ((S(0, groups=3),), (S(0),) * 3)]),
]


def test_every_copy_op_has_a_case():
    assert {op for op, _, _ in CASES} == set(VIEW_OF)


@pytest.mark.parametrize("op,args,expect", CASES, ids=[str(c[0]) for c in CASES])
def test_copy_takes_the_view_rule(op, args, expect):
    report = check(op, *args, expect=expect)
    view = check(VIEW_OF[op], *args)
    assert strategies_1d(report) == strategies_1d(view)


@pytest.mark.parametrize("op,args", [(aten.view_copy.default, (_r(5, 6, 7), [5, 42])),
                                     (aten.squeeze_copy.default, (_r(5, 1, 7),)),
                                     (aten.split_copy.Tensor, (_r(6, 5), 2)),
                                     (aten.as_strided_copy.default, (_r(5, 6, 7), [5, 3, 7], [42, 14, 1], 7))])
def test_the_rank_gets_a_fresh_tensor(op, args):
    """A view's local call may choose a view op (reshape, squeeze.dims, split_with_sizes) or a Python function
    returning a view (as_strided over the row-major layout): the copy's call shares no memory with its input."""
    load_all()
    call = OpCall.from_values(op, args, {}, op(*args))
    rule, mesh = DEFAULT.get(op), Mesh((2,))
    for st in expand(call, rule, mesh):
        for rank in range(2):
            ctx = LocalCtx(call, st, mesh, rank)
            lc = rule.local_call(ctx)
            assert not getattr(lc.fn, "is_view", False), (st, lc.fn)
            x = torch.randn(ctx.local_in_shape(0))
            outs = run_local(lc, [x])
            for o in outs if isinstance(outs, (list, tuple)) else [outs]:
                assert o.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), (st, lc.fn)
