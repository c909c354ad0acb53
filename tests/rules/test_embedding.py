"""embedding / embedding_dense_backward rules checked numerically on meshes (2,), (3,), (2, 2).

Run: python -m pytest tests/rules/test_embedding.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard


def ids(shape, vocab, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab,dim,idx_shape", [(8, 4, (2, 6)), (7, 5, (3, 5)), (2, 3, (5,)), (5, 1, (2, 3, 2))])
def test_embedding(vocab, dim, idx_shape):
    idx = ids(idx_shape, vocab)
    expect = [((R, S(d)), (S(d),)) for d in range(len(idx_shape))]
    expect += [((S(1), R), (S(len(idx_shape)),)), ((S(0), R), (P,)), ((P, R), (P,))]
    check(aten.embedding.default, torch.randn(vocab, dim), idx, expect=expect)


def test_embedding_padding_idx_bf16():
    idx = ids((3, 4), 7)
    idx[0, 0] = 2
    check(aten.embedding.default, torch.randn(7, 4).bfloat16(), idx, 2, expect=[((S(0), R), (P,))])


@pytest.mark.parametrize("padding_idx", [-1, 2, 6])
@pytest.mark.parametrize("vocab,dim,idx_shape", [(8, 4, (2, 6)), (7, 3, (3, 5)), (2, 5, (5,))])
def test_embedding_dense_backward(vocab, dim, idx_shape, padding_idx):
    idx = ids(idx_shape, vocab)
    idx.view(-1)[::4] = min(padding_idx, vocab - 1) if padding_idx >= 0 else 0
    grad = torch.randn(*idx_shape, dim)
    expect = [((S(d), S(d)), (P,)) for d in range(len(idx_shape))]
    expect += [((S(len(idx_shape)), R), (S(1),)), ((R, R), (S(0),)), ((P, R), (P,))]
    pad = padding_idx if padding_idx < vocab else -1
    check(aten.embedding_dense_backward.default, grad, idx, vocab, pad, False, expect=expect)


@pytest.mark.parametrize("padding_idx", [-1, 1])
def test_embedding_dense_backward_scale_grad_by_freq(padding_idx):
    idx = torch.tensor([[0, 1, 1, 4], [4, 4, 2, 0], [3, 1, 1, 1]])
    grad = torch.randn(3, 4, 6)
    r = check(aten.embedding_dense_backward.default, grad, idx, 5, padding_idx, True,
              expect=[((S(2), R), (S(1),)), ((R, R), (S(0),)), ((P, R), (P,))])
    tokens_sharded = [((S(d), S(d)), (P,)) for d in range(2)]
    got = {(ins, outs) for ins, outs in tokens_sharded} & {
        (tuple(p[0] for p in x.strategy.ins), tuple(p[0] for p in x.strategy.outs)) for x in r.results}
    assert not got, "token-sharded strategies must be absent: counts are global"


def test_embedding_dense_backward_bf16():
    idx = ids((4, 3), 6)
    check(aten.embedding_dense_backward.default, torch.randn(4, 3, 4).bfloat16(), idx, 6, -1, False,
          expect=[((S(0), S(0)), (P,)), ((R, R), (S(0),))])
