"""The hand recipes as starts of the ILP (issue #49: "never worse than a recipe").

``param_placements="auto"`` with ``planner="ilp"`` searches from propagation's plan (parameters
whole). A recipe a user could have written instead (FSDP on the data dims, Megatron on "tp", the two
merged) is priced the same way first, and the cheapest that fits becomes the search's starting plan
(search/solve.py ``starts``): the rounds only ever replace it by a cheaper plan, so the planner's
answer is at least as good as each recipe in its own cost model. A recipe that does not apply to the
model (no Megatron plan for its family) is left out, said in the solve report.

    starts = recipe_starts(model, mesh, free, params)   # {label: {placeholder: placements}}
"""
from __future__ import annotations

from ..core.errors import ShardingError
from ..core.mesh import Mesh
from . import recipes
from .spec import param_specs

TP = "tp"  # the mesh dim name Megatron's recipe is tried on (recipes.megatron's convention)
NOT_DATA = (TP, "pp", "sp", "ep")  # mesh dims that are not data dims for FSDP's recipe


def recipe_specs(model, mesh: Mesh) -> tuple[dict, dict]:
    """({label: {param name: {mesh dim: placement}}}, {label: why left out}) of the recipes that
    apply to ``model`` on ``mesh``."""
    data = tuple(n for n in mesh.names if n not in NOT_DATA)
    out, skipped = {}, {}
    if data:
        out["fsdp"] = recipes.fsdp(model, data)
    if TP in mesh.names:
        try:
            meg = recipes.megatron(model, TP, size=mesh.shape[mesh.dim_index(TP)])
        except ShardingError as e:
            skipped["megatron"] = e.message
        else:
            out["megatron"] = meg
            if data:
                out["fsdp+megatron"] = recipes.merge(recipes.fsdp(model, data, beside=meg), meg)
    return out, skipped


def recipe_starts(model, mesh: Mesh, free: dict, params: dict) -> tuple[dict, dict]:
    """({label: {placeholder: placements}}, {label: why left out}): each recipe restricted to the
    parameters the program places (``free``: {placeholder: candidates}; ``params``: {placeholder:
    parameter name}). A recipe's placement that is not among a parameter's candidates is added to
    them, so the program can keep it."""
    specs, skipped = recipe_specs(model, mesh)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = {}
    for label, spec in specs.items():
        try:
            placed = param_specs(shapes, spec, mesh)
        except ShardingError as e:
            skipped[label] = e.message
            continue
        start = {ph: tuple(placed[params[ph]]) for ph in free if params.get(ph) in placed}
        for ph, pl in start.items():
            if pl not in free[ph]:
                free[ph].append(pl)
        out[label] = start
    return out, skipped
