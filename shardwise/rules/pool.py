"""Pooling (max with indices, avg, adaptive avg/max), upsampling (nearest, nearest-exact, linear,
bilinear, bicubic, trilinear, anti-aliased bilinear and bicubic) and pixel (un)shuffle, forward
and backward.

Each op works plane by plane on its trailing ``k`` spatial dims: every leading dim (batch,
channels) shards freely on input, output, indices and gradients alike (max-pool indices are
positions inside one plane, so a leading shard leaves them right). Linear ops also take
Partial: avg and adaptive avg pools, upsampling and pixel (un)shuffle forward, and every
backward in its gradient (max-pool backward given the replicated input and indices).
Upsampling backward carries the full input size: the local call gets the local one.
Pixel shuffle moves ``r*r`` channels into each output channel, so its channel dim shards in
whole blocks of ``r*r`` (``Shard(c, unit=r*r)``) against the output's plain channel shard;
pixel unshuffle the other way round. Max and average pools also shard a spatial dim through
halo exchanges (rules/pool_spatial.py); the other ops here do not shard spatial dims.
"""
from __future__ import annotations

import torch

from ..core.layout import Shard
from . import pool_spatial
from .common import P, R, replicate_all
from .registry import DEFAULT, LocalCall, LocalCtx, OpCall, Registry, Rule, Strategy1D

aten = torch.ops.aten

# op -> (spatial dims, linear in the first tensor input)
FORWARD = {
    aten.max_pool2d_with_indices.default: (2, False),
    aten.max_pool3d_with_indices.default: (3, False),
    aten.adaptive_max_pool2d.default: (2, False),
    aten.adaptive_max_pool3d.default: (3, False),
    aten.avg_pool1d.default: (1, False),
    aten.adaptive_avg_pool1d.default: (1, False),
    aten.avg_pool2d.default: (2, True),
    aten.avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool3d.default: (3, True),
    aten.upsample_nearest1d.default: (1, True),
    aten.upsample_nearest2d.default: (2, True),
    aten.upsample_nearest3d.default: (3, True),
    aten.upsample_nearest1d.vec: (1, True),
    aten.upsample_nearest2d.vec: (2, True),
    aten.upsample_nearest3d.vec: (3, True),
    aten.upsample_linear1d.default: (1, True),
    aten.upsample_bilinear2d.default: (2, True),
    aten.upsample_bilinear2d.vec: (2, True),
    aten.upsample_bicubic2d.default: (2, True),
    aten.upsample_trilinear3d.default: (3, True),
    aten._upsample_nearest_exact1d.default: (1, True),
    aten._upsample_nearest_exact2d.default: (2, True),
    aten._upsample_nearest_exact3d.default: (3, True),
    aten._upsample_nearest_exact1d.vec: (1, True),
    aten._upsample_nearest_exact2d.vec: (2, True),
    aten._upsample_nearest_exact3d.vec: (3, True),
    aten._upsample_bilinear2d_aa.default: (2, True),
    aten._upsample_bilinear2d_aa.vec: (2, True),
    aten._upsample_bicubic2d_aa.default: (2, True),
    aten._upsample_bicubic2d_aa.vec: (2, True),
}
# backward op -> spatial dims; all linear in grad_output (the first tensor input)
BACKWARD = {
    aten.max_pool2d_with_indices_backward.default: 2,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten.adaptive_max_pool2d_backward.default: 2,
    aten.adaptive_max_pool3d_backward.default: 3,
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
    aten._adaptive_avg_pool2d_backward.default: 2,
    aten._adaptive_avg_pool3d_backward.default: 3,
}
# upsampling backward(grad_output, output_size, input_size, ...): input_size is the full shape
UPSAMPLE_BACKWARD = {
    aten.upsample_nearest1d_backward.default: 1,
    aten.upsample_nearest2d_backward.default: 2,
    aten.upsample_nearest3d_backward.default: 3,
    aten.upsample_linear1d_backward.default: 1,
    aten.upsample_bilinear2d_backward.default: 2,
    aten.upsample_bicubic2d_backward.default: 2,
    aten.upsample_trilinear3d_backward.default: 3,
    aten._upsample_nearest_exact1d_backward.default: 1,
    aten._upsample_nearest_exact2d_backward.default: 2,
    aten._upsample_nearest_exact3d_backward.default: 3,
    aten._upsample_bilinear2d_aa_backward.default: 2,
    aten._upsample_bicubic2d_aa_backward.default: 2,
}


def _outs(call: OpCall, p) -> tuple:
    return tuple(None if o is None else p for o in call.outs)


def leading_strategies(k: int, linear: bool):
    """Shard any leading dim of every tensor input and output; Partial in the first input if linear."""

    def strategies(call: OpCall) -> list[Strategy1D]:
        out = [replicate_all(call)]
        for d in range(call.outs[0].ndim - k):
            out.append(Strategy1D(_outs(call, Shard(d)), tuple(Shard(d) for _ in call.ins)))
        if linear:
            out.append(Strategy1D(_outs(call, P), (P,) + (R,) * (len(call.ins) - 1)))
        return out

    strategies.__name__ = f"leading_dims[{k} spatial]"
    return strategies


