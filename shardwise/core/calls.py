"""What a rule sees of one traced node: ``OpCall`` (the op, its args with tensors as
``TensorMeta``: global shape and dtype, its flattened outputs). Below the pipeline: trace/
builds them from fx nodes, rules/ (registry.py re-imports them), search/ and lower/ read them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.utils._pytree as pytree


def map_leaves(fn, tree):
    """``pytree.tree_map(fn, tree)`` for the plain tuples, lists and dicts op arguments are made of,
    without pytree's generic dispatch (a third of lowering's time on deep models); any other
    container (a namedtuple, torch.Size, an OrderedDict) goes through pytree itself."""
    t = type(tree)
    if t is tuple or t is list:
        return t([map_leaves(fn, x) for x in tree])
    if t is dict:
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list, dict)):
        return pytree.tree_map(fn, tree)
    return fn(tree)


def bound_arguments(op, args, kwargs) -> dict:
    """Every schema argument of a call of ``op`` by name: given positionally, by keyword, or its
    default (None where it has none). Ops of one family order their arguments differently (and
    torch releases reorder them); their names stay."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def leaves(tree) -> list:
    """``pytree.tree_leaves(tree)`` for op arguments, in the order ``map_leaves`` visits them:
    tuples, lists (namedtuples, fx's immutable lists) and dicts are walked, anything else is a leaf."""
    out: list = []
    _collect(tree, out)
    return out


def _collect(a, out: list) -> None:
    if isinstance(a, (tuple, list)):
        for x in a:
            _collect(x, out)
    elif isinstance(a, dict):
        for x in a.values():
            _collect(x, out)
    else:
        out.append(a)


def pure(fn):
    """Mark a local function a program calls (a rule's, a redistribution's) as a function of its
    arguments alone, with no other effect: lower/memory.py reuses a call on the same sizes,
    run/replay.py computes it once when its arguments are constants."""
    fn.sw_pure = True
    return fn


def is_pure(fn) -> bool:
    return getattr(fn, "sw_pure", False)


@dataclass(frozen=True)
class TensorMeta:
    """What a rule may know about a tensor: its global shape and dtype."""

    shape: tuple
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def of(t) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in t.shape), t.dtype)

    def __repr__(self) -> str:
        return f"T{list(self.shape)}:{str(self.dtype).replace('torch.', '')}"


@dataclass(frozen=True)
class OpCall:
    """One node: the op, its args with tensors as TensorMeta, and its (flattened) tensor outputs."""

    op: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outs: tuple = ()  # TensorMeta or None per flattened output

    @cached_property
    def ins(self) -> list[TensorMeta]:
        """Tensor inputs in pytree order of (args, kwargs) (computed once: the planner asks per
        strategy and rank)."""
        return [x for x in leaves((self.args, self.kwargs)) if isinstance(x, TensorMeta)]

    @cached_property
    def key(self) -> tuple:
        """What the call's strategies depend on, as plain values (op, printed args and kwargs,
        outputs): calls of equal keys share cached strategies."""
        return self.op, repr(self.args), repr(sorted(self.kwargs.items())), self.outs

    @property
    def out(self) -> TensorMeta:
        return self.outs[0]

    def arg(self, i: int, name: str, default=None):
        """Positional-or-keyword arg ``i`` / ``name`` with its schema default (``i`` = KW_ONLY: keyword-only)."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    @staticmethod
    def from_values(op, args, kwargs, out) -> "OpCall":
        """Build from real or fake tensors (the tracer and the verifier both use this)."""
        conv = lambda x: TensorMeta.of(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        args, kwargs = map_leaves(conv, (tuple(args), dict(kwargs)))
        outs = tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in flatten_outputs(out))
        return OpCall(op, args, kwargs, outs)


KW_ONLY = 99  # OpCall.arg position of a keyword-only arg: never positional


def flatten_outputs(out) -> list:
    if isinstance(out, (tuple, list)):
        return [o for x in out for o in flatten_outputs(x)]
    return [out]
