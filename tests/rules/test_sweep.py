"""The rule sweep: every registered op verified on sampled calls, every strategy on meshes
(2,), (3,), (2, 2); the totals line goes to the test log (the table: shardwise verify-rules).

    python -m pytest tests/rules/test_sweep.py -q                 # fast sweep + checks (~1 min)
    python -m pytest tests/rules/test_sweep.py -q -m slow         # the full sweep
"""
from __future__ import annotations

import pytest
import torch

from shardwise.cli import main
from shardwise.core.layout import Replicate, Shard
from shardwise.rules import DEFAULT, Registry, Strategy1D, load_all
from shardwise.tools.verify.sweep import UNINITIALISED, sweep

aten = torch.ops.aten


def _log(capsys, report):
    """One totals line (and any failure in detail) straight to the terminal, so CI logs show
    them; the coverage table is ``shardwise verify-rules``'s, not the test run's."""
    with capsys.disabled():
        print("\n" + report.totals())
        if not report.ok:
            print(report.failure_text())


@pytest.fixture(scope="module")
def fast():
    return sweep()


def test_fast_sweep_passes(fast, capsys):
    _log(capsys, fast)
    assert fast.ok, f"{fast.totals()}\n{fast.failure_text()}\n\n{fast.table()}"


def test_every_registered_op_has_a_sample(fast):
    assert set(fast.rows) == set(load_all(DEFAULT).ops())
    assert not fast.unsampled, "no sample for: " + ", ".join(sorted(map(str, fast.unsampled)))
    assert all(r.strategies > 0 for r in fast.rows.values() if not r.failures)


def test_uninitialised_outputs_are_checked_by_shape(fast):
    for op in UNINITIALISED & set(fast.rows):
        row = fast.rows[op]
        assert row.note.startswith("shape-only") and row.strategies > 0, (op, row.note)


def test_table_lists_every_op_and_totals(fast):
    lines = fast.table().splitlines()
    assert lines[0].split()[:5] == ["op", "samples", "strategies", "failures", "max"]
    assert len(lines) == len(fast.rows) + 3 and lines[-1].startswith("TOTAL (fast)")


def _wrong_sum(wrong):
    """A rule for sum.dim_IntList: kept dims right, but a sharded reduced dim gives ``wrong(d)``
    (the right answer is Partial('sum'))."""
    def strategies(call):
        x, keep = call.ins[0], call.arg(2, "keepdim", False)
        red = {d % x.ndim for d in (call.arg(1, "dim") or range(x.ndim))} if x.ndim else set()
        out = [Strategy1D((Replicate(),), (Replicate(),))]
        for d in range(x.ndim):
            if d not in red:
                out.append(Strategy1D((Shard(d if keep else d - sum(r < d for r in red)),), (Shard(d),)))
            else:
                out.append(Strategy1D((wrong(d if keep else 0) if call.out.ndim else Replicate(),), (Shard(d),)))
        return out
    return strategies


@pytest.mark.parametrize("wrong", [lambda d: Replicate(), lambda d: Shard(d)], ids=["replicate", "shard"])
def test_a_wrong_rule_is_caught(wrong):
    """A sum rule claiming a Replicate (or Shard) result when the reduced dim is sharded (it
    is a Partial sum) fails the sweep on exactly those strategies; the others still pass."""
    reg = Registry()
    reg.register(aten.sum.dim_IntList, _wrong_sum(wrong))
    report = sweep(registry=reg)
    row = report.rows[aten.sum.dim_IntList]
    assert not report.ok and row.samples > 0 and row.failures and row.strategies > 0
    for f in row.failures:
        assert f.strategy is not None and any(isinstance(p, Shard) for ps in f.strategy.ins for p in ps), f


def test_cli_filters_and_lists_strategies(capsys):
    assert main(["verify-rules", "--op", "aten.mm.default", "--list-strategies"]) == 0
    out = capsys.readouterr().out
    assert "aten.mm.default" in out and "aten.addmm" not in out
    assert "mesh (2, 2):" in out and "[Shard(0)], [Replicate()]) -> ([Shard(0)])" in out
    assert "TOTAL (fast): 1 ops" in out


@pytest.mark.slow
def test_full_sweep_passes(capsys):
    full = sweep(full=True)
    _log(capsys, full)
    assert full.ok, f"{full.totals()}\n{full.failure_text()}"
