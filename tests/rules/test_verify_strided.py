"""The rule verifier feeds every strategy the strided views the program slices (issue 9), as
well as contiguous locals: a kernel that reads an input as contiguous without checking is
caught, and the failure says that only the strided views fail.

    python -m pytest tests/rules/test_verify_strided.py -q
"""
import torch

from shardwise.core.layout import Shard
from shardwise.rules import Registry
from shardwise.rules.norm import BACKWARD, backward_strategies
from shardwise.rules.pointwise import _with
from shardwise.rules.registry import LocalCall
from shardwise.tools.verify import STRIDED, verify_rule

aten = torch.ops.aten
S = Shard


def rnd(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def _layer_norm_backward_sample(shape=(4, 6, 3)):
    x, w, b = rnd(*shape), rnd(shape[-1]), rnd(shape[-1]) + 1
    out, mean, rstd = aten.native_layer_norm.default(x, [shape[-1]], w, b, 1e-5)
    return rnd(*out.shape), x, [shape[-1]], mean, rstd, w, b, [True, True, True]


def test_verifier_feeds_the_strided_views_the_program_slices():
    """The raw layer-norm backward kernel (mean/rstd read as contiguous rows) passes on
    contiguous locals but fails on the program's strided views of a non-leading dim, and the
    verifier says so; the rule's local call (contiguous statistics) passes both."""
    op = aten.native_layer_norm_backward.default
    raw = Registry()
    raw.register(op, backward_strategies(*BACKWARD[op]))  # the op itself as local call
    report = verify_rule(op, *_layer_norm_backward_sample(), registry=raw)
    bad = report.failures
    assert bad and all(f.error.startswith(STRIDED) for f in bad), report
    assert all(any(isinstance(p, Shard) and (p.dim > 0 or p.groups > 1) for p in f.strategy.ins[0]) for f in bad)
    assert any(r.ok and r.strategy.ins[0] == (S(0),) for r in report.results)  # leading-dim chunks are contiguous
    assert verify_rule(op, *_layer_norm_backward_sample()).ok


def _contiguous_only_mul(a, b):
    if not (a.is_contiguous() and b.is_contiguous()):
        raise RuntimeError("this kernel needs contiguous inputs")
    return a * b


def test_a_crash_on_strided_views_only_is_named_so():
    reg = Registry()
    reg.register(aten.mul.Tensor, _with("one"), local=lambda ctx: LocalCall(_contiguous_only_mul, ctx.call.args, {}))
    report = verify_rule(aten.mul.Tensor, rnd(4, 5), rnd(4, 5), registry=reg)
    bad = report.failures
    assert bad and all(f.error.startswith(STRIDED) and "needs contiguous" in f.error for f in bad), report
    # sharded on dim 0 only: every local chunk is contiguous, nothing to fail
    assert all(r.ok for r in report.results if all(ps in ((S(0),), (S(0), S(0))) for ps in r.strategy.ins))
    assert all(any(isinstance(p, Shard) and (p.dim > 0 or p.groups > 1) for ps in f.strategy.ins for p in ps)
               for f in bad)


def test_the_sweep_lists_kernels_wrong_on_strided_inputs_only():
    from shardwise.tools.verify.samples import Sample
    from shardwise.tools.verify.sweep import sweep

    op = aten.native_layer_norm_backward.default
    raw = Registry()
    raw.register(op, backward_strategies(*BACKWARD[op]))
    report = sweep(registry=raw, samples={op: [Sample(op, _layer_norm_backward_sample())]})
    assert not report.ok and report.strided_only == [op]
    assert f"WRONG ON STRIDED LOCAL INPUTS ONLY: {op}" in report.failure_text()
