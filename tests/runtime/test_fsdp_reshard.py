"""FSDP frees after use: a parameter all-gathered for forward is freed after its last forward
read and gathered again for backward (FSDP's reshard_after_forward), exact against one
device; the liveness report (lower/memory.gathered_arguments) and the memory estimate show it.

    python -m pytest tests/runtime/test_fsdp_reshard.py -q --durations=0
"""
from __future__ import annotations

import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Shard as S
from shardwise.lower.memory import gathered_arguments
from tests.parallel.harness import check_training
from tests.plan.test_memory import TOLERANCE, measured_peak


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