# backward ops that read their input only for its shape: its values may be Partial
SHAPE_ONLY_INPUT = {aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default,
                    aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default}


def shape_only_strategies(k: int):
    """avg-pool backwards: also accept the input Partial (only its shape is read), so a Partial
    forward input needs no reduction for the backward."""
    base = leading_strategies(k, True)

    def strategies(call: OpCall) -> list[Strategy1D]:
        return base(call) + [Strategy1D((R,), (R, P)), Strategy1D((P,), (P, P))]

    strategies.__name__ = f"leading_dims[{k} spatial, input shape only]"
    return strategies


def empty_safe(op, shapes: tuple, dtypes: tuple, *args, **kwargs):
    """``op(*args)``, or zeros of the planned local shapes where this rank's first result is
    empty (its chunk of the input is: several kernels refuse an empty channel dim); the other
    results are then sums over nothing (Partial parts) or empty too."""
    first = next((s for s in shapes if s is not None), None)
    if first is not None and 0 in first:
        ref = next(a for a in args if isinstance(a, torch.Tensor))
        outs = tuple(None if s is None else ref.new_zeros(s, dtype=d) for s, d in zip(shapes, dtypes))
        return outs if len(outs) > 1 else outs[0]
    # contiguous: some CPU kernels misread strided inputs (adaptive_max_pool3d_backward on a
    # chunk of the channel dim); a no-op for the contiguous locals the program passes
    return op(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)


def _safe(ctx: LocalCtx, args, kwargs) -> LocalCall:
    shapes = tuple(None if o is None else tuple(ctx.local_out_shape(i)) for i, o in enumerate(ctx.call.outs))
    dtypes = tuple(None if o is None else o.dtype for o in ctx.call.outs)
    return LocalCall(empty_safe, (ctx.call.op, shapes, dtypes, *args), kwargs)


def local(ctx: LocalCtx) -> LocalCall:
    return _safe(ctx, ctx.call.args, ctx.call.kwargs)


def upsample_backward_local(ctx: LocalCtx) -> LocalCall:
    """input_size (arg 2) becomes this rank's grad_input shape."""
    args = list(ctx.call.args)
    kwargs = dict(ctx.call.kwargs)
    if len(args) > 2:
        args[2] = ctx.local_out_shape(0)
    else:
        kwargs["input_size"] = ctx.local_out_shape(0)
    return _safe(ctx, tuple(args), kwargs)


def shuffle_strategies(call: OpCall) -> list[Strategy1D]:
    """pixel_shuffle / pixel_unshuffle: leading dims free, channels in blocks of r*r on the wide side."""
    x = call.ins[0]
    r = call.arg(1, "upscale_factor" if call.op is aten.pixel_shuffle.default else "downscale_factor")
    c = x.ndim - 3
    strategies = [replicate_all(call), Strategy1D((P,), (P,))]
    strategies += [Strategy1D((Shard(d),), (Shard(d),)) for d in range(c)]
    wide, narrow = Shard(c, unit=r * r), Shard(c)
    if call.op is aten.pixel_shuffle.default:
        strategies.append(Strategy1D((narrow,), (wide,)))
    else:
        strategies.append(Strategy1D((wide,), (narrow,)))
    return strategies


def with_spatial(base):
    """``base`` plus the spatial (halo) strategies of max and average pools (rules/pool_spatial.py)."""

    def strategies(call: OpCall) -> list[Strategy1D]:
        return base(call) + pool_spatial.spatial_strategies(call)

    strategies.__name__ = base.__name__ + "+halo"
    return strategies


def spatial_local(ctx: LocalCtx) -> LocalCall:
    return pool_spatial.local(ctx) or local(ctx)


def register(registry: Registry = DEFAULT) -> None:
    registry.add(*(Rule(op, leading_strategies(k, lin), local, blockwise=False) for op, (k, lin) in FORWARD.items()),
                 *(Rule(op, shape_only_strategies(k) if op in SHAPE_ONLY_INPUT else leading_strategies(k, True), local,
                        blockwise=False) for op, k in BACKWARD.items()))
    registry.add(*(Rule(op, with_spatial(registry.get(op).strategies), spatial_local, valid=pool_spatial.valid,
                        comm=pool_spatial.comm, blockwise=False) for op in pool_spatial.SPATIAL),
                 *(Rule(op, leading_strategies(k, True), upsample_backward_local, blockwise=False)
                   for op, k in UPSAMPLE_BACKWARD.items()),
                 Rule([aten.pixel_shuffle.default, aten.pixel_unshuffle.default], shuffle_strategies, local,
                      blockwise=False))
