"""Indexing rules (index, index_put, scatter, index_add, slice/select backward and scatter)
checked numerically on meshes (2,), (3,), (2, 2) with even and uneven sizes, including the
index patterns of the Hugging Face GPT-2 / Llama joint graphs.

    python -m pytest tests/rules/test_indexing.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.rules.indexing import advanced
from shardwise.rules.registry import TensorMeta
from shardwise.trace.index_rows import INDEX_ALIGNED
from tests.rules._rulecheck import check, strategies_1d

aten = torch.ops.aten
R, P, PMAX, PMIN = Replicate(), Partial(), Partial("max"), Partial("min")
S = Shard
BIG = 2**63 - 1  # the "end" HF's rotate_half slices carry


def randn(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


def absent(report, ins, outs):
    assert (tuple(ins), tuple(outs)) not in strategies_1d(report), f"unexpected {ins} -> {outs}\n{report}"


def hf_mask_indices(b, s, last):
    """HF mask construction: mask[batch_arange[B,1,1,1], pos_arange[1,1,S,1] or [1,1,1,S]]."""
    pos = torch.arange(s).view(1, 1, 1, s) if last else torch.arange(s).view(1, 1, s, 1)
    return [torch.arange(b).view(b, 1, 1, 1), pos]


# -- geometry ---------------------------------------------------------------------------------
def test_advanced_geometry():
    t = lambda *s: TensorMeta(s, torch.int64)  # noqa: E731
    g = advanced(4, [None, t(2, 3), t(3)])  # adjacent: broadcast dims replace dims 1, 2
    assert (g.positions, g.bshape, g.start, g.kept) == ((1, 2), (2, 3), 1, {0: 0, 3: 3})
    g = advanced(4, [t(2, 1), None, t(3)])  # not adjacent: broadcast dims first
    assert (g.positions, g.bshape, g.start, g.kept) == ((0, 2), (2, 3), 0, {1: 2, 3: 3})
    assert advanced(2, [TensorMeta((4,), torch.bool)]) is None


# -- index.Tensor -------------------------------------------------------------------------------
@pytest.mark.parametrize("b,s", [(2, 8), (3, 5)])
@pytest.mark.parametrize("last", [False, True])
def test_index_hf_attention_mask(b, s, last):
    mask = torch.randint(0, 2, (b, s))
    pos_dim = 3 if last else 2
    check(aten.index.Tensor, mask, hf_mask_indices(b, s, last), expect=[
        ((R, S(0), R), (S(0),)),  # batch arange sharded -> batch-sharded mask
        ((R, R, S(pos_dim)), (S(pos_dim),)),  # positions sharded -> sequence-sharded mask
        ((S(0), R, R), (P,)), ((S(1), R, R), (P,)),  # mask sharded on an indexed dim: lookup in range
        ((P, R, R), (P,)), ((PMAX, R, R), (PMAX,)), ((PMIN, R, R), (PMIN,)),
    ])


def test_index_not_adjacent_negative_indices():
    x = randn(4, 5, 6, 3)
    idx = [torch.tensor([[0], [-1]]), None, torch.tensor([1, 5, -2])]  # out [2, 3, 5, 3]
    check(aten.index.Tensor, x, idx, expect=[
        ((S(1), R, R), (S(2),)), ((S(3), R, R), (S(3),)),  # kept dims follow the broadcast dims
        ((R, S(0), R), (S(0),)), ((R, R, S(0)), (S(1),)),
        ((S(0), R, R), (P,)), ((S(2), R, R), (P,)), ((P, R, R), (P,)),
    ])
    idx = [None, torch.tensor([[0], [4]]), None, torch.tensor([1, 2, -1])]  # out [2, 3, 4, 6]
    check(aten.index.Tensor, x, idx, expect=[
        ((S(0), R, R), (S(2),)), ((S(2), R, R), (S(3),)), ((R, S(0), R), (S(0),)), ((R, R, S(0)), (S(1),)),
        ((S(1), R, R), (P,)), ((S(3), R, R), (P,)),
    ])


def test_index_adjacent_in_middle_small_dim():
    x = randn(2, 7, 3)  # dim 0 smaller than mesh (3,)
    idx = [None, torch.tensor([[0, 6, 2, 2], [1, -7, 5, 3]])]  # out [2, 2, 4, 3]
    check(aten.index.Tensor, x, idx, expect=[
        ((S(0), R), (S(0),)), ((S(2), R), (S(3),)), ((R, S(0)), (S(1),)), ((R, S(1)), (S(2),)),
        ((S(1), R), (P,)), ((PMAX, R), (PMAX,)),
    ])


def test_index_bf16_and_unsafe_index():
    x = randn(5, 6, dtype=torch.bfloat16)
    idx = [torch.tensor([4, 0, 3]), torch.tensor([[5], [1]])]  # out [2, 3]
    for op in (aten.index.Tensor, aten._unsafe_index.Tensor):
        check(op, x, idx, expect=[((R, S(0), R), (S(1),)), ((R, R, S(0)), (S(0),)), ((S(0), R, R), (P,)),
                                  ((S(1), R, R), (P,)), ((P, R, R), (P,))])


def test_index_bool_mask_replicates():
    x = randn(5, 3)
    rep = check(aten.index.Tensor, x, [torch.tensor([True, False, True, True, False])],
                expect=[((R, R), (R,)), ((P, R), (P,))])
    absent(rep, (S(1), R), (S(1),))


# -- slice_backward / select_backward ---------------------------------------------------------
@pytest.mark.parametrize("start,end", [(4, BIG), (0, 4)])
def test_slice_backward_rotate_half(start, end):
    g = randn(2, 3, 5, 4)  # llama rotate_half: grad of x[..., :4] / x[..., 4:]
    rep = check(aten.slice_backward.default, g, [2, 3, 5, 8], 3, start, end, 1, expect=[
        ((S(0),), (S(0),)), ((S(1),), (S(1),)), ((S(2),), (S(2),)),
        ((P,), (P,)), ((PMAX,), (PMAX,)), ((PMIN,), (PMIN,)),
    ])
    absent(rep, (S(3),), (S(3),))


def test_slice_backward_whole_parts_of_a_dim_in_groups():
    """The gradient of q of a fused [q|k|v] (5 of 15 features: uneven over 2 and 3 ranks): zeros
    around each rank's chunk of the part; two parts of three stay in groups."""
    check(aten.slice_backward.default, randn(2, 5), [2, 15], 1, 5, 10, 1, expect=[((S(1),), (S(1, groups=3),))])
    check(aten.slice_backward.default, randn(2, 8), [2, 12], -1, 4, BIG, 1,
          expect=[((S(1, groups=2),), (S(1, groups=3),))])


