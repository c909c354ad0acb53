"""A ParallelModule's step arguments as the planner and the backends need them.

``prepare(pm, args)`` -> ``Batch``: the inputs and targets the plan is traced and keyed with
(global shapes; for ``inputs="local"`` meta stand-ins of the global shapes the ranks' pieces
make), and, for local inputs, each rank's own pieces. ``check_same_inputs`` is the
``inputs="global"`` check of the first step of each plan. The checks themselves live in
run/inputs.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..core.errors import ShardingError
from ..run.inputs import check_same, has_replicas, leaves_of, resolve_local
from .spec import check_fits, describe_role, role_placements
from ..trace.roles import flatten, input_roles, target_roles


@dataclass
class Batch:
    """inputs / targets: full tensors, or (local inputs) meta tensors of the global shapes.
    local: None, or {rank: (inputs, targets)} of the pieces each rank held here was handed.
    target_spec: the target placements the local pieces were checked with (None: global).
    placements: every input and target tensor leaf's, normalised once (``leaf_placements``)."""

    inputs: tuple
    targets: tuple
    local: dict | None = None
    target_spec: dict | None = None
    placements: list | None = None

    @property
    def key(self) -> str:
        """What besides the shapes a plan depends on: the target placements local pieces were read with."""
        return "" if self.target_spec is None else repr(sorted(self.target_spec.items(), key=repr))


def _per_rank(pm, args) -> dict:
    """inputs="local": {rank held here: that rank's arguments}."""
    ranks = pm.backend.ranks
    if len(ranks) < pm.mesh.size:  # torch backend: this process's rank
        return {ranks[0]: tuple(args)}
    n = pm.mesh.size
    for i, a in enumerate(args):
        if not isinstance(a, (list, tuple)) or len(a) != n:
            got = f"a {type(a).__name__} of length {len(a)}" if isinstance(a, (list, tuple)) else type(a).__name__
            raise ShardingError(
                f'inputs="local" on the {pm.backend.name} backend: argument {i} must be a list of {n} per-rank '
                f"values (every rank of mesh {pm.mesh.shape} runs in this process), got {got}",
                fix="pass [piece of rank 0, piece of rank 1, ...] for every argument, or use inputs='global'")
    return {r: tuple(a[r] for a in args) for r in range(n)}


def _roles(pm, inputs, targets) -> list:
    return input_roles(pm.model, flatten((tuple(inputs), {}))) + target_roles(flatten(tuple(targets)))


def leaf_names(pm, inputs, targets) -> list[str]:
    """How errors name the tensor leaves of (inputs, targets), in trace order."""
    return [describe_role(r) for r in _roles(pm, inputs, targets)]


def leaf_placements(pm, batch: Batch) -> list:
    """Every input and target tensor leaf's placements, in trace order: the user's specs normalised
    and checked against the leaves' global shapes once per batch (at parallelize for the example
    inputs, or when a new signature is planned); the plan takes them as they are."""
    leaves = leaves_of((batch.inputs, {})) + leaves_of(batch.targets)
    if batch.placements is None:
        tspec = batch.target_spec if batch.target_spec is not None else pm._target_spec(batch.inputs, batch.targets)
        batch.placements = [role_placements(r, tuple(t.shape), pm.mesh, pm.input_spec, tspec, pm.n_inputs)
                            for r, t in zip(_roles(pm, batch.inputs, batch.targets), leaves)]
    else:  # local pieces: normalised by prepare; their units and groups fit the global shapes they make?
        for pl, t, name in zip(batch.placements, leaves, leaf_names(pm, batch.inputs, batch.targets)):
            check_fits(pl, pm.mesh, tuple(t.shape), name)
    return batch.placements


def prepare(pm, args) -> Batch:
    n = pm.n_inputs
    if pm.inputs_mode == "global":
        return Batch(tuple(args[:n]), tuple(args[n:]))
    per_rank = _per_rank(pm, args)
    first = per_rank[min(per_rank)]
    inputs, targets = tuple(first[:n]), tuple(first[n:])
    tspec = pm._target_spec(inputs, targets)  # a target follows an input of its (local) shape
    roles = _roles(pm, inputs, targets)
    leaves = {r: leaves_of((tuple(a[:n]), {})) + leaves_of(tuple(a[n:])) for r, a in per_rank.items()}
    mine = leaves[min(leaves)]
    pls = [role_placements(role, t.dim(), pm.mesh, pm.input_spec, tspec, n) for role, t in zip(roles, mine)]
    infos = pm.backend.gather_infos(leaves, [has_replicas(pl, pm.mesh) for pl in pls])
    shapes = resolve_local(infos, pm.mesh, pls, [describe_role(r) for r in roles], [t.dtype for t in mine])
    stand_ins = iter([torch.empty(s, dtype=t.dtype, device="meta") for s, t in zip(shapes, mine)])
    glob_in, glob_tg = pytree.tree_map(lambda x: next(stand_ins) if isinstance(x, torch.Tensor) else x,
                                       (inputs, targets))
    local = {r: (tuple(a[:n]), tuple(a[n:])) for r, a in per_rank.items()}
    return Batch(tuple(glob_in), tuple(glob_tg), local, tspec, pls)


def check_same_inputs(pm, plan, batch: Batch) -> None:
    """inputs="global" on the torch backend, first step of each plan: every rank was handed the
    same tensors (one small all-gather of shapes and checksums; collective)."""
    if batch.local is not None or len(pm.backend.ranks) == pm.mesh.size or getattr(plan, "inputs_checked", False):
        return
    leaves = leaves_of((batch.inputs, {})) + leaves_of(batch.targets)
    infos = pm.backend.gather_infos({pm.backend.ranks[0]: leaves})
    check_same(infos, leaf_names(pm, batch.inputs, batch.targets))
    plan.inputs_checked = True
