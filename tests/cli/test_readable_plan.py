"""Readable plans: summary rows carry the module path and source line, graph outputs get a row
each, and program(rank) is annotated with local shapes, placements and modules, guards left
out unless asked."""
from __future__ import annotations

import re

import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo

MEGATRON = {"fc1.weight": [S(0)], "fc1.bias": [S(0)], "fc2.weight": [S(1)]}


def _pm():
    model, x, y, loss_fn = zoo.mlp(batch=5)
    return sw.parallelize(model, sw.Mesh((2,), ("tp",)), x, loss_fn=loss_fn, example_targets=y,
                          param_placements=MEGATRON)


def test_summary_rows_and_program_annotations():
    pm = _pm()
    summary = pm.plan.summary()
    assert re.search(r"^addmm\s+addmm\s+fc1\s+\[S\(0\)\] \[R\] \[S\(1\)\] -> \[S\(1\)\]\s+zoo\.py:\d+", summary, re.M)
    grads = [line for line in summary.splitlines() if line.startswith("grad ")]
    assert all(len(line) < 200 for line in grads)  # one row per output, no 1000-character row
    total = int(re.search(r"totals: (\d+) collectives", summary).group(1))
    assert summary.count("all_reduce(") == total  # every collective on exactly one row

    plain, guarded = pm.plan.program(0), pm.plan.program(0, guards=True)
    assert "shape_guard" not in plain and "shape_guard" in guarded
    assert "# shape guards left out" in plain
    # fc1's addmm on rank 0: 5 rows, 16 of fc1's 32 hidden units, sharded on its last dim
    assert re.search(r"addmm = .*# \(5, 16\) \[S\(1\)\] fc1$", plain, re.M), plain
    calls = lambda text: sorted(re.findall(r"= (\w*all_reduce\w*)\(", text))  # noqa: E731
    assert calls(plain) == calls(guarded) and calls(plain)
    assert re.search(r"all_reduce\(.*# over mesh dim 'tp'$", plain, re.M), plain
    assert pm.plan.program(1, annotate=False).count("#") == 1  # only the stage header


def test_annotated_program_still_runs_exactly():
    pm = _pm()
    model, x, y, loss_fn = zoo.mlp(batch=5)
    loss = pm.step(*x, *y)
    want = loss_fn(model(*x), *y)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=1e-6)
