"""FSDP frees after use: a parameter all-gathered for forward is freed after its last forward
read and gathered again for backward (FSDP's reshard_after_forward), exact against one
device; the liveness report (lower/memory.gathered_arguments) and the memory estimate show it.

    python -m pytest tests/run/test_fsdp_reshard.py -q --durations=0
"""
from __future__ import annotations

import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Shard as S
from shardwise.lower.explain import param_reasons
from shardwise.lower.memory import gathered_arguments
from tests.parallel.harness import check_training
from tests.search.test_memory import TOLERANCE, measured_peak


class NormNet(nn.Module):
    """Linear + LayerNorm blocks: LayerNorm's backward reads its weight and bias again."""

    def __init__(self, d=64, k=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)) for _ in range(k)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def mse(out, y):
    return ((out - y) ** 2).mean()


def _fsdp(mesh, model, x, y, **kw):
    spec = {n: [S(0)] for n, _ in model.named_parameters()}
    return check_training(model, mesh, (x,), (y,), mse, steps=2, input_placements={0: [S(0)]},
                          param_placements=spec, cost_model=sw.CostModel(latency=0.0), **kw)


def _fsdp_on_two(seed: int):
    """NormNet fully sharded on ("dp", 2), planned but not run; with its example batch."""
    torch.manual_seed(seed)
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    model = NormNet()
    spec = {n: [S(0)] for n, _ in model.named_parameters()}
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, example_targets=(y,),
                        input_placements={0: [S(0)]}, param_placements=spec, cost_model=sw.CostModel(latency=0.0))
    return pm, x, y


def test_layer_norm_weights_gathered_again_for_backward_uneven():
    torch.manual_seed(0)
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    pm = _fsdp(sw.Mesh((3,), ("dp",)), NormNet(), x, y)  # 64 rows over 3 ranks: 22, 21, 21
    for rank in (0, 2):
        gathers = gathered_arguments(pm.plan, rank)
        src = pm.plan.program(rank)
        held = [g for g in gathers if g.held_into_backward]
        assert not held, f"kept from forward for backward: {held}\n{src}"
        forward = {g.source for g in gathers if g.first_read < g.backward_at}
        backward = {g.source for g in gathers if g.first_read >= g.backward_at}
        norms = {f"p_layers_{i}_1_{w}" for i in range(3) for w in ("weight", "bias")}
        assert norms <= forward and {f"p_layers_{i}_1_weight" for i in range(3)} <= backward, src
        est = pm.plan.memory_estimate(rank)
        got = measured_peak(pm, rank, (x,), (y,))
        assert abs(est.peak - got) <= TOLERANCE * got, est.table(top=8)


def test_forward_gathers_freed_before_backward_in_the_estimate():
    """At the first backward node no forward-gathered parameter is live: the estimate's
    curve there holds none of their bytes (each is freed right after its last forward read)."""
    pm, _, _ = _fsdp_on_two(seed=1)
    gathers = gathered_arguments(pm.plan, 0)
    fwd = [g for g in gathers if g.first_read < g.backward_at]
    assert fwd and all(g.last_read < g.backward_at for g in fwd), gathers


def test_stats_count_the_backward_gathers():
    """plan.stats() counts each gather the program makes, the backward re-gathers included: its
    all_gathers equal the tensors rank 0's program gathers, in fewer calls (one per layer and
    phase, lower/prefetch.py)."""
    pm, x, y = _fsdp_on_two(seed=2)
    pm.step(x, y)
    backward = [g for g in gathered_arguments(pm.plan, 0) if g.first_read >= g.backward_at]
    src = pm.plan.program(0)
    assert backward, src
    members, launches = src.count("prefetch_gathered("), src.count("prefetch_start_all_gather(")
    assert launches < members, src
    calls = pm.plan.collective_calls(0)["all_gather"]
    assert pm.plan.stats()["collectives"]["all_gather"] == calls - launches + members, src


