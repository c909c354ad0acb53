"""User placement specs -> one validated placement tuple per graph placeholder.

Inputs are named by forward-arg name or positional index; parameters by qualified name.
Every spec is checked against the mesh and the tensor it lays out, and a wrong one fails
here (at ``parallelize``) with a ShardingError naming the input, what was given, what the
mesh expects and a fix — never deep inside a rule.
"""
from __future__ import annotations

import difflib

from .errors import ShardingError
from .layout import Partial, Replicate, normalize_placements
from .mesh import Mesh
from .trace.roles import BUFFER, INPUT, PARAM, TARGET


def _close(name, names) -> str:
    near = difflib.get_close_matches(str(name), [str(n) for n in names], n=3)
    return f" (did you mean {', '.join(map(repr, near))}?)" if near else ""


def check_placements(spec, mesh: Mesh, ndim: int, what: str, allow_partial: bool = False) -> tuple:
    placements = normalize_placements(spec, mesh, ndim, what)
    if not allow_partial and any(isinstance(p, Partial) for p in placements):
        raise ShardingError(f"{what}: {list(placements)} holds a Partial; a full tensor given by the user cannot be "
                            "a partial sum", fix="use Shard(dim) or Replicate()")
    return placements


def param_specs(named_shapes: dict, spec, mesh: Mesh) -> dict:
    """{param name: placements} for every parameter and buffer (Replicate where unnamed)."""
    rep = (Replicate(),) * mesh.ndim
    out = {n: rep for n in named_shapes}
    if spec in (None, "auto"):
        return out
    if not isinstance(spec, dict):
        raise ShardingError(f"param_placements must be 'auto' or a dict {{param name: placements}}, got {spec!r}")
    for name, pl in spec.items():
        if name not in named_shapes:
            raise ShardingError(
                f"param_placements names {name!r}, which is not a parameter or buffer of the model"
                f"{_close(name, named_shapes)}",
                fix=f"use a name from model.named_parameters(), e.g. {next(iter(named_shapes), '...')!r}",
            )
        out[name] = check_placements(pl, mesh, len(named_shapes[name]), f"parameter {name!r}")
    return out


def _lookup(spec: dict, keys, what: str):
    for k in keys:
        if k is not None and k in spec:
            return spec[k]
    return None


def check_input_keys(spec: dict, names: list, n_inputs: int, what: str = "input_placements") -> None:
    for k in spec:
        if isinstance(k, int):
            if not -n_inputs <= k < n_inputs:
                raise ShardingError(f"{what} names input index {k} but the model takes {n_inputs} example inputs",
                                    fix=f"use an index in [0, {n_inputs - 1}] or a forward-arg name from {names}")
        elif k not in names:
            raise ShardingError(f"{what} names {k!r}, which is not an argument of forward{_close(k, names)}; "
                                f"forward takes {names}", fix="use a forward-arg name or a positional index")


def placeholder_specs(traced, mesh: Mesh, inputs_spec: dict, targets_spec: dict, params: dict, n_inputs: int):
    """{placeholder node name: placements} for one traced graph."""
    rep = (Replicate(),) * mesh.ndim
    out = {}
    for node, role in zip(traced.placeholder_nodes(), traced.placeholders):
        val = node.meta["val"]
        if role.kind in (PARAM, BUFFER):
            out[node.name] = params.get(role.name, rep)
            continue
        spec = inputs_spec if role.kind == INPUT else targets_spec
        head = role.path[0] if role.path else None
        keys = (role.name, head, head - n_inputs if isinstance(head, int) and role.kind == INPUT else None)
        pl = _lookup(spec, keys, role.kind)
        what = f"{role.kind} {role.name or head!r}" + (f" leaf {role.path[1:]}" if len(role.path) > 1 else "")
        out[node.name] = rep if pl is None else check_placements(pl, mesh, val.dim(), what)
    return out
