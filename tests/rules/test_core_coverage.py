"""Core ATen coverage: every op torch tags ``core`` has a rule (verified by the sweep) or a
documented refusal; ``shardwise verify-rules --coverage`` prints which.

    python -m pytest tests/rules/test_core_coverage.py -q            # static check + CLI on a few ops
    python -m pytest tests/rules/test_core_coverage.py -q -m slow    # every core op through the sweep
"""
from __future__ import annotations

import pytest
import torch

from shardwise.cli import main
from shardwise.tools.verify.coverage import REFUSALS, core_aten_ops, coverage
from shardwise.rules import DEFAULT, load_all


def test_every_core_aten_op_has_a_rule_or_a_refusal():
    registry = load_all(DEFAULT)
    core = core_aten_ops()
    assert len(core) > 150 and torch.ops.aten.mm.default in core
    missing = [str(op) for op in core if op not in registry and str(op) not in REFUSALS]
    assert not missing, f"core ATen ops with neither a rule nor a refusal: {missing}"
    names = {str(op) for op in core}
    assert set(REFUSALS) <= names, f"refusals for ops that are not core: {set(REFUSALS) - names}"
    assert all(len(why) > 40 for why in REFUSALS.values())


def test_cli_coverage_table(capsys):
    assert main(["verify-rules", "--coverage", "--op", "acos"]) == 0
    out = capsys.readouterr().out
    assert "aten.acos.default" in out and "verified" in out and "CORE ATEN: 2 ops, 2 verified" in out  # acos, acosh
    assert main(["verify-rules", "--coverage", "--op", "nonzero"]) == 0
    out = capsys.readouterr().out
    assert "aten.nonzero.default" in out and "refused" in out and "TraceError" in out
    assert main(["verify-rules", "--coverage", "--op", "no_such_op"]) == 2


@pytest.mark.slow
def test_every_core_rule_passes_the_sweep():
    rows = coverage()
    bad = [(str(r.op), r.status, r.note) for r in rows if r.status not in ("verified", "refused")]
    assert not bad, bad
