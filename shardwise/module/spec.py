"""User placement specs -> one validated placement tuple per graph placeholder.

Inputs are named by forward-arg name or positional index; parameters by qualified name.
Every spec is checked against the mesh and the tensor it lays out, and a wrong one fails
here (at ``parallelize``) with a ShardingError naming the input, what was given, what the
mesh expects and a fix — never deep inside a rule.
"""
from __future__ import annotations

import difflib

from ..core.errors import ConfigError, ConfigTypeError, ShardingError
import torch

from ..core.layout import Layout, Partial, Replicate, normalize_placements
from ..core.mesh import Mesh
from ..trace import BUFFER, INPUT, PARAM, Traced


def _close(name, names) -> str:
    near = difflib.get_close_matches(str(name), [str(n) for n in names], n=3)
    return f" (did you mean {', '.join(map(repr, near))}?)" if near else ""


def check_placements(spec, mesh: Mesh, shape, what: str) -> tuple:
    """The one validation path for user placements (parameters, buffers, inputs, targets).

    ``shape``: the tensor's global shape (or its ndim, when only that is known yet). With a
    shape, units, groups and their nesting are checked for every rank too, so a spec such as
    ``[Shard(0), Shard(0, unit=3)]`` on 6 rows of a (3, 2) mesh fails here, naming ``what``,
    and a unit that splits the tensor exactly as the plain shard would is returned as that shard
    (Layout.canonical: the spelling the rules plan with).
    """
    ndim = shape if isinstance(shape, int) else len(shape)
    placements = normalize_placements(spec, mesh, ndim, what)
    if any(isinstance(p, Partial) for p in placements):
        raise ShardingError(f"{what}: {list(placements)} holds a Partial; a full tensor given by the user cannot be "
                            "a partial sum", fix="use Shard(dim) or Replicate()")
    if not isinstance(shape, int):
        check_fits(placements, mesh, shape, what)
        placements = Layout(tuple(shape), torch.float32, placements).canonical(mesh).placements
    return placements


def check_fits(placements: tuple, mesh: Mesh, shape, what: str) -> None:
    """Normalised ``placements`` lay a tensor of global ``shape`` out on every rank (units, groups, nesting)."""
    try:
        layout = Layout(tuple(shape), torch.float32, placements)
        for r in range(mesh.size):
            layout.local_shape(mesh, r)
    except ShardingError as e:
        msg = e.message
        raise ShardingError(f"{what} of shape {tuple(shape)}: {list(placements)} cannot lay it out on mesh "
                            f"{mesh.shape} {mesh.names}: {msg}", fix=e.fix) from None


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
        out[name] = check_placements(pl, mesh, named_shapes[name], f"parameter {name!r}")
    return out


def kept_gathered(reshard_after_forward, model) -> frozenset:
    """The parameters a step keeps gathered from forward into backward, from ``parallelize(...,
    reshard_after_forward=)`` (FSDP2's ``fully_shard`` option): True (every parameter gathered
    before use is freed after its last forward read and gathered again for backward), False
    (none is: gathered once, held until backward's last read, one gather less per parameter and
    step), or {module or parameter name: bool} (per module, as FSDP2 is applied per module; ""
    is the whole model): the longest name a parameter is under decides, True where none is.
    A tied parameter is under each of its names; its most specific one decides."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if isinstance(reshard_after_forward, bool):
        return frozenset() if reshard_after_forward else frozenset(n for n, _ in model.named_parameters())
    if not isinstance(reshard_after_forward, dict):
        raise ConfigTypeError(f"reshard_after_forward must be True, False or {{module or parameter name: bool}}, got "
                              f"{reshard_after_forward!r}", fix="e.g. reshard_after_forward={'layers.11': False}")
    known = {""} | {n for n, _ in model.named_modules()} | set(names)
    for key, value in reshard_after_forward.items():
        if key not in known:
            raise ConfigError(f"reshard_after_forward names {key!r}, which is not a module or parameter of the model"
                              f"{_close(key, known)}", fix="use a name from model.named_modules() or "
                                                            "model.named_parameters(); \"\" is the whole model")
        if not isinstance(value, bool):
            raise ConfigTypeError(f"reshard_after_forward[{key!r}] must be True or False, got {value!r}")

    def under(name: str, key: str) -> bool:
        return key == "" or name == key or name.startswith(key + ".")

    canonical = {id(t): n for n, t in model.named_parameters()}
    best: dict = {}  # canonical name -> (length of the most specific key, its value)
    for name, t in model.named_parameters(remove_duplicate=False):
        for key, value in reshard_after_forward.items():
            if under(name, key):
                c = canonical[id(t)]
                if c not in best or len(key) > best[c][0]:
                    best[c] = (len(key), value)
    return frozenset(n for n, (_, reshard) in best.items() if not reshard)


def check_input_keys(spec: dict, names: list, n_inputs: int, what: str = "input_placements",
                     keywords: tuple = ()) -> None:
    """Every key of ``spec`` names an input: a positional index, a forward-arg name, or the name
    of a keyword input the example passes (``keywords``)."""
    known = list(names) + [k for k in keywords if k not in names]
    for k in spec:
        if isinstance(k, int):
            if not -n_inputs <= k < n_inputs:
                raise ShardingError(f"{what} names input index {k} but the model takes {n_inputs} example inputs",
                                    fix=f"use an index in [0, {n_inputs - 1}] or a forward-arg name from {known}")
        elif k not in known:
            raise ShardingError(f"{what} names {k!r}, which is not an argument of forward{_close(k, known)}; "
                                f"forward takes {known}", fix="use a forward-arg name, a keyword input's name or a "
                                                              "positional index")


def role_placements(role, shape, mesh: Mesh, inputs_spec: dict, targets_spec: dict, n_inputs: int) -> tuple:
    """The validated placements of one input or target leaf (Replicate where unnamed), named in errors
    by the key the user gave them under; ``shape``: its global shape, or its ndim where the global
    shape is not known yet (local inputs: ``check_fits`` once it is)."""
    spec = inputs_spec if role.kind == INPUT else targets_spec
    head = role.path[0] if role.path else None
    keys = (role.name, head, head - n_inputs if isinstance(head, int) and role.kind == INPUT else None)
    key = next((k for k in keys if k is not None and k in spec), None)
    if key is None:
        return (Replicate(),) * mesh.ndim
    leaf = f" leaf {role.path[1:]}" if len(role.path) > 1 else ""
    return check_placements(spec[key], mesh, shape, f"{role.kind} {key!r}{leaf}")


def describe_role(role) -> str:
    """How an error names an input or target leaf: "input 'x'", "target 0"."""
    head = role.path[0] if role.path else None
    return f"{role.kind} {role.name or head!r}" + (f" leaf {role.path[1:]}" if len(role.path) > 1 else "")


def placeholder_specs(traced: Traced, mesh: Mesh, params: dict, leaves: list) -> dict:
    """{placeholder node name: placements} for one traced graph: a parameter's or buffer's from
    ``params`` (Replicate where unnamed), the input and target leaves' ``leaves`` in trace order,
    as normalised once (module/inputs.StepInputs.leaf_placements)."""
    rep = (Replicate(),) * mesh.ndim
    leaves = iter(leaves)
    return {node.name: params.get(role.name, rep) if role.kind in (PARAM, BUFFER) else next(leaves)
            for node, role in zip(traced.placeholder_nodes(), traced.placeholders)}
