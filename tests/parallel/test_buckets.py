"""Bucketed, overlapped all_reduces (lower/buckets.py) against one device, and the printed
program's buckets: fewer calls than gradients, each wait after its launch, launches before the
end of backward.

    python -m pytest tests/parallel/test_buckets.py -q --durations=0
"""
from __future__ import annotations

import re

import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S
from shardwise.lower.buckets import DEFAULT_BUCKET_BYTES
from shardwise.run.launch import spawn

from ..models import zoo
from .harness import assert_close, check_training, single_step
from .recipes import n_trainable

LAUNCH = re.compile(r"^\s*(bucket\d+) = \w*bucket_(?:all_reduce|reduce_scatter)\(")
WAIT = re.compile(r"= \w*wait_bucket\((bucket\d+)\)")
DATA = {"input_ids": [S(0)], "labels": [S(0)]}
MEGATRON = {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)}


def launches_and_waits(src: str):
    """{bucket: line of its launch}, {bucket: line of its wait} in a printed program."""
    launch, wait = {}, {}
    for i, line in enumerate(src.splitlines()):
        if m := LAUNCH.match(line):
            launch[m.group(1)] = i
        if m := WAIT.search(line):
            wait[m.group(1)] = i
    return launch, wait


def gpt2_dp(mesh, batch, **kwargs):
    c = zoo.gpt2(batch=batch)
    return check_training(c.model, mesh, c.example_inputs, c.example_targets, c.loss_fn, input_placements=DATA,
                          **kwargs), c.model


@pytest.mark.parametrize("bucket_bytes", [None, 4000, DEFAULT_BUCKET_BYTES], ids=["off", "small", "default"])
def test_gpt2_data_parallel_uneven_batch_threads(bucket_bytes):
    pm, model = gpt2_dp(sw.Mesh((3,), ("dp",)), 5, bucket_bytes=bucket_bytes)
    launch, wait = launches_and_waits(pm.plan.program(1))
    stats = pm.plan.stats()
    # gradients, the loss, and cross_entropy's count of targets (a program call of its own:
    # trace/microbatch.count_targets, not an all_reduce inside nll_loss)
    assert stats["collectives"] == {"all_reduce": n_trainable(model) + 2}, pm.plan.summary()
    assert stats["op_collectives"] == {}
    if bucket_bytes is None:
        assert not launch and stats["collective_calls"] == {"all_reduce": n_trainable(model) + 2}
    else:
        assert 0 < len(launch) == stats["collective_calls"]["all_reduce"] < n_trainable(model)
        assert set(wait) == set(launch) and all(wait[b] > launch[b] for b in launch)


def test_gpt2_program_buckets_launch_early_and_wait_late():
    c = zoo.gpt2(batch=4)
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, loss_fn=c.loss_fn,
                        example_targets=c.example_targets, input_placements=DATA, bucket_bytes=8000)
    src = pm.plan.program(0)
    launch, wait = launches_and_waits(src)
    grads = n_trainable(c.model)
    assert 1 < len(launch) < grads, src
    assert set(launch) == set(wait), src
    for b, at in launch.items():
        assert wait[b] > at, f"{b} waited at line {wait[b]} before its launch at line {at}"
    # overlap: buckets are in flight while backward still computes (aten ops between launch and wait)
    lines = src.splitlines()
    overlapped = [b for b in launch if any("torch.ops.aten" in ln for ln in lines[launch[b] + 1:wait[b]])]
    assert len(overlapped) > len(launch) // 2, src
    # each bucket flattens several tensors where it can: the calls are fewer than the gradients
    calls = pm.plan.stats()["collective_calls"]["all_reduce"]
    assert calls == len(launch) < pm.plan.stats()["collectives"]["all_reduce"]


