"""shardwise run SCRIPT --nproc N (shardwise.run.launch.run_script): a script on local
processes through torch's launcher; exit code 0 when every rank succeeds, non-zero with the
failed rank's error on stderr when one fails (or hangs: the others name it after the collective
timeout); runs end cleanly (no SIGABRT at teardown); the script's arguments reach it whole.

    python -m pytest tests/run/test_launch_script.py -q            # 3 clean runs
    python -m pytest tests/run/test_launch_script.py -q -m slow    # 50 clean runs, a hanging rank
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


@pytest.mark.slow  # ~35 s on 2 cores; every default torchrun test below also checks a clean exit code
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


@pytest.mark.slow  # 3 processes, about 40 s on 2 cores; the failing-rank test above runs by default
@pytest.mark.timeout(300)
def test_a_hanging_rank_is_named_by_every_other_rank_within_the_timeout(capfd):
    """Rank 1 of 3 sleeps inside a program node of its second step (alive, never arriving): ranks 0
    and 2 each raise CollectiveError naming rank 1 once the 5 s collective timeout passes (well
    within timeout + 30 s), and the job ends non-zero instead of hanging."""
    timeout = 5.0
    rc = run_script(SCRIPT, 3, ["--hang-rank", "1"], timeout=timeout)
    _, err = capfd.readouterr()
    assert rc != 0
    for rank in (0, 2):
        assert (f"[rank{rank}]: shardwise.core.errors.CollectiveError: rank {rank}: all_reduce on mesh dim 0 over "
                f"ranks [0, 1, 2] timed out after 5.0s; rank(s) [1] did not arrive") in err, err[-3000:]
        took = float(re.search(rf"rank {rank} stopped after ([0-9.]+)s: CollectiveError", err).group(1))
        assert timeout - 0.5 < took < timeout + 30.0
    assert "rank 1 stopped" not in err  # it never raised: the launcher ended it


def test_script_arguments_after_the_double_dash_reach_the_script_whole(tmp_path):
    """``--log`` is a prefix of torchrun's --log-dir / --logs-specs: still the script's."""
    script = tmp_path / "args.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[-1], 'argv' + os.environ['RANK']), 'w').write(repr(sys.argv[1:]))\n")
    rc = run_script(str(script), 1, ["--log", "x", "--nproc-per-node", "--", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "argv0").read_text() == repr(["--log", "x", "--nproc-per-node", "--", str(tmp_path)])


def test_launcher_command_is_one_local_node_on_loopback(tmp_path):
    cmd = launcher_command("train.py", 4, ["--steps", 3])
    assert cmd[1:3] == ["-m", "shardwise.run.torchrun"]  # torch.distributed.run, the script's args kept whole
    assert "--nproc-per-node=4" in cmd and cmd[-4:] == ["--", "train.py", "--steps", "3"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert cmd[cmd.index("--max-restarts") + 1] == "0"
    assert launcher_command("train.py", 2, max_restarts=3)[cmd.index("--max-restarts") + 1] == "3"
    with pytest.raises(ValueError, match="nproc >= 1"):
        run_script(SCRIPT, 0, [])
    with pytest.raises(ValueError, match="max_restarts >= 0"):
        run_script(SCRIPT, 2, [], max_restarts=-1)
    with pytest.raises(sw.ConfigError, match="no script"):
        run_script(str(tmp_path / "missing.py"), 2, [])
    with pytest.raises(ValueError, match="positive number of seconds"):
        run_script(SCRIPT, 2, [], timeout=0)
