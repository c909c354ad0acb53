"""Every aten op in the zoo models' joint graphs (both dtypes) has a sharding rule.

    python -m pytest tests/rules/test_model_coverage.py -q

operator.getitem (tuple unpacking of multi-output ops) is structural and needs no rule.
"""
from __future__ import annotations

import pytest
import torch

import shardwise.rules
from tests.models import zoo


@pytest.fixture(scope="module")
def registry():
    return shardwise.rules.load_all()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_every_op_has_a_rule(name, dtype, registry):
    ts = zoo.cached_step(name, dtype)
    ops = ts.ops()
    missing = sorted(str(op) for op in ops if op not in registry)
    assert not missing, (
        f"{name} ({dtype}): {len(missing)} of {len(ops)} ops have no rule:\n  " + "\n  ".join(missing)
        + "\nops seen: " + ", ".join(sorted(map(str, ops)))
    )
