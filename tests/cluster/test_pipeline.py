"""The calculator's "pp" dim (tools/cluster/pipeline.py, ``shardwise plan MODEL --pp N``).

Fast: the schedule played with stage times (the bubble against the closed forms of 1F1B and
interleaved 1F1B with equal stages and free messages; messages and an unequal stage only add
to it) and the checks of a pipeline's numbers. Slow: a tiny Llama estimated with a pipeline
(the step's parts add up to the step, bubble included; interleaved's bubble below 1F1B's; the
JSON and text), --compare trying pipeline sizes, and the command line.

    python -m pytest tests/cluster/test_pipeline.py -q [-m slow]
"""
from __future__ import annotations

import json

import pytest

from shardwise.core.errors import CliError
from shardwise.search.schedules import schedule
from shardwise.tools.cluster.pipeline import PipeJob, play, stage_blocks

from .test_calculator import _tiny


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32), (2, 3)])
def test_bubble_of_equal_stages_is_the_closed_form(p, m):
    f, b = 1.0, 2.0
    one = play([(f, b, b / 2)] * p, 0.0, schedule("1f1b", p, m))
    assert one.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
    assert one.end - max(one.busy(r) for r in range(p)) == pytest.approx((p - 1) * (f + b))
    if m % p == 0:  # interleaved, v = 2: each rank's stages half as long, (p - 1) / (v m + p - 1)
        two = play([(f / 2, b / 2, b / 4)] * (2 * p), 0.0, schedule("interleaved", p, m, 2))
        assert two.bubble_fraction() == pytest.approx((p - 1) / (2 * m + p - 1))
        assert two.end < one.end


def test_messages_and_an_unequal_stage_lengthen_the_step():
    sched = schedule("1f1b", 4, 8)
    even = play([(1.0, 2.0, 1.0)] * 4, 0.0, sched)
    assert play([(1.0, 2.0, 1.0)] * 4, 0.1, sched).end > even.end
    slow_last = play([(1.0, 2.0, 1.0)] * 3 + [(1.5, 3.0, 1.5)], 0.0, sched)
    assert slow_last.end > even.end and slow_last.bubble_fraction() > even.bubble_fraction()
    assert stage_blocks(126, 16) == [8] * 14 + [7] * 2 and sum(stage_blocks(7, 4)) == 7


def test_pipeline_numbers_are_checked():
    with pytest.raises(CliError, match="does not split"):
        PipeJob(pp=2, microbatches=3).check(local_batch=4, layers=8)
    with pytest.raises(CliError, match="more stages"):
        PipeJob(pp=4, schedule="interleaved").check(local_batch=8, layers=6)
    with pytest.raises(CliError, match="multiple of"):
        PipeJob(pp=4, microbatches=6, schedule="interleaved").check(local_batch=6, layers=32)
    assert PipeJob(pp=4, schedule="interleaved").check(local_batch=8, layers=32).n_stages == 8


def _job(tmp_path, **kw):
    from shardwise.tools.cluster.calc import Job

    base = dict(gpu="h100", gpus=4, gpus_per_node=2, seq=32, local_batch=4, precision="bf16", checkpoint="selective",
                config_path=_tiny(tmp_path), candidates=("fsdp",))
    return Job(None, **{**base, **kw})


@pytest.mark.slow
def test_estimate_with_a_pipeline(tmp_path):
    from shardwise.tools.cluster import report
    from shardwise.tools.cluster.calc import estimate

    got = {}
    for sched in ("1f1b", "interleaved"):
        est = estimate(_job(tmp_path, pp=2, microbatches=4, schedule=sched))
        d = got[sched] = json.loads(json.dumps(report.data(est)))
        assert d["mesh"] == {"shape": [2, 2], "names": ["pp", "dp"]}
        s = d["step"]
        assert d["step_time_s"] == pytest.approx(s["compute_s"] + s["exposed_communication_s"] + s["optimizer_s"]
                                                 + s["bubble_s"])
        assert 0 < s["bubble_s"] == d["pipeline"]["bubble_s"] and s["p2p_s"] > 0
        assert d["tokens_per_s_per_gpu"] == pytest.approx(4 * 2 * 32 / d["step_time_s"] / 4)
        assert d["peak_memory_bytes"] == sum(d["memory_bytes"].values())
        assert f"pp 2, {sched}" in report.text(est)
    assert got["interleaved"]["pipeline"]["bubble_fraction"] < got["1f1b"]["pipeline"]["bubble_fraction"]
    flat = report.data(estimate(_job(tmp_path)))
    assert flat["step"]["bubble_s"] == 0.0 and "pipeline" not in flat


@pytest.mark.slow
def test_compare_tries_pipeline_sizes(tmp_path, capsys):
    """4 GPUs, 2 per node: pp 1 (4 and 2 x 2) and pp 2 (a stage per node); the JSON rows say which."""
    from shardwise.cli import main

    assert main(["plan", "--config", _tiny(tmp_path), "--gpu", "h100", "--gpus", "4", "--gpus-per-node", "2",
                 "--seq", "32", "--local-batch", "4", "--mixed-precision", "bf16", "--compare", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    meshes = {tuple(r["mesh"]["names"]) for r in rows}
    assert ("pp", "dp") in meshes and ("dp",) in meshes
    for r in rows:
        assert (r["step"]["bubble_s"] > 0) == ("pp" in r["mesh"]["names"])
        assert (r["reserved_memory_bytes"] is None) == ("pp" in r["mesh"]["names"])  # not modelled under a pipeline
    assert main(["plan", "--config", _tiny(tmp_path), "--gpu", "h100", "--gpus", "4", "--gpus-per-node", "2",
                 "--seq", "32", "--local-batch", "4", "--mixed-precision", "bf16", "--compare"]) == 0
    table = capsys.readouterr().out.splitlines()
    ranked = [row for row in table[1:] if row[:4].strip().isdigit()]
    assert "reserved" in table[0] and len(ranked) == len(rows)
    assert all((" -  " in row) == (" pp," in row) for row in ranked), table
