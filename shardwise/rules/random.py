"""Random ops whose sharded result equals the single-device result for the same seed.

Every rank draws the FULL-shape random tensor from its rank generator
(``scope.rank_generator()``: it starts from the state the single-device run would
have) with exactly the call the single-device kernel makes, then keeps its own slice (the
output layout's shard bounds). Draws consume the generator identically on every rank, so
later random ops stay in step too. Any dim may be sharded; Partial is never offered.
The cost is a full-size draw per rank, the price of bitwise equality with one device.

Kernel facts (torch 2.13 CPU, checked in tests/rules/test_random.py):
- native_dropout(x, p, train=True) = (x * (mask.to(x.dtype) * (1 / (1 - p))), mask) with
  ``mask = empty(x.shape, bool).bernoulli_(1 - p)`` (scale 0 when p == 1).
- bernoulli.p(x, p) = empty_like(x).bernoulli_(p); bernoulli(x) draws one number per
  element whatever its probability, so the full draw may use zero probabilities outside
  the local slice; rand_like/randn_like = rand/randn of the full shape.

The draws that depend only on their input's shape (uniform, exponential, cauchy, log_normal,
geometric, random, randint_like: what in-place ``x.uniform_()`` becomes once functional) are drawn
whole the same way (SHAPE_DRAWS). Random ops without a rule run replicated through
``replicate_fallback`` draw whole from the rank's stream too (``replicated_local``): every rank
holds one device's values and the streams stay in step.

Also here: bernoulli_.float (F.dropout on CPU traces to empty_like + bernoulli_.float +
div_ under plain make_fx) and native_dropout_backward (pointwise, linear in grad). An
explicit ``generator=`` argument (one object all ranks would share) gets Replicate only.
"""
from __future__ import annotations

import torch

from ..core import scope
from .common import R, pointwise_strategies, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D
from ..core.layout import Shard

aten = torch.ops.aten


def _generator():
    """The rank's generator; None (the default generator) outside a sharded run, and while a
    compiled program runs (run/compiled.py makes the rank's stream the default one there:
    torch.compile takes no Generator argument)."""
    return scope.rank_generator()


def _local_slice_view(full: torch.Tensor, bounds) -> torch.Tensor:
    for d, (off, n) in enumerate(bounds):
        full = full.narrow(d, off, n)
    return full


def _local_slice(full: torch.Tensor, bounds) -> torch.Tensor:
    return _local_slice_view(full, bounds).contiguous()


def random_strategies(call: OpCall) -> list[Strategy1D]:
    """Shard any dim of the (same-shape) input and outputs; never Partial."""
    out = [replicate_all(call)]
    x = call.ins[0]
    for d in range(x.ndim):
        out.append(Strategy1D(tuple(None if o is None else Shard(d) for o in call.outs),
                              (Shard(d),) + (R,) * (len(call.ins) - 1)))
    return out


def dropout_full_draw(x, p: float, full_shape, bounds):
    """native_dropout(x, p, train=True) on a shard: the full mask drawn as one device would."""
    mask = torch.empty(full_shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p, generator=_generator())
    mask = _local_slice(mask, bounds)
    scale = 0.0 if 1.0 - p == 0 else 1.0 / (1.0 - p)
    return x * (mask.to(x.dtype) * scale), mask


def dropout_eval(x):
    """native_dropout(x, p, train=False) on a shard, also when the shard is empty."""
    return x.clone(), torch.ones_like(x, dtype=torch.bool)


def bernoulli_p_full_draw(x, p: float, full_shape, bounds):
    """bernoulli.p: a full-shape draw, sliced."""
    full = torch.empty(full_shape, dtype=x.dtype, device=x.device).bernoulli_(p, generator=_generator())
    return _local_slice(full, bounds)


def bernoulli_p_inplace_full_draw(x, p: float, full_shape, bounds):
    """bernoulli_.float: the full draw, its slice written into the local tensor."""
    return x.copy_(bernoulli_p_full_draw(x, p, full_shape, bounds))


def bernoulli_full_draw(probs, full_shape, bounds):
    """bernoulli(probs): local probabilities placed in a zero full tensor, one draw per element."""
    full = torch.zeros(full_shape, dtype=probs.dtype, device=probs.device)
    _local_slice_view(full, bounds).copy_(probs)
    return _local_slice(torch.bernoulli(full, generator=_generator()), bounds)


def rand_like_full_draw(x, full_shape, bounds, normal: bool, dtype):
    """rand_like / randn_like: the full draw, sliced."""
    draw = torch.randn if normal else torch.rand
    return _local_slice(draw(full_shape, dtype=dtype, device=x.device, generator=_generator()), bounds)


def _bounds(ctx: LocalCtx):
    lay = ctx.out_layout(0)
    return lay.shape, lay.shard_bounds(ctx.mesh, ctx.rank)


