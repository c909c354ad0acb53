"""param_placements="auto" under the ILP (search/params.py): every parameter the user did not
place is a variable of the program, chosen with the node strategies, and the plan stays exact
against one device.

    python -m pytest tests/search/test_auto_params.py -q -p no:cacheprovider
    python -m pytest tests/search/test_auto_params.py -q -p no:cacheprovider -m slow   # GPT-2 vs Megatron
"""
from collections import Counter

import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S
from shardwise.search.budget import MemoryBudgetError
from shardwise.search.params import candidates
from shardwise.search.solve import plan_cost
from tests.models import zoo
from tests.models.zoo import positional
from tests.parallel.harness import check_training, comm_seconds_per_call

ADAM = dict(steps=2, lr=1e-3, optim_kwargs={"eps": 1e-6})  # see tests/parallel/test_transformer.ADAM


def bytes_by_dim(plan) -> Counter:
    """{mesh dim name: bytes each rank sends over it}."""
    out = Counter(dict.fromkeys(plan.mesh.names, 0))
    for s in plan.collective_steps():
        out[plan.mesh.names[s.mesh_dim]] += s.bytes
    return out


def test_candidates():
    mesh1, mesh2 = sw.Mesh((2,), ("a",)), sw.Mesh((2, 2), ("a", "b"))
    assert candidates((6, 9), mesh1, (3,)) == [(R(),), (S(0),), (S(1),), (S(0, groups=3),), (S(1, groups=3),)]
    assert candidates((1, 4), mesh1) == [(R(),), (S(1),)]  # one row cannot be split over 2 ranks
    two = candidates((2, 4), mesh2)
    assert two[0] == (R(), R()) and (S(1), S(1)) in two and (S(0), S(0)) not in two  # 2 rows over 4 ranks
    assert candidates((), mesh2) == [(R(), R())]
    grouped = candidates((6, 12), mesh2, (3,))
    assert (S(1, groups=3), S(1)) not in grouped  # a grouped dim is split by one mesh dim only
    assert (S(1, groups=3), S(0)) in grouped


