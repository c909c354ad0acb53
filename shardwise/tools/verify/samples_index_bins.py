"""Hand samples (uneven sizes) for the index / search / histogram rules and the batched linalg ops
torch's OpInfo reaches only in part: rules/indexing.py's index_fill, index_copy and masked-index rows,
rules/flat_index.py, bins.py, segment.py, and linalg.py's pinv, LDL, geqrf / ormqr and Householder
rows. Indices include negative and (for the masked ops) out-of-range ones, duplicates only where
the op accumulates; segment lengths include an empty segment where the reduction defines it finitely."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 3 * sum(shape)))


def _ints(*shape, seed=0):
    return (_r(*shape, seed=seed) * 2).round()


def _index_samples() -> dict:
    x, x3 = _r(5, 7), _r(3, 5, 7)
    idx = torch.tensor([4, 0, -2])
    col = torch.tensor([True, False, True]).view(3, 1)
    rows, pair = torch.tensor([[4], [0], [9]]), torch.tensor([1, -1])
    return {
        aten.index_fill.int_Scalar: [(x, 0, idx, 2.5), (x3, 2, idx, 0.0)],
        aten.index_fill.int_Tensor: [(x, 1, idx, torch.tensor(-1.5)), (x3, 0, torch.tensor([2]), torch.tensor(0.5))],
        aten.index_copy.default: [(x, 0, torch.tensor([4, 0, 2]), _r(3, 7, seed=1)),
                                  (x3, 2, torch.tensor([6, 0, 3, 1]), _r(3, 5, 4, seed=2))],
        aten._unsafe_masked_index.default: [(x, col, [idx], 0.0),
                                            (x3, _r(3, 3, 2, seed=12) > 0, [None, rows, pair], 1.5)],
        aten._unsafe_masked_index_put_accumulate.default: [
            (x, col, [torch.tensor([4, 0, 4])], _r(3, 7, seed=3)),
            (x3, _r(3, 3, 2, seed=13) > 0, [None, torch.tensor([[4], [0], [4]]), pair], _r(3, 3, 2, seed=4))],
    }


def _flat_samples() -> dict:
    x, x3 = _r(5, 7), _r(3, 5, 7)
    flat = torch.tensor([[4, 0, -2], [34, 17, 3]])
    mask = torch.arange(35).view(5, 7) % 3 != 1
    return {
        aten.take.default: [(x, flat), (x3, torch.tensor([104, 0, 50, 7, -8]))],
        aten.put.default: [(x, flat, _r(2, 3, seed=1)),
                           (x, torch.tensor([[4, 0, -2], [34, 4, 3]]), _r(2, 3, seed=2), True),
                           (x3, torch.tensor([104, 0, 50, 7, 8]), _r(5, seed=3), True)],
        aten.masked_scatter.default: [(x, mask, _r(30, seed=4)), (x3, mask[:, :1], _r(3, 40, seed=5))],
        aten.masked_scatter_backward.default: [(x, mask, [6, 4]), (x3, mask, [3, 25])],
        aten.nonzero_static.default: [((mask,), {"size": 30}), ((_ints(3, 5, 2), ), {"size": 12, "fill_value": -3})],
    }


def _bins_samples() -> dict:
    x3 = _r(3, 5, 7)
    rows = torch.sort(_r(3, 5, 6, seed=1)).values
    edges = torch.linspace(-2.0, 2.0, 6)
    pts = _r(5, 7, 2, seed=2)
    box = [-1.0, 1.5, -2.0, 2.0]
    return {
        aten.searchsorted.Tensor: [(torch.sort(_r(9)).values, x3), ((rows, _r(3, 5, 4, seed=3)), {"right": True}),
                                   ((rows, _r(3, 5, 4, seed=4)), {"sorter": torch.argsort(_r(3, 5, 6, seed=5))})],
        aten.searchsorted.Scalar: [(torch.sort(_r(7)).values, 0.3)],
        aten.bucketize.Tensor: [(x3, edges), ((_r(5, 7), edges), {"right": True})],
        aten.bucketize.Scalar: [(0.2, edges)],
        aten.isin.Tensor_Tensor: [(_ints(3, 5, 7), _ints(3, 4, seed=6)),
                                  ((_ints(5, 7), _ints(6, seed=7)), {"invert": True})],
        aten.isin.Tensor_Scalar: [(_ints(5, 7), 1.0)],
        aten.isin.Scalar_Tensor: [(1.0, _ints(5, 3)), ((0.0, _ints(5, 3)), {"invert": True})],
        aten.histogram.bins_tensor: [(x3, edges), ((x3, edges), {"weight": _r(3, 5, 7, seed=8).abs()})],
        aten.histogram.bin_ct: [((x3, 4), {"range": [-1.0, 1.5], "weight": _r(3, 5, 7, seed=9).abs()}), (x3, 4)],
        aten._histogramdd_bin_edges.default: [((pts, [3, 4]), {"range": box}), (pts, [3, 4])],
        aten._histogramdd_from_bin_cts.default: [((pts, [3, 4]), {"range": box, "weight": _r(5, 7, seed=10).abs()}),
                                                 (pts, [3, 4])],
        aten._histogramdd_from_bin_tensors.default: [
            ((pts, [torch.linspace(-2, 2, 4), torch.tensor([-1.0, 0.0, 0.5, 2.0])]),
             {"weight": _r(5, 7, seed=11).abs()})],
    }


def _segment_samples() -> dict:
    d2, d3 = _r(6, 7), _r(3, 6, 5)
    lengths = torch.tensor([[2, 1, 3], [1, 4, 1], [6, 0, 0]])
    out: dict = {aten.segment_reduce.default: [((d2, "sum"), {"lengths": torch.tensor([2, 0, 3, 1])}),
                                               ((d3, "max"), {"lengths": lengths, "axis": 1, "initial": 0.5}),
                                               ((d3, "mean"), {"offsets": torch.tensor([[0, 2, 3, 6]] * 3),
                                                               "axis": 1})],
                 aten._segment_reduce_backward.default: []}
    for data, reduce, kw in ((d2, "sum", {"lengths": torch.tensor([2, 1, 3])}),
                             (d3, "max", {"lengths": lengths, "axis": 1, "initial": 0.0})):
        res = aten.segment_reduce.default(data, reduce, **kw)
        out[aten._segment_reduce_backward.default].append(((_r(*res.shape, seed=1), res, data, reduce), kw))
    return out


def _linalg_samples() -> dict:
    a = _r(5, 4, 3)
    sym = _r(5, 4, 4, seed=1)
    sym = sym + sym.mT + 0.5 * torch.eye(4)
    ld, piv, _ = aten.linalg_ldl_factor_ex.default(sym)
    qa, tau = aten.geqrf.default(_r(5, 4, 3, seed=2))
    return {
        aten.linalg_pinv.atol_rtol_tensor: [(a,), ((a,), {"atol": torch.tensor(0.1),
                                                          "rtol": _r(5, seed=3).abs() * 0.1})],
        aten.linalg_pinv.atol_rtol_float: [((a,), {"atol": 0.01})],
        aten.linalg_pinv.default: [(a, 1e-5), (sym[:3], 1e-5, True)],
        aten.linalg_pinv.rcond_tensor: [(a, torch.full((5,), 1e-3))],
        aten.linalg_ldl_factor_ex.default: [(sym,), ((sym[:3],), {"hermitian": True})],
        aten.linalg_ldl_solve.default: [(ld, piv, _r(5, 4, 2, seed=4)), (ld[0], piv[0], _r(3, 4, 2, seed=5))],
        aten.geqrf.default: [(a,), (_r(3, 5, 2, 4, seed=6),)],
        aten.ormqr.default: [(qa, tau, _r(5, 4, 2, seed=7)), (qa, tau, _r(5, 2, 4, seed=8), False, True)],
        aten.linalg_householder_product.default: [(qa, tau), (qa[..., :2], tau[..., :2])],
    }


def index_bins_samples() -> dict:
    return {**_index_samples(), **_flat_samples(), **_bins_samples(), **_segment_samples(), **_linalg_samples()}
