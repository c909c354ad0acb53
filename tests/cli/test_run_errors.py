"""``shardwise run`` prints a failure as one line: the first failing rank's typed error and its
fix, and the file holding every rank's output (run/script_logs.py); the exit code non-zero.

    python -m pytest tests/cli/test_run_errors.py -q
"""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from shardwise.cli import main
from shardwise.run import script_logs

TYPO = textwrap.dedent('''
    import torch
    import torch.distributed as dist

    import shardwise as sw

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 2)
    sw.parallelize(model, sw.Mesh((2,), ("dp",)), (torch.randn(5, 4),),
                   input_placements={"input": {"pd": sw.Shard(0)}}, backend="torch")  # "pd": a typo of "dp"
''')


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_typo_in_a_placement_under_shardwise_run_is_one_line(tmp_path, capfd):
    """Both ranks raise the same ShardingError at parallelize; torchrun's summary and the two
    tracebacks (78 lines before) go to the log file, which the one line names."""
    script = tmp_path / "typo.py"
    script.write_text(TYPO)
    logs = tmp_path / "logs"
    code = main(["run", str(script), "--nproc", "2", "--log-dir", str(logs)])
    out, err = capfd.readouterr()
    assert code != 0
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, out + err
    line = lines[0]
    assert line.startswith("shardwise run: error: rank "), line
    assert "ShardingError: input 'input': unknown mesh dim name 'pd'; this mesh has ('dp',) (fix: " in line, line
    log = str(logs / script_logs.RUN_LOG)
    assert line.endswith(f"every rank's output: {log}")
    text = open(log).read()
    for rank in (0, 1):
        assert f"=== attempt_0 rank {rank} stderr ===" in text
    assert text.count("Traceback (most recent call last)") >= 3  # each rank's, and the launcher's
    assert "ChildFailedError" in text


def _error_file(root, rank: int, kind: str, message: str, when: int) -> None:
    d = root / "job_x" / "attempt_0" / str(rank)
    d.mkdir(parents=True)
    data = {"message": {"message": f"{kind}: {message}", "extraInfo": {"py_callstack": "", "timestamp": str(when)}}}
    (d / "error.json").write_text(json.dumps(data))
    (d / "stderr.log").write_text(f"rank {rank} traceback\n")


def test_the_first_failure_is_the_cause_not_the_ranks_it_stopped(tmp_path):
    """A rank stopped by another's failure (RankFailedError) is reported after it, even when its
    file is older; otherwise the earliest, then the lowest rank; the fix ends the line."""
    _error_file(tmp_path, 0, "RankFailedError", "rank 0: stopped in all_reduce because rank 2 failed", 100)
    _error_file(tmp_path, 2, "ValueError", "bad batch\nsecond line", 101)
    _error_file(tmp_path, 1, "ShardingError", "input 'x': no\n  fix: use Shard(0)", 101)
    assert script_logs.first_failure(str(tmp_path)) == "rank 1: ShardingError: input 'x': no (fix: use Shard(0))"
    os.remove(tmp_path / "job_x" / "attempt_0" / "1" / "error.json")
    assert script_logs.first_failure(str(tmp_path)) == "rank 2: ValueError: bad batch; second line"
    line = script_logs.exit_line(str(tmp_path), 1)
    assert line.endswith(f"every rank's output: {tmp_path / 'run.log'}")
    assert "rank 2 traceback" in (tmp_path / "run.log").read_text()
    assert script_logs.first_failure(str(tmp_path / "none")) is None
    assert "without a Python exception" in script_logs.exit_line(str(tmp_path / "none"), 1)