def test_gpt2_fsdp_style_gradients_reduce_scattered_in_buckets_threads():
    """Matrices Shard(0) on "dp" (3 ranks, uneven rows and batch): their gradients are
    reduce-scattered, several per bucket call."""
    c = zoo.gpt2(batch=5)
    spec = {n: [S(0)] for n, p in c.model.named_parameters() if p.dim() == 2}
    pm = check_training(c.model, sw.Mesh((3,), ("dp",)), c.example_inputs, c.example_targets, c.loss_fn,
                        input_placements=DATA, param_placements=spec, lr=1e-3, optim_kwargs={"eps": 1e-6})
    src = pm.plan.program(2)
    launch, wait = launches_and_waits(src)
    assert "bucket_reduce_scatter(" in src and set(launch) == set(wait), src
    stats = pm.plan.stats()
    assert stats["collective_calls"]["reduce_scatter"] < stats["collectives"]["reduce_scatter"], src


def test_hybrid_sharded_gradients_reduce_scattered_in_buckets_before_the_end():
    """HSDP (FSDP2's 2-d mesh): matrices Shard(0) on "shard", replicated on "rep", the batch on
    both. Each gradient is reduce-scattered on "shard" then all-reduced on "rep": the chain's
    first step goes into reduce_scatter buckets launched as backward makes the gradients (it was
    left with the rest of the chain at the program's end, one call per tensor, every unsharded
    gradient alive until then), so the estimate's peak is below the unbucketed program's; the
    later steps go into buckets of their own as the first step's are waited for. Exact, on
    uneven rows and batch."""
    def mlp():
        return torch.nn.Sequential(*(torch.nn.Linear(48, 48) for _ in range(4)))

    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(6, 48), torch.randn(6, 48)
    both = {0: {"rep": S(0), "shard": S(0)}}
    spec = {n: {"shard": S(0)} for n, p in model.named_parameters() if p.dim() == 2}
    kw = {"input_placements": both, "target_placements": both, "param_placements": spec}
    mesh = sw.Mesh((2, 3), ("rep", "shard"))
    pm = check_training(model, mesh, (x,), (y,), torch.nn.functional.mse_loss, lr=1e-3, **kw)
    src = pm.plan.program(0)
    launch, wait = launches_and_waits(src)
    assert "bucket_reduce_scatter(" in src and set(launch) == set(wait), src
    assert src.count("bucket_chunk(") >= 4, src  # every weight gradient's reduce_scatter is a bucket's
    # the chains' later steps are bucketed too (a second pass over the first one's pieces), but
    # for the last gradient's, read as soon as its bucket is waited for: nothing to overlap
    unbucketed = src.count("comm_all_reduce(") + src.count("comm_reduce_scatter(")
    assert unbucketed <= 1 and src.count("bucket_all_reduce(") >= 2, src
    plain = sw.parallelize(mlp(), mesh, (x,), loss_fn=torch.nn.functional.mse_loss, example_targets=(y,),
                           bucket_bytes=None, **kw)
    for rank in pm.plan.rank_classes.reps:
        assert pm.plan.memory_estimate(rank).peak < plain.plan.memory_estimate(rank).peak


def test_gradient_gathered_before_its_reduce_scatter_is_reduced_where_made():
    """FSDP x Megatron with both dims sharding a weight's rows (dp outer): its gradient, Partial
    on "dp" and Shard(0) on "tp", reaches Shard(0) x Shard(0) by all_gather(tp) ->
    reduce_scatter(dp) -> slice(tp), which the bucket pass cannot launch asynchronously (its
    first step is a gather). The program runs that chain right after the gradient is made, as
    FSDP2's post-backward does (lower/program._reduce_where_made; it was left at the program's
    end, every such gradient unreduced until then). Exact on uneven rows."""
    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 48),
                                   torch.nn.ReLU(), torch.nn.Linear(48, 42))

    torch.manual_seed(0)
    x, y = torch.randn(6, 48), torch.randn(6, 42)
    rows = {"dp": S(0), "tp": S(0)}
    spec = {"0.weight": rows, "0.bias": rows, "2.weight": {"dp": S(0), "tp": S(1)}, "4.weight": rows,
            "4.bias": rows}
    batch = {0: {"dp": S(0)}}
    pm = check_training(mlp(), sw.Mesh((2, 2), ("dp", "tp")), (x,), (y,), torch.nn.functional.mse_loss,
                        lr=1e-3, input_placements=batch, target_placements=batch, param_placements=spec)
    for rank in range(4):
        graph = pm.plan.program_module(rank, guards=False).graph
        output = next(n for n in graph.nodes if n.op == "output")
        chains = 0
        for last in output.all_input_nodes:
            chain, x_ = [], last
            while "sw_step" in x_.meta:
                chain.append(x_)
                x_ = x_.args[0]
            steps = [n.meta["sw_step"] for n in reversed(chain) if n.meta["sw_step"].is_collective]
            if steps and steps[0].kind == "all_gather":
                chains += [s.kind for s in steps] == ["all_gather", "reduce_scatter"]
                at = x_  # the gradient, then its chain, node after node
                for n in reversed(chain):
                    assert at.next is n, (rank, last.name, n.name, at.next.name)
                    at = n
        assert chains == 2, chains  # the last layer's weight and bias (the planner's layouts make the rest)

