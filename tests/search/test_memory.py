"""The memory estimate (lower/memory.py) against the measured peak: within +-15% for data
parallel, tensor parallel and FSDP-style placements of an MLP and a tiny GPT-2.

Measured: one rank's program run alone on this thread with real tensors, under
torch.profiler's memory events (every CPU allocation and free, in order); its peak is the
largest running sum, plus the program's arguments. Collectives there allocate as the torch
backend's do (lower/memory.py's model of them); the gloo test (slow) measures a real torch
backend process.

    python -m pytest tests/search/test_memory.py -q --durations=0
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import shardwise as sw
from shardwise import Shard as S
from shardwise.lower.memory import _ModelCollectives, program_memory
from shardwise.run.execute import Executable
from shardwise.run.collectives import using, using_generator
from tests.models import zoo

TOLERANCE = 0.15
GPT2_DATA = {"input_ids": [S(0)], "labels": [S(0)]}


def profiled_peak(run) -> int:
    """The most bytes ``run()`` had allocated at once on this thread (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    assert events, "the profiler recorded no memory events"
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


class SoloCollectives(_ModelCollectives):
    """One rank alone: each collective allocates its result as the torch backend does, filled
    from this rank's own tensor (gathered targets stay valid class indices)."""

    def all_gather(self, t, mesh_dim):
        return t.unsqueeze(0).expand(self.group_size(mesh_dim), *t.shape).clone()

    def reduce_scatter(self, t, mesh_dim, op="sum"):
        return t[self.group_index(mesh_dim)].clone()

    def all_to_all(self, t, mesh_dim):
        return t.clone(memory_format=torch.contiguous_format)

    def send_recv(self, t, mesh_dim, shift=1):
        return t.clone(memory_format=torch.contiguous_format)


def measured_peak(pm, rank: int, inputs, targets) -> int:
    """Rank ``rank``'s program alone, on its own contiguous arguments: their bytes + the peak."""
    plan = pm.plan
    program = plan.program_module(rank, guards=False)
    args = [a.detach().clone() for a in Executable(plan).flat_locals(pm.shards, rank, inputs, targets)]
    resident = sum(a.untyped_storage().nbytes() for a in args)

    def run():
        with using(SoloCollectives(plan.mesh, rank)), using_generator(None), torch.no_grad():
            out = program(*args)
        del out

    return resident + profiled_peak(run)


def _mlp_case(kind):
    c = zoo.mlp(batch=37)
    names = [n for n, _ in c.model.named_parameters()]
    kw = {"dp": dict(input_placements={0: [S(0)]}),
          "tp": dict(param_placements={"fc1.weight": [S(0)], "fc1.bias": [S(0)], "fc2.weight": [S(1)]}),
          "fsdp": dict(input_placements={0: [S(0)]}, param_placements={n: [S(0)] for n in names})}[kind]
    return c, kw


def _gpt2_case(kind):
    from tests.parallel.recipes import megatron_gpt2

    c = zoo.gpt2(batch=5, seq=16)
    matrices = {n: [S(0)] for n, p in c.model.named_parameters() if p.dim() == 2}
    kw = {"dp": dict(input_placements=GPT2_DATA),
          "tp": dict(param_placements={n: [p] for n, p in megatron_gpt2().items()}),
          "fsdp": dict(input_placements=GPT2_DATA, param_placements=matrices)}[kind]
    return c, kw


CASES = [(m, k) for m in ("mlp", "gpt2") for k in ("dp", "tp", "fsdp")]


@pytest.mark.parametrize("model,kind", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_estimate_within_15_percent_of_measured_peak(model, kind):
    c, kw = (_mlp_case if model == "mlp" else _gpt2_case)(kind)
    mesh = sw.Mesh((3,), ("dp" if kind != "tp" else "tp",))
    pm = sw.parallelize(c.model, mesh, c.example_inputs, loss_fn=c.loss_fn, example_targets=c.example_targets, **kw)
    for rank in (0, 2):  # uneven: rank 2 holds the smaller shards
        est = program_memory(pm.plan, rank)
        got = measured_peak(pm, rank, c.example_inputs, c.example_targets)
        assert abs(est.peak - got) <= TOLERANCE * got, (
            f"{model} {kind} rank {rank}: estimated {est.peak} B, measured {got} B\n{est.table(top=8)}")
        assert est.resident < est.peak


def test_gradients_counted_once_and_figures_add_up():
    """Data parallel: each gradient is one value of the program (a view of its bucket), so the
    gradient bytes are the parameter bytes, plus the float32 loss the bucket carries too (returned
    as a copy); memory()'s three figures add up to the peak."""
    c, kw = _gpt2_case("dp")
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, loss_fn=c.loss_fn,
                        example_targets=c.example_targets, **kw)
    est = pm.plan.memory_estimate(0)
    assert est.gradients == est.parameters + 4 and est.parameters > 0
    mem = pm.plan.memory()
    assert mem["parameters"] + mem["gradients"] + mem["peak_activations"] == mem["peak"]
    assert mem["peak"] >= est.peak and pm.plan.stats()["peak_memory_bytes"] >= mem["peak"]
    assert est.peak_node in est.table()
    assert len(est.curve) == len(pm.plan.program_module(0, guards=False).graph.nodes)


def test_views_alias_their_base():
    """Views add no bytes: y.t().reshape().t() holds y's storage only, and the [8, 32] expand
    of the loss's scalar gradient (new_ones, trace/microbatch.seed_from_shape) holds 4 bytes."""

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def forward(self, x):
            y = x @ self.w  # one new [rows, 32]
            return y.t().reshape(32, -1).t().sum()

    x = torch.randn(8, 64)
    pm = sw.parallelize(Views(), sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [S(0)]})
    est = pm.plan.memory_estimate(0)
    got = measured_peak(pm, 0, (x,), ())
    assert abs(est.peak - got) <= TOLERANCE * got, est.table()
    live = dict(est.curve)
    assert live["mm"] == live["t"] == live["view"] == live["t_1"] == est.resident + 4 * 32 * 4, est.table()
    # new_ones reads the loss (its dtype) last: the loss's 4 bytes die there, the expand adds none
    assert live["expand"] == live["t_3"] == live["new_ones_default"], est.table()


