"""Redistribution: exhaustive round trips on the threads backend, step kinds, bytes, costs.

Run: python -m pytest tests/layout/test_redistribute.py -q -p no:cacheprovider
"""
import itertools

import pytest
import torch

import shardwise as sw
from shardwise.lower.redistribute import apply_step, redistribute_local
from shardwise.core.cost import CostModel
from shardwise.run import run_threads

OPS = ("sum", "max", "min")
MESHES = [(2,), (3,), (4,), (2, 2), (2, 3)]
# even sizes, uneven sizes, and dims smaller than a mesh dim (empty shards)
SHAPES = [(12,), (7,), (2,), (12, 6), (5, 3), (1, 7), (6, 12, 6), (3, 5, 2)]


def _id(shape):
    return "x".join(map(str, shape))


def _placement_lists(mesh_ndim, ndim):
    base = [sw.Replicate()] + [sw.Shard(d) for d in range(ndim)]
    plain = list(itertools.product(base, repeat=mesh_ndim))
    partial = [c for m in range(mesh_ndim) for op in OPS
               for c in itertools.product(*[[sw.Partial(op)] if k == m else base for k in range(mesh_ndim)])]
    return plain, partial


def _partial_locals(shape, mesh, src, gen):
    """Per-rank partial values built directly: member p of the Partial group holds a slice of x_p.

    Integer-valued floats keep sums exact in any order, so every comparison is bitwise.
    """
    m = next(k for k, p in enumerate(src) if isinstance(p, sw.Partial))
    xs = [torch.randint(-50, 50, shape, generator=gen).float() for _ in range(mesh.shape[m])]
    layout = sw.Layout(shape, torch.float32, src)
    out = []
    for r in range(mesh.size):
        t = xs[mesh.coord(r)[m]]
        for d, (off, n) in enumerate(layout.shard_bounds(mesh, r)):
            t = t.narrow(d, off, n)
        out.append(t.clone())
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=_id)
def test_every_pair_round_trips(mesh_shape, shape):
    mesh = sw.Mesh(mesh_shape)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    plain, partial = _placement_lists(mesh.ndim, len(shape))
    sources = [(src, sw.distribute(x, mesh, src)) for src in plain]
    sources += [(src, _partial_locals(shape, mesh, src, gen)) for src in partial]
    cases = [(src, dst, locs) for src, locs in sources for dst in plain + partial]

    def body(rank):  # one thread spawn per (mesh, shape): each rank runs every pair in order
        return [redistribute_local(locs[rank], sw.Layout(shape, x.dtype, src), dst, mesh)
                for src, dst, locs in cases]

    outs = run_threads(body, mesh)
    wrong = []
    for k, (src, dst, locs) in enumerate(cases):
        want = x if src in plain else sw.collect(locs, mesh, src)
        got = sw.collect([outs[r][k] for r in range(mesh.size)], mesh, dst)
        if got.shape != want.shape or not torch.equal(got, want):
            wrong.append((src, dst))
    assert not wrong, f"{len(wrong)} of {len(cases)} pairs wrong, e.g. {wrong[:4]}"


def test_public_redistribute_uneven_nested():
    mesh = sw.Mesh((2, 3))
    x = torch.randn(7, 5)
    src, dst = [sw.Shard(0), sw.Shard(0)], [sw.Shard(1), sw.Shard(0)]
    out = sw.redistribute(sw.distribute(x, mesh, src), mesh, src, dst)
    assert [tuple(t.shape) for t in out] == [sw.Layout(x.shape, x.dtype, dst).local_shape(mesh, r) for r in range(6)]
    assert torch.equal(sw.collect(out, mesh, dst), x)


def _only_step(shape, src, dst, mesh):
    steps = sw.plan_redistribute(sw.Layout(shape, torch.float32, src), dst, mesh)
    assert len(steps) == 1, steps
    return steps[0]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=_id)