def test_fully_sharded_mlp_prefetches_weights():
    """Every parameter Shard(0) on "dp" with a latency-free link (the planner gathers weights):
    one all_gather call per layer (weight and bias coalesced), each layer's started before the
    previous layer's is waited for (one ahead), exact."""
    x = torch.randn(33, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(33, 3, generator=torch.Generator().manual_seed(3))
    spec = {n: [S(0)] for n, _ in mlp().named_parameters()}
    pm = check_training(mlp(), sw.Mesh((3,), ("dp",)), (x,), (y,), mse, steps=2, input_placements={0: [S(0)]},
                        param_placements=spec, cost_model=sw.CostModel(latency=0.0))
    lines = pm.plan.program(1).splitlines()
    started = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"\s*(gathers\d+) = \w*start_all_gather\(", ln))}
    read = {m.group(1): i for i, ln in enumerate(lines) if (m := re.search(r"= \w*wait_gathers\((gathers\d+)\)", ln))}
    assert len(started) >= 2 and set(started) == set(read), "\n".join(lines)
    order = sorted(started, key=started.get)
    for a, b in zip(order, order[1:]):
        assert started[b] < read[a], f"{b} is not started before {a} is waited for"
    assert all(started[u] < read[u] for u in started), "\n".join(lines)
    calls = pm.plan.stats()["collective_calls"]
    assert calls["all_gather"] == len(started) < pm.plan.stats()["collectives"]["all_gather"], calls


@pytest.mark.parametrize("bucket_bytes", [64, 25 * 2**20])
def test_data_by_tensor_parallel_2x2_uneven(bucket_bytes):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    spec = {n: {"tp": p} for n, p in MEGATRON.items()}
    pm = check_training(mlp(), sw.Mesh((2, 2), ("dp", "tp")), (x,), (y,), mse, steps=2,
                        input_placements={0: [S(0), R()]}, param_placements=spec, bucket_bytes=bucket_bytes)
    launch, wait = launches_and_waits(pm.plan.program(3))
    assert launch and set(launch) == set(wait), pm.plan.program(3)


def test_bucket_bytes_checked():
    x = torch.randn(4, 6)
    for bad in (0, -1, "25MB", True):
        with pytest.raises(sw.ShardingError, match="bucket_bytes"):
            sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, bucket_bytes=bad)


# -- torch backend: two gloo processes ------------------------------------------------
mlp = zoo.seeded_mlp


def mse(out, y):
    return ((out - y) ** 2).mean()


GLOO_BUCKETS = (48, 25 * 2**20)


def _data(batch):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


def _gloo_cases():
    """(bucket_bytes, parallelize kwargs): data parallel, and FSDP-style (every parameter
    Shard(0): gradients reduce-scattered; a latency-free link so weights are gathered)."""
    fsdp = dict(param_placements={n: [S(0)] for n, _ in mlp().named_parameters()},
                cost_model=sw.CostModel(latency=0.0))
    return [(cap, {}, 5) for cap in GLOO_BUCKETS] + [(25 * 2**20, fsdp, 33)]


