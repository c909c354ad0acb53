"""A value the model reads from its inputs in forward (Hugging Face's ``labels.max() >= vocab_size``
check) is answered from the real example while tracing and guarded each call (trace/value_guards.py).

    python -m pytest tests/trace/test_value_guards.py -q
"""
import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise.trace.errors import TraceError
from shardwise.trace.value_guards import ValueGuardError
from tests.parallel.harness import check_training

DP = {"x": [sw.Shard(0)], "y": [sw.Shard(0)]}


class Checked(nn.Module):
    """Raises on labels out of range, as Hugging Face's heads do, before any weight is used."""

    def __init__(self, classes=5):
        super().__init__()
        self.classes = classes
        self.lin = nn.Linear(4, classes)

    def forward(self, x, y):
        if y.max() >= self.classes:
            raise ValueError("labels out of range")
        return nn.functional.cross_entropy(self.lin(x), y)


class Branchy(nn.Module):
    """Takes another path on another value without raising: a plan cannot follow it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.lin(x)
        if (y > 0).all():
            out = out * 2
        return nn.functional.cross_entropy(out, y)


def _data(batch=5):
    torch.manual_seed(0)
    return torch.randn(batch, 4), torch.randint(0, 5, (batch,))


def test_checked_model_trains_exactly_and_is_guarded():
    """5 rows on 2 ranks (uneven): loss, gradients and two AdamW steps as one device; one guard, on y."""
    x, y = _data()
    pm = check_training(Checked(), sw.Mesh((2,), ("dp",)), (x, y), input_placements=DP, steps=2)
    from shardwise.trace.value_guards import guards_of

    guards = guards_of(pm.plan.traced.gm).guards
    assert len(guards) == 1 and guards[0].value is False and guards[0].indices == (1,)
    assert "y.max() >= self.classes" in guards[0].source
    reads = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.max.default)
    assert not any(op in pm.plan.traced.ops() for op in reads), pm.plan.traced.ops()


def test_labels_that_break_the_check_raise_the_models_error():
    """After steps that plan and settle (the steady path), a batch with a label out of range raises the
    model's own ValueError, as one device does; the step after it runs again as one device."""
    x, y = _data()
    model = Checked()
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x, y), input_placements=DP)
    pm.step(x, y)
    pm.step(x, y)
    bad = y.clone()
    bad[3] = 7
    with pytest.raises(ValueError, match="labels out of range"):
        model(x, bad)
    with pytest.raises(ValueError, match="labels out of range"):
        pm.step(x, bad)
    with pytest.raises(ValueError, match="labels out of range"):
        pm(x, bad)
    pm.zero_grad()
    loss = pm.step(x, y)
    model.zero_grad()
    want = model(x, y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pm.gradients()["lin.weight"], model.lin.weight.grad, rtol=1e-4, atol=1e-5)


def test_another_path_without_an_error_is_refused():
    x, _ = _data()
    y = torch.tensor([1, 2, 1, 2, 1])
    pm = sw.parallelize(Branchy(), sw.Mesh((2,), ("dp",)), (x, y), input_placements=DP)
    pm.step(x, y)
    with pytest.raises(ValueGuardError, match="another path") as e:
        pm.step(x, torch.tensor([1, 0, 1, 2, 1]))
    assert "(y > 0).all()" in str(e.value) and e.value.fix


def test_a_value_read_from_weights_stays_refused():
    class FromWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            h = self.lin(x)
            return h.sum() * 2 if h.max() > 0 else h.sum()

    with pytest.raises(TraceError, match="reads a Python value"):
        sw.parallelize(FromWeights(), sw.Mesh((2,), ("dp",)), (torch.randn(5, 4),),
                       input_placements={"x": [sw.Shard(0)]})


def test_local_inputs_refuse_a_guard():
    """inputs='local': no rank holds the whole labels the check reads (the trace sees their shapes only)."""
    x, y = _data(4)
    with pytest.raises(TraceError, match="reads a Python value") as e:
        sw.parallelize(Checked(), sw.Mesh((2,), ("dp",)), ([x[:2], x[2:]], [y[:2], y[2:]]), input_placements=DP,
                       inputs="local")
    assert "y.max() >= self.classes" in str(e.value)


class Covariance(nn.Module):
    """torch.cov / torch.corrcoef: their C++ compares a normalising factor made from shapes alone with
    torch.equal (a read of constants, no input): answered while tracing, exact on sharded weights."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 7))

    def forward(self, x):
        h = self.w * x
        return (torch.cov(h) * torch.corrcoef(h)).sum()


def test_a_read_of_constants_by_torch_equal_is_answered_and_exact():
    torch.manual_seed(0)
    x = torch.randn(3, 7)
    pm = check_training(Covariance(), sw.Mesh((2,), ("dp",)), (x,), input_placements={"x": [sw.Shard(1)]},
                        param_placements={"w": [sw.Shard(1)]}, steps=2)
    from shardwise.trace.value_guards import guards_of

    guards = guards_of(pm.plan.traced.gm).guards
    assert guards and all(g.equal and g.indices == () for g in guards), guards
    assert torch.ops.aten.equal.default not in pm.plan.traced.ops()


class EqualOnInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x, y):
        out = self.lin(x)
        if torch.equal(y, torch.zeros_like(y)):
            raise ValueError("all labels are zero")
        return nn.functional.cross_entropy(out, y)


def test_torch_equal_on_inputs_is_guarded_each_call():
    x, y = _data()
    y[0] = 1
    pm = check_training(EqualOnInputs(), sw.Mesh((2,), ("dp",)), (x, y), input_placements=DP)
    with pytest.raises(ValueError, match="all labels are zero"):
        pm.step(x, torch.zeros_like(y))
