"""Random ops: sharded results must equal the single-device result for the same seed, bitwise.

verify_rule does not set rank generators, so this file has its own harness: the single-device
op runs after torch.manual_seed(s); every rank runs its local call under
``using_generator(torch.Generator().manual_seed(s))``; the collected outputs must be equal
and every rank's generator must end in the state the single device's generator ends in.
Run: python -m pytest tests/rules/test_random.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.run.shards import collect
from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, LocalCtx, OpCall, Strategy1D, load_all
from shardwise.rules.registry import expand, flatten_outputs, run_local
from shardwise.run.collectives import using_generator
from shardwise.run.threads import run_threads
from shardwise.tools.verify import lay_out

from ._rulecheck import check

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard
MESHES = ((2,), (3,), (2, 2))


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def check_random(op, *args, shard_dims=(), seeds=(0, 7), **kwargs):
    load_all()
    rule = DEFAULT.get(op)
    tried = set()
    for seed in seeds:
        torch.manual_seed(seed)
        want = flatten_outputs(op(*_clone(args), **kwargs))
        state = torch.default_generator.get_state()
        call = OpCall.from_values(op, args, kwargs, tuple(want) if len(want) > 1 else want[0])
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for shape in MESHES:
            mesh = Mesh(shape)
            for st in expand(call, rule, mesh):
                assert all(not isinstance(p, Partial) for o in st.outs if o for p in o), st
                per_input = [lay_out(t, mesh, p, torch.Generator().manual_seed(0)) for t, p in zip(tensors, st.ins)]

                def body(rank):
                    ctx = LocalCtx(call, st, mesh, rank)
                    with using_generator(torch.Generator().manual_seed(seed)) as g:
                        out = flatten_outputs(run_local(rule.local_call(ctx), [loc[rank] for loc in per_input]))
                    for i, o in enumerate(out):
                        assert list(o.shape) == ctx.local_out_shape(i), (st, rank, i)
                    return out, g.get_state()

                per_rank = run_threads(body, mesh)
                for i, w in enumerate(want):
                    got = collect([out[i] for out, _ in per_rank], mesh, st.outs[i])
                    assert got.dtype == w.dtype and torch.equal(got, w), f"{op} {st} output {i} seed {seed}"
                assert all(torch.equal(s, state) for _, s in per_rank), f"{op} {st}: generator out of step"
                if shape == (2,):
                    tried.add(st.ins[0][0] if st.ins else None)
    for d in shard_dims:
        assert S(d) in tried, f"{op}: no Shard({d}) strategy"


@pytest.mark.parametrize("shape", [(4, 6), (5, 7), (2, 3, 5), (1, 9)])
@pytest.mark.parametrize("p", [0.3, 0.5])
def test_native_dropout(shape, p):
    check_random(aten.native_dropout.default, torch.randn(shape), p, True, shard_dims=range(len(shape)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_native_dropout_dtypes(dtype):
    check_random(aten.native_dropout.default, torch.randn(5, 7).to(dtype), 0.3, True, shard_dims=(0, 1))


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_native_dropout_edge_p(p):
    check_random(aten.native_dropout.default, torch.randn(3, 5), p, True, shard_dims=(0, 1))


def test_native_dropout_eval():
    check_random(aten.native_dropout.default, torch.randn(3, 5), 0.3, False, shard_dims=(0, 1))


@pytest.mark.parametrize("shape", [(4, 6), (5, 3, 7)])
def test_bernoulli_p(shape):
    check_random(aten.bernoulli.p, torch.randn(shape), 0.3, shard_dims=range(len(shape)))
    check_random(aten.bernoulli_.float, torch.empty(shape), 0.7, shard_dims=range(len(shape)))


def test_bernoulli_tensor_probs():
    probs = torch.rand(5, 7, generator=torch.Generator().manual_seed(3))
    check_random(aten.bernoulli.default, probs, shard_dims=(0, 1))
    check_random(aten.bernoulli.default, probs.double(), shard_dims=(0, 1))


@pytest.mark.parametrize("op", [aten.rand_like.default, aten.randn_like.default])
def test_rand_like(op):
    check_random(op, torch.randn(5, 3, 2), shard_dims=(0, 1, 2))
    check_random(op, torch.randn(3, 7), dtype=torch.bfloat16, shard_dims=(0, 1))


def test_explicit_generator_is_replicate_only():
    load_all()
    x = torch.randn(4, 4)
    g = torch.Generator().manual_seed(0)
    call = OpCall.from_values(aten.bernoulli.p, (x, 0.5), {"generator": g}, x)
    assert len(DEFAULT.get(aten.bernoulli.p).strategies(call)) == 1


@pytest.mark.parametrize("shape", [(4, 6), (5, 7)])
def test_native_dropout_backward(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    _, mask = aten.native_dropout.default(x, 0.4, True)
    check(aten.native_dropout_backward.default, torch.randn(shape), mask, 1 / 0.6,
          expect=[((S(0), S(0)), (S(0),)), ((S(1), S(1)), (S(1),)), ((P, R), (P,))])


@pytest.mark.parametrize("op, args, kwargs", [
    (aten.uniform.default, (-2.0, 3.0), {}), (aten.exponential.default, (1.5,), {}),
    (aten.cauchy.default, (0.0, 2.0), {}), (aten.log_normal.default, (1.0, 0.5), {}),
    (aten.geometric.default, (0.3,), {}), (aten.random.to, (17,), {}), (getattr(aten.random, "from"), (3, 40), {}),
    (aten.random.default, (), {}), (aten.randint_like.default, (10,), {}),
    (aten.randint_like.low_dtype, (-4, 9), {"dtype": torch.int64}),
])
def test_draws_of_a_shape_equal_one_device_on_every_shard(op, args, kwargs):
    """SHAPE_DRAWS: drawn whole from the rank's stream (one device's), sliced; uneven sizes."""
    x = torch.empty(5, 3, 2) if op not in (aten.random.default,) else torch.empty(5, 3, dtype=torch.int32)
    check_random(op, x, *args, shard_dims=range(x.ndim), **kwargs)


def _draws(op_call, fallback=(), mesh=(2,), placements=None, buffer=False):
    """Loss (and the generator after it) of a small step drawing with ``op_call``, sharded and on one
    device, for two steps with the seed set before each, as a training loop does."""
    import copy

    import shardwise as sw

    class Drawing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 5))
            self.register_buffer("b", torch.zeros(5, 5))

        def forward(self, x):
            return (op_call(self, x) * self.w * x).sum()

    torch.manual_seed(0)
    model, x = Drawing(), torch.randn(5, 5)
    ref = copy.deepcopy(model)
    placements = placements or [S(0)] * len(mesh)
    extra = {"param_placements": {"b": placements}} if buffer else {}
    pm = sw.parallelize(model, sw.Mesh(mesh, ("a", "b")[:len(mesh)]), (x,), input_placements={0: placements},
                        replicate_fallback=fallback, **extra)
    for step in range(2):
        torch.manual_seed(5 + step)
        loss, after = pm.step(x), torch.rand(4)
        torch.manual_seed(5 + step)
        ref.zero_grad()
        ref_loss = ref(x)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pm.gradients()["w"], ref.w.grad, rtol=1e-5, atol=1e-5)
        pm.zero_grad()
        assert torch.equal(after, torch.rand(4)), "the generator after the step is not one device's"
    return pm


@pytest.mark.parametrize("mesh, placements", [((2,), None), ((2, 2), [S(0), S(1)])])
def test_randint_like_and_an_in_place_draw_on_a_sharded_buffer_equal_one_device(mesh, placements):
    _draws(lambda m, x: torch.randint_like(x, 10).float(), mesh=mesh, placements=placements)
    _draws(lambda m, x: m.b.uniform_() * 2, mesh=mesh, placements=placements, buffer=True)


@pytest.mark.parametrize("mesh, placements", [((2,), None), ((2, 2), [S(0), S(1)])])
def test_a_random_op_through_replicate_fallback_draws_one_devices_values(mesh, placements):
    """poisson has no rule (its draws per element depend on the rate): replicated, every rank draws the
    whole from its stream (one device's); before, each rank drew from the shared default generator: other
    numbers on each run (multinomial then, which has a rule now)."""
    pm = _draws(lambda m, x: torch.poisson(x.abs() * 3), fallback={"aten.poisson.default"}, mesh=mesh,
                placements=placements)
    assert "replicate fallback" in pm.plan.summary()


@pytest.mark.parametrize("op, args", [
    (aten.randn.default, ([5, 3],)), (aten.rand.default, ([3, 7],)), (aten.randint.default, (9, [5, 2])),
    (aten.randint.low, (-3, 9, [7],)), (aten.randperm.default, (7,)), (aten.normal.float_float, (1.5, 2.0, [5, 3])),
])
def test_random_factories_draw_whole_and_slice(op, args):
    """torch.randn(shape) and friends inside a step: the whole draw, one device's, sliced on any dim."""
    ndim = len(args[-1]) if isinstance(args[-1], list) else 1
    check_random(op, *args, shard_dims=())
    load_all()
    outs = {st.outs[0] for st in expand(OpCall.from_values(op, args, {}, op(*args)), DEFAULT.get(op), Mesh((2,)))}
    assert {(S(d),) for d in range(ndim)} <= outs, outs


@pytest.mark.parametrize("mean, std", [
    (torch.randn(5, 3), torch.rand(5, 3) + 0.1), (torch.randn(5, 1), torch.rand(3) + 0.1), (torch.randn(5, 3), 2.0),
    (1.5, torch.rand(5, 3) + 0.1),
])
def test_normal_with_tensor_mean_or_std(mean, std):
    """normal(mean, std): z * std + mean with z the whole standard-normal draw, sliced; broadcasting."""
    op = {(True, True): aten.normal.Tensor_Tensor, (True, False): aten.normal.Tensor_float,
          (False, True): aten.normal.float_Tensor}[isinstance(mean, torch.Tensor), isinstance(std, torch.Tensor)]
    check_random(op, mean, std)
    check_random(aten.normal_functional.default, torch.empty(5, 3), 0.5, 2.0, shard_dims=(0, 1))


@pytest.mark.parametrize("n, replacement", [(3, False), (1, True), (1, False)])
def test_multinomial_rows_sharded(n, replacement):
    """Without replacement (or one sample) the kernel takes the top n of probs / Exp(1): rows shard."""
    probs = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) + 0.05
    check_random(aten.multinomial.default, probs, n, replacement, shard_dims=(0,))
    check_random(aten.multinomial.default, probs[0], n, replacement)


def test_multinomial_with_replacement_is_replicated():
    probs = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) + 0.05
    check_random(aten.multinomial.default, probs, 4, True)
    load_all()
    call = OpCall.from_values(aten.multinomial.default, (probs, 4, True), {}, torch.multinomial(probs, 4, True))
    assert DEFAULT.get(aten.multinomial.default).strategies(call) == [Strategy1D((R,), (R,))]


@pytest.mark.parametrize("training", [True, False])
def test_rrelu_with_noise(training):
    """Training: a slope drawn per non-positive element in order: replicated, one device's draws.
    Eval: leaky_relu with the mean slope, pointwise."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    check_random(aten.rrelu_with_noise_functional.default, x, torch.zeros(5, 4), 0.1, 0.3, training,
                 shard_dims=() if training else (0, 1))
    torch.manual_seed(0)
    _, noise = aten.rrelu_with_noise_functional.default(x, torch.zeros(5, 4), 0.1, 0.3, True)
    check(aten.rrelu_with_noise_backward.default, torch.randn(5, 4), x, noise, 0.1, 0.3, training, False)
