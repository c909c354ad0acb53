"""Flop estimates (search/flops.py) come from LOCAL shapes on the busiest rank."""
import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard as S
from shardwise.search.flops import flops
from shardwise.rules.registry import OpCall, Strategy

aten = torch.ops.aten
R, P = Replicate(), Partial()
MESH = sw.Mesh((2,), ("tp",))


def call(op, *args):
    return OpCall.from_values(op, args, {}, op(*args))


def test_matmul_counts_the_local_contraction():
    mm = call(aten.mm.default, torch.randn(8, 16), torch.randn(16, 4))
    assert flops(mm, Strategy(((R,),), ((R,), (R,))), MESH) == 2 * 8 * 4 * 16
    assert flops(mm, Strategy(((S(0),),), ((S(0),), (R,))), MESH) == 2 * 4 * 4 * 16  # rows split
    assert flops(mm, Strategy(((P,),), ((S(1),), (S(0),))), MESH) == 2 * 8 * 4 * 8  # contraction split


def test_uneven_shards_count_the_busiest_rank():
    mm = call(aten.mm.default, torch.randn(5, 16), torch.randn(16, 4))
    assert flops(mm, Strategy(((S(0),),), ((S(0),), (R,))), MESH) == 2 * 3 * 4 * 16


def test_attention_and_pointwise():
    q = torch.randn(1, 2, 8, 4)
    att = call(torch.ops.shardwise.attention.default, q, q, q, None, True, None, False, 0, 0, None, None)
    rep = Strategy(((R,), (R,)), ((R,), (R,), (R,)))
    heads = Strategy(((S(1),), (S(1),)), ((S(1),), (S(1),), (S(1),)))
    causal = 36 / 64  # is_causal: the 8 x 9 / 2 scores on or below the diagonal of 8 x 8
    assert flops(att, rep, MESH) == 4 * q.numel() * 8 * causal
    assert flops(att, heads, MESH) == 4 * q.numel() * 8 * causal / 2
    dense = call(torch.ops.shardwise.attention.default, q, q, q, None, False, None, False, 0, 0, None, None)
    assert flops(dense, rep, MESH) == 4 * q.numel() * 8
    add = call(aten.add.Tensor, torch.randn(8, 4), torch.randn(8, 4))
    assert flops(add, Strategy(((S(0),),), ((S(0),), (S(0),))), MESH) == 16
