"""A rank dies, the job goes on, nothing is lost: ``shardwise run --nproc 2 --max-restarts 1`` on gloo
runs resilient_train.py (dropout, AdamW, a Checkpointer every 3 steps, async saves); one rank is
SIGKILLed during step 7 of 12; torch's elastic agent stops the other and restarts both; they resume
from the newest complete checkpoint, and the final parameters, optimizer state and every step's
loss equal, bit for bit, those of a run that was never interrupted. Likewise when the newest
checkpoint is damaged (a shard file truncated): the resume falls back to the one before and says so.

    python -m pytest tests/checkpoint/test_restart.py -q              # the kill (about 1.5 min)
    python -m pytest tests/checkpoint/test_restart.py -q -m slow      # the damaged checkpoint too
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from shardwise.cli import main

from .helpers import assert_bitwise

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

SCRIPT = os.path.join(os.path.dirname(__file__), "resilient_train.py")
STEPS, KILL_STEP = 12, 7


def _run(out, *args, restarts=1) -> tuple[int, float]:
    """Run the job; its output (the launcher's and every rank's) goes to ``out / "logs"``: read it
    with ``_output``. shardwise run prints one line only."""
    out.mkdir()
    t0 = time.monotonic()
    rc = main(["run", SCRIPT, "--nproc", "2", "--max-restarts", str(restarts), "--log-dir", str(out / "logs"),
               "--", str(out), *args])
    return rc, time.monotonic() - t0


def _output(out) -> str:
    """The job's whole output: the launcher's (torchrun's agent) and every rank's, every attempt."""
    from shardwise.run.script_logs import gather

    with open(gather(str(out / "logs"))) as f:
        return f.read()


def _losses(out) -> dict:
    """{step: loss hex} of the last attempt that ran each step, and the attempts seen."""
    by_step, attempts = {}, set()
    for line in (out / "losses.txt").read_text().split("\n"):
        if line:
            attempt, step, loss = line.split()
            by_step[int(step)] = loss  # a later attempt's line comes later
            attempts.add(int(attempt))
    return by_step, attempts


def _resumes(out) -> list[tuple[int, int, str]]:
    rows = [line.split() for line in (out / "resumed.txt").read_text().split("\n") if line]
    return [(int(a), int(s), p) for a, s, p in rows]


def _final(out) -> dict:
    return torch.load(out / "final.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job, never interrupted."""
    out = tmp_path_factory.mktemp("restart") / "reference"
    rc, took = _run(out, restarts=0)
    assert rc == 0
    losses, attempts = _losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1)) and attempts == {0}
    return losses, _final(out), took


def _check_same_bits(out, reference) -> None:
    want_losses, want_final, _ = reference
    losses, attempts = _losses(out)
    assert attempts == {0, 1}, "the job was not restarted"
    assert losses == want_losses  # steps 1..6 from the first attempt, 7..12 from the resumed one
    assert_bitwise(_final(out), want_final)


def test_a_killed_rank_restarts_and_ends_bitwise_equal(tmp_path, reference):
    """Rank 1 is SIGKILLed after its forward and backward of step 7, while the save of step 6 may
    still be in flight: the restarted job resumes from step 6, or from step 3 if that save had
    not completed (the killed write is never taken for a checkpoint), and ends with the same bits."""
    out = tmp_path / "killed"
    rc, took = _run(out, "--kill-rank", "1", "--kill-step", str(KILL_STEP))
    err = _output(out)
    assert rc == 0, err[-3000:]
    assert "exitcode: -9" in err or "exitcode  : -9" in err, err[-3000:]  # the agent saw the SIGKILL
    resumes = _resumes(out)
    assert resumes[0] == (0, 0, "None") and resumes[1][:2] in {(1, 6), (1, 3)}, resumes
    assert resumes[1][2].endswith(f"step_{resumes[1][1]:08d}")
    _check_same_bits(out, reference)
    print(f"killed run: resumed from step {resumes[1][1]}, {took:.1f}s (uninterrupted: {reference[2]:.1f}s)")


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_and_ends_bitwise_equal(tmp_path, reference):
    """Rank 0 (which also hosts the process group's store) waits for the save of step 6, truncates
    one of its shard files and kills itself during step 7: the resume finds step 6 damaged, warns
    naming it and the file, resumes from step 3 and still ends with the same bits."""
    out = tmp_path / "damaged"
    rc, _ = _run(out, "--kill-rank", "0", "--kill-step", str(KILL_STEP), "--corrupt-newest")
    err = _output(out)
    assert rc == 0, err[-3000:]
    assert _resumes(out)[1][:2] == (1, 3)
    damaged, previous = out / "ckpt" / "step_00000006", out / "ckpt" / "step_00000003"
    assert (f"CheckpointWarning: checkpoint '{damaged}': file '__0_0.distcp' has " in err
            and "(truncated or overwritten): resuming from the checkpoint before it, "
                f"{previous}, instead" in err), err[-3000:]
    _check_same_bits(out, reference)