def _gloo_body(rank, world):
    out = []
    for cap, kwargs, batch in _gloo_cases():
        x, y = _data(batch)
        pm = sw.parallelize(mlp(), sw.Mesh((world,), ("dp",)), (x,), loss_fn=mse, backend="torch",
                            input_placements={0: [S(0)]}, bucket_bytes=cap, **kwargs)
        losses, grads = [], []
        for _ in range(2):
            pm.zero_grad()
            losses.append(pm.step(x, y))
            grads.append(pm.gradients())
        out.append({"losses": losses, "grads": grads, "program": pm.plan.program(rank)})
    return out


@pytest.mark.dist
@pytest.mark.slow  # ~30 s; tests/parallel/test_gloo.py runs bucketed programs (the default) on gloo by default
@pytest.mark.timeout(300)
def test_gloo_bucketed_data_parallel_uneven_batch():
    outs = spawn(_gloo_body, 2, 2, timeout=240)
    for rank, per_cap in enumerate(outs):
        for (cap, kwargs, batch), got in zip(_gloo_cases(), per_cap, strict=True):
            x, y = _data(batch)
            want_loss, want_grads = single_step(mlp(), (x,), (y,), mse)
            where = f"rank {rank} bucket_bytes={cap} {sorted(kwargs)}"
            launch, wait = launches_and_waits(got["program"])
            assert launch and set(launch) == set(wait), got["program"]
            if kwargs:
                assert "bucket_reduce_scatter(" in got["program"], got["program"]
                assert "start_all_gather(" in got["program"], got["program"]
            for i in range(2):
                assert_close(got["losses"][i], want_loss, f"{where} step {i} loss")
                for n, g in want_grads.items():
                    assert_close(got["grads"][i][n], g, f"{where} step {i} grad of {n}")


def _fail_at_a_bucket_wait(rank, world):
    """Rank 1 raises at its first bucket wait, with buckets still in flight on both ranks."""
    from shardwise.run import collectives

    if rank == 1:
        def broken(self):
            raise RuntimeError("deliberate failure at a bucket wait")
        collectives.Handle.wait = broken
    x, y = _data(5)
    pm = sw.parallelize(mlp(), sw.Mesh((world,), ("dp",)), (x,), loss_fn=mse, backend="torch",
                        input_placements={0: [S(0)]}, bucket_bytes=48)
    for _ in range(2):
        pm.step(x, y)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_failure_at_a_bucket_wait_names_the_rank_and_does_not_hang():
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="deliberate failure at a bucket wait") as ei:
        spawn(_fail_at_a_bucket_wait, 2, 2, timeout=60)
    assert time.monotonic() - t0 < 50
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "rank 1" in notes and "bucket" in notes, notes


class _Echo:
    """Collectives whose launches hand back the buffer as built (a one-rank stand-in)."""

    class _Handle:
        def __init__(self, t):
            self.t = t

        def wait(self):
            return self.t

    def start_all_reduce(self, t, mesh_dim, op="sum"):
        return self._Handle(t)

    def start_reduce_scatter(self, t, mesh_dim, op="sum"):
        return self._Handle(t)


def test_bucket_buffers_under_compile_are_one_cat_and_equal_eagers():
    """Under torch.compile a bucket's buffer is one cat (the eager copies into narrowed slices
    trace as slice_scatters, which inductor fuses into one loop testing every member's range per
    element: half of heavier GPT-2's compiled step); same buffer, padding of uneven chunks included."""
    from shardwise.lower.buckets import bucket_all_reduce, bucket_reduce_scatter
    from shardwise.core.scope import using

    torch.manual_seed(0)
    a, b, c = torch.randn(3, 5), torch.randn(5, 6).t(), torch.randn(7)  # b strided
    splits = ((0, (2, 1)), (1, (3, 2)), (0, (4, 3)))  # uneven chunks: padded to the largest
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def both(a, b, c):
        return (bucket_all_reduce((a, b, c), 0).wait(), bucket_reduce_scatter((a, b, c), 0, "sum", splits).wait())

    with using(_Echo(), process_wide=True):
        eager = both(a, b, c)
        torch._dynamo.reset()
        compiled = torch.compile(both, backend=capture, fullgraph=True)(a, b, c)
    torch._dynamo.reset()
    assert eager[0].shape == (15 + 30 + 7,) and eager[1].shape == (2, 2 * 5 + 6 * 3 + 4)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("cat" in t for t in targets), targets
    assert not any("copy_" in t or "slice_scatter" in t or "new_empty" in t for t in targets), targets


