"""Pipelines composed with sequence and expert parallelism on 3-d meshes (threads): the other mesh
dims are planned inside each stage as without a pipeline, so ring or Ulysses attention over a
sequence dim and Mixture-of-Experts over an expert dim run within the stages; loss, every
gradient and the parameters after two AdamW steps equal one device (rtol 1e-4).

    python -m pytest tests/pipeline/test_compose.py -q            # Ulysses attention, expert dispatch
    python -m pytest tests/pipeline/test_compose.py -q -m slow    # ring attention, experts whole, HF Mixtral
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo
from tests.parallel.harness import check_training

from .models import ADAM, MoENet, data, mse, pipe


def _tags(pm, op: str) -> list:
    return [np_.strategy.tags for np_ in pm.plan.prop.nodes.values() if op in str(np_.call.op)]


@pytest.mark.parametrize("mode,tag", [("ulysses", "leading"), pytest.param("ring", "ring", marks=pytest.mark.slow)])
def test_pipeline_data_sequence_2x2x2(mode, tag):
    """TinyLM (2 attention blocks) on ("pp", "dp", "sp"): the batch on "dp", the sequence (7
    tokens: uneven over 2 ranks) on "sp", ignored labels in one microbatch only."""
    torch.manual_seed(0)
    model = zoo.TinyLM(layers=2, dim=16, heads=2, max_len=16)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 7), generator=g), torch.randint(0, 64, (4, 7), generator=g)
    y[0, :3] = -100
    seq = {"dp": S(0), "sp": S(1)}
    pm = check_training(model, sw.Mesh((2, 2, 2), ("pp", "dp", "sp")), (x,), (y,), zoo.ce_loss, **ADAM,
                        example_targets=(y,), input_placements={0: seq}, target_placements={0: seq}, attention=mode,
                        pipeline=pipe("1f1b", 2))
    tags = _tags(pm, "shardwise.attention")
    assert len(tags) == 4 and all(t[2] == tag for t in tags), tags  # the sequence dim's strategy, per block
    colls = pm.plan.stats()["collectives"]
    assert colls["p2p"] > 0 and (mode == "ring" or colls["all_to_all"] >= 6), colls  # Ulysses: q, k, v there and back


EXPERTS = {f"blocks.{k}.{w}": {"ep": S(0)} for k in range(2) for w in ("gate_up", "down")}


@pytest.mark.parametrize("tokens,schedule", [("dispatch", "zero-bubble"),
                                             pytest.param("whole", "1f1b", marks=pytest.mark.slow)])
def test_pipeline_data_experts_2x2x2(tokens, schedule):
    """MoENet (2 blocks, 4 experts, top-2) on ("pp", "dp", "ep"): experts Shard(0) on "ep"; the
    tokens sharded there too (dispatched by all-to-all inside the experts op) or whole there
    (each rank its experts' share, a partial sum) at the first block."""
    x, y = data(16)
    tok = {"dp": S(0), "ep": S(0)} if tokens == "dispatch" else {"dp": S(0)}
    pm = check_training(MoENet(), sw.Mesh((2, 2, 2), ("pp", "dp", "ep")), (x,), (y,), mse, steps=2,
                        example_targets=(y,), input_placements={0: tok}, target_placements={0: tok},
                        param_placements=EXPERTS, pipeline=pipe(schedule, 4))
    tags = _tags(pm, "moe_experts")
    assert len(tags) == 4 and tags[0][2] == ("dispatch" if tokens == "dispatch" else "experts"), tags
    assert all(t[2] in ("dispatch", "experts") for t in tags), tags
    for r in range(pm.mesh.size):  # each rank holds half the experts of its stage's blocks
        assert all(t.shape[0] == 2 for n, t in pm.shards[r].items() if n in EXPERTS)


@pytest.mark.slow
def test_hf_mixtral_pipeline_data_experts_2x2x2():
    from tests.parallel.test_moe import mixtral

    model, inputs, _, _ = mixtral(batch=4, experts=4)
    check_training(model, sw.Mesh((2, 2, 2), ("pp", "dp", "ep")), inputs, **ADAM,
                   input_placements={"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}},
                   param_placements=sw.recipes.experts(model, "ep"), pipeline=pipe("1f1b", 2))
