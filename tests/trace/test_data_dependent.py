"""Data-dependent shapes are refused at trace time, each naming the op, the user's line and the
fixed-shape alternative (shardwise/trace/errors.py): nonzero, boolean-mask indexing,
masked_select, unique. A plan holds static global shapes; these ops' output sizes come from
the data, so no rule could give every rank its local size before the step runs.

    python -m pytest tests/trace/test_data_dependent.py -q
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.trace import trace_step
from shardwise.trace.errors import TraceError

aten = torch.ops.aten


class DataShaped(torch.nn.Module):
    def __init__(self, pick):
        super().__init__()
        self.lin, self.pick = torch.nn.Linear(4, 4), pick

    def forward(self, x):
        h = self.lin(x)
        return self.pick(h).float().sum()


CASES = {
    "nonzero": (lambda h: torch.nonzero(h > 0), "torch.nonzero(h > 0)", aten.nonzero.default),
    "mask_index": (lambda h: h[h > 0], "h[h > 0]", aten.nonzero.default),
    "masked_select": (lambda h: h.masked_select(h > 0), "h.masked_select(h > 0)", aten.masked_select.default),
    "unique": (lambda h: torch.unique(h), "torch.unique(h)", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_with_op_line_and_fix(name):
    pick, line, op = CASES[name]
    with pytest.raises(TraceError) as e:
        trace_step(DataShaped(pick), (torch.randn(3, 4),))
    err = e.value
    assert isinstance(err, sw.ShardingError) and err.op is not None and str(err.op) in str(err)
    assert op is None or err.op == op, err.op
    assert "depends on the data" in str(err), str(err)
    assert "test_data_dependent.py" in err.source and line in err.source, err.source
    assert "torch.where" in err.fix


def test_the_fixed_shape_alternative_traces_and_trains():
    """``torch.where(h > 0, h, 0).sum()`` (what the fix says) equals ``h[h > 0].sum()`` and runs
    data parallel exactly."""
    from tests.parallel.harness import check_training

    torch.manual_seed(0)
    model, x = DataShaped(lambda h: torch.where(h > 0, h, 0)), torch.randn(5, 4)
    with torch.no_grad():
        h = model.lin(x)
        # the same terms and zeros: equal up to the summation order of the CPU's kernels
        torch.testing.assert_close(model(x), h[h > 0].sum(), rtol=1e-6, atol=1e-6)
    check_training(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: {"dp": sw.Shard(0)}})