@pytest.mark.parametrize("shape", [(12, 6, 6), (5, 3, 7), (1, 2, 3)], ids=_id)
def test_single_mesh_dim_changes_take_one_step(mesh_shape, shape):
    mesh = sw.Mesh(mesh_shape)
    plain, _ = _placement_lists(mesh.ndim, len(shape))
    for base, m in itertools.product(plain, range(mesh.ndim)):
        later = {p.dim for p in base[m + 1:] if isinstance(p, sw.Shard)}

        def with_(p):
            return base[:m] + (p,) + base[m + 1:]

        for i, j in itertools.permutations(range(len(shape)), 2):
            if not {i, j} & later:
                s = _only_step(shape, with_(sw.Shard(i)), with_(sw.Shard(j)), mesh)
                assert (s.kind, s.mesh_dim, s.src_dim, s.dst_dim) == ("all_to_all", m, i, j)
        for d in set(range(len(shape))) - later:
            s = _only_step(shape, with_(sw.Replicate()), with_(sw.Shard(d)), mesh)
            assert (s.kind, s.bytes, s.time) == ("slice", 0, 0.0)
            for op in OPS:
                s = _only_step(shape, with_(sw.Partial(op)), with_(sw.Shard(d)), mesh)
                assert (s.kind, s.op, s.dst_dim) == ("reduce_scatter", op, d)
        for op in OPS:
            s = _only_step(shape, with_(sw.Replicate()), with_(sw.Partial(op)), mesh)
            assert (s.kind, s.op, s.bytes) == ("partial_local", op, 0)
            assert _only_step(shape, with_(sw.Partial(op)), with_(sw.Replicate()), mesh).kind == "all_reduce"