def test_data_parallel_gradient_all_reduce_only():
    """Small parameters, a large (uneven) batch, this CPU's figures: the planner shards the batch
    itself and keeps the parameters replicated: every collective is an all_reduce, the
    gradients' 2 * P * (n - 1) / n elements plus the scalar loss."""
    model, x, y, loss_fn = zoo.mlp(batch=16387)
    mesh = sw.Mesh((4,), ("dp",))
    pm = check_training(model, mesh, x, y, loss_fn, planner="ilp", cost_model=sw.CostModel.preset("cpu"))
    st = pm.plan.stats()
    assert set(st["collectives"]) == {"all_reduce"}, pm.plan.summary()
    assert all(pl == (R(),) for pl in pm.specs.values()), pm.specs
    grads = sum(2 * 3 * -(-p.numel() // 4) * 4 for p in model.parameters())
    assert st["comm_bytes"] == grads + 2 * 3 * 1 * 4, pm.plan.summary()  # + the loss, one float
    assert st["collectives"]["all_reduce"] == len(list(model.parameters())) + 1


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_regather_priced_twice(reshard):
    """With FSDP-style placements (Shard(0) on "dp") a program argument moved by a collective is
    gathered for forward and again for backward (the program's move key); the plan's cost
    (plan_cost, SolveReport.cost_s) prices both: it equals the plan's emitted moves (Plan.edges)
    plus compute, priced here one by one, but the argument all_gathers as the program makes them:
    one latency per call (its coalesced FSDP units', lower/prefetch.py), and so does the ILP's
    objective (a call gathered in part gets its own column, search/ilp.py). The plan runs exactly.
    (GPT-2, 2 blocks: a tiny MLP is one unit, and one call gathering its input and weights for
    good is its optimum.) With reshard_after_forward=False the argument is gathered once and kept:
    priced once, by the same figures."""
    from shardwise.search.ilp import EPS, node_cost
    from shardwise.search.params import optimizer_time
    from tests.parallel.test_fsdp_units import ADAMW, DATA, fsdp_spec, gpt2_97
    model, ids = gpt2_97()
    pm = check_training(model, sw.Mesh((3,), ("dp",)), (ids, ids), lr=1e-3, input_placements=DATA,
                        param_placements=fsdp_spec(model), optim_kwargs=ADAMW, planner="ilp",
                        reshard_after_forward=reshard)
    report, prop = pm.plan.prop.solve_report, pm.plan.prop
    args = {n.name for n in prop.gm.graph.nodes if n.op == "placeholder"}
    gathers = Counter(src for _, src, steps in pm.plan.edges for s in steps if s.kind == "all_gather" and src in args)
    blocks = {a for a in args if "_h_" in a and "_c_" in a and a.endswith("_weight")}  # the blocks' matrices
    assert blocks and all(gathers[a] == (2 if reshard else 1) for a in blocks), gathers  # forward (and backward)
    ties = EPS * sum(len(steps) for dst, src, steps in pm.plan.edges if dst != src)  # the ILP's tie-breakers
    op_comm = sum(prop.cost.step_time(s, prop.mesh) for dst, src, ss in pm.plan.edges if dst == src for s in ss)
    comm = comm_seconds_per_call(pm.plan) - op_comm + ties  # an op's own collectives are in its node_cost
    compute = sum(node_cost(pm.planner, n.call, n.strategy) for n in prop.nodes.values())
    compute += optimizer_time(prop, prop.param_choices, prop.cost)  # the placed parameters' optimizer step
    assert abs(report.cost_s - (comm + compute)) <= 1e-9 * report.cost_s, (report, comm + compute)
    assert abs(report.objective_s - report.cost_s) <= 1e-9 * report.cost_s, report


def test_slow_dp_fast_tp_transformer():
    """On (2, 2) with a slow "dp" link and a fast "tp" one, the heavy traffic is on "tp". (A tiny
    MLP is no test of this: priced honestly, its optimum on these figures is data parallel only.)"""
    model, x, y, loss_fn = zoo.transformer(batch=8, seq=32)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    cost = sw.CostModel(bandwidth={"dp": 1e9, "tp": 100e9}, latency=5e-6, flops=78e9)
    pm = check_training(model, mesh, x, y, loss_fn, planner="ilp", cost_model=cost, **ADAM)
    by = bytes_by_dim(pm.plan)
    assert by["tp"] > 2 * by["dp"], (by, pm.plan.summary())


def test_named_parameters_stay_and_forward_plan_first():
    """A named parameter keeps its placement; a forward-only plan made before the first step
    chooses nothing, and is made again once the step plan has placed the parameters."""
    model, x, y, loss_fn = zoo.mlp(batch=6)
    mesh = sw.Mesh((2,), ("tp",))
    ref = zoo.mlp(batch=6).model
    # compute-bound and no gradient buckets (each gradient all_reduce pays its latency): tensor parallel
    pm = sw.parallelize(model, mesh, x, loss_fn=loss_fn, planner="ilp", cost_model=sw.CostModel(flops=1e9),
                        param_placements={"fc2.bias": [R()]}, bucket_bytes=None)
    before = pm(*x)
    torch.testing.assert_close(before, ref(*x), rtol=1e-4, atol=1e-5)
    pm.step(*x, *y)
    assert pm.specs["fc2.bias"] == (R(),)
    assert any(pl != (R(),) for pl in pm.specs.values()), pm.specs
    assert all(pm.shards[0][n].shape == pm.plan.prop.layouts[ph][0].local_shape(mesh, 0)
               for ph, n in pm.plan.param_placeholders.items())
    torch.testing.assert_close(pm(*x), ref(*x), rtol=1e-4, atol=1e-5)


def gpt2(layers=4, hidden=256, batch=8, seq=512, vocab=512):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, vocab, (batch, seq))
    return model, positional(model.forward, input_ids=ids, labels=ids.clone())


@pytest.mark.slow
def test_gpt2_auto_not_costlier_than_megatron():
    """GPT-2 (4 layers, h 256, 4096 tokens: activations much larger than parameters) on tp=4 with
    GPU-like figures (fast link, 100 TFLOP/s): the auto plan's modelled time is at most the
    Megatron plan's, it sends at most Megatron's floor (8 * b * s * h * (t - 1) / t elements per
    rank per layer), does not replicate the compute, and trains exactly."""
    layers, hidden, batch, seq, t = 4, 256, 8, 512, 4
    model, inputs = gpt2(layers, hidden, batch, seq)
    mesh = sw.Mesh((t,), ("tp",))
    cost = sw.CostModel(bandwidth=450e9, latency=2e-6, flops=100e12)
    meg = sw.recipes.megatron(model)
    megatron = {n: [meg.get(n, R())] for n, _ in model.named_parameters()}
    pm_m = sw.parallelize(model, mesh, inputs, planner="ilp", cost_model=cost, param_placements=megatron)
    pm = check_training(model, mesh, inputs, (), None, planner="ilp", cost_model=cost, lr=1e-3,
                        optim_kwargs={"eps": 1e-6})
    floor = megatron_floor(batch, seq, hidden, t, layers)
    auto_s, meg_s = plan_cost(pm.planner, pm.plan.prop), plan_cost(pm_m.planner, pm_m.plan.prop)
    assert auto_s <= meg_s * (1 + 1e-9), (auto_s, meg_s)
    assert pm.plan.stats()["comm_bytes"] <= floor, (pm.plan.stats(), floor)
    assert pm_m.plan.stats()["comm_bytes"] <= floor
    # compute is sharded (replicating it all would be ~3.5x Megatron's flops per rank): here data
    # parallel over "tp", its gradient all_reduces bucketed, is the cheapest plan
    assert pm.plan.stats()["flops_per_rank"] <= 2 * pm_m.plan.stats()["flops_per_rank"], pm.plan.stats()


def megatron_floor(batch, seq, hidden, t, layers) -> int:
    """Megatron's bytes per rank per step in float32: per layer two all-reduces of [b, s, h] in
    forward and two in backward, each sending 2 * (t - 1) / t of it."""
    return 8 * batch * seq * hidden * (t - 1) // t * 4 * layers


def test_gpt2_megatron_placements_default_planner_at_floor():
    """Megatron's placements given, nothing else, default planner (propagation, the CPU preset):
    at most Megatron's floor, as DTensor sends. The backward keeps each partial gradient until
    it meets a shard and reduces it where it is [b, s, h], never carried into the [b, s, 4h]
    activations with their saved shards gathered (search/propagate.Planner._owed; was 2.96x)."""
    layers, hidden, batch, seq, t = 4, 256, 8, 512, 4
    model, inputs = gpt2(layers, hidden, batch, seq)
    meg = sw.recipes.megatron(model)
    placements = {n: [meg.get(n, R())] for n, _ in model.named_parameters()}
    mesh = sw.Mesh((t,), ("tp",))
    floor = megatron_floor(batch, seq, hidden, t, layers)
    pm = check_training(model, mesh, inputs, (), None, param_placements=placements, **ADAM)
    st = pm.plan.stats()
    assert pm.options.planner == "propagate"
    assert st["comm_bytes"] <= floor, (st, floor)
    assert set(st["collectives"]) <= {"all_reduce", "reduce_scatter", "all_gather"}, st


# -- memory_budget (search/budget.py) -------------------------------------------------------------
def wide_mlp(batch=4096):
    """Parameters of 640 KiB, a large batch: replicated parameters + gradients + AdamW state are
    2.6 MiB per rank, sharded a quarter of that."""
    torch.manual_seed(0)
    model = zoo.MLP(256, 512, 64)
    return model, (torch.randn(batch, 256),), (torch.randn(batch, 64),)


BUDGET_KW = dict(loss_fn=zoo.mse_loss, planner="ilp", input_placements={0: [S(0)]},
                 cost_model=sw.CostModel.preset("cpu"))


def test_memory_budget_shards_parameters_fsdp_style():
    """A budget below the replicated plan's estimate by more than the parameters' size: every
    parameter comes out sharded, gathered before use (all_gather), its gradient reduce-scattered
    (no all_reduce but the loss's), the estimated peak (optimizer state included) within budget,
    and training equals one device's."""
    model, x, y = wide_mlp()
    mesh = sw.Mesh((4,), ("dp",))
    # data parallel (propagation: every parameter replicated) is the reference the budget is set below
    free = sw.parallelize(model, mesh, x, example_targets=y, **{**BUDGET_KW, "planner": "propagate"})
    assert all(pl == (R(),) for pl in free.specs.values()), free.specs
    state = 4 * sum(p.numel() * 4 for p in model.parameters())  # parameters, gradients, AdamW's two moments
    budget = free.plan.stats()["peak_memory_bytes"] - state // 2
    pm = check_training(model, mesh, x, y, memory_budget=budget, lr=1e-3, optim_kwargs={"eps": 1e-6}, **BUDGET_KW)
    st = pm.plan.stats()
    assert st["peak_memory_bytes"] <= budget, (st, budget)
    assert all(pl != (R(),) for pl in pm.specs.values()), pm.specs
    n = len(list(model.parameters()))
    assert st["collectives"].get("reduce_scatter") == n and st["collectives"].get("all_gather", 0) >= n, st
    assert st["collectives"].get("all_reduce") == 1, st  # the loss


def test_memory_budget_infeasible():
    model, x, y = wide_mlp(batch=512)
    with pytest.raises(MemoryBudgetError) as err:
        sw.parallelize(model, sw.Mesh((4,), ("dp",)), x, example_targets=y, memory_budget=100_000, **BUDGET_KW)
    msg = str(err.value)
    assert isinstance(err.value, sw.ShardingError) and "100000" in msg and "fix: raise memory_budget to at least" in msg
    least = int(msg.split("at least ")[1].split(",")[0])
    assert least > 100_000
    pm = sw.parallelize(model, sw.Mesh((4,), ("dp",)), x, example_targets=y, memory_budget=least, **BUDGET_KW)
    assert pm.plan.stats()["peak_memory_bytes"] <= least
