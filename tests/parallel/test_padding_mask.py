"""Padding masks indexed per batch row (HF's ``padding_mask[batch_idx, kv_idx]``) stay sharded
with the batch: data parallel with an attention mask needs no collective beyond the gradient
and loss all-reduces, and equals one device (uneven batch: 5 rows over 2 ranks).

    python -m pytest tests/parallel/test_padding_mask.py -q
"""
import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.trace.index_rows import INDEX_ALIGNED
from tests.models import zoo
from tests.models.zoo import positional

from .harness import check_training
from .recipes import n_trainable


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_padding_mask_stays_batch_sharded(name):
    model, (ids, *_), _, _ = zoo.MODELS[name](batch=5, seq=8)
    mask = torch.ones(5, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding on two rows
    mask[4, :2] = 0
    inputs = positional(model.forward, input_ids=ids, attention_mask=mask, labels=ids.clone())
    pm = check_training(model, sw.Mesh((2,), ("dp",)), inputs, lr=1e-3, optim_kwargs={"eps": 1e-6},
                        input_placements={"input_ids": [S(0)], "attention_mask": [S(0)], "labels": [S(0)]})
    assert INDEX_ALIGNED in pm.plan.traced.ops()
    # gradients, the loss, and cross_entropy's total weight (all-reduced inside nll_loss)
    assert pm.plan.stats()["collectives"] == {"all_reduce": n_trainable(model) + 2}, pm.plan.summary()


class Rows(torch.nn.Module):
    """``x[perm]`` with a permutation is not an arange: it stays aten.index."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, perm):
        rows = torch.arange(x.shape[0])
        return (self.lin(x)[rows.unsqueeze(1), torch.arange(4).unsqueeze(0)] * self.lin(x)[perm]).sum()


def test_only_an_arange_index_is_retargeted():
    from shardwise.trace import trace_step

    x, perm = torch.randn(5, 4), torch.tensor([4, 2, 0, 1, 3])
    traced = trace_step(Rows(), (x, perm))
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(INDEX_ALIGNED) == 1 and torch.ops.aten.index.Tensor in targets
    model = Rows()
    pm = check_training(model, sw.Mesh((2,)), (x, perm), input_placements={0: [S(0)], 1: [S(0)]})
    assert INDEX_ALIGNED in pm.plan.traced.ops()
