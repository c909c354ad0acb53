"""Reduction, norm-of-vector, cumsum, sort and topk rules checked numerically on meshes
(2,), (3,), (2, 2), with even and uneven sizes (dims of 5 and 7, a dim smaller than the mesh).

Run: python -m pytest tests/rules/test_reduction.py -q -p no:cacheprovider
"""
import math

import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.tools.verify import verify_rule

from ._rulecheck import check, strategies_1d

aten = torch.ops.aten
R, P = Replicate(), Partial()
PMAX, PMIN = Partial("max"), Partial("min")
S = Shard




def rnd(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


# -- sum / mean ----------------------------------------------------------------------------
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, -2])
def test_mean_over_sharded_dim_of_5(keepdim, dim):
    """The issue's case: mean over a dim of 5 sharded on 2 and 3 ranks is a Partial sum / 5."""
    rep = check(aten.mean.dim, rnd(5, 3), [dim], keepdim,
                expect=[((S(0),), (P,)), ((S(1),), (S(1 if keepdim else 0),)), ((P,), (P,)), ((R,), (R,))])
    for mesh in ((2,), (3,)):
        (r,) = [r for r in rep.results if r.mesh == mesh and r.strategy.ins == ((S(0),),)]
        assert r.ok and r.strategy.outs == ((P,),)


@pytest.mark.parametrize("dim", [None, []])
def test_mean_dim_none_or_empty_means_all(dim):
    check(aten.mean.dim, rnd(5, 7), dim, expect=[((S(0),), (P,)), ((S(1),), (P,)), ((P,), (P,))])


def test_mean_keepdim_all_and_negative_multi():
    check(aten.mean.dim, rnd(5, 2, 3), [-1, 0], True, expect=[((S(0),), (P,)), ((S(2),), (P,)), ((S(1),), (S(1),))])


def test_mean_default_and_bf16():
    check(aten.mean.default, rnd(7, 3), expect=[((S(0),), (P,)), ((S(1),), (P,))])
    check(aten.mean.dim, rnd(5, 3, dtype=torch.bfloat16), [0], expect=[((S(0),), (P,)), ((S(1),), (S(0),))])


def test_mean_dtype_kwarg():
    # Downcast: the verifier's tolerance follows the output dtype, and Partial input parts are
    # only as exact as the input dtype, so an upcast would be judged too strictly.
    check(aten.mean.dim, rnd(5, 3, dtype=torch.float64), [0], dtype=torch.float32, expect=[((S(0),), (P,))])


@pytest.mark.parametrize("dim,keepdim", [([1], False), ([0, 2], False), ([-1], True), ([], False)])
def test_sum_dim(dim, keepdim):
    x = rnd(5, 3, 7)
    kept = [d for d in range(3) if d not in [d % 3 for d in dim]] if dim else []
    expect = [((S(d),), (S(d if keepdim else kept.index(d)),)) for d in kept]
    expect += [((S(d),), (P,)) for d in range(3) if d not in kept] + [((P,), (P,))]
    check(aten.sum.dim_IntList, x, dim, keepdim, expect=expect)


def test_sum_default_int_and_bf16():
    check(aten.sum.default, torch.randint(-5, 5, (5, 2)), expect=[((S(0),), (P,)), ((S(1),), (P,)), ((P,), (P,))])
    check(aten.sum.default, rnd(7, 3, dtype=torch.bfloat16), expect=[((S(0),), (P,))])
    check(aten.sum.dim_IntList, rnd(2, 5, dtype=torch.float64), [1], dtype=torch.float32,
          expect=[((S(1),), (P,)), ((S(0),), (S(0),))])


def test_sum_zero_dim():
    check(aten.sum.default, rnd(), expect=[((P,), (P,))])


