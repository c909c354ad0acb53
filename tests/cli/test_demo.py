"""``shardwise demo --steps 3``: trains sharded (the ILP planner's choice on a 2x2 mesh), then on
one device, and says they match; the exit status says it too."""
from __future__ import annotations

import pytest
import torch

from shardwise.cli import main
from shardwise.tools.demo.runner import Comparison, RunResult, compare


def test_demo_three_steps_matches_one_device(capsys):
    rc = main(["demo", "--steps", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "MATCH: the sharded run and the single-device run agree" in out
    assert "plan (step) on mesh 2x2 (dp, tp): 4 ranks" in out
    assert "training" in out and "tokens/s" in out and "3/3" in out  # the progress bar's last state
    assert "max |loss difference| over 3 steps" in out


def _run(losses, state):
    return RunResult(losses=list(losses), state=dict(state))


def test_compare_says_mismatch_when_runs_differ():
    """The comparison can fail: a loss or a parameter off by more than the tolerance."""
    w = {"w": torch.ones(4, 4)}
    same = compare(_run([1.0, 0.5], w), _run([1.0, 0.5], w))
    assert isinstance(same, Comparison) and same.match and same.max_param_diff == 0.0
    assert not compare(_run([1.0, 0.6], w), _run([1.0, 0.5], w)).match
    off = {"w": torch.ones(4, 4) + torch.eye(4) * 1e-2}
    bad = compare(_run([1.0], off), _run([1.0], w))
    assert not bad.match and bad.worst_param == "w" and abs(bad.max_param_diff - 1e-2) < 1e-6
    assert not compare(_run([1.0], {}), _run([1.0], w)).match  # a missing parameter is a mismatch


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_demo_on_gloo_processes_matches(capsys):
    """--backend torch: 4 gloo processes, one per rank, data parallel on both mesh dims."""
    rc = main(["demo", "--backend", "torch", "--nproc", "4", "--steps", "2", "--parallel", "dp"])
    out = capsys.readouterr().out
    assert rc == 0 and "MATCH" in out and "gloo processes, one per rank" in out, out