def test_program_that_cannot_run_on_fake_tensors_gets_a_planned_upper_bound(monkeypatch):
    """A program whose sizes depend on data cannot run on fake tensors: the estimate falls back
    to planned local sizes, each value its own allocation, and says so (exact False); that
    bounds the liveness estimate of the same program from above."""
    from shardwise.lower import memory

    c, kw = _gpt2_case("dp")
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, loss_fn=c.loss_fn,
                        example_targets=c.example_targets, **kw)
    exact = pm.plan.memory_estimate(0)
    pm.plan.prop.lowered.clear()  # the estimates made so far (lower/plan.py)

    def data_dependent(*args):
        raise RuntimeError("Could not extract specialized integer from data-dependent expression")

    monkeypatch.setattr(memory, "_run_fake", data_dependent)
    bound = pm.plan.memory_estimate(0)
    assert exact.exact and not bound.exact and pm.plan.memory()["exact"] is False
    assert bound.peak >= exact.peak and bound.resident == exact.resident


@pytest.mark.parametrize("kind", ["tp", "fsdp"])  # data parallel: the estimate-vs-measured test above
def test_meta_run_with_reused_calls_equals_the_fake_run(kind):
    """The estimate runs the program on meta tensors and makes a call seen before (a repeated
    block's) from the first one's outputs without dispatch: the curve, peak, aliasing and
    gradients are those of a plain run on fake tensors, node for node, on the ranks of an
    uneven mesh (the second rank class reusing the first one's calls); and on GPT-2's repeated
    blocks most calls are reused."""
    from shardwise.core.scope import using, using_generator as gen
    from shardwise.lower import memory

    c, kw = _gpt2_case(kind)
    mesh = sw.Mesh((3,), ("dp" if kind != "tp" else "tp",))
    pm = sw.parallelize(c.model, mesh, c.example_inputs, loss_fn=c.loss_fn, example_targets=c.example_targets, **kw)
    plan = pm.plan
    for rank in (0, 2):  # rank 2 holds the smaller shards
        gm = plan.program_module(rank, guards=False)
        runs = {}
        for meta in (True, False):
            mode, args = memory._fake_args(plan, gm, rank, meta)
            facts = memory._Facts()
            interp = memory._Interpreter(gm, facts, {} if meta else None)
            with mode, using(memory._ModelCollectives(mesh, rank)), gen(None), torch.no_grad():
                interp.run(*args)
            runs[meta] = (memory._walk(gm, facts, plan, rank), interp.memo)
        (on_meta, memo), (on_fake, _) = runs[True], runs[False]
        assert on_meta.curve == on_fake.curve and on_meta.live_after == on_fake.live_after
        assert (on_meta.peak, on_meta.gradients, on_meta.grad_shares) == (on_fake.peak, on_fake.gradients,
                                                                         on_fake.grad_shares)
        calls = sum(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
        made = sum(isinstance(key[0], torch._ops.OpOverload) for key in memo)  # aten calls dispatched
        assert made < calls / 2, "repeated calls were not reused"
        views = [m for m in memo.values() if m is not None and m.views]
        assert views, "no view (a reshape, a transpose) was remade from its argument"
        assert program_memory(plan, rank).curve == on_fake.curve