# -- max / min -----------------------------------------------------------------------------
@pytest.mark.parametrize("op,pp", [(aten.amax.default, PMAX), (aten.amin.default, PMIN)])
@pytest.mark.parametrize("shape,dim,keepdim", [((5, 3), [0], False), ((2, 7), [-2], True), ((5, 2, 3), [], False)])
def test_amax_amin(op, pp, shape, dim, keepdim):
    """A dim of 2 on 3 ranks leaves one shard empty: it contributes the identity of max/min."""
    red = [d % len(shape) for d in dim] if dim else list(range(len(shape)))
    expect = [((S(d),), (pp,)) for d in red] + [((pp,), (pp,))]
    kept = [d for d in range(len(shape)) if d not in red]
    expect += [((S(d),), (S(d if keepdim else kept.index(d)),)) for d in kept]
    check(op, rnd(*shape), dim, keepdim, expect=expect, absent=[((P,), (P,))])


def test_amax_int_and_bf16():
    check(aten.amax.default, torch.randint(-9, 9, (2, 5)), [0], expect=[((S(0),), (PMAX,))])
    check(aten.amin.default, rnd(5, 3, dtype=torch.bfloat16), [1], expect=[((S(1),), (PMIN,)), ((S(0),), (S(0),))])


@pytest.mark.parametrize("op,pp", [(aten.max.default, PMAX), (aten.min.default, PMIN)])
def test_max_min_all(op, pp):
    check(op, rnd(2, 5), expect=[((S(0),), (pp,)), ((S(1),), (pp,)), ((pp,), (pp,))])


@pytest.mark.parametrize("op", [aten.max.dim, aten.min.dim])
@pytest.mark.parametrize("dim,keepdim", [(1, False), (-3, True)])
def test_max_min_dim_shards_only_kept_dims(op, dim, keepdim):
    red = dim % 3
    kept = [d for d in range(3) if d != red]
    expect = [((S(d),), (S(d if keepdim else kept.index(d)),) * 2) for d in kept]
    absent = [((S(red),), (PMAX, PMAX)), ((S(red),), (PMIN, PMIN))]
    check(op, rnd(5, 7, 2), dim, keepdim, expect=expect, absent=absent)


@pytest.mark.parametrize("op", [aten.argmax.default, aten.argmin.default])
def test_argmax_argmin(op):
    check(op, rnd(5, 7), 1, expect=[((S(0),), (S(0),))], absent=[((S(1),), (PMAX,))])
    check(op, rnd(5, 7), -2, True, expect=[((S(1),), (S(1),))])
    check(op, rnd(5, 3), expect=[((R,), (R,))])  # dim=None: flattened, replicate only


# -- ops that only shard kept dims ---------------------------------------------------------
def test_prod():
    check(aten.prod.dim_int, rnd(5, 3), 0, expect=[((S(1),), (S(0),))], absent=[((S(0),), (P,))])
    check(aten.prod.dim_int, rnd(3, 5), -1, True, expect=[((S(0),), (S(0),))])
    check(aten.prod.default, rnd(3, 2), expect=[((R,), (R,))])


@pytest.mark.parametrize("name", ["all", "any"])
def test_all_any(name):
    x = torch.rand(5, 3, 2) > 0.3
    check(getattr(aten, name).dim, x, 1, expect=[((S(0),), (S(0),)), ((S(2),), (S(1),))])
    check(getattr(aten, name).dims, x, [0, -1], True, expect=[((S(1),), (S(1),))])
    check(getattr(aten, name).dims, x, [], expect=[((S(0),), (S(0),)), ((S(2),), (S(2),))])  # [] reduces nothing
    check(getattr(aten, name).default, x, expect=[((R,), (R,))])


@pytest.mark.parametrize("name", ["std", "var"])
def test_std_var(name):
    packet = getattr(aten, name)
    check(packet.correction, rnd(5, 7), [1], correction=0, expect=[((S(0),), (S(0),))], absent=[((S(1),), (P,))])
    check(packet.correction, rnd(5, 3, 2), [0, 2], keepdim=True, expect=[((S(1),), (S(1),))])
    check(packet.dim, rnd(3, 5), [-1], False, True, expect=[((S(0),), (S(0),))])
    check(packet.default, rnd(3, 5), expect=[((R,), (R,))])


