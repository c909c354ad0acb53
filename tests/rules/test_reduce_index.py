"""scatter_reduce.two and index_reduce (rules/indexing.py): dims other than the indexed one shard alike;
sum/amax/amin as Partial(sum/max/min) of (self, src), and with the (index, src) pairs sharded only when
self is reduced in (include_self); mean and prod keep the indexed dim whole. Meshes (2,), (3,), (2, 2).

    python -m pytest tests/rules/test_reduce_index.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R = Replicate()
PART = {"sum": Partial(), "amax": Partial("max"), "amin": Partial("min")}
IDX = torch.tensor([[4, 0, 1, 4, 2, 0, 4], [3, 3, 0, 1, 4, 4, 2], [0, 1, 2, 3, 4, 0, 1], [4, 4, 4, 4, 4, 4, 4],
                    [1, 2, 1, 0, 3, 2, 0]])


@pytest.mark.parametrize("reduce", ["sum", "amax", "amin", "mean", "prod"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    p = PART.get(reduce)
    pairs = ((p, S(0), S(0)), (p,))
    expect = [((S(1), S(1), S(1)), (S(1),))] + ([((p, R, p), (p,))] if p else [])
    expect += [pairs] if p and include_self else []
    absent = [] if p and include_self else [pairs]
    absent += [((S(0), S(0), S(0)), (S(0),))]
    if not p:
        absent += [((q, R, q), (q,)) for q in PART.values()]
    check(aten.scatter_reduce.two, torch.randn(5, 7), 0, IDX, torch.randn(5, 7), reduce, include_self=include_self,
          expect=expect, absent=absent)


@pytest.mark.parametrize("reduce", ["amax", "amin", "mean", "prod"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    p = PART.get(reduce)
    pairs = ((p, S(0), S(1)), (p,))
    expect = [((S(0), R, S(0)), (S(0),))] + ([((p, R, p), (p,))] if p else [])
    expect += [pairs] if p and include_self else []
    absent = ([] if p and include_self else [pairs]) + [((S(1), R, S(1)), (S(1),))]
    check(aten.index_reduce.default, torch.randn(5, 7), 1, torch.tensor([6, 0, 6, 2, 1, 0, 3, 5]),
          torch.randn(5, 8), reduce, include_self=include_self, expect=expect, absent=absent)
