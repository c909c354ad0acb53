"""nll_loss / nll_loss2d rules (forward and backward) checked numerically on meshes (2,), (3,), (2, 2).

Run: python -m pytest tests/rules/test_loss.py -q -p no:cacheprovider
"""
import pytest
import torch
import torch.nn.functional as F

from shardwise.run.shards import collect
from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, LocalCtx, OpCall, Strategy, load_all
from shardwise.rules.registry import flatten_outputs, run_local
from shardwise.run.threads import run_threads

from ._rulecheck import check

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard
NONE, MEAN, SUM = 0, 1, 2
IGN = -100


def inputs(shape, weight, ignore, dtype=torch.float32, seed=0):
    """log-probs of ``shape`` (class dim 1, or 0 for 1-d), targets with some ``ignore`` entries."""
    g = torch.Generator().manual_seed(seed)
    cd = 1 if len(shape) > 1 else 0
    x = torch.randn(shape, generator=g).log_softmax(cd).to(dtype)
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, shape[cd], tshape, generator=g)
    if t.dim():
        t.view(-1)[::3] = ignore
    w = torch.rand(shape[cd], generator=g).to(dtype) + 0.5 if weight else None
    return x, t, w


def fwd_expect(ndim, red, weight):
    w = (R,) if weight else ()
    o_batch, tw_batch = (S(0), R) if red == NONE else (P, P if red == SUM else R)
    cls = ((S(1 if ndim > 1 else 0), R) + ((S(0),) if weight else ()), (P, R if red == MEAN else P))
    out = [((P, R) + w, (P, R)), cls]
    if ndim > 1:
        out.append(((S(0), S(0)) + w, (o_batch, tw_batch)))
    if ndim == 4:
        out.append(((S(2), S(1)) + w, (S(1) if red == NONE else o_batch, tw_batch)))
    return out


def bwd_expect(ndim, red, weight):
    w = (R,) if weight else ()
    out = [((R, S(1 if ndim > 1 else 0), R) + ((S(0),) if weight else ()) + (R,), (S(1 if ndim > 1 else 0),)),
           ((P, R, R) + w + (R,), (P,))]
    if ndim > 1:
        out.append(((S(0) if red == NONE else R, S(0), S(0)) + w + (R,), (S(0),)))
    return out


def check_both(shape, red, weight, ignore=IGN, dtype=torch.float32):
    fwd, bwd = (aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default) if len(shape) == 4 else \
        (aten.nll_loss_forward.default, aten.nll_loss_backward.default)
    x, t, w = inputs(shape, weight, ignore, dtype)
    check(fwd, x, t, w, red, ignore, expect=fwd_expect(len(shape), red, weight))
    out, tw = fwd(x, t, w, red, ignore)
    g = torch.randn(out.shape).to(dtype)
    check(bwd, g, x, t, w, red, ignore, tw, expect=bwd_expect(len(shape), red, weight))


@pytest.mark.parametrize("red", [NONE, MEAN, SUM])
@pytest.mark.parametrize("shape,weight", [((5, 7), True), ((4, 4), False), ((2, 2), True), ((6,), True)])
def test_nll_loss(shape, red, weight):
    check_both(shape, red, weight)


def test_nll_loss_ignore_index_is_a_class():
    for red in (NONE, MEAN, SUM):
        check_both((5, 7), red, True, ignore=3)


@pytest.mark.parametrize("red", [NONE, MEAN, SUM])
def test_nll_loss2d(red):
    check_both((2, 3, 3, 5), red, red != SUM)


def test_nll_loss_bf16():
    check_both((5, 6), MEAN, True, dtype=torch.bfloat16)


def test_nll_loss_all_ignored_mean_is_nan_everywhere():
    x, _, w = inputs((5, 4), True, IGN)
    t = torch.full((5,), IGN)
    check(aten.nll_loss_forward.default, x, t, w, MEAN, IGN)


