"""A preference (DPO) loss and a KL term over a hardswish MLP, data-parallel on 2 ranks with an
uneven batch (5 rows): loss and every gradient against one device. The step's graph holds the
pointwise rules of issue #50 (hardswish and its backward, log_sigmoid_forward/_backward, xlogy).

Run: python -m pytest tests/parallel/test_pointwise_losses.py -q -p no:cacheprovider
"""
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Shard as S

from .harness import check_training


class PreferenceMLP(torch.nn.Module):
    """Scores (chosen, rejected) per row, through a hardswish hidden layer."""

    def __init__(self, d_in=6, hidden=8):
        super().__init__()
        self.up, self.score = torch.nn.Linear(d_in, hidden), torch.nn.Linear(hidden, 2)

    def forward(self, x):
        return self.score(F.hardswish(self.up(x)))


def dpo_kl_loss(scores, target, beta=0.7):
    """DPO's -logsigmoid(beta * (chosen - rejected)).mean(), plus KL(target || softmax(scores)) with
    zeros in the target (xlogy(0, .) is 0 there: the term the rule must keep exact)."""
    dpo = -F.logsigmoid(beta * (scores[:, 0] - scores[:, 1])).mean()
    kl = (torch.xlogy(target, target) - torch.xlogy(target, scores.softmax(-1))).sum(-1).mean()
    return dpo + kl


def test_dpo_loss_data_parallel_uneven_batch():
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    target = torch.tensor([[1.0, 0.0], [0.3, 0.7], [0.0, 1.0], [0.5, 0.5], [1.0, 0.0]])
    pm = check_training(PreferenceMLP(), sw.Mesh((2,), ("dp",)), (x,), (target,), dpo_kl_loss, steps=2,
                        input_placements={0: [S(0)]}, target_placements={0: [S(0)]})
    ops = ("hardswish", "hardswish_backward", "log_sigmoid_forward", "log_sigmoid_backward", "xlogy")
    seen = {op: 0 for op in ops}
    for n in pm.plan.prop.gm.graph.nodes:
        name = getattr(n.target, "__name__", "").split(".")[0]
        if name in seen:  # each runs on the rank's own rows: 3 and 2, every output Shard(0)
            seen[name] += 1
            assert all(lay.placements == (S(0),) for lay in pm.plan.prop.layouts[n.name]), (n, pm.plan.summary())
    assert all(seen.values()), seen
    assert set(pm.plan.stats()["collectives"]) == {"all_reduce"}, pm.plan.summary()  # loss and gradients only
