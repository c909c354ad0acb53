"""MLP: data, Megatron tensor, data x tensor and fully-sharded parallelism against one device."""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R, Shard as S

from .harness import check_training


def mlp(d_in=6, hidden=8, d_out=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d_out))


def mse(out, y):
    return ((out - y) ** 2).mean()


def data(batch=8, d_in=6, d_out=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)


MEGATRON = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)]}


def collectives(pm):
    return pm.plan.stats()["collectives"]


def test_data_parallel_uneven_batch():
    x, y = data(batch=5)
    pm = check_training(mlp(), sw.Mesh((2,), ("dp",)), (x,), (y,), mse, steps=3,
                        input_placements={0: [S(0)]})
    assert set(collectives(pm)) == {"all_reduce"}
    # loss + one gradient reduction per parameter
    assert collectives(pm)["all_reduce"] == 1 + 4


def test_megatron_tensor_parallel():
    x, y = data()
    pm = check_training(mlp(), sw.Mesh((2,), ("tp",)), (x,), (y,), mse, steps=3, param_placements=MEGATRON)
    prog = pm.plan.program(0)
    assert "all_reduce" in prog
    assert "all_gather" not in prog, pm.plan.summary()


def test_megatron_uneven_hidden_on_four_ranks():
    x, y = data()
    check_training(mlp(hidden=6), sw.Mesh((4,), ("tp",)), (x,), (y,), mse, steps=2, param_placements=MEGATRON)


def test_data_by_tensor_parallel_2x2():
    x, y = data(batch=6)
    spec = {n: {"tp": p[0]} for n, p in MEGATRON.items()}
    check_training(mlp(), sw.Mesh((2, 2), ("dp", "tp")), (x,), (y,), mse, steps=3,
                   input_placements={"input": {"dp": S(0)}}, param_placements=spec)


def test_fully_sharded_parameters():
    # A batch much larger than the weights and a bandwidth-bound link (no latency term: at
    # these toy sizes latency dominates and the planner rightly gathers the activations in
    # one collective instead), so gathering weights is what the cost model prefers.
    x, y = data(batch=33)
    model = mlp()
    spec = {n: [S(0)] for n, _ in model.named_parameters()}
    pm = check_training(model, sw.Mesh((2,), ("dp",)), (x,), (y,), mse, steps=3,
                        input_placements={0: [S(0)]}, param_placements=spec,
                        cost_model=sw.CostModel(latency=0.0))
    kinds = collectives(pm)
    assert kinds.get("all_gather", 0) >= 2, pm.plan.summary()  # weights gathered before use
    assert kinds.get("reduce_scatter", 0) >= 4, pm.plan.summary()  # every gradient reduce-scattered
    prog = pm.plan.program(0)
    assert "all_gather" in prog and "reduce_scatter" in prog


def test_forward_returns_full_outputs():
    x, _ = data(batch=5)
    model = mlp()
    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), (x,), input_placements={0: [S(0), R()]},
                        param_placements={n: {"tp": p[0]} for n, p in MEGATRON.items()}, loss_fn=mse)
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(input_placements={0: [S(0)]}), "expects exactly one placement per mesh dim"),
    (dict(input_placements={0: [S(2), R()]}), "out of range"),
    (dict(param_placements={"0.wieght": [S(0), R()]}), "0.weight"),
    (dict(input_placements={0: {"pp": S(0)}}), "unknown mesh dim name 'pp'"),
    (dict(input_placements={"y": [S(0), R()]}), "not an argument of forward"),
])
def test_bad_specs_fail_early(kwargs, needle):
    x, _ = data()
    with pytest.raises(sw.ShardingError, match=needle.replace("(", r"\(")):
        sw.parallelize(mlp(), sw.Mesh((2, 1), ("dp", "tp")), (x,), loss_fn=mse, **kwargs)


def test_state_dict_round_trip_and_load():
    x, y = data(batch=5)
    model = mlp()
    spec = {n: {"tp": p[0]} for n, p in MEGATRON.items()}
    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), (x,), input_placements={0: [S(0), R()]},
                        param_placements=spec, loss_fn=mse)
    for k, v in model.state_dict().items():
        assert torch.equal(pm.state_dict()[k], v), k
    other = mlp(seed=7)
    pm.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(pm.state_dict()[k], v), k
    torch.testing.assert_close(pm(x), other(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(sw.ShardingError, match="missing keys"):
        pm.load_state_dict({"0.weight": other.state_dict()["0.weight"]})


def test_memory_budget_is_enforced():
    x, y = data(batch=6)
    kwargs = dict(input_placements={0: [S(0)]}, loss_fn=mse, example_targets=(y,))
    need = sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), **kwargs).plan.stats()["peak_memory_bytes"]
    sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), memory_budget=need, **kwargs)
    with pytest.raises(sw.ShardingError, match="memory_budget"):
        sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), memory_budget=need - 1, planner="propagate", **kwargs)
    # the default planner ("auto": the ILP under a budget) steers to it instead (sharded parameters)
    pm = sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), memory_budget=need - 1, **kwargs)
    assert str(pm.plan.prop.solve_report).startswith("ilp") and pm.plan.stats()["peak_memory_bytes"] <= need - 1
    with pytest.raises(sw.MemoryBudgetError, match="cannot be met"):
        sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), memory_budget=64, **kwargs)
    with pytest.raises(sw.ShardingError, match="positive number of bytes"):
        sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), memory_budget=0, **kwargs)