def dropout_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    x, p, train = call.args[0], call.arg(1, "p"), call.arg(2, "train", None)
    if call.ins[0].numel == 0:  # returns (input, empty_like(input)): nothing drawn, every shard empty
        return LocalCall(call.op, call.args, call.kwargs)
    if train is False:  # not the op: on an empty shard it would return a mask of x's dtype
        return LocalCall(dropout_eval, (x,), {})
    return LocalCall(dropout_full_draw, (x, p, *_bounds(ctx)), {})


def bernoulli_p_local(ctx: LocalCtx) -> LocalCall:
    fn = bernoulli_p_inplace_full_draw if ctx.call.op is aten.bernoulli_.float else bernoulli_p_full_draw
    return LocalCall(fn, (ctx.call.args[0], ctx.call.arg(1, "p", 0.5), *_bounds(ctx)), {})


def bernoulli_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(bernoulli_full_draw, (ctx.call.args[0], *_bounds(ctx)), {})


def rand_like_local(ctx: LocalCtx) -> LocalCall:
    normal = ctx.call.op is aten.randn_like.default
    return LocalCall(rand_like_full_draw, (ctx.call.args[0], *_bounds(ctx), normal, ctx.call.outs[0].dtype), {})


# Draws whose values depend only on their input's shape and dtype (and numbers): drawn whole, sliced.
# op -> the overload that takes ``generator=`` (randint_like's plain overloads have none).
SHAPE_DRAWS = {
    aten.uniform.default: aten.uniform.default, aten.exponential.default: aten.exponential.default,
    aten.cauchy.default: aten.cauchy.default, aten.log_normal.default: aten.log_normal.default,
    aten.geometric.default: aten.geometric.default, aten.random.default: aten.random.default,
    aten.random.to: aten.random.to, getattr(aten.random, "from"): getattr(aten.random, "from"),
    aten.randint_like.default: aten.randint_like.generator, aten.normal_functional.default: aten.normal_functional.default,
    aten.randint_like.low_dtype: aten.randint_like.low_generator_dtype,
}


def shape_draw_full(op, x, rest: tuple, kwargs: dict, full_shape, bounds):
    """``op`` drawn on a full-shape tensor of ``x``'s dtype, as one device would, sliced to this rank."""
    full = torch.empty(full_shape, dtype=x.dtype, device=x.device)
    return _local_slice(SHAPE_DRAWS[op](full, *rest, **kwargs, generator=_generator()), bounds)


def shape_draw_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    return LocalCall(shape_draw_full, (call.op, call.args[0], tuple(call.args[1:]), dict(call.kwargs), *_bounds(ctx)), {})


_STREAM_LOCK = __import__("threading").Lock()


def replicated_draw(op, *args, **kwargs):
    """A random op run replicated (replicate_fallback): every rank draws the whole tensor from its
    stream (one device's), so every rank holds one device's values and the streams stay in step.
    An op without a ``generator=`` argument draws from the default generator, which holds the rank's
    stream for the call (under a lock: the threads backend's ranks share the default generator)."""
    gen = _generator()
    if gen is None:
        return op(*args, **kwargs)
    if any(a.name == "generator" for a in op._schema.arguments):
        return op(*args, **kwargs, generator=gen)
    with _STREAM_LOCK:
        saved = torch.random.get_rng_state()
        torch.random.set_rng_state(gen.get_state())
        try:
            return op(*args, **kwargs)
        finally:
            gen.set_state(torch.random.get_rng_state())
            torch.random.set_rng_state(saved)


def replicated_local(ctx: LocalCtx) -> LocalCall:
    """The local call of a replicated op: a seeded one through ``replicated_draw``."""
    call = ctx.call
    if torch.Tag.nondeterministic_seeded in getattr(call.op, "tags", ()) and call.kwargs.get("generator") is None:
        return LocalCall(replicated_draw, (call.op, *call.args), dict(call.kwargs))
    return LocalCall(call.op, call.args, call.kwargs)


def _no_generator(strategies, local):
    """With an explicit generator argument (one object every rank would share) only Replicate,
    each rank running the op itself with that generator."""
    def strat(call: OpCall):
        return [replicate_all(call)] if call.kwargs.get("generator") is not None else strategies(call)

    def loc(ctx: LocalCtx) -> LocalCall:
        if ctx.call.kwargs.get("generator") is not None:
            return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
        return local(ctx)

    strat.__name__ = strategies.__name__
    return dict(strategies=strat, local=loc, blockwise=False)


# Factories that draw (no tensor input): drawn whole with the overload that takes ``generator=``, sliced.
FACTORY_DRAWS = {
    aten.rand.default: aten.rand.generator, aten.randn.default: aten.randn.generator,
    aten.randint.default: aten.randint.generator, aten.randint.low: aten.randint.low_generator,
    aten.randperm.default: aten.randperm.generator, aten.normal.float_float: aten.normal.float_float,
}


