"""What a pipeline plan says and refuses: BatchNorm's typed error, the planner's balanced split on
unequal layers, stats (bubble, per-stage memory, point-to-point bytes), the schedule in the
summary and the HTML report, checkpoints between pipeline layouts.

    python -m pytest tests/pipeline/test_plan.py -q
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise.search.schedules import simulate
from shardwise.tools.report import plan_data, render_html
from tests.parallel.harness import assert_close

from .models import Net, UnequalLM, ce, data, mse, pipe


def _net(mesh_shape=(2,), schedule="1f1b", m=4, rows=8, **kw):
    x, y = data(rows)
    pm = sw.parallelize(Net(), sw.Mesh(mesh_shape, ("pp",)), (x,), loss_fn=mse, example_targets=(y,),
                        pipeline=pipe(schedule, m, **kw))
    return pm, x, y


def test_batchnorm_in_training_raises_naming_the_op():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(8, 4)
    with pytest.raises(sw.MicrobatchError, match="batch_norm") as e:
        sw.parallelize(model, sw.Mesh((2,), ("pp",)), (x,), loss_fn=lambda o: o.sum(), example_targets=(),
                       pipeline=sw.Pipeline("pp", 4))
    assert e.value.node and "batch_norm" in str(e.value.op) and "module '1'" in str(e.value)
    assert "eval" in e.value.fix and "LayerNorm" in e.value.fix
    assert isinstance(e.value, sw.ShardingError)
    model.eval()  # running statistics: the same for every microbatch, so the pipeline runs it
    sw.parallelize(model, sw.Mesh((2,), ("pp",)), (x,), loss_fn=lambda o: o.sum(), example_targets=(),
                   pipeline=sw.Pipeline("pp", 4, split_points=["2"]))


def test_pipeline_timeline_needs_a_pipeline():
    x, y = data(4)
    pm = sw.parallelize(Net(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, example_targets=(y,))
    with pytest.raises(sw.ConfigError, match="no pipeline"):
        pm.pipeline_timeline()
    with pytest.raises(sw.ConfigError, match="timed"):
        sw.Pipeline("pp", timed="yes")


def test_pipeline_with_auto_checkpointing_is_refused_not_ignored():
    """The ILP decides "auto" against memory_budget; a pipeline keeps the budget by its split."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(sw.ConfigError, match="not decided under pipeline") as e:
        sw.parallelize(model, sw.Mesh((2,), ("pp",)), (torch.randn(8, 4),), loss_fn=lambda o: o.sum(),
                       example_targets=(), pipeline=sw.Pipeline("pp", 4), activation_checkpointing="auto")
    assert "blocks" in e.value.fix


def _stage_times(pm) -> list:
    return [s["forward_s"] + s["backward_s"] for s in pm.plan.stats()["pipeline"]["stages"]]