def test_slice_backward_whole_dim_and_step():
    g = randn(3, 7, dtype=torch.bfloat16)
    check(aten.slice_backward.default, g, [3, 7], -1, -7, BIG, 1, expect=[((S(1),), (S(1),)), ((S(0),), (S(0),))])
    rep = check(aten.slice_backward.default, randn(3, 7), [9, 7], 0, 1, 7, 2, expect=[((S(1),), (S(1),)), ((P,), (P,))])
    absent(rep, (S(0),), (S(0),))


def test_select_backward():
    rep = check(aten.select_backward.default, randn(5, 7), [5, 3, 7], 1, -1, expect=[
        ((S(0),), (S(0),)), ((S(1),), (S(2),)), ((P,), (P,)), ((PMAX,), (PMAX,))])
    absent(rep, (S(1),), (S(1),))
    check(aten.select_backward.default, randn(2, 3, dtype=torch.bfloat16), [2, 3, 4], 2, 1,
          expect=[((S(0),), (S(0),)), ((S(1),), (S(1),))])


# -- index_put / scatter / index_add ------------------------------------------------------------
@pytest.mark.parametrize("op", [aten.index_put.default, aten._unsafe_index_put.default])
def test_index_put(op):
    x = randn(5, 7, 3)
    check(op, x, [None, torch.tensor([0, 6, 2])], randn(5, 3, 3), expect=[
        ((S(0), R, S(0)), (S(0),)), ((S(2), R, S(2)), (S(2),)),
        ((P, R, P), (P,)), ((PMAX, R, PMAX), (PMAX,))])
    rep = check(op, x, [None, torch.tensor([0, 6, 2, 6])], randn(3), True, expect=[
        ((S(0), R, R), (S(0),)), ((S(2), R, S(0)), (S(2),)),  # values broadcast: Replicate on dim 0
        ((P, S(0), R), (P,)), ((P, R, P), (P,))])  # accumulate: each rank adds its share
    absent(rep, (PMAX, R, PMAX), (PMAX,))


def test_index_put_accumulate_not_adjacent():
    x = randn(5, 7, 3)
    idx = [torch.tensor([[0], [4], [4]]), None, torch.tensor([1, 2])]  # values broadcast to [3, 2, 7]
    check(aten.index_put.default, x, idx, randn(3, 2, 7), True, expect=[
        ((S(1), R, R, S(2)), (S(1),)), ((P, S(0), R, S(0)), (P,)), ((P, R, S(0), S(1)), (P,))])


