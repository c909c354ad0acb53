"""eye (factory.py), aminmax (reduction.py), addr (matmul.py) and narrow_copy (view.py): every
strategy verified against one device on meshes (2,), (3,), (2, 2), sizes that divide and sizes
that do not (empty shards included).

Run: python -m pytest tests/rules/test_eye_aminmax_addr.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.rules import Registry, Rule, Strategy1D
from shardwise.tools.verify import verify_rule

from ._rulecheck import check

aten = torch.ops.aten
R, P, PMAX, PMIN, S = Replicate(), Partial(), Partial("max"), Partial("min"), Shard


@pytest.mark.parametrize("args,kwargs", [((5,), {}), ((5, 7), {}), ((7, 3), {"dtype": torch.int64}),
                                         ((4, 2), {"dtype": torch.bool}), ((1,), {})])
def test_eye_blocks_at_their_global_offsets(args, kwargs):
    """A sharded eye makes only its block, with the ones where global row == global column;
    Partial('sum') ones on the holder only, max/min ones everywhere."""
    op = aten.eye.m if len(args) == 2 else aten.eye.default
    check(op, *args, expect=[((), (p,)) for p in (S(0), S(1), R, P, PMAX, PMIN)], **kwargs)


@pytest.mark.parametrize("shape,kwargs", [
    ((5, 7), {}), ((5, 7), {"dim": 1}), ((5, 7), {"dim": 0, "keepdim": True}), ((5, 7), {"keepdim": True}),
    ((3, 5, 2), {"dim": -1}),  # 2 on 3 ranks: the last rank's shard is empty
])
def test_aminmax(shape, kwargs):
    x = torch.randn(*shape)
    red = kwargs.get("dim")
    reduced = range(len(shape)) if red is None else [red % len(shape)]
    expect = [((S(d),), (PMIN, PMAX)) for d in reduced]
    if red is not None:
        kept = next(d for d in range(len(shape)) if d not in reduced)
        out = kept if kwargs.get("keepdim") or kept < reduced[0] else kept - 1
        expect.append(((S(kept),), (S(out), S(out))))
    check(aten.aminmax.default, x, expect=expect, absent=[((PMAX,), (PMAX, PMAX)), ((PMIN,), (PMIN, PMIN))],
          **kwargs)


def test_aminmax_integers_with_empty_shards():
    check(aten.aminmax.default, torch.randint(-9, 9, (5, 2)), dim=1, expect=[((S(1),), (PMIN, PMAX))])


@pytest.mark.parametrize("self_shape,on_cols", [((5, 7), S(1)), ((7,), S(0)), ((1, 7), S(1)), ((), R)])
def test_addr_bias_follows_the_output(self_shape, on_cols):
    """beta * self + alpha * outer(vec1, vec2): a Partial vector gives a Partial output only with a
    Partial self (each rank adds its part of beta * self, so self is added once in the sum)."""
    s, v1, v2 = torch.randn(self_shape), torch.randn(5), torch.randn(7)
    check(aten.addr.default, s, v1, v2, beta=0.5, alpha=-2.0,
          expect=[((P, P, R), (P,)), ((P, R, P), (P,)), ((on_cols, R, S(0)), (S(1),))],
          absent=[((R, P, R), (P,)), ((R, R, P), (P,))])


def test_addr_with_a_replicated_self_on_a_partial_output_is_caught():
    """The mistake the rule avoids: self Replicate with a Partial output adds beta * self once per rank."""
    def replicated_self(call):
        return [Strategy1D((R,), (R, R, R)), Strategy1D((P,), (R, P, R))]

    bad = Registry([Rule(aten.addr.default, replicated_self, blockwise=True)])
    report = verify_rule(aten.addr.default, torch.randn(5, 7), torch.randn(5), torch.randn(7), registry=bad)
    assert not report.ok
    assert all(any(isinstance(p, Partial) for p in f.strategy.outs[0]) for f in report.failures), report


def test_narrow_copy_as_narrow():
    x = torch.randn(5, 7)
    check(aten.narrow_copy.default, x, 1, 2, 4, expect=[((S(0),), (S(0),))], absent=[((S(1),), (S(1),))])
    check(aten.narrow_copy.default, x, 0, 0, 5, expect=[((S(0),), (S(0),)), ((S(1),), (S(1),))])
    check(aten.narrow_copy.default, torch.randn(3, 5, 7), -1, -5, 3, expect=[((S(1),), (S(1),))])