@pytest.mark.parametrize("name", ["var_mean", "std_mean"])
def test_var_mean(name):
    check(getattr(aten, name).correction, rnd(5, 7), [0], expect=[((S(1),), (S(0), S(0)))])
    check(getattr(aten, name).dim, rnd(7, 2, 3), [1], True, True, expect=[((S(2),), (S(2), S(2)))])
    check(getattr(aten, name).default, rnd(3, 5), expect=[((R,), (R, R))])


def test_logsumexp():
    check(aten.logsumexp.default, rnd(5, 7), [1], expect=[((S(0),), (S(0),))], absent=[((S(1),), (P,))])
    check(aten.logsumexp.default, rnd(3, 5, 2), [-2], True, expect=[((S(0),), (S(0),)), ((S(2),), (S(2),))])


def test_nansum():
    x = rnd(5, 3)
    x[1, 2] = float("nan")
    check(aten.nansum.default, x, [0], expect=[((S(0),), (P,)), ((S(1),), (S(0),))], absent=[((P,), (P,))])
    check(aten.nansum.default, x, expect=[((S(0),), (P,)), ((S(1),), (P,))])


@pytest.mark.parametrize("name", ["median", "nanmedian"])
def test_median(name):
    check(getattr(aten, name).dim, rnd(5, 7), -1, expect=[((S(0),), (S(0), S(0)))], absent=[((S(1),), (P, P))])
    check(getattr(aten, name).default, rnd(5, 3), expect=[((R,), (R,))])


def test_mode_kthvalue():
    x = torch.randint(0, 3, (5, 7)).float()
    check(aten.mode.default, x, expect=[((S(0),), (S(0), S(0)))], absent=[((S(1),), (S(1), S(1)))])  # dim=-1
    check(aten.mode.default, x, 0, True, expect=[((S(1),), (S(1), S(1)))])
    check(aten.kthvalue.default, rnd(5, 7), 2, expect=[((S(0),), (S(0), S(0)))])  # dim=-1
    check(aten.kthvalue.default, rnd(5, 7, 2), 3, 0, True, expect=[((S(1),), (S(1), S(1))), ((S(2),), (S(2), S(2)))])


def test_cumsum():
    check(aten.cumsum.default, rnd(5, 7), 1, expect=[((S(0),), (S(0),)), ((P,), (P,))], absent=[((S(1),), (S(1),))])
    check(aten.cumsum.default, rnd(2, 5, 3, dtype=torch.float64), -2, dtype=torch.float32,
          expect=[((S(2),), (S(2),)), ((S(0),), (S(0),))])


@pytest.mark.parametrize("op", [aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
                                aten.cummin.default])
def test_other_scans(op):
    n = 2 if op in (aten.cummax.default, aten.cummin.default) else 1
    check(op, rnd(5, 7), -1, expect=[((S(0),), (S(0),) * n)], absent=[((S(1),), (S(1),) * n), ((P,), (P,) * n)])


# -- vector norms --------------------------------------------------------------------------
@pytest.mark.parametrize("ord,pp", [(2, None), (1, P), (0, P), (math.inf, PMAX), (-math.inf, PMIN), (3.0, None)])
def test_linalg_vector_norm(ord, pp):
    x = rnd(5, 2)
    x[0, 0] = 0.0  # ord=0 counts nonzeros
    expect = [((S(1),), (S(0),))] + ([((S(0),), (pp,))] if pp else [])
    check(aten.linalg_vector_norm.default, x, ord, [0], expect=expect)
    if pp:  # all dims, one of them smaller than the mesh
        check(aten.linalg_vector_norm.default, x, ord, expect=[((S(0),), (pp,)), ((S(1),), (pp,))])