def test_planner_split_balances_unequal_layers_within_15_percent():
    """A large embedding and LM head around 8 small blocks: splitting the blocks evenly leaves the
    head's stage over 20% slower than the mean; the planner's cut (module/pipeline.py ->
    search/stages.balance) moves blocks to the first stage: the slowest stage's modelled
    forward + backward time is within 15% of the stages' mean (the balanced ideal)."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 512, (8, 16)), torch.randint(0, 512, (8, 16))
    mesh = sw.Mesh((2,), ("pp",))

    def plan(**kw):
        return sw.parallelize(UnequalLM(vocab=512, n=8), mesh, (ids,), loss_fn=ce, example_targets=(y,),
                              planner="propagate", pipeline=pipe("1f1b", 4, **kw))

    auto = _stage_times(plan())
    even = _stage_times(plan(split_points=["blocks.4"]))
    assert max(auto) <= 1.15 * sum(auto) / len(auto), auto
    assert max(even) > 1.15 * sum(even) / len(even), even  # what the planner avoids
    assert max(auto) < max(even)


def test_stats_bubble_memory_and_messages():
    """stats(): the bubble of the modelled timeline, per-stage memory (1F1B's first stage holds p
    microbatches' stashes, GPipe's all m) and the bytes each rank sends point-to-point."""
    m = 4
    one, _, _ = _net(schedule="1f1b", m=m, split_points=["blocks.2"])
    gp, _, _ = _net(schedule="gpipe", m=m, split_points=["blocks.2"])
    s1, sg = one.plan.stats(), gp.plan.stats()
    for st, pm in ((s1, one), (sg, gp)):
        assert st["bubble_fraction"] == pytest.approx(pm.plan.timeline.bubble_fraction())
        assert 0 < st["bubble_fraction"] < 1
        # each microbatch's activation (2 rows x 8 features) forward, its gradient backward
        assert st["p2p_bytes"] == m * 2 * 8 * 4 and st["collectives"] == {"p2p": m}
    first1, firstg = s1["pipeline"]["stages"][0], sg["pipeline"]["stages"][0]
    assert first1["in_flight"] == 2 and firstg["in_flight"] == m
    assert first1["stash"] == firstg["stash"] > 0 and first1["state"] == firstg["state"] > 0
    assert first1["peak"] < firstg["peak"] and s1["peak_memory_bytes"] < sg["peak_memory_bytes"]
    assert [st["layers"] for st in s1["pipeline"]["stages"]] == [["inp", "blocks.0", "(top level)", "blocks.1"],
                                                              ["blocks.2", "(top level)", "blocks.3", "out"]]


def test_measured_stage0_memory_1f1b_below_gpipe():
    """pm.pipeline_timeline().held_bytes: stage 0 holds at most p microbatches' stashes under
    1F1B, all m under GPipe (threads; the gloo measurement is tests/pipeline/test_bubble.py)."""
    held = {}
    for schedule in ("1f1b", "gpipe"):
        pm, x, y = _net(schedule=schedule, m=4, split_points=["blocks.2"])
        pm.step(x, y)
        held[schedule] = pm.pipeline_timeline().held_bytes[0]
    assert 0 < held["1f1b"] < held["gpipe"], held


def test_modelled_bubble_of_1f1b_with_equal_stages():
    """With equal stage times and free messages the modelled 1F1B bubble is (p - 1) / (m + p - 1)."""
    pm, _, _ = _net(mesh_shape=(4,), m=8)
    tl = simulate(pm.plan.schedule, lambda a: 1.0 if a.kind == "F" else 2.0)
    assert tl.bubble_fraction() == pytest.approx(3 / 11)


def test_summary_table_and_html_report():
    pm, x, y = _net(schedule="zero-bubble", split_points=["blocks.2"])
    text = pm.plan.summary()
    assert text.startswith("# stage: pipeline plan") and "split points: blocks.2.0" in text
    assert "schedule zero-bubble" in text and "W0.0" in text and "rank 1: |" in text
    assert "# stage: plan (step)" in text  # the microbatch plan follows
    prog = pm.plan.program(0)
    assert "# stage 0 F" in prog and "# stage 0 W" in prog
    data_ = plan_data(pm.plan)
    assert data_["pipeline"]["schedule"] == "zero-bubble" and not data_["pipeline"]["measured"]
    assert data_["reserved_memory_bytes"] is None  # the schedule's allocations are not one program's
    html = render_html(data_)
    assert '<svg id="pipeline"' in html and "Pipeline schedule" in html
    assert pm.pipeline_timeline() is None  # no step yet
    pm.step(x, y)
    tl = pm.pipeline_timeline()
    measured = plan_data(pm.plan, measured=tl)
    assert measured["pipeline"]["measured"] and len(measured["pipeline"]["rows"]["0"]) == 3 * 4
    assert measured["pipeline"]["end"] == tl.end >= max(tl.finish.values()) > 0
    assert [a for a, r in sorted(tl.rank_of.items(), key=lambda ar: tl.start[ar[0]]) if r == 1] == \
        list(pm.plan.schedule.ranks[1])  # each rank ran its schedule's actions, in order
    assert 0 <= tl.idle_fraction(0) < 1 and set(tl.held_bytes) == {0, 1} and tl.held_bytes[0] > 0


def test_checkpoint_pp2_to_pp4_and_to_no_pipeline(tmp_path):
    """pm.save under pp 2 (each stage's ranks write their parameters and optimizer state) loads
    bitwise into pp 4 and into a mesh without a pipeline; training on from there agrees."""
    pm, x, y = _net(rows=8)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    pm.step(x, y)
    opt.step()
    opt.zero_grad()
    pm.save(tmp_path / "ck", optimizer=opt)
    saved = {n: t.clone() for n, t in pm.state_dict().items()}
    pm.step(x, y)
    opt.step()
    want = pm.state_dict()
    others = [sw.parallelize(Net(seed=5), sw.Mesh((4,), ("pp",)), (x,), loss_fn=mse, example_targets=(y,),
                             pipeline=pipe("gpipe", 4)),
              sw.parallelize(Net(seed=5), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, example_targets=(y,),
                             input_placements={0: [sw.Shard(0)]}, target_placements={0: [sw.Shard(0)]})]
    for other in others:
        o_opt = other.optimizer(torch.optim.AdamW, lr=1e-2)
        other.load(tmp_path / "ck", optimizer=o_opt)
        for n, t in other.state_dict().items():
            assert torch.equal(t, saved[n]), n
        other.step(x, y)
        o_opt.step()
        for n, t in other.state_dict().items():
            assert_close(t, want[n], f"{other.mesh} {n} after a step on from the checkpoint")
