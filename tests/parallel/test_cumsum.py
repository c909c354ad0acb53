"""A model with cumsum trains exactly (issue 9): cumsum's backward flips, and flip has a rule.
Loss, every gradient and the parameters after 2 AdamW steps equal one device, with the batch,
the scanned sequence dim or the hidden units sharded (uneven sizes).

    python -m pytest tests/parallel/test_cumsum.py -q
"""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R, Shard as S

from .harness import check_training


class RunningMean(torch.nn.Module):
    """Project, take the running mean over the sequence (cumsum / position), project back;
    plus a cumsum over the hidden units, so both a sharded and a replicated scan dim occur."""

    def __init__(self, d=5, hidden=6, out=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(d, hidden)
        self.out = torch.nn.Linear(hidden, out)

    def forward(self, x):
        h = self.inp(x).tanh()
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).unsqueeze(-1)
        h = h.cumsum(dim=1) / steps + 0.1 * h.cumsum(dim=-1)
        return self.out(h)


def mse(out, y):
    return ((out - y) ** 2).mean()


def data(batch, seq, d=5, out=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, seq, d, generator=g), torch.randn(batch, seq, out, generator=g)


MEGATRON = {"inp.weight": S(0), "inp.bias": S(0), "out.weight": S(1)}
CASES = {
    "batch-2": ((2,), (5, 4), {0: [S(0)]}, {}),
    "seq-3": ((3,), (2, 7), {0: [S(1)]}, {}),
    "seq-2-hidden": ((2,), (3, 5), {0: [S(1)]}, {n: [p] for n, p in MEGATRON.items()}),
    "2x2-batch-hidden": ((2, 2), (3, 4), {0: [S(0), R()]}, {n: [R(), p] for n, p in MEGATRON.items()}),
}


@pytest.mark.parametrize("case", CASES)
def test_cumsum_model_trains_like_one_device(case):
    mesh, (batch, seq), inputs, params = CASES[case]
    x, y = data(batch, seq)
    pm = check_training(RunningMean(), sw.Mesh(mesh), (x,), (y,), mse, steps=2,
                        input_placements=inputs, target_placements=inputs, param_placements=params)
    assert "flip" in pm.plan.summary()


def test_cumsum_model_under_the_ilp_planner():
    x, y = data(4, 5)
    check_training(RunningMean(), sw.Mesh((2,)), (x,), (y,), mse, steps=2, input_placements={0: [S(1)]},
                   target_placements={0: [S(1)]}, planner="ilp")
