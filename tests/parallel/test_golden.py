"""Golden plans: the printed ``pm.plan.summary()`` of a few test models, kept in
tests/parallel/golden/<case>.txt, so a refactor that changes a plan is noticed.

    python -m pytest tests/parallel/test_golden.py -q                              # compare
    SHARDWISE_UPDATE_GOLDEN=1 python -m pytest tests/parallel/test_golden.py -q    # rewrite the files

A changed plan is not necessarily wrong: read the diff, and if the new plan is the intended
one, regenerate and commit the files with the change that caused it.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo

from .recipes import megatron_gpt2, megatron_llama, megatron_transformer, on

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SHARDWISE_UPDATE_GOLDEN") == "1"
MLP_MEGATRON = {"fc1.weight": S(0), "fc1.bias": S(0), "fc2.weight": S(1)}


def _mlp(mesh, batch=6, **kw):
    model, x, y, loss_fn = zoo.mlp(batch=batch)
    return sw.parallelize(model, mesh, x, loss_fn=loss_fn, example_targets=y, **kw)


def _lm(mesh, batch=2, seq=8, **kw):
    model, x, y, loss_fn = zoo.transformer(batch=batch, seq=seq)
    return sw.parallelize(model, mesh, x, loss_fn=loss_fn, example_targets=y, **kw)


def _hf(name, mesh, **kw):
    model, inputs, _, _ = zoo.MODELS[name]()
    return sw.parallelize(model, mesh, inputs, **kw)


DP, TP = sw.Mesh((2,), ("dp",)), sw.Mesh((2,), ("tp",))
DP_TP = sw.Mesh((2, 2), ("dp", "tp"))

CASES = {
    "mlp_dp_uneven": lambda: _mlp(DP, batch=5, input_placements={0: [S(0)]}),
    "mlp_megatron": lambda: _mlp(TP, param_placements={n: [p] for n, p in MLP_MEGATRON.items()}),
    "mlp_dp_x_tp": lambda: _mlp(DP_TP, input_placements={0: {"dp": S(0)}}, param_placements=on("tp", MLP_MEGATRON)),
    "transformer_dp": lambda: _lm(DP, input_placements={0: [S(0)]}),
    "transformer_megatron": lambda: _lm(TP, param_placements=megatron_transformer()),
    "transformer_seq_dim1": lambda: _lm(sw.Mesh((2,), ("sp",)), seq=7, input_placements={0: [S(1)]}),
    "gpt2_megatron": lambda: _hf("gpt2", TP, param_placements=megatron_gpt2()),
    "llama_megatron": lambda: _hf("llama", TP, param_placements=megatron_llama()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_golden(case):
    pm = CASES[case]()
    assert pm.plan.stage == "step"
    got = pm.plan.summary().rstrip() + "\n"
    path = GOLDEN / f"{case}.txt"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got)
        return
    assert path.exists(), f"no golden plan {path}; generate it with SHARDWISE_UPDATE_GOLDEN=1"
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"golden/{case}.txt", "current plan", n=1))
        lines = diff.splitlines()
        more = f"\n... {len(lines) - 120} more diff lines" if len(lines) > 120 else ""
        pytest.fail(f"the plan of {case} changed (if intended: SHARDWISE_UPDATE_GOLDEN=1):\n"
                    + "\n".join(lines[:120]) + more, pytrace=False)
