"""Batch norm (training with exact cross-rank statistics, eval) and group norm rules checked
numerically on meshes (2,), (3,), (2, 2) with uneven sizes (5 images, 3 channels), forward
and backward, including the updated running statistics.

Run: python -m pytest tests/rules/test_batch_norm.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import norm_batch
from shardwise.rules.registry import OpCall, Strategy

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard


def _inputs(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(5, 3, 4, 3) * 2 + 1
    return x, torch.randn(3), torch.randn(3), torch.randn(3), torch.rand(3) + 0.5


def test_training_forward_sync_statistics():
    """Batch or spatial dims sharded: out sharded, saved and running statistics Replicate and
    equal one device's (uneven: 5 images on 2 and 3 ranks, 4 rows on 3 ranks)."""
    x, w, b, rm, rv = _inputs()
    five = lambda p: (p, R, R, R, R)  # noqa: E731
    expect = [((S(d), R, R, R, R), five(S(d))) for d in (0, 2, 3)]
    expect.append(((S(1), S(0), S(0), S(0), S(0)), (S(1),) + (S(0),) * 4))
    check(aten._native_batch_norm_legit_functional.default, x, w, b, rm, rv, True, 0.1, 1e-5, expect=expect)


def test_training_forward_without_stats_or_affine():
    x = _inputs()[0]
    check(aten.native_batch_norm.default, x, None, None, None, None, True, 0.1, 1e-5,
          expect=[((S(0),), (S(0), R, R)), ((S(1),), (S(1), S(0), S(0)))])


@pytest.mark.parametrize("op,extra", [(aten.native_batch_norm.default, (False, 0.1, 1e-5)),
                                      (aten._native_batch_norm_legit_no_training.default, (0.1, 1e-5))])
def test_eval_forward(op, extra):
    x, w, b, rm, rv = _inputs()
    check(op, x, w, b, rm, rv, *extra, expect=[((S(0), R, R, R, R), (S(0), R, R))])


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]])
def test_training_backward(mask):
    x, w, b, rm, rv = _inputs()
    _, sm, si, _, _ = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    g = torch.randn_like(x)
    outs = lambda p: tuple(p if m else None for m in mask)  # noqa: E731
    first = (S(0),) if mask[0] else (None,)
    check(aten.native_batch_norm_backward.default, g, x, w, rm, rv, sm, si, True, 1e-5, mask,
          expect=[((S(0), S(0), R, R, R, R, R), first + outs(R)[1:]), ((P,) + (R,) * 6, outs(P))])


def test_eval_backward_partial_weight_grads():
    x, w, b, rm, rv = _inputs()
    _, sm, si = aten.native_batch_norm.default(x, w, b, rm, rv, False, 0.1, 1e-5)
    g = torch.randn_like(x)
    check(aten.native_batch_norm_backward.default, g, x, w, rm, rv, sm, si, False, 1e-5, [True, True, True],
          expect=[((S(0), S(0), R, R, R, R, R), (S(0), P, P))])


def test_group_norm():
    """6 channels in 3 groups: whole groups per rank (3 groups on 2 ranks: 2 + 1)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 6, 4), torch.randn(6), torch.randn(6)
    u = S(1, unit=2)
    check(aten.native_group_norm.default, x, w, b, 5, 6, 4, 3, 1e-5,
          expect=[((S(0), R, R), (S(0),) * 3), ((u, S(0, unit=2), S(0, unit=2)), (u, S(1), S(1)))])
    _, mean, rstd = aten.native_group_norm.default(x, w, b, 5, 6, 4, 3, 1e-5)
    check(aten.native_group_norm_backward.default, torch.randn_like(x), x, mean, rstd, w, 5, 6, 4, 3,
          [True, True, True], expect=[((S(0),) * 4 + (R,), (S(0), P, P)), ((P, R, R, R, R), (P, P, P))])


def test_sync_statistics_are_stated_to_the_plan():
    """The all-reduces of a sync strategy are plan steps (counted by plan.stats())."""
    x, w, b, rm, rv = _inputs()
    call = OpCall.from_values(aten._native_batch_norm_legit_functional.default, (x, w, b, rm, rv, True, 0.1, 1e-5),
                              {}, aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5))
    mesh = Mesh((2, 2))
    sync = [s for s in norm_batch.bn_strategies(call) if s.tag == norm_batch.SYNC][0]
    st = Strategy(tuple((o, R) for o in sync.outs), tuple((i, R) for i in sync.ins), (sync.tag, ""))
    steps = norm_batch.bn_comm(call, st, mesh)
    assert [(s.kind, s.mesh_dim) for s in steps] == [("all_reduce", 0)] * 2 and all(s.is_collective for s in steps)


def test_repeat():
    """InstanceNorm tiles weight and statistics per sample with aten.repeat: a dim repeated once
    keeps its shard, a new leading dim is added, Partial passes through."""
    check(aten.repeat.default, torch.randn(5, 3), [2, 1, 2],
          expect=[((S(0),), (S(1),)), ((P,), (P,))], absent=[((S(1),), (S(2),))])