def test_plan_shapes_of_composite_moves():
    mesh = sw.Mesh((2, 2))
    lay = sw.Layout((8, 8), torch.float32, [sw.Shard(0), sw.Replicate()])
    assert sw.plan_redistribute(lay, [sw.Shard(0), sw.Replicate()], mesh) == []
    # Shard -> Partial goes through Replicate; Partial(max) -> Partial(sum) through Replicate
    kinds = [s.kind for s in sw.plan_redistribute(lay, [sw.Partial(), sw.Replicate()], mesh)]
    assert kinds == ["all_gather", "partial_local"]
    lay = sw.Layout((8, 8), torch.float32, [sw.Partial("max"), sw.Replicate()])
    assert [s.kind for s in sw.plan_redistribute(lay, [sw.Partial("sum"), sw.Replicate()], mesh)] == \
        ["all_reduce", "partial_local"]
    # the free slice happens first so the all_reduce moves half the data
    steps = sw.plan_redistribute(sw.Layout((8, 8), torch.float32, [sw.Partial(), sw.Replicate()]),
                                 [sw.Replicate(), sw.Shard(1)], mesh)
    assert [(s.kind, s.mesh_dim) for s in steps] == [("slice", 1), ("all_reduce", 0)]
    assert steps[1].bytes == 2 * 1 * (8 * 4 // 2) * 4
    # mixed partial ops reduce innermost first: max over d1 before sum over d0
    steps = sw.plan_redistribute(sw.Layout((4,), torch.float32, [sw.Partial("sum"), sw.Partial("max")]),
                                 [sw.Replicate(), sw.Replicate()], mesh)
    reductions = [(s.mesh_dim, s.op) for s in steps if s.kind in ("all_reduce", "reduce_scatter")]
    assert reductions == [(1, "max"), (0, "sum")], steps


def test_mixed_partials_execute_exactly():
    mesh = sw.Mesh((2, 2))
    gen = torch.Generator().manual_seed(1)
    locs = [torch.randint(-9, 9, (6,), generator=gen).float() for _ in range(4)]
    for src in ([sw.Partial("sum"), sw.Partial("max")], [sw.Partial("min"), sw.Partial("sum")]):
        for dst in ([sw.Replicate(), sw.Replicate()], [sw.Shard(0), sw.Partial("max")],
                    [sw.Partial("max"), sw.Partial("sum")]):
            out = sw.redistribute(locs, mesh, src, dst)
            assert torch.equal(sw.collect(out, mesh, dst), sw.collect(locs, mesh, src)), (src, dst)


# -- bytes and time -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_are_textbook_for_even_sizes(n):
    mesh = sw.Mesh((n,))
    shape = (4 * n, 6 * n)
    full = shape[0] * shape[1] * 4  # float32 bytes of the full tensor
    cases = {
        ("all_gather", (sw.Shard(0),), (sw.Replicate(),)): (n - 1) * full // n,
        ("reduce_scatter", (sw.Partial(),), (sw.Shard(1),)): (n - 1) * full // n,
        ("all_reduce", (sw.Partial(),), (sw.Replicate(),)): 2 * (n - 1) * full // n,
        ("all_to_all", (sw.Shard(0),), (sw.Shard(1),)): (n - 1) * (full // n) // n,
    }
    for (kind, src, dst), want in cases.items():
        s = _only_step(shape, src, dst, mesh)
        assert (s.kind, s.bytes) == (kind, want)
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        assert s.time == pytest.approx(5e-6 * steps + want / 50e9)


def test_bytes_on_a_2d_mesh_use_local_sizes():
    mesh = sw.Mesh((2, 3))
    shape = (48, 72)
    local = 48 * 72 * 8 // 2  # float64 local tensor after the dp split (bytes)
    lay = sw.Layout(shape, torch.float64, [sw.Shard(0), sw.Shard(1)])
    s = sw.plan_redistribute(lay, [sw.Shard(0), sw.Replicate()], mesh)[0]
    assert (s.kind, s.mesh_dim, s.bytes) == ("all_gather", 1, 2 * local // 3)
    s = sw.plan_redistribute(lay, [sw.Shard(0), sw.Shard(0)], mesh)[0]
    assert (s.kind, s.bytes) == ("all_to_all", 2 * (local // 3) // 3) and s.bytes == 3072
    assert repr(s) == "all_to_all(mesh_dim=1, Shard(1)->Shard(0), 3.0 KiB/rank)"
    s = sw.plan_redistribute(lay, [sw.Shard(0), sw.Partial()], mesh)[-1]
    assert repr(s) == "partial_local(mesh_dim=1, Replicate()->Partial(), local)"


def test_uneven_bytes_use_the_largest_padded_chunk():
    mesh = sw.Mesh((4,))
    s = _only_step((5, 2), (sw.Shard(0),), (sw.Replicate(),), mesh)  # chunks 2,2,1,0 -> pad to 2
    assert s.bytes == 3 * 2 * 2 * 4
    s = _only_step((5, 2), (sw.Partial(),), (sw.Replicate(),), mesh)
    assert s.bytes == 2 * 3 * 3 * 4  # ceil(10 / 4) elements per ring chunk


def test_cost_model():
    c = CostModel()
    assert c.collective_time("all_gather", 10**9, 4) == pytest.approx(3 * 5e-6 + 10**9 / 50e9)
    assert c.collective_time("all_reduce", 0, 4) == pytest.approx(6 * 5e-6)
    assert c.collective_time("slice", 10**9, 4) == 0.0 and c.collective_time("all_gather", 0, 1) == 0.0
    assert c.compute_time(2e14) == pytest.approx(2.0)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    by_name = CostModel(bandwidth={"tp": 100e9}, latency=(1e-5, 1e-6))
    assert by_name.collective_time("all_gather", 10**9, 2, "tp", mesh) == pytest.approx(1e-6 + 0.01)
    assert by_name.collective_time("all_gather", 10**9, 2, 0, mesh) == pytest.approx(1e-5 + 0.02)
    assert hash(by_name) == hash(CostModel(bandwidth={"tp": 100e9}, latency=[1e-5, 1e-6]))
    with pytest.raises(sw.ShardingError):
        CostModel(bandwidth=0)
    with pytest.raises(sw.ShardingError):
        c.collective_time("broadcastish", 1, 2)


def test_cost_model_steers_the_plan():
    # [Shard(0), Shard(1)] -> replicated: the first gather moves half as much as the second,
    # so the slow link should carry the first one
    mesh = sw.Mesh((2, 2))
    lay = sw.Layout((8, 8), torch.float32, [sw.Shard(0), sw.Shard(1)])
    dst = [sw.Replicate(), sw.Replicate()]
    slow_d0 = sw.plan_redistribute(lay, dst, mesh, CostModel(bandwidth=(1e3, 1e12), latency=0))
    slow_d1 = sw.plan_redistribute(lay, dst, mesh, CostModel(bandwidth={"d0": 1e12, "d1": 1e3}, latency=0))
    assert [(s.mesh_dim, s.bytes) for s in slow_d0] == [(0, 16 * 4), (1, 32 * 4)]
    assert [(s.mesh_dim, s.bytes) for s in slow_d1] == [(1, 16 * 4), (0, 32 * 4)]


# -- execution errors -----------------------------------------------------------------------------

def test_wrong_local_shape_names_both_shapes():
    mesh = sw.Mesh((2,))
    lay = sw.Layout((6, 4), torch.float32, [sw.Shard(0)])

    def body(rank):
        return redistribute_local(torch.zeros(2, 4), lay, [sw.Replicate()], mesh)

    with pytest.raises(sw.ShardingError, match=r"expects a local tensor of shape \[3, 4\].*got shape \[2, 4\]"):
        run_threads(body, mesh)
    step = sw.plan_redistribute(lay, [sw.Shard(1)], mesh)[0]
    with pytest.raises(sw.ShardingError, match=r"\[3, 4\].*\[3, 5\]"):
        apply_step(torch.zeros(3, 5), step, None, 0, mesh)


def test_local_only_plans_need_no_backend():
    mesh = sw.Mesh((2, 2))
    x = torch.arange(16.0).reshape(4, 4)
    lay = sw.Layout(x.shape, x.dtype, [sw.Replicate(), sw.Replicate()])
    dst = [sw.Shard(1), sw.Partial()]
    out = [redistribute_local(x, lay, dst, mesh, rank=r) for r in range(4)]
    assert torch.equal(sw.collect(out, mesh, dst), x)


def test_3d_mesh_sampled_pairs_round_trip():
    mesh = sw.Mesh((2, 2, 2))
    x = torch.randn(5, 9)
    plain, _ = _placement_lists(3, 2)
    gen = torch.Generator().manual_seed(2)
    pairs = [(plain[i], plain[j]) for i, j in torch.randint(0, len(plain), (150, 2), generator=gen).tolist()]
    pairs.append(((sw.Shard(0),) * 3, (sw.Shard(1),) * 3))
    locs = {src: sw.distribute(x, mesh, src) for src, _ in pairs}

    def body(rank):
        return [redistribute_local(locs[s][rank], sw.Layout(x.shape, x.dtype, s), d, mesh) for s, d in pairs]

    outs = run_threads(body, mesh)
    for k, (src, dst) in enumerate(pairs):
        assert torch.equal(sw.collect([o[k] for o in outs], mesh, dst), x), (src, dst)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.float64])
def test_other_dtypes_and_scalars(dtype):
    mesh = sw.Mesh((2, 3))
    x = torch.arange(35).reshape(5, 7).to(dtype)
    for src, dst in [([sw.Shard(0), sw.Shard(1)], [sw.Shard(1), sw.Shard(0)]),
                     ([sw.Partial(), sw.Replicate()], [sw.Shard(1), sw.Shard(1)]),
                     ([sw.Replicate(), sw.Shard(0)], [sw.Partial("max"), sw.Shard(1)])]:
        out = sw.redistribute(sw.distribute(x, mesh, src), mesh, src, dst)
        assert all(t.dtype == dtype for t in out)
        assert torch.equal(sw.collect(out, mesh, dst), x), (src, dst)
    s = torch.tensor(3, dtype=dtype)
    out = sw.redistribute(sw.distribute(s, mesh, [sw.Partial(), sw.Partial()]), mesh,
                          [sw.Partial(), sw.Partial()], [sw.Replicate(), sw.Partial("min")])
    assert torch.equal(sw.collect(out, mesh, [sw.Replicate(), sw.Partial("min")]), s)
    for step in sw.plan_redistribute(sw.Layout((), dtype, [sw.Partial()] * 2), [sw.Replicate()] * 2, mesh):
        n = mesh.shape[step.mesh_dim]  # 1 element: ceil(1/n) = 1 element per ring chunk
        assert (step.kind, step.bytes) == ("all_reduce", 2 * (n - 1) * x.element_size())


def _reference_steps(shape, src, dst, mesh, cost):
    """The search before searches were shared (issue 9): Dijkstra from ``src`` stopped at
    ``dst``, over the options of that pair only (no Partial that neither end holds)."""
    import heapq

    from shardwise.search import paths as rd

    shapes = rd._Shapes(shape, torch.float32, mesh)
    options = []
    for m in range(mesh.ndim):
        opts = [sw.Replicate()] + [sw.Shard(d) for d in range(len(shape))]
        opts += [p for p in dict.fromkeys((src[m], dst[m])) if not isinstance(p, sw.Replicate) and p not in opts]
        options.append(opts)
    best, prev, tie = {src: (0.0, 0)}, {}, itertools.count()
    heap = [(0.0, 0, next(tie), src)]
    while heap:
        t, k, _, state = heapq.heappop(heap)
        if state == dst:
            break
        if (t, k) > best[state]:
            continue
        for m, opts in enumerate(options):
            for new in opts:
                e = None if new == state[m] else rd._edge(state, m, new, shapes, cost)
                if e is not None and (e[0] not in best or (t + e[1][-1], k + 1) < best[e[0]]):
                    best[e[0]], prev[e[0]] = (t + e[1][-1], k + 1), (state, e[1])
                    heapq.heappush(heap, (t + e[1][-1], k + 1, next(tie), e[0]))
    steps, state = [], dst
    while state != src:
        state, edge = prev[state]
        steps.append((state,) + edge)
    return steps[::-1]


@pytest.mark.parametrize("shape", [(4, 2)] + [pytest.param(s, marks=pytest.mark.slow) for s in [(5, 3), (2, 3, 1, 2, 3)]],
                         ids=_id)
def test_shared_searches_plan_the_steps_of_one_search_per_pair(shape):
    """One search per source layout answers every destination: the steps (kinds, order, bytes,
    times, ties included) are those of a search for that pair alone; where the destination
    holds a Partial the source does not hold on that mesh dim, the steps are that search's to
    the destination with Replicate there, then the Partials entered, and cost what the search
    for the pair finds (time and number of steps). Sampled pairs on (2, 2, 2), with partials
    of every op, a unit shard and a shard in groups, under the default and a bandwidth-bound
    cost model."""
    mesh = sw.Mesh((2, 2, 2))
    n = len(shape)
    base = [sw.Replicate()] + [sw.Shard(d) for d in range(n)] + [sw.Partial(op) for op in OPS]
    base += [sw.Shard(n - 1, groups=2)] if shape[-1] % 2 == 0 else []
    base += [sw.Shard(0, unit=2)] if shape[0] % 2 == 0 else []
    states = []
    for c in itertools.product(base, repeat=3):
        try:
            states.append(sw.Layout(shape, torch.float32, c).placements)
        except sw.ShardingError:
            continue
    gen = torch.Generator().manual_seed(len(shape))
    pairs = [(states[i], states[j]) for i, j in torch.randint(0, len(states), (60, 2), generator=gen).tolist()]
    pairs += [(states[0], d) for d in states[::7]]  # many destinations from one source
    for cost in (CostModel(), CostModel(latency=0.0, bandwidth=[1e9, 5e10, 5e10])):
        for src, dst in pairs:
            try:
                want = _reference_steps(shape, src, dst, mesh, cost)
            except KeyError:  # no path: the planner must say so too
                with pytest.raises(sw.ShardingError):
                    sw.plan_redistribute(sw.Layout(shape, torch.float32, src), dst, mesh, cost)
                continue
            got = sw.plan_redistribute(sw.Layout(shape, torch.float32, src), dst, mesh, cost)
            got = [(s.src.placements, s.kind, s.mesh_dim, s.src_dim, s.dst_dim, s.op, s.bytes, s.time) for s in got]
            late = [m for m in range(3) if isinstance(dst[m], sw.Partial) and dst[m] != src[m]]
            if late:
                assert (len(got), sum(s[-1] for s in got)) == pytest.approx((len(want), sum(s[-1] for s in want)),
                                                                            rel=1e-12), (src, dst)
                base = tuple(sw.Replicate() if m in late else p for m, p in enumerate(dst))
                want = _reference_steps(shape, src, base, mesh, cost)
                here = list(base)
                for m in late:  # entered last, in mesh-dim order
                    want.append((tuple(here), "partial_local", m, None, None, dst[m].op, 0, 0.0))
                    here[m] = dst[m]
            assert got == want, (src, dst)
