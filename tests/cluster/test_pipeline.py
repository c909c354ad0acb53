"""The calculator's "pp" dim (tools/cluster/pipeline.py, ``shardwise plan MODEL --pp N``).

Fast: the schedule played with stage times (the bubble against the closed forms of 1F1B and
interleaved 1F1B with equal stages and free messages; messages and an unequal stage only add
to it; a stage's gradient reductions end its rank's step without delaying the others), the
checks of a pipeline's numbers, and the data dims' communication once a step (a tiny Llama's
FSDP and Megatron-on-tp blocks: gathers, reductions, parameters kept gathered in memory). Slow: a tiny Llama estimated with a pipeline
(the step's parts add up to the step, bubble included; interleaved's bubble below 1F1B's; the
JSON and text), --compare trying pipeline sizes, and the command line.

    python -m pytest tests/cluster/test_pipeline.py -q [-m slow]
"""
from __future__ import annotations

import json
import math

import pytest

from shardwise.core.errors import CliError
from shardwise.search.schedules import schedule
from shardwise.tools.cluster.pipeline import PipeJob, kept_gathered, once_a_step, play, stage_blocks, with_tails

from ._tiny import PLANS, config
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


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zero-bubble", 3, 6, 1)])
def test_reductions_end_their_rank_and_gathers_delay_the_first_forward(name, p, m, v):
    sched = schedule(name, p, m, v)
    times = [(1.0, 2.0, 1.0)] * sched.n_stages
    tl = play(times, 0.1, sched)
    end, busy = with_tails(tl, sched, [0.5] * sched.n_stages)
    # each rank ends v reductions after its last action; none delays another rank's work
    lasts = [max(tl.finish[a] for a in sched.ranks[r]) for r in range(p)]
    assert end == pytest.approx(max(last + 0.5 * v for last in lasts))
    assert busy == pytest.approx([tl.busy(r) + 0.5 * v for r in range(p)])
    assert with_tails(tl, sched, [0.0] * sched.n_stages) == (tl.end, [tl.busy(r) for r in range(p)])
    # a gather at each stage's first forward: the step at least one gather longer, at most one per stage
    gathered = play(times, 0.1, sched, [0.25] * sched.n_stages)
    assert tl.end + 0.25 <= gathered.end + 1e-9 and gathered.end <= tl.end + 0.25 * sched.n_stages + 1e-9
    assert sum(map(gathered.busy, range(p))) == pytest.approx(sum(map(tl.busy, range(p))) + 0.25 * sched.n_stages)


def _pipelined(layout, mesh, names, m=4):
    from shardwise.tools.cluster.calc import Job, estimate

    job = Job(None, gpu="h100", gpus=2 * math.prod(mesh), gpus_per_node=math.prod(mesh), seq=32, local_batch=m,
              precision="bf16", checkpoint="full", config_path=config(6), pp=2, microbatches=m, candidates=(layout,))
    return estimate(job, mesh, names, plans=PLANS).layout


def test_data_dims_communicate_once_a_step():
    """FSDP on dp: every collective of a block is a parameter's gather (forward; the one for backward
    is not made) or its gradient's reduce-scatter, none per microbatch; its gathered parameters and
    unsharded float32 gradients held through the step. Megatron on tp, whole on dp: the gradients'
    all-reduce once, the tp all-reduces per microbatch, nothing kept gathered."""
    from shardwise.tools.cluster.stamp import blocks

    for layout, mesh, names in (("fsdp", (2,), ("dp",)), ("dp+tp", (2, 2), ("dp", "tp"))):
        lay = _pipelined(layout, mesh, names)
        plan, (_, by) = lay.plan, blocks(lay.plan)
        part = {n.name: i for i, nodes in by.items() for n in nodes}
        once = once_a_step(plan, part.get, ("dp",))[1]
        per_mb = lay.figures.parts[1].plus(once.total(), -1)
        gathered, grads = kept_gathered(plan, by[1], ("dp",), 4)
        if layout == "fsdp":
            assert once.gather.comm_s > 0 and once.dropped.comm_s > 0 and once.reduce_after.comm_s > 0
            assert once.reduce.comm_s == 0 and per_mb.comm_s == pytest.approx(0.0, abs=1e-12)
            assert gathered > 0 and grads == 2 * gathered  # bf16 copies, float32 gradients
            mem = lay.memory
            assert mem["activations"] >= lay.pipeline.rank_blocks * gathered
            assert mem["gradients"] >= lay.pipeline.rank_blocks * grads
        else:
            assert once.reduce.comm_s > 0 and per_mb.comm_s > 0  # tensor parallelism's, every microbatch
            assert once.gather.comm_s == once.dropped.comm_s == once.reduce_after.comm_s == 0
            assert (gathered, grads) == (0, 0)
    # more microbatches of the same size: the once-a-step communication is not paid again
    few, many = _pipelined("fsdp", (2,), ("dp",), 2).pipeline, _pipelined("fsdp", (2,), ("dp",), 8).pipeline
    assert many.compute_s == pytest.approx(4 * few.compute_s)
    assert many.exposed_comm_s < 2 * few.exposed_comm_s


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
    from shardwise.tools.cluster.report import PIPELINE_RESERVED

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
    assert all((PIPELINE_RESERVED in row) == (" pp," in row) for row in ranked), table
