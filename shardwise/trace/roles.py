"""What each placeholder and output of a traced graph stands for, and how inputs flatten.

A traced graph takes a flat list of tensors. ``PlaceholderRole`` says, for each of them,
whether it is a parameter, a buffer, a model input or a loss target, and where it lives
(qualified name, or index path into the example inputs). ``OutputRole`` does the same for
graph outputs (the loss, the gradient of a parameter, or a leaf of the model's output).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..core.errors import ShardingError

PARAM, BUFFER, INPUT, TARGET = "param", "buffer", "input", "target"
LOSS, GRAD, OUTPUT = "loss", "grad", "output"


@dataclass(frozen=True)
class PlaceholderRole:
    """One graph placeholder.

    kind: "param" | "buffer" | "input" | "target".
    name: the parameter/buffer qualified name; for inputs the forward argument the leaf
      belongs to (None where it cannot be named, e.g. ``*args``); None for targets.
    path: for inputs/targets, the index path into the example pytree: first element is the
      positional index (int) or the keyword name (str), then keys/indices into nested
      containers. ``()`` for params and buffers.
    requires_grad: params only: whether a gradient is taken.
    """

    kind: str
    name: str | None = None
    path: tuple = ()
    requires_grad: bool = False

    @property
    def is_top_level(self) -> bool:
        """An input/target that is directly an argument (not nested inside a container)."""
        return len(self.path) == 1

    def describe(self) -> str:
        if self.kind in (PARAM, BUFFER):
            return f"{self.kind} '{self.name}'"
        where = "".join(f"[{p!r}]" for p in self.path)
        label = f" '{self.name}'" if self.name else ""
        return f"{self.kind}{label} (example_{self.kind}s{where})"


@dataclass(frozen=True)
class OutputRole:
    """One graph output. kind: "loss" | "grad" (name: the parameter) | "output" (path into the model output)."""

    kind: str
    name: str | None = None
    path: tuple = ()


@dataclass
class FlatTree:
    """A pytree flattened into tensor leaves (graph inputs) and constant leaves (baked in)."""

    spec: Any
    leaves: list  # every leaf; tensors included (only their position matters after tracing)
    tensor_idx: list[int]  # which leaves are tensors, in order
    paths: list[tuple] = field(default_factory=list)  # per tensor leaf

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_idx]

    def rebuild(self, tensors) -> Any:
        leaves = list(self.leaves)
        tensors = list(tensors)
        if len(tensors) != len(self.tensor_idx):
            raise ShardingError(f"expected {len(self.tensor_idx)} tensors to rebuild the traced structure, got "
                                f"{len(tensors)}", fix="pass one tensor per tensor leaf, as traced")
        for i, t in zip(self.tensor_idx, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)


def _key(k) -> Any:
    for attr in ("idx", "key", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def flatten(tree) -> FlatTree:
    with_path, spec = pytree.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_path]
    idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    paths = [tuple(_key(k) for k in with_path[i][0]) for i in idx]
    return FlatTree(spec, leaves, idx, paths)


def forward_arg_names(model) -> tuple[list[str], str | None]:
    """Positional parameter names of ``model.forward`` (without self) and the ``*args`` name."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return [], None
    names, var = [], None
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            var = p.name
    return names, var


def input_roles(model, flat: FlatTree) -> list[PlaceholderRole]:
    """Roles of the tensor leaves of ``(args, kwargs)``; paths start at the arg index or kwarg name."""
    names, _ = forward_arg_names(model)
    roles = []
    for path in flat.paths:
        # path[0] selects args (0) or kwargs (1) of the (args, kwargs) pair
        sub = path[1:]
        head = sub[0]
        if isinstance(head, int):
            name = names[head] if head < len(names) else None
        else:
            name = head
        roles.append(PlaceholderRole(INPUT, name, sub))
    return roles


def target_roles(flat: FlatTree) -> list[PlaceholderRole]:
    return [PlaceholderRole(TARGET, None, p) for p in flat.paths]


_NOT_IDENT = re.compile(r"\W+")


def placeholder_name(role: PlaceholderRole) -> str:
    """A readable Python identifier for a placeholder (made unique by the graph namespace)."""
    if role.kind in (PARAM, BUFFER):
        base = ("p_" if role.kind == PARAM else "b_") + role.name
    elif role.kind == INPUT:
        rest = role.path[1:] if role.name is not None else role.path
        base = "_".join([role.name or "input"] + [str(p) for p in rest])
    else:
        base = "_".join(["target"] + [str(p) for p in role.path])
    base = _NOT_IDENT.sub("_", base).strip("_") or "arg"
    return base if not base[0].isdigit() else "_" + base
