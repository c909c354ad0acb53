"""searchsorted, bucketize, isin, histogram, histogramdd (rules/bins.py): values shard on every dim
with the bins whole (an n-d sorted sequence: its batch dims with the values'); isin's test elements
sharded give an OR (AND inverted) of parts; histogram counts are Partial(sum) only where the edges do
not depend on the data (bins as tensors, or range given) and density is off. Meshes (2,), (3,), (2, 2).

    python -m pytest tests/rules/test_bins.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX, PMIN = Replicate(), Partial(), Partial("max"), Partial("min")


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_searchsorted_shards_values_and_the_sequences_batch():
    x = _r(3, 5, 7)
    check(aten.searchsorted.Tensor, torch.sort(_r(9)).values, x,
          expect=[((R, S(0)), (S(0),)), ((R, S(2)), (S(2),))])
    rows = torch.sort(_r(3, 5, 6, seed=1)).values
    check(aten.searchsorted.Tensor, rows, _r(3, 5, 4, seed=2), sorter=torch.argsort(_r(3, 5, 6, seed=3)), right=True,
          expect=[((S(0), S(0), S(0)), (S(0),)), ((S(1), S(1), S(1)), (S(1),)), ((R, S(2), R), (S(2),))],
          absent=[((S(2), S(2), S(2)), (S(2),))])


def test_bucketize_shards_the_values():
    check(aten.bucketize.Tensor, _r(3, 5, 7), torch.linspace(-2, 2, 6), right=True,
          expect=[((S(0), R), (S(0),)), ((S(2), R), (S(2),))])


def test_isin_shards_elements_or_or_s_the_test_elements():
    ints = lambda *s, seed=0: (_r(*s, seed=seed) * 2).round()  # noqa: E731
    check(aten.isin.Tensor_Tensor, ints(3, 5, 7), ints(3, 4, seed=1),
          expect=[((S(1), R), (S(1),)), ((R, S(0)), (PMAX,)), ((R, S(1)), (PMAX,))])
    check(aten.isin.Tensor_Tensor, ints(5, 7), ints(6, seed=2), invert=True, expect=[((R, S(0)), (PMIN,))])
    check(aten.isin.Scalar_Tensor, 1.0, ints(5, 3), expect=[((S(0),), (PMAX,)), ((S(1),), (PMAX,))])


def test_histogram_counts_are_partial_only_with_fixed_edges():
    x, w = _r(3, 5, 7), _r(3, 5, 7, seed=1).abs()
    edges = torch.linspace(-2, 2, 6)
    check(aten.histogram.bins_tensor, x, edges, weight=w,
          expect=[((S(0), R, S(0)), (P, R)), ((S(2), R, S(2)), (P, R)), ((R, R, P), (P, R))])
    check(aten.histogram.bins_tensor, x, edges, density=True, absent=[((S(0), R), (P, R))])
    check(aten.histogram.bin_ct, x, 4, range=[-1.0, 1.5], expect=[((S(1),), (P, R))])
    # edges from the data's own min and max: the values stay whole
    report = check(aten.histogram.bin_ct, x, 4)
    assert all(p == R for r in report.results for ps in r.strategy.ins for p in ps)


def test_histogramdd_shards_the_points_not_the_coordinate():
    pts, w, box = _r(5, 7, 2), _r(5, 7, seed=1).abs(), [-1.0, 1.5, -2.0, 2.0]
    check(aten._histogramdd_from_bin_cts.default, pts, [3, 4], range=box, weight=w,
          expect=[((S(0), S(0)), (P,)), ((S(1), S(1)), (P,)), ((R, P), (P,))], absent=[((S(2), R), (P,))])
    check(aten._histogramdd_from_bin_tensors.default, pts, [torch.linspace(-2, 2, 4), torch.tensor([-1.0, 0.0, 2.0])],
          expect=[((S(1), R, R), (P,))])
    check(aten._histogramdd_bin_edges.default, pts, [3, 4], range=box, expect=[((S(0),), (R, R))])
    check(aten._histogramdd_bin_edges.default, pts, [3, 4], absent=[((S(0),), (R, R))])
