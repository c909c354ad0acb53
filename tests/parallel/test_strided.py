"""No strided surprises: LayerNorm whose output meets a parameter sharded on a non-leading
dim. The planner slices the replicated ``x``, ``mean`` and ``rstd`` locally, and
``native_layer_norm_backward``'s CPU kernel reads the statistics as contiguous rows, so a
``narrow`` view gave ``ln.weight.grad`` off by up to ~4 (issue 9). Local slices are now
contiguous copies (lower/comm.py); these are the fuzzer's reproducers, exact against one device.

    python -m pytest tests/parallel/test_strided.py -q
"""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R, Shard as S
from shardwise.lower import comm

from .harness import check_training


class LayerNormTimes(torch.nn.Module):
    """``(LayerNorm(x) * p).square().sum()`` (or ``+ p``) with ``p`` of x's full shape."""

    def __init__(self, shape, add=False):
        super().__init__()
        torch.manual_seed(0)
        self.ln = torch.nn.LayerNorm(shape[-1])
        with torch.no_grad():  # non-trivial affine weights, so a wrong statistic shows in every grad
            self.ln.weight.copy_(torch.randn(shape[-1]))
            self.ln.bias.copy_(torch.randn(shape[-1]))
        self.p = torch.nn.Parameter(torch.randn(shape))
        self.add = add

    def forward(self, x):
        y = self.ln(x)
        return ((y + self.p) if self.add else (y * self.p)).square().sum()


class PositionTable(torch.nn.Module):
    """LayerNorm, then a learned position table [seq, d] added (the realistic case)."""

    def __init__(self, seq, d):
        super().__init__()
        torch.manual_seed(0)
        self.ln = torch.nn.LayerNorm(d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.ln(x) + self.pos).tanh().square().mean()


@pytest.mark.parametrize("mesh", [(2,), (3,)])
@pytest.mark.parametrize("dim,shape,add", [(1, (4, 5, 3), False), (2, (4, 5, 7), False), (1, (3, 7, 4), True)])
def test_layernorm_then_param_sharded_on_a_later_dim(mesh, dim, shape, add):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    check_training(LayerNormTimes(shape, add), sw.Mesh(mesh), (x,), steps=2,
                   input_placements={0: [R()] * len(mesh)}, param_placements={"p": [S(dim)] * len(mesh)})


@pytest.mark.parametrize("mesh,spec", [((2,), [S(0)]), ((2, 2), [R(), S(0)]), ((2, 2), [S(0), S(0)]),
                                       ((4,), [S(0)])], ids=["2", "2x2-seq", "2x2-nested", "4"])
def test_layernorm_then_sequence_sharded_position_table(mesh, spec):
    seq, d = 7, 6  # uneven on every mesh here
    x = torch.randn(2, seq, d, generator=torch.Generator().manual_seed(1))
    check_training(PositionTable(seq, d), sw.Mesh(mesh), (x,), steps=2,
                   input_placements={0: [R()] * len(mesh)}, param_placements={"pos": spec})


def test_local_slices_are_contiguous():
    """Replicate -> Shard on a non-leading dim, plain and in groups, hands a contiguous tensor on."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    got = comm.local_slice(x, 1, 1, 2)
    assert got.is_contiguous() and torch.equal(got, x[:, 1:3])
    got = comm.regrouped(x, ((2, 2, 2),), "local_slice", 3, 1, 1)  # dim 2 as 2 groups [a b]: b of each
    assert got.is_contiguous() and torch.equal(got, x[:, :, 1::2])