def test_loss_reductions_leave_the_critical_path():
    """Data parallel cross-entropy: the count of targets is all-reduced while the forward runs
    (launched before the first embedding, waited for at the loss), and the loss rides in the
    gradients' bucket (one round trip a step less than a bucket of its own: the tiny GPT-2's step
    is a few ms on gloo): the backward waits for no collective but the count's. The loss returned
    is a copy, not a view of the gradients' buffer, which a caller's reference to it would keep
    alive."""
    c = zoo.gpt2(batch=4)
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, loss_fn=c.loss_fn,
                        example_targets=c.example_targets, input_placements=DATA)
    src = pm.plan.program(0)
    lines = src.splitlines()
    launch, wait = launches_and_waits(src)
    first_op = next(i for i, ln in enumerate(lines) if "aten.embedding" in ln)
    seed = next(i for i, ln in enumerate(lines) if "aten.nll_loss_backward" in ln)
    count, grads = sorted(launch, key=launch.get)
    assert launch[count] < first_op < wait[count] < seed < launch[grads] < wait[grads], src
    assert "bucket_scalar" in src, src
    assert pm.plan.stats()["collective_calls"] == {"all_reduce": 2}, src
    assert pm.plan.stats()["op_collectives"] == {}
    pm.step(*c.example_inputs, *c.example_targets)
    out = pm.step(*c.example_inputs, *c.example_targets)
    grad = next(p.grad for p in pm.parameters() if p.grad is not None)
    assert out.untyped_storage().nbytes() == out.element_size()
    assert grad.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()


def test_bucket_buffers_hold_each_member_in_its_place():
    """The buffer a bucket launches, built by one call (cat, or a foreach copy for strided
    members): an all_reduce bucket is its members flattened end to end; a reduce_scatter bucket's
    row k is each member's k-th chunk zero-padded to the largest, block after block; and each
    member's result (bucket_piece) is its range of the reduced buffer, in the member's shape."""
    from shardwise.core.scope import using
    from shardwise.lower import buckets as B

    class Echo:  # launches nothing: the handle is the buffer the collective would be given
        def start_all_reduce(self, buf, mesh_dim, op):
            return buf

        start_reduce_scatter = start_all_reduce

    g = torch.Generator().manual_seed(0)
    strided = [torch.randn(5, 3, generator=g), torch.randn(4, 7, generator=g).t(), torch.randn(3, generator=g),
               torch.randn(0, generator=g)]
    contiguous = [torch.randn(2, 3, generator=g), torch.randn(4, generator=g)]
    with using(Echo()):
        for members in (strided, contiguous):
            flat = B.bucket_all_reduce(members, 0)
            assert torch.equal(flat, torch.cat([m.reshape(-1) for m in members]))
            off = 0
            for m in members:
                piece = B.bucket_piece(flat, off, tuple(m.shape))
                assert torch.equal(piece, m) and piece.is_contiguous() and piece.data_ptr() == flat[off:].data_ptr()
                off += m.numel()
        members = [torch.randn(5, 3, generator=g), torch.randn(4, 7, generator=g).t(), torch.randn(3, generator=g)]
        splits = [(0, (3, 2)), (1, (2, 2)), (0, (2, 1))]
        buf = B.bucket_reduce_scatter(members, 0, "sum", splits)
    rows = []
    for k in range(2):
        row = []
        for m, (d, sizes) in zip(members, splits):
            chunk = m.split(list(sizes), d)[k]
            pad = list(chunk.shape)
            pad[d] = max(sizes) - chunk.shape[d]
            row.append(torch.cat([chunk, torch.zeros(pad)], d).reshape(-1))
        rows.append(torch.cat(row))
    assert torch.equal(buf, torch.stack(rows))