def factory_draw_full(op, args: tuple, kwargs: dict, bounds):
    """A random factory called with its global size, as one device would, sliced to this rank."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    return _local_slice(FACTORY_DRAWS[op](*args, **kwargs, generator=_generator()), bounds)


def factory_draw_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(factory_draw_full, (ctx.call.op, tuple(ctx.call.args), dict(ctx.call.kwargs), _bounds(ctx)[1]), {})


def normal_full_draw(mean, std, full_shape, bounds):
    """normal(mean, std) with a tensor mean or std: the CPU kernel draws a standard normal of the
    output's shape and computes ``z * std + mean``; the local mean / std are the output's pieces
    (broadcast as the output is), so the slice of the full draw finishes the same way."""
    z = torch.empty(full_shape, dtype=_dtype_of(mean, std), device=_device_of(mean, std))
    z = _local_slice(z.normal_(0.0, 1.0, generator=_generator()), bounds)
    return z.mul_(std).add_(mean)


def _dtype_of(*xs):
    return next(x.dtype for x in xs if isinstance(x, torch.Tensor))


def _device_of(*xs):
    return next(x.device for x in xs if isinstance(x, torch.Tensor))


def normal_tensor_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    return LocalCall(normal_full_draw, (call.arg(0, "mean"), call.arg(1, "std", 1.0), *_bounds(ctx)), {})


def normal_tensor_strategies(call: OpCall) -> list[Strategy1D]:
    """Any output dim sharded, mean and std following by broadcasting; never Partial."""
    return pointwise_strategies(call)


def multinomial_strategies(call: OpCall) -> list[Strategy1D]:
    """Rows of a 2-d ``probs`` sharded where the kernel draws one Exp(1) per probability and takes
    the top k of ``probs / q`` (without replacement, or one sample): a row needs only its own draws.
    With replacement and several samples the kernel draws row after row: replicated."""
    out = [replicate_all(call)]
    n, replacement = call.arg(1, "num_samples"), call.arg(2, "replacement", False)
    if call.ins[0].ndim == 2 and (not replacement or n == 1):
        out.append(Strategy1D((Shard(0),), (Shard(0),)))
    return out


def multinomial_rows(probs, n: int, full_shape, bounds):
    """multinomial on a block of rows: the full Exp(1) draw of ``probs``' shape, sliced, as the kernel
    does it (``q = probs / q``; argmax for one sample, else topk)."""
    q = torch.empty(full_shape, dtype=probs.dtype, device=probs.device).exponential_(1, generator=_generator())
    q = torch.div(probs, _local_slice(q, bounds))
    return torch.argmax(q, dim=-1, keepdim=True) if n == 1 else torch.topk(q, n).indices


def multinomial_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    if not any(isinstance(p, Shard) for p in ctx.strategy.ins[0]):
        return replicated_local(ctx)
    lay = ctx.in_layout(0)
    return LocalCall(multinomial_rows, (call.args[0], call.arg(1, "num_samples"), lay.shape,
                                        lay.shard_bounds(ctx.mesh, ctx.rank)), {})


def rrelu_strategies(call: OpCall) -> list[Strategy1D]:
    """rrelu_with_noise in training draws a slope only for each non-positive element, in order, so
    where a piece's draws start depends on the signs before it: replicated, drawing as one device
    (``replicated_local``). Out of training it is leaky_relu with the mean slope: pointwise."""
    return [replicate_all(call)] if call.arg(4, "training", False) else pointwise_strategies(call)


def rrelu_local(ctx: LocalCtx) -> LocalCall:
    return replicated_local(ctx) if ctx.call.arg(4, "training", False) else LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)


def dropout_backward_strategies(call: OpCall) -> list[Strategy1D]:
    """native_dropout_backward(grad, mask, scale) = grad * mask * scale: pointwise, linear in grad."""
    return pointwise_strategies(call, "first")


ROWS = (Rule(aten.native_dropout.default, random_strategies, dropout_local, blockwise=False),
        Rule([aten.bernoulli.p, aten.bernoulli_.float], **_no_generator(random_strategies, bernoulli_p_local)),
        Rule(aten.bernoulli.default, **_no_generator(random_strategies, bernoulli_local)),
        Rule([aten.rand_like.default, aten.randn_like.default], random_strategies, rand_like_local,
             blockwise=False),
        Rule(list(SHAPE_DRAWS), **_no_generator(random_strategies, shape_draw_local)),
        Rule(list(FACTORY_DRAWS), **_no_generator(pointwise_strategies, factory_draw_local)),
        Rule([aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor],
             **_no_generator(normal_tensor_strategies, normal_tensor_local)),
        Rule(aten.multinomial.default, **_no_generator(multinomial_strategies, multinomial_local)),
        Rule(aten.rrelu_with_noise_functional.default, **_no_generator(rrelu_strategies, rrelu_local)),
        # grad * noise in training, leaky_relu's backward otherwise: pointwise, linear in grad
        Rule(aten.rrelu_with_noise_backward.default, dropout_backward_strategies, blockwise=False),
        Rule(aten.native_dropout_backward.default, dropout_backward_strategies, blockwise=False))
