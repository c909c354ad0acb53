"""Rank classes (search/classes.py): the per-class figures equal the per-rank ones.

Plan.memory(), Plan.memory_estimate(rank) and the compute figures are worked out on one rank per
class (ranks whose programs see the same local shapes). Here every rank is estimated on its own
(lower/memory.program_memory, search/flops.flops_by_rank on every rank), as before classes, and
compared with the class figures: the golden plans (tests/parallel/test_golden.py) and plans with
uneven shards on (2, 2) and (2, 2, 2).

    python -m pytest tests/search/test_rank_classes.py -q
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S
from shardwise.lower.memory import program_memory
from shardwise.search.classes import rank_classes
from shardwise.search.flops import flops_by_rank
from tests.models import zoo
from tests.parallel.test_golden import CASES


def _uneven_mlp(mesh_shape, placements):
    model, x, y, loss_fn = zoo.mlp(batch=7)
    mesh = sw.Mesh(mesh_shape)
    return sw.parallelize(model, mesh, x, loss_fn=loss_fn, example_targets=y, input_placements={0: placements})


def _uneven_lm(mesh_shape, placements):
    model, x, y, loss_fn = zoo.transformer(batch=3, seq=5)
    return sw.parallelize(model, sw.Mesh(mesh_shape), x, loss_fn=loss_fn, example_targets=y,
                          input_placements={0: placements})


UNEVEN = {
    "mlp_2x2_batch7": lambda: _uneven_mlp((2, 2), [S(0), S(0)]),
    "mlp_2x2x2_batch7": lambda: _uneven_mlp((2, 2, 2), [S(0), R(), S(1)]),
    "lm_2x2x2_batch3_seq5": lambda: _uneven_lm((2, 2, 2), [S(0), S(1), R()]),
    "lm_2x2_seq5": lambda: _uneven_lm((2, 2), [R(), S(1)]),
}


def _same(a, b) -> bool:
    return (a.peak, a.resident, a.parameters, a.gradients, a.peak_gradients, a.peak_node, a.curve, a.exact,
            a.intervals, a.temps) == \
        (b.peak, b.resident, b.parameters, b.gradients, b.peak_gradients, b.peak_node, b.curve, b.exact,
         b.intervals, b.temps)


# the default run: the MLP plans (even, uneven, (2, 2, 2) uneven, a rank holding a partial bias);
# the transformer plans (every rank fake-run on its own, 5-60 s each on 2 shared cores) are slow
FAST = {"mlp_2x2x2_batch7", "mlp_2x2_batch7", "mlp_dp_x_tp", "mlp_megatron", "mlp_dp_uneven"}
ALL = [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in list(CASES) + list(UNEVEN)]


@pytest.mark.parametrize("case", ALL)
def test_class_figures_equal_per_rank_figures(case):
    pm = (CASES.get(case) or UNEVEN[case])()
    plan = pm.plan
    mesh = plan.mesh
    each = [program_memory(plan, r) for r in range(mesh.size)]  # every rank on its own, as before classes
    classes = plan.rank_classes
    for r, est in enumerate(each):
        assert _same(est, each[classes.of(r)]), f"rank {r} differs from its class's first rank {classes.of(r)}"
        assert _same(plan.memory_estimate(r), est) and plan.memory_estimate(r).rank == r
    worst = max(each, key=lambda e: (e.peak, -e.rank))
    mem = plan.memory()
    assert (mem["peak"], mem["rank"], mem["parameters"], mem["gradients"]) == \
        (worst.peak, worst.rank, worst.parameters, worst.peak_gradients)
    flops = [0.0] * mesh.size
    for np_ in plan.prop.nodes.values():
        for r, f in enumerate(flops_by_rank(np_.call, np_.strategy, mesh)):
            flops[r] += f
    assert plan.costs.flops_by_rank == pytest.approx(tuple(flops), rel=1e-12)


def test_uneven_shards_make_classes_even_mesh_one():
    """Uneven shards split the ranks into a few classes; an even mesh is one class, a value made
    partial where one rank of the group keeps it and the others hold zeros (Megatron's
    row-parallel bias) included: the keeper keeps a copy, so both kinds of rank allocate alike
    (test_class_figures_equal_per_rank_figures checks each rank's estimate on that plan)."""
    assert len(UNEVEN["mlp_2x2_batch7"]().plan.rank_classes) > 1
    even = CASES["transformer_dp"]().plan
    assert len(even.rank_classes) == 1 and even.rank_classes.members(0) == tuple(range(even.mesh.size))
    bias = CASES["mlp_dp_x_tp"]().plan
    held = [s for np_ in bias.prop.nodes.values() for ss in np_.in_steps for s in ss
            if s.kind == "partial_local" and s.op == "sum"]
    assert held and bias.rank_classes.rep_of == (0, 0, 0, 0)


def test_classes_of_layouts_by_local_shapes_and_group_shapes():
    """A layout of 7 rows on 4 ranks (2, 2, 2, 1): ranks 0-2 hold 2 rows, rank 3 one; a gather over
    mesh dim 1 makes ranks of one group alike only if their groups' members hold the same shapes."""
    mesh = sw.Mesh((2, 2))
    lay = sw.Layout((7, 3), torch.float32, [S(0), S(0)])
    assert rank_classes([lay], mesh).rep_of == (0, 0, 0, 3)

    class Step:
        kind, src, dst, mesh_dim, is_collective = "all_gather", lay, lay.with_placements([S(0), R()]), 1, True

    got = rank_classes([lay], mesh, [Step()])
    assert got.rep_of == (0, 0, 2, 3)  # ranks 2 and 3 gather (2 + 1) rows, ranks 0 and 1 (2 + 2)
    even = sw.Layout((8, 3), torch.float32, [S(0), S(0)])
    assert rank_classes([even], mesh).reps == (0,)
