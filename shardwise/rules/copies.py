"""The ``*_copy`` ops of views (expand_copy, view_copy, split_copy, ...) and the unsafe splits.

Each is its view op's semantics with a fresh output, so it takes the view op's rule as it is: the
same strategies, validity hook and local call, computed on the call restated as the view op (rules
that read ``call.op``, such as squeeze's, see the overload they were written for). Only the function
the rank calls changes: the view op becomes its copy op, a view op the view's local call chose
(reshape, squeeze.dims, split_with_sizes) becomes that op's copy, and a Python local function that
may return a view (as_strided over the row-major layout) has its outputs cloned. No view logic is
restated here. unsafe_split / unsafe_split_with_sizes are split / split_with_sizes without autograd's
view tracking (unsafe_chunk reaches aten as unsafe_split): the same rule, the op itself called.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.utils._pytree as pytree

from ..core.errors import RuleError
from . import pointwise, strided, view
from .registry import LocalCall, LocalCtx, Registry, Rule

aten = torch.ops.aten

# copy op -> the view op whose rule it takes
VIEW_OF = {
    aten.expand_copy.default: aten.expand.default,
    aten.as_strided_copy.default: aten.as_strided.default,
    aten.view_copy.default: aten.view.default,
    aten.permute_copy.default: aten.permute.default,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.unbind_copy.int: aten.unbind.int,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.t_copy.default: aten.t.default,
    aten.alias_copy.default: aten.alias.default,
    aten.detach_copy.default: aten.detach.default,
    aten.unfold_copy.default: aten.unfold.default,
    aten.select_copy.int: aten.select.int,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.unsafe_split.Tensor: aten.split.Tensor,
    aten.unsafe_split_with_sizes.default: aten.split_with_sizes.default,
}
# a view op a view rule's local call may choose -> its copy (reshape: view_copy takes any strides)
COPY_OF = {aten.reshape.default: aten.view_copy.default, aten.squeeze.dims: aten.squeeze_copy.dims,
           aten.split_with_sizes.default: aten.split_with_sizes_copy.default}


@functools.cache
def _view_rules() -> Registry:
    """The rows of the families the copies borrow from (a registry of their own: no load order)."""
    reg = Registry()
    for mod in (view, strided, pointwise):
        reg.add(*mod.ROWS)
    return reg


@functools.cache
def fresh(fn):
    """``fn`` with every tensor output cloned (a local function that may return a view of its input)."""
    def call(*args, **kwargs):
        return pytree.tree_map_only(torch.Tensor, torch.clone, fn(*args, **kwargs))

    call.__name__ = call.__qualname__ = f"{getattr(fn, '__name__', 'local')}_fresh"
    return call


def _as_view(call, view_op):
    return dataclasses.replace(call, op=view_op)


def _copy_fn(fn, view_op, op):
    """The function a rank calls for copy ``op``, given the one the view rule chose."""
    if fn is view_op:
        return op
    if fn in COPY_OF:
        return COPY_OF[fn]
    if getattr(fn, "is_view", False):
        raise RuleError(f"the rule of {view_op} calls view op {fn}, which has no copy for {op}",
                        fix="add the view op and its *_copy op to rules/copies.COPY_OF")
    return fn if isinstance(fn, torch._ops.OpOverload) else fresh(fn)


def _row(op, view_op) -> Rule:
    base = _view_rules().get(view_op)

    def strategies(call):
        return base.strategies(_as_view(call, view_op))

    def local(ctx: LocalCtx) -> LocalCall:
        lc = base.local_call(dataclasses.replace(ctx, call=_as_view(ctx.call, view_op)))
        return LocalCall(_copy_fn(lc.fn, view_op, op), lc.args, lc.kwargs)

    valid = None if base.valid is None else lambda call, st, mesh: base.valid(_as_view(call, view_op), st, mesh)
    strategies.__name__ = f"{base.name}[copy]"
    return Rule(op, strategies, local, shape_sensitive=base.shape_sensitive, name=strategies.__name__, valid=valid,
                blockwise=base.blockwise, comm=base.comm, shape_only=base.shape_only)


ROWS = tuple(_row(op, view_op) for op, view_op in VIEW_OF.items())