def test_linalg_vector_norm_keepdim_dtype():
    check(aten.linalg_vector_norm.default, rnd(5, 3, dtype=torch.bfloat16), math.inf, [-2], True,
          dtype=torch.float32, expect=[((S(0),), (PMAX,)), ((S(1),), (S(1),))])


@pytest.mark.parametrize("op,args", [(aten.norm.Scalar, ()), (aten.norm.ScalarOpt_dim, ([0],)),
                                     (aten.norm.ScalarOpt_dim, ([-1], True))])
@pytest.mark.parametrize("p,pp", [(None, None), (1, P), (math.inf, PMAX)])
def test_norm_scalar(op, args, p, pp):
    x = rnd(2, 5)
    if op == aten.norm.Scalar:
        if p is None:
            return
        check(op, x, p, expect=[((S(0),), (pp,)), ((S(1),), (pp,))] if pp else [((R,), (R,))])
        return
    d = args[0][0] % 2
    expect = [((S(1 - d),), (S(1 - d if len(args) > 1 else 0),))] + ([((S(d),), (pp,))] if pp else [])
    check(op, x, p, *args, expect=expect)


def test_norm_scalaropt_dim_dtype():
    check(aten.norm.ScalarOpt_dim_dtype, rnd(5, 3, dtype=torch.bfloat16), math.inf, [0], False, dtype=torch.float32,
          expect=[((S(0),), (PMAX,)), ((S(1),), (S(0),))])


def test_powsum():
    check(aten.linalg__powsum.default, rnd(5, 2), 3, [0], expect=[((S(0),), (P,)), ((S(1),), (S(0),))],
          absent=[((P,), (P,))])
    check(aten.linalg__powsum.default, rnd(5, 2), 2, expect=[((S(0),), (P,)), ((S(1),), (P,))])


@pytest.mark.parametrize("op,args,pp", [(aten._foreach_powsum.Scalar, (2,), P), (aten._foreach_max.default, (), PMAX)])
def test_foreach_powsum_max(op, args, pp):
    ts = [rnd(5, 3), rnd(7), rnd(2, 2)]
    check(op, ts, *args, expect=[((S(0), S(0), S(0)), (pp, pp, pp)), ((S(1), R, S(1)), (pp, R, pp))])


@pytest.mark.parametrize("ord,pp", [(2, None), (1, P), (math.inf, PMAX)])
def test_foreach_norm(ord, pp):
    ts = [rnd(5, 3), rnd(7), rnd(2, 2)]
    expect = [((R, R, R), (R, R, R))]
    if pp:
        expect += [((S(0), S(0), S(0)), (pp, pp, pp)), ((S(1), R, S(1)), (pp, R, pp))]
    check(aten._foreach_norm.Scalar, ts, ord, expect=expect)


# -- sort / topk ---------------------------------------------------------------------------
def test_sort():
    check(aten.sort.default, rnd(5, 7), expect=[((S(0),), (S(0), S(0)))], absent=[((S(1),), (S(1), S(1)))])
    check(aten.sort.default, rnd(5, 7, 2), 1, True, expect=[((S(0),), (S(0), S(0))), ((S(2),), (S(2), S(2)))])
    check(aten.sort.stable, rnd(7, 3), stable=True, dim=-2, expect=[((S(1),), (S(1), S(1)))],
          absent=[((S(0),), (S(0), S(0)))])


def test_topk():
    check(aten.topk.default, rnd(5, 7), 3, expect=[((S(0),), (S(0), S(0)))], absent=[((S(1),), (S(1), S(1)))])
    check(aten.topk.default, rnd(7, 2, 3), 2, 0, False, expect=[((S(1),), (S(1), S(1))), ((S(2),), (S(2), S(2)))])
    check(aten.topk.default, rnd(5, 6, dtype=torch.bfloat16), 2, expect=[((S(0),), (S(0), S(0)))])
