"""_embedding_bag and its backwards (rules/embedding_bag.py) on meshes (2,), (3,), (2, 2), uneven: the
table's columns for every mode, its rows (a masked Partial sum) for sum and mean, the bags with the
table whole (each rank's run of indices read from the offsets), padding and include_last_offset.

Run: python -m pytest tests/rules/test_embedding_bag.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
SUM, MEAN, MAX = 0, 1, 2
g = torch.Generator().manual_seed(3)
W = torch.randn(10, 7, generator=g)
IDX = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 7, 7])
OFF = torch.tensor([0, 3, 3, 6, 8])  # bag 1 empty
PSW = torch.randn(11, generator=g)
GRAD = torch.randn(5, 7, generator=g)
FWD, BWD = aten._embedding_bag.default, aten._embedding_bag_backward.default


@pytest.mark.parametrize("last", [False, True], ids=["", "last_offset"])
@pytest.mark.parametrize("pad", [-1, 2], ids=["", "padding"])
@pytest.mark.parametrize("mode", [SUM, MEAN, MAX], ids=["sum", "mean", "max"])
def test_forward_and_backward(mode, pad, last):
    psw = PSW if mode == SUM else None
    off = torch.cat([OFF, torch.tensor([11])]) if last else OFF  # (a last offset short of the end reads
    # past grad in the sum-mode backward, torch 2.13: its one-device result is not defined)
    rest = (R, R) + ((R,) if psw is not None else ())
    cols = ((S(1),) + rest, (S(1), R, R, S(1) if mode == MAX else R))
    bags = ((R,) + rest, (S(0), R, R, S(0)))
    rows = ((S(0),) + rest, (P, R, R, R))
    report = check(FWD, W, IDX, off, False, mode, False, psw, last, pad,
                   expect=[cols, bags] + ([rows] if mode != MAX and not last else []),
                   absent=[rows] if mode == MAX or last else [])
    assert report.results
    out = FWD(W, IDX, off, False, mode, False, psw, last, pad)
    b = out[0].shape[0]
    n_t = 6 + (psw is not None)
    max_cols = S(1) if mode == MAX else R
    bwd_cols = ((S(1), R, R, R, R, max_cols) + (R,) * (n_t - 6), (S(1),))
    bwd_rows = ((R,) * n_t, (S(0),))
    check(BWD, GRAD[:b], IDX, off, *out[1:], 10, False, mode, False, psw, pad,
          expect=[bwd_cols, ((P,) + (R,) * (n_t - 1), (P,))] + ([bwd_rows] if mode != MAX else []),
          absent=[bwd_rows] if mode == MAX else [])


def test_scale_grad_by_freq_keeps_gradient_rows_whole():
    out = FWD(W, IDX, OFF, False, MEAN, False, None, False, -1)
    check(BWD, GRAD, IDX, OFF, *out[1:], 10, True, MEAN, False, None, -1, absent=[((R,) * 6, (S(0),))])


def test_dense_backward_and_per_sample_weights_backward():
    out = FWD(W, IDX, OFF, False, MEAN, False, None, False, 2)
    check(aten._embedding_bag_dense_backward.default, GRAD, IDX, *out[1:], 10, False, MEAN, None, 2,
          expect=[((R,) * 5, (S(0),)), ((S(0),) + (R,) * 4, (P,))])
    o2b = FWD(W, IDX, OFF, False, SUM, False, PSW, False, -1)[1]
    check(aten._embedding_bag_per_sample_weights_backward.default, GRAD, W, IDX, OFF, o2b, SUM,
          expect=[((S(1), S(1), R, R, R), (P,)), ((S(0), R, R, R, R), (P,)), ((R, P, R, R, R), (P,))])