# -- the uneven case end to end: forward on shards, backward from the forward's local outputs ---------
def _run(op, args, st, mesh, per_input):
    """Run op's rule for strategy ``st`` on every rank; returns per-rank flattened outputs."""
    load_all()
    rule = DEFAULT.get(op)
    call = OpCall.from_values(op, args, {}, op(*args))

    def body(rank):
        lc = rule.local_call(LocalCtx(call, st, mesh, rank))
        return flatten_outputs(run_local(lc, per_input(rank)))

    return run_threads(body, mesh)


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_uneven_mean_with_weight_and_ignore_index_loss_and_grad_exact(n_ranks):
    """N=5 over 2 or 3 ranks, a different number of ignored targets on each shard."""
    mesh = Mesh((n_ranks,))
    x, _, w = inputs((5, 4), True, IGN)
    t = torch.tensor([IGN, 1, IGN, 3, 0])  # shards 2 ranks: [2, 0] ignored; 3 ranks: [1, 1, 0]
    xg = x.clone().requires_grad_()
    loss = F.nll_loss(xg, t, weight=w, ignore_index=IGN)
    loss.backward()
    xs, ts = list(torch.chunk(x, n_ranks)), list(torch.chunk(t, n_ranks))
    xs += [x[:0]] * (n_ranks - len(xs))
    ts += [t[:0]] * (n_ranks - len(ts))
    fwd_st = Strategy(((P,), (R,)), ((S(0),), (S(0),), (R,)))
    outs = _run(aten.nll_loss_forward.default, (x, t, w, MEAN, IGN), fwd_st, mesh, lambda r: [xs[r], ts[r], w])
    got_loss = collect([o[0] for o in outs], mesh, [P])
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-6, atol=1e-7)
    tw = outs[0][1]
    assert all(torch.equal(o[1], tw) for o in outs) and float(tw) == float(w[t[t != IGN]].sum())
    bwd_st = Strategy(((S(0),),), ((R,), (S(0),), (S(0),), (R,), (R,)))
    one = torch.tensor(1.0)
    grads = _run(aten.nll_loss_backward.default, (one, x, t, w, MEAN, IGN, tw), bwd_st, mesh,
                 lambda r: [one, xs[r], ts[r], w, outs[r][1]])
    torch.testing.assert_close(collect([g[0] for g in grads], mesh, [S(0)]), xg.grad, rtol=0, atol=0)


# -- mse_loss ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("red", [NONE, MEAN, SUM])
@pytest.mark.parametrize("xs,ts", [((5, 7), (5, 7)), ((4, 6), (4, 6)), ((3, 5), (5,)), ((2, 1, 3), (2, 1, 3))])
def test_mse_loss(xs, ts, red):
    x, t = torch.randn(xs), torch.randn(ts)
    t_last = S(len(ts) - 1)
    if red == NONE:
        expect = [((S(0), S(0) if len(ts) == len(xs) else R), (S(0),)), ((S(len(xs) - 1), t_last), (S(len(xs) - 1),))]
    else:
        expect = [((S(0), S(0) if len(ts) == len(xs) else R), (P,)), ((S(len(xs) - 1), t_last), (P,))]
    check(aten.mse_loss.default, x, t, red, expect=expect)
    out = aten.mse_loss.default(x, t, red)
    g = torch.randn(out.shape)
    g_s = lambda d: (S(d),) if red == NONE else (R,)  # noqa: E731
    check(aten.mse_loss_backward.default, g, x, t, red,
          expect=[(g_s(0) + (S(0), S(0) if len(ts) == len(xs) else R), (S(0),)),
                  ((P, R, R), (P,)), ((R, P, P), (P,))])


def test_mse_loss_bf16():
    x, t = torch.randn(5, 3).bfloat16(), torch.randn(5, 3).bfloat16()
    check(aten.mse_loss.default, x, t, MEAN, expect=[((S(0), S(0)), (P,))])
    check(aten.mse_loss_backward.default, torch.tensor(1.0).bfloat16(), x, t, MEAN,
          expect=[((R, S(1), S(1)), (S(1),))])


def test_nll_loss_mean_local_call_runs_on_meta_without_collectives():
    from shardwise.rules.registry import expand, local_shapes_match
    load_all()
    x, t, w = inputs((5, 4), True, IGN)
    op = aten.nll_loss_forward.default
    call = OpCall.from_values(op, (x, t, w, MEAN, IGN), {}, op(x, t, w, MEAN, IGN))
    for shape in ((2,), (3,), (2, 2)):
        sts = expand(call, DEFAULT.get(op), Mesh(shape))
        assert all(local_shapes_match(call, DEFAULT.get(op), st, Mesh(shape)) for st in sts)