def test_scatter_ops():
    x = randn(5, 7, 3)
    perm = torch.stack([torch.randperm(7)[:4] for _ in range(15)]).view(5, 3, 4).transpose(1, 2).contiguous()
    shards = [((S(0), S(0), S(0)), (S(0),)), ((S(2), S(2), S(2)), (S(2),))]
    check(aten.scatter.src, x, 1, perm, randn(5, 4, 3), expect=shards + [((P, R, P), (P,)), ((PMIN, R, PMIN), (PMIN,))])
    rep = check(aten.scatter_add.default, x, 1, torch.randint(0, 7, (5, 4, 3)), randn(5, 4, 3),
                expect=shards + [((P, R, P), (P,)), ((P, S(1), S(1)), (P,))])
    absent(rep, (PMAX, R, PMAX), (PMAX,))
    rep = check(aten.scatter.value, x, 1, perm, 2.5, expect=[((S(0), S(0)), (S(0),)), ((PMAX, R), (PMAX,))])
    absent(rep, (P, R), (P,))
    check(aten.scatter.value, x.bfloat16(), 1, perm, 0.0, expect=[((P, R), (P,))])
    rep = check(aten.scatter.src, x, 1, perm[:4], randn(5, 4, 3), expect=[((S(2), S(2), S(2)), (S(2),))])
    absent(rep, (S(0), S(0), S(0)), (S(0),))  # index smaller than self on dim 0: positions differ


def test_index_add():
    x = randn(5, 7, 3)
    check(aten.index_add.default, x, 1, torch.tensor([0, 6, 2, 6]), randn(5, 4, 3), alpha=2, expect=[
        ((S(0), R, S(0)), (S(0),)), ((S(2), R, S(2)), (S(2),)), ((P, R, P), (P,)), ((P, S(0), S(1)), (P,))])
    check(aten.index_add.default, torch.randn(()), 0, torch.tensor([0]), torch.randn(()), expect=[((P, R, P), (P,))])  # 0-d


# -- slice_scatter / select_scatter ---------------------------------------------------------------
def test_slice_and_select_scatter():
    x = randn(5, 7, 3)
    rep = check(aten.slice_scatter.default, x, randn(5, 3, 3), 1, 2, 7, 2, expect=[
        ((S(0), S(0)), (S(0),)), ((S(2), S(2)), (S(2),)), ((P, P), (P,)), ((PMAX, PMAX), (PMAX,))])
    absent(rep, (S(1), S(1)), (S(1),))
    check(aten.slice_scatter.default, x, randn(5, 7, 3), 1, -7, expect=[((S(1), S(1)), (S(1),))])
    check(aten.select_scatter.default, x.bfloat16(), randn(5, 3, dtype=torch.bfloat16), 1, 4, expect=[
        ((S(0), S(0)), (S(0),)), ((S(2), S(1)), (S(2),)), ((P, P), (P,))])


# -- the calls of the HF joint graphs ------------------------------------------------------------
def _sample(call):
    """Real args for an OpCall of the graph: index tensors in range of the dim they index."""
    src = call.ins[0]

    def make(x, dim):
        if not isinstance(x, TensorMeta):
            return x
        if x.dtype.is_floating_point:
            return torch.randn(x.shape).to(x.dtype)
        return torch.randint(0, src.shape[dim] if dim is not None else 2, x.shape, dtype=x.dtype)

    args = [make(a, None) for a in call.args]
    if call.op in (aten.index.Tensor, INDEX_ALIGNED):
        args[1] = [make(t, k) for k, t in enumerate(call.args[1])]
    if call.op is INDEX_ALIGNED:  # its index on dim is an arange over that dim (trace/index_rows.py)
        dim, t = call.args[2], call.args[1][call.args[2]]
        args[1][dim] = torch.arange(src.shape[dim]).view(t.shape)
    return args


def test_hf_graph_calls():
    from shardwise.trace.normalize import node_call
    from tests.models import zoo

    seen = {}
    for n in zoo.cached_step("llama").call_nodes():
        if n.target in (aten.index.Tensor, INDEX_ALIGNED, aten.slice_backward.default):
            c = node_call(n)
            seen.setdefault(repr((c.op, c.args)), c)
    # the padding mask's per-row lookups trace as shardwise.index_aligned
    assert {c.op for c in seen.values()} == {INDEX_ALIGNED, aten.slice_backward.default}
    for c in seen.values():
        rep = check(c.op, *_sample(c))
        sharded = [r for r in rep.results if any(isinstance(p, Shard) for ps in r.strategy.outs for p in ps)]
        assert sharded, rep
