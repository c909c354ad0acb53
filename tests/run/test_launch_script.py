"""shardwise run SCRIPT --nproc N (shardwise.run.launch.run_script): a script on local
processes through torch's launcher; exit code 0 when every rank succeeds, non-zero with the
failed rank's error on stderr when one fails; runs end cleanly (no SIGABRT at teardown).

    python -m pytest tests/run/test_launch_script.py -q            # 3 clean runs
    python -m pytest tests/run/test_launch_script.py -q -m slow    # 50 clean runs
"""
from __future__ import annotations

import os
import re

import pytest

import shardwise as sw
from shardwise.run.launch import launcher_command, run_script

pytestmark = [pytest.mark.dist]

SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun_step.py")


def _clean_runs(n: int, capfd) -> None:
    """``n`` consecutive runs of the training script (no destroy_process_group: shardwise's
    exit handler tears the groups down), each exiting 0 with no 'terminate called'."""
    for i in range(n):
        rc = run_script(SCRIPT, 2, [])
        out, err = capfd.readouterr()
        assert "terminate called" not in err, f"run {i}: {err[-3000:]}"
        assert rc == 0, f"run {i}: exit code {rc}\n{err[-3000:]}"
        assert "step 1 loss" in out, out
        for rank in (0, 1):  # the abort's cause, seen every run rather than one run in twenty
            assert f"rank {rank}: gloo threads left at exit: 0 " in err, f"run {i}: {err[-3000:]}"


@pytest.mark.timeout(300)
def test_consecutive_torchrun_runs_exit_cleanly(capfd):
    _clean_runs(3, capfd)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fifty_consecutive_torchrun_runs_exit_cleanly(capfd):
    _clean_runs(50, capfd)


@pytest.mark.timeout(300)
def test_failing_rank_gives_nonzero_exit_and_its_error(capfd):
    """Rank 1 raises at a node of its second step while rank 0 waits in the all-reduce that needs
    it: rank 0 stops with RankFailedError naming rank 1 and the node, long before the 60 s
    collective timeout, and the job exits non-zero with both errors on stderr."""
    rc = run_script(SCRIPT, 2, ["--fail-rank", "1"], timeout=60)
    _, err = capfd.readouterr()
    assert rc != 0
    assert "[rank1]: ValueError: deliberate failure on rank 1" in err, err[-3000:]
    assert "[rank1]: shardwise: raised on rank 1 at node 'addmm_1' (torch backend)" in err
    assert ("[rank0]: shardwise.core.errors.RankFailedError: rank 0: stopped in all_reduce on mesh dim 0 over ranks "
            "[0, 1] because rank 1 failed at node 'addmm_1' (ValueError: deliberate failure on rank 1)") in err
    assert "[rank0]: shardwise: raised on rank 0 at node 'all_reduce' (torch backend)" in err
    took = float(re.search(r"rank 0 stopped after ([0-9.]+)s: RankFailedError", err).group(1))
    assert took < 30.0
    assert "terminate called" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_state_dict_on_rank0_only_under_torchrun_exits_nonzero(capfd):
    rc = run_script(SCRIPT, 2, ["--state-dict-on-rank0"], timeout=3)
    _, err = capfd.readouterr()
    assert rc != 0
    assert ("[rank0]: shardwise.core.errors.CollectiveError: rank 0: all_gather on mesh dim 0 over ranks [0, 1] "
            "timed out after 3.0s; rank(s) [1] did not arrive") in err, err[-3000:]
    took = float(re.search(r"rank 0 stopped after ([0-9.]+)s: CollectiveError", err).group(1))
    assert 2.5 < took < 10.0


def test_launcher_command_is_one_local_node_on_loopback(tmp_path):
    cmd = launcher_command("train.py", 4, ["--steps", 3])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and cmd[-3:] == ["train.py", "--steps", "3"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert cmd[cmd.index("--max-restarts") + 1] == "0"
    with pytest.raises(ValueError, match="nproc >= 1"):
        run_script(SCRIPT, 0, [])
    with pytest.raises(sw.ConfigError, match="no script"):
        run_script(str(tmp_path / "missing.py"), 2, [])
    with pytest.raises(ValueError, match="positive number of seconds"):
        run_script(SCRIPT, 2, [], timeout=0)