class LinearNet(nn.Module):
    """Residual nn.Linear MLP blocks: nn.Linear computes t(w) in forward and its backward reads
    that t, which would hold the gathered weight from forward into backward."""

    def __init__(self, d=64, k=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
                                     for _ in range(k)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_linear_weights_gathered_again_for_backward_uneven():
    """trace/regather.py: backward reads the parameter, not forward's view of the gathered one,
    so every matrix whose backward needs it (all but the first layer's first: the input needs
    no gradient) is gathered again for backward, and no forward node that views a parameter is
    read by backward; the estimate matches the measured peak; exact against one device (3 ranks,
    128 rows: 43, 43, 42)."""
    from shardwise.trace.regather import is_view

    torch.manual_seed(3)
    x, y = torch.randn(7, 64), torch.randn(7, 64)
    spec = {n: [S(0)] for n, _ in LinearNet().named_parameters()}
    pm = check_training(LinearNet(), sw.Mesh((3,), ("dp",)), (x,), (y,), mse, steps=2, input_placements={0: [S(0)]},
                        param_placements=spec, lr=1e-3, optim_kwargs={"eps": 1e-6})  # Adam: see test_transformer.ADAM
    gm = pm.plan.traced.gm
    params = {n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("p_")}
    views, read_in_backward = set(), []
    for n in gm.graph.nodes:
        if is_view(n) and (n.args[0] in params or n.args[0] in views):
            if not n.meta.get("autograd_backward"):
                views.add(n)
        if n.meta.get("autograd_backward"):
            read_in_backward += [a.name for a in n.all_input_nodes if a in views]
    assert views and not read_in_backward, read_in_backward
    for rank in (0, 2):
        gathers = gathered_arguments(pm.plan, rank)
        backward = {g.source for g in gathers if g.first_read >= g.backward_at}
        matrices = {f"p_layers_{i}_{j}_weight" for i in range(3) for j in (0, 2)}
        assert backward == matrices - {"p_layers_0_0_weight"}, pm.plan.program(rank)
        est = pm.plan.memory_estimate(rank)
        got = measured_peak(pm, rank, (x,), (y,))
        assert abs(est.peak - got) <= TOLERANCE * got, est.table(top=8)


# -- reshard_after_forward=False / per module: gathered once, kept for backward ---------------------
def _linear_fsdp(keep):
    torch.manual_seed(3)
    x, y = torch.randn(7, 64), torch.randn(7, 64)
    spec = {n: [S(0)] for n, _ in LinearNet().named_parameters()}
    pm = check_training(LinearNet(), sw.Mesh((3,), ("dp",)), (x,), (y,), mse, steps=2, input_placements={0: [S(0)]},
                        param_placements=spec, lr=1e-3, optim_kwargs={"eps": 1e-6}, reshard_after_forward=keep)
    return pm, x, y


def _phases(pm, rank):
    """({gathered again for backward}, {gathered in forward and held into backward}) on ``rank``."""
    gathers = gathered_arguments(pm.plan, rank)
    return ({g.source for g in gathers if g.first_read >= g.backward_at},
            {g.source for g in gathers if g.held_into_backward})


MATRICES = {f"p_layers_{i}_{j}_weight" for i in range(3) for j in (0, 2)}
REGATHERED = MATRICES - {"p_layers_0_0_weight"}  # backward reads every matrix but the first (no input gradient)


def test_reshard_after_forward_false_keeps_forward_gathers_uneven():
    """FSDP2's reshard_after_forward=False: no parameter is gathered again for backward; the
    matrices backward reads are held from their forward gather into backward instead. The plan
    sends less by exactly those backward gathers, (n - 1) padded blocks each (prefetch pads to
    the largest shard: 43 of 128 rows, 22 of 64), and makes that many all_gathers fewer; training
    is exact against one device (3 ranks, uneven) and the estimate matches the measured peak."""
    regather, _, _ = _linear_fsdp(True)
    pm, x, y = _linear_fsdp(False)
    for rank in (0, 2):
        backward, held = _phases(pm, rank)
        assert not backward and held == REGATHERED, pm.plan.program(rank)
        est, got = pm.plan.memory_estimate(rank).peak, measured_peak(pm, rank, (x,), (y,))
        assert abs(est - got) <= TOLERANCE * got, pm.plan.memory_estimate(rank).table(top=8)
    saved = sum(2 * (43 * 64 if name.endswith("_0_weight") else 22 * 128) * 4 for name in REGATHERED)
    before, after = regather.plan.stats(), pm.plan.stats()
    assert before["comm_bytes"] - after["comm_bytes"] == saved, (before, after)
    assert before["collectives"]["all_gather"] - after["collectives"]["all_gather"] == len(REGATHERED)
    assert after["collectives"]["all_gather"] == pm.plan.collective_calls(0)["all_gather"] \
        - pm.plan.program(0).count("prefetch_start_all_gather(") + pm.plan.program(0).count("prefetch_gathered(")


def test_reshard_after_forward_per_module_most_specific_name_decides():
    """{module: bool}: the longest name a parameter is under decides ("" is the whole model)."""
    pm, _, _ = _linear_fsdp({"layers.2": False})
    last = {"p_layers_2_0_weight", "p_layers_2_2_weight"}
    assert _phases(pm, 1) == (REGATHERED - last, last), pm.plan.program(1)
    pm, _, _ = _linear_fsdp({"": False, "layers.0": True, "layers.1.2.weight": True})
    again = {"p_layers_0_2_weight", "p_layers_1_2_weight"}
    assert _phases(pm, 0) == (again, REGATHERED - again), pm.plan.program(0)


def test_reshard_after_forward_bad_values_raise():
    import pytest

    model, x = LinearNet(), torch.randn(4, 64)
    with pytest.raises(sw.ConfigError, match=r"'layer\.2'.*did you mean 'layers\.2'"):
        sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), reshard_after_forward={"layer.2": False})
    for bad in ("no", None, {"layers.2": 0}):
        with pytest.raises(TypeError, match="reshard_after_forward"):
            sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), reshard_after_forward=bad)


def test_summary_says_which_parameters_stay_gathered():
    pm, _, _ = _linear_fsdp({"layers.2": False})
    why = {name: w for name, _, w in param_reasons(pm.plan)}
    kept = {n for n, w in why.items() if "kept for backward" in w}
    assert kept == {"layers.2.0.weight", "layers.2.0.bias", "layers.2.2.weight", "layers.2.2.bias"}, why
    assert "kept for backward" in pm.plan.summary()


def test_reshard_after_forward_on_parameters_never_gathered_raises():
    """Kept gathered, but placed where they are used (replicated here): nothing to keep, said."""
    import pytest

    torch.manual_seed(0)
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    spec = {n: [sw.Replicate()] for n, _ in LinearNet().named_parameters()}
    kw = dict(loss_fn=mse, example_targets=(y,), input_placements={0: [S(0)]}, param_placements=spec)
    with pytest.raises(sw.ConfigError, match="gathers none of them"):
        sw.parallelize(LinearNet(), sw.Mesh((2,), ("dp",)), (x,), reshard_after_forward={"layers.1": False}, **kw)
    sw.parallelize(LinearNet(), sw.Mesh((2,), ("dp",)), (x,), **kw)  # the default asks nothing
