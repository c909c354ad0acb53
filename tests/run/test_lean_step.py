"""The lean step: plain tensor arguments skip the pytree work (_ArgPlan: each input's local
slice worked out once per plan and rank), the debug shape guards run on the first run of each
plan only, and an all_reduce of a value the program owns reduces it in place; exact against
one device throughout.

    python -m pytest tests/run/test_lean_step.py -q --durations=0
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.core.errors import ShardingError
from shardwise.lower.guards import shape_guard
from shardwise.module.planning import signature
from shardwise.run import execute as be
from tests.models import zoo
from tests.parallel.harness import check_training


def mse(out, y):
    return ((out - y) ** 2).mean()


def _dp(batch=5, ranks=3, **kw):
    x = torch.randn(batch, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(batch, 3, generator=torch.Generator().manual_seed(3))
    pm = check_training(zoo.seeded_mlp(), sw.Mesh((ranks,), ("dp",)), (x,), (y,), mse, steps=2,
                        input_placements={0: [S(0)]}, **kw)
    return pm, x, y


def test_fast_arguments_equal_the_pytree_path_uneven():
    pm, x, y = _dp()
    plan = pm.plan
    for rank in range(3):
        fast = be._ArgPlan.of(plan, rank)
        assert fast is not None
        got = fast.args(pm.shards[rank], (x,), (y,))
        assert got is not None
        slow = be.Executable(plan)
        slow._arg_plans[rank] = None  # force the pytree path
        want = slow.flat_locals(pm.shards, rank, (x,), (y,))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.data_ptr() == b.data_ptr() and torch.equal(a, b)


def test_fast_arguments_split_past_dim_0_equal_the_pytree_path():
    """A (5, 7, 6) input split on dims 0 and 1 of a 2x2 mesh and its target on dim 1 only: each
    rank's views (one basic index each) are the pytree path's narrow views, uneven pieces too."""
    x = torch.randn(5, 7, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(3))
    pm = sw.parallelize(zoo.seeded_mlp(), sw.Mesh((2, 2), ("dp", "sp")), (x,), loss_fn=mse, example_targets=(y,),
                        input_placements={0: [S(0), S(1)]}, target_placements={0: [sw.Replicate(), S(1)]})
    plan = pm.plan
    for rank in range(4):
        fast = be._ArgPlan.of(plan, rank)
        assert fast is not None and sum(ix is not None for ix in fast.index) == 2
        got = fast.args(pm.shards[rank], (x,), (y,))
        slow = be.Executable(plan)
        slow._arg_plans[rank] = None  # force the pytree path
        want = slow.flat_locals(pm.shards, rank, (x,), (y,))
        for a, b in zip(got, want):
            assert (a.shape, a.stride(), a.data_ptr()) == (b.shape, b.stride(), b.data_ptr())


def test_nested_inputs_take_the_pytree_path():
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, batch):
            return self.lin(batch["x"]).sum()

    x = torch.randn(4, 4)
    pm = sw.parallelize(Nested(), sw.Mesh((2,), ("dp",)), ({"x": x},))
    pm.step({"x": x})
    assert be._ArgPlan.of(pm.plan, 0) is None
    assert be._ArgPlan(["w"], [None]).args({"w": x}, ({"x": x},), ()) is None
    assert be._ArgPlan(["w"], [None]).args({"w": x}, (x, x), ()) is None


def test_guards_run_on_the_first_run_of_a_plan_only():
    pm, x, y = _dp(batch=6, ranks=2)
    plan = pm.plan
    run = pm._executable(plan)
    for rank in range(2):
        assert run.program(rank) is plan.program_module(rank, guards=False)
        assert not any(n.target is shape_guard for n in run.program(rank).graph.nodes)
    assert any(n.target is shape_guard for n in plan.program_module(0).graph.nodes)


def test_a_first_run_that_fails_keeps_the_guards(monkeypatch):
    """A wrong local shape is named by the guard on the first run; the run after it is still guarded."""
    x, y = torch.randn(6, 6), torch.randn(6, 3)
    pm = sw.parallelize(zoo.seeded_mlp(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, example_targets=(y,),
                        input_placements={0: [S(0)]})
    plan = pm.plan
    gm = plan.program_module(0)
    guard = next(n for n in gm.graph.nodes if n.target is shape_guard)
    shapes = tuple(None if s is None else tuple(d + 1 for d in s) for s in guard.args[1])
    guard.args = (guard.args[0], shapes, guard.args[2])
    gm.recompile()
    for _ in range(2):
        with pytest.raises(ShardingError, match="the plan expects"):
            pm.step(x, y)
    assert pm._executable(plan).program(0) is gm


def test_signature_fast_path_keys_by_shape_and_dtype():
    pm, x, y = _dp(batch=6, ranks=2)
    n = len(pm.planning._plans)
    pm.step(x.clone(), y.clone())
    assert len(pm.planning._plans) == n
    pm.step(x[:4], y[:4])
    assert len(pm.planning._plans) == n + 1
    assert signature((x,), (y,)) != signature((x.double(),), (y,))


def test_all_reduce_of_an_owned_value_reduces_in_place():
    """Megatron MLP: the partial sum the row-parallel layer's all_reduce reads is a fresh aten
    result nothing else reads, so the call is owned_all_reduce (no copy on the torch backend);
    exact on threads ranks, counted as one all_reduce call; a value read again stays plain."""
    from shardwise.lower.buckets import owned_all_reduce

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    spec = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)]}
    pm = check_training(zoo.seeded_mlp(), sw.Mesh((2,), ("tp",)), (x,), (y,), mse, steps=2, param_placements=spec)
    for gm in (pm.plan.program_module(1, guards=False), pm.plan.program_module(1)):
        owned = [n for n in gm.graph.nodes if n.target is owned_all_reduce]
        assert owned, gm.code
        for n in owned:
            src = n.args[0].args[0] if n.args[0].target is shape_guard else n.args[0]
            assert isinstance(src.target, torch._ops.OpOverload) and len(src.users) == 1, gm.code
    assert pm.plan.collective_calls(0)["all_reduce"] == pm.plan.stats()["collectives"]["all_reduce"]


def test_a_value_read_again_is_not_reduced_in_place():
    import torch.fx as fx

    from shardwise.lower import comm
    from shardwise.lower.buckets import reduce_owned_in_place

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    r = g.call_function(comm.all_reduce, (y, 0, "sum"))
    z = g.call_function(torch.ops.aten.add.Tensor, (r, y))  # y read after the reduce
    v = g.call_function(torch.ops.aten.t.default, (x,))
    r2 = g.call_function(comm.all_reduce, (v, 0, "sum"))  # a view of an argument
    g.output((z, r2))
    reduce_owned_in_place(g)
    assert r.target is comm.all_reduce and r2.target is comm.all_reduce


def test_a_reshape_is_owned_only_when_its_input_is():
    """aten._unsafe_view (matmul's reshape of its mm) aliases its input although its schema says
    nothing: reducing it in place would write into a value another node still reads. Through a
    reshape of a value read once, the reduce is in place; run, the other reader sees its value."""
    import torch.fx as fx

    from shardwise.lower import comm
    from shardwise.lower.buckets import owned_all_reduce, reduce_owned_in_place

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    shared = g.call_function(aten.mm.default, (x, x))
    r = g.call_function(comm.all_reduce, (g.call_function(aten._unsafe_view.default, (shared, [16])), 0, "sum"))
    z = g.call_function(aten.add.Tensor, (shared, 1))  # the mm read again, by another node
    alone = g.call_function(aten.mm.default, (x, x))
    r2 = g.call_function(comm.all_reduce, (g.call_function(aten.view.default, (alone, [16])), 0, "sum"))
    g.output((r, z, r2))
    reduce_owned_in_place(g)
    assert r.target is comm.all_reduce and r2.target is owned_all_reduce


def test_bucketed_gradients_are_views_of_their_bucket_not_copies():
    """Data parallel MLP: every gradient is a disjoint view of one reduced bucket (no copy per
    step); an in-place update of one leaves the others as they were; a second step accumulates."""
    pm, x, y = _dp(batch=6, ranks=2)
    pm.zero_grad()
    pm.step(x, y)
    for rank in range(2):
        grads = [p.grad for p in pm.named_local_parameters(rank).values()]
        assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
        before = [g.clone() for g in grads]
        grads[0].mul_(0)
        for g, b in zip(grads[1:], before[1:]):
            assert torch.equal(g, b)
        grads[0].copy_(before[0])
    first = {n: g.clone() for n, g in pm.gradients().items()}
    pm.step(x, y)
    for n, g in pm.gradients().items():
        torch.testing.assert_close(g, 2 * first[n])


def test_threads_backend_runs_rank_0_on_the_calling_thread():
    import threading

    from shardwise.run.threads import run_threads

    names = run_threads(lambda rank: threading.current_thread().name, sw.Mesh((3,)))
    assert names == [threading.current_thread().name, "shardwise-rank1", "shardwise-rank2"]
    assert run_threads(lambda rank: threading.get_ident(), sw.Mesh((1,))) == [threading.get_ident()]


# -- what a step skips: the generator state of a plan that draws nothing, the storage scan of
#    gradients the program owns, the placements of a signature planned before --------------------
def test_output_buffers_follow_the_schemas():
    """A fresh aten result is its own buffer; a view (the schema's alias, or aten._unsafe_view)
    is its input's; results of one call with several are apart; an argument, a Python call or
    a graph with set_ cannot be told."""
    import operator

    import torch.fx as fx

    from shardwise.lower import comm

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    mm = g.call_function(aten.mm.default, (x, x))
    view = g.call_function(aten.view.default, (mm, [16]))
    unsafe = g.call_function(aten._unsafe_view.default, (mm, [16]))
    t = g.call_function(aten.t.default, (x,))
    ln = g.call_function(aten.native_layer_norm_backward.default,
                         (mm, mm, [4], mm, mm, None, None, [True, True, False]))
    first, second = (g.call_function(operator.getitem, (ln, i)) for i in (0, 1))
    reduced = g.call_function(comm.all_reduce, (mm, 0, "sum"))
    summed = g.call_function(aten.sum.default, (reduced,))
    g.output((mm, view, unsafe, t, first, second, reduced, summed))
    bufs = be.output_buffers(g)
    assert bufs[0] == bufs[1] == bufs[2] == frozenset({mm})
    assert bufs[3] is None and bufs[6] is None
    assert bufs[4] == frozenset({(ln, 0)}) and bufs[5] == frozenset({(ln, 1)})
    assert bufs[7] == frozenset({summed})  # a new buffer, whatever its input was
    g2 = fx.Graph()
    a, b = g2.placeholder("a"), g2.placeholder("b")
    fresh = g2.call_function(aten.mul.Tensor, (a, 2))
    g2.call_function(aten.set_.source_Tensor, (fresh, b))  # fresh now shares b's buffer
    g2.output((fresh,))
    assert be.output_buffers(g2) == [None]


def test_owned_gradients_are_kept_apart_and_accumulate():
    """Megatron MLP on 2 ranks: every gradient is a fresh aten result (no bucket, no collective),
    so the step keeps each as it is; each has a buffer of its own (no shard's, no input's, no other
    gradient's): an in-place update of one leaves the rest; a second step accumulates; exact."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    spec = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)]}
    pm = check_training(zoo.seeded_mlp(), sw.Mesh((2,), ("tp",)), (x,), (y,), mse, steps=2, param_placements=spec)
    run = pm._executable(pm.plan)
    assert all(run.owns(r, pm.plan.traced.grad_indices) for r in range(2))
    _kept_gradients_apart(pm, x, y, lambda grads: len({g.untyped_storage().data_ptr() for g in grads}) == len(grads))


def _kept_gradients_apart(pm, x, y, storages_ok) -> None:
    """One step from zero: on each of 2 ranks the gradients (``storages_ok(grads)`` of their
    storages) share no storage with a shard or an input and no element with each other, so an
    in-place update of one leaves the rest; a second step accumulates (twice the first)."""
    pm.zero_grad()
    pm.step(x, y)
    first = {n: g.clone() for n, g in pm.gradients().items()}
    for rank in range(2):
        shards = pm.named_local_parameters(rank)
        grads = [p.grad for p in shards.values()]
        assert storages_ok(grads)
        spans = sorted((g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()) for g in grads)
        assert all(lo >= hi for (_, hi), (lo, _) in zip(spans, spans[1:]))
        assert not {g.untyped_storage().data_ptr() for g in grads} & {
            t.untyped_storage().data_ptr() for t in (*shards.values(), x, y)}
        before = [g.clone() for g in grads]
        grads[0].mul_(0)
        assert all(torch.equal(g, b) for g, b in zip(grads[1:], before[1:]))
        grads[0].copy_(before[0])
    pm.step(x, y)
    for n, g in pm.gradients().items():
        torch.testing.assert_close(g, 2 * first[n])


def test_bucketed_gradients_are_disjoint_views_of_one_fresh_buffer():
    """Data parallel: the gradients come back as views of their bucket's reduced buffer (DDP's
    gradient_as_bucket_view), each its own element range, so the step keeps them without the
    storage scan; in place on one leaves the others, a second step accumulates; exact."""
    pm, x, y = _dp(batch=6, ranks=2)
    plan, run = pm.plan, pm._executable(pm.plan)
    assert any(n.target is be.wait_bucket for n in plan.program_module(0, guards=False).graph.nodes)
    assert all(run.owns(r, plan.traced.grad_indices) for r in range(2))
    # views of one buffer: fewer storages than gradients
    _kept_gradients_apart(pm, x, y, lambda grads: len({g.untyped_storage().data_ptr() for g in grads}) < len(grads))


def test_buffer_ranges_are_told_apart():
    """_apart: a bucket's pieces are apart when their element ranges are; a range overlapping
    another, or a piece beside an output holding the whole buffer, is not; unknown is not."""
    assert be._apart([frozenset({be._Span("w", 0, 4)}), frozenset({be._Span("w", 4, 9)}), frozenset({"mm"})])
    assert not be._apart([frozenset({be._Span("w", 0, 5)}), frozenset({be._Span("w", 4, 9)})])
    assert not be._apart([frozenset({be._Span("w", 0, 4)}), frozenset({"w"})])
    assert not be._apart([frozenset({"mm"}), frozenset({"mm"})])
    assert not be._apart([frozenset({"mm"}), None])
    assert be._apart([frozenset({be._Span("w", 3, 3)}), frozenset({be._Span("w", 3, 7)})])  # an empty member


def test_a_plan_that_draws_nothing_leaves_the_generators_alone():
    """A plan without random ops runs without a copy of the generator (the default one's state is
    as before the step); with dropout the rank's generator is one device's stream, and the default
    one ends where one device's does."""
    import copy

    pm, x, y = _dp(batch=6, ranks=2)
    assert not pm.plan.draws_random
    state = torch.random.get_rng_state()
    pm.step(x, y)
    assert torch.equal(torch.random.get_rng_state(), state)
    model = torch.nn.Sequential(zoo.seeded_mlp(), torch.nn.Dropout(0.5))
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, example_targets=(y,),
                        input_placements={0: [S(0)]})
    assert pm.plan.draws_random
    torch.manual_seed(11)
    loss = pm.step(x, y)
    after = torch.random.get_rng_state()
    torch.manual_seed(11)
    want = mse(ref(x), y)
    torch.testing.assert_close(loss, want.detach())
    assert torch.equal(after, torch.random.get_rng_state())


def test_switching_shapes_and_modes_between_steps_stays_exact():
    """The plan of each step is looked up by shapes, dtypes and every submodule's training flag,
    without reading placements again: switching batch sizes, eval and train (dropout on and off)
    back and forth gives one device's loss and gradients every step."""
    import copy

    model = torch.nn.Sequential(zoo.seeded_mlp(), torch.nn.Dropout(0.5))
    ref = copy.deepcopy(model)
    big = (torch.randn(6, 6, generator=torch.Generator().manual_seed(2)),
           torch.randn(6, 3, generator=torch.Generator().manual_seed(3)))
    small = (big[0][:4].clone(), big[1][:4].clone())
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (big[0],), loss_fn=mse, input_placements={0: [S(0)]})
    for i, ((x, y), train) in enumerate([(big, True), (big, False), (small, False), (small, True), (big, True),
                                         (big, False)]):
        pm.train(train)
        ref.train(train)
        pm.zero_grad()
        ref.zero_grad()
        torch.manual_seed(i)
        loss = pm.step(x, y)
        torch.manual_seed(i)
        want = mse(ref(x), y)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), msg=f"step {i}")
        got = pm.gradients()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.grad, msg=f"step {i}: grad of {n}")
    assert len(pm.planning._plans) == 4
