"""A ParallelModule's step arguments as the planner and the backends need them.

    step_inputs = StepInputs(model, mesh, n_inputs, input_placements, target_placements, mode)
    batch = step_inputs.prepare(args, backend)        # Batch: global (meta for local) + local pieces
    placements = step_inputs.leaf_placements(batch)   # every tensor leaf's, checked once per batch

The ``Batch`` carries the inputs and targets a plan is traced and keyed with (global shapes;
for ``inputs="local"`` meta stand-ins of the global shapes the ranks' pieces make), and, for
local inputs, each rank's own pieces. ``check_same_inputs`` is the ``inputs="global"`` check of
the first step of each plan. The checks themselves live in run/inputs.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..core.errors import ShardingError
from ..core.mesh import Mesh
from ..run.inputs import check_mode, check_same, has_replicas, leaves_of, resolve_local
from ..trace.roles import flatten, forward_arg_names, input_roles, target_roles
from .spec import check_fits, check_input_keys, describe_role, role_placements


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


def _keyed(spec, what: str) -> dict:
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise ShardingError(f"{what} must be a dict keyed by forward-arg name or index, got {type(spec).__name__}",
                            fix=f"e.g. {what}={{'x': [sw.Shard(0)]}}")
    return dict(spec)


class StepInputs:
    """How one ParallelModule reads a step's arguments: the first ``n_inputs`` are the model's
    inputs, the rest the loss's targets; their placements (by forward-arg name or index), and
    whether each rank passes the full tensors ("global") or its own piece ("local")."""

    def __init__(self, model, mesh: Mesh, n_inputs: int, input_placements, target_placements, mode: str):
        self.model, self.mesh, self.n_inputs = model, mesh, n_inputs
        self.mode = check_mode(mode)
        self.input_spec = _keyed(input_placements, "input_placements")
        self.target_spec = _keyed(target_placements, "target_placements")
        self.names, _ = forward_arg_names(model)
        check_input_keys(self.input_spec, self.names, n_inputs)

    def target_spec_for(self, inputs, targets) -> dict:
        """Explicit target placements, else a target shaped like a placed input follows it."""
        spec = dict(self.target_spec)
        for j, t in enumerate(targets):
            if j in spec or not isinstance(t, torch.Tensor):
                continue
            for k, pl in self.input_spec.items():
                x = inputs[k if isinstance(k, int) else self.names.index(k)]
                if isinstance(x, torch.Tensor) and x.shape == t.shape:
                    spec[j] = pl
                    break
        return spec

    def _roles(self, inputs, targets) -> list:
        return input_roles(self.model, flatten((tuple(inputs), {}))) + target_roles(flatten(tuple(targets)))

    def leaf_names(self, inputs, targets) -> list[str]:
        """How errors name the tensor leaves of (inputs, targets), in trace order."""
        return [describe_role(r) for r in self._roles(inputs, targets)]

    def leaf_placements(self, batch: Batch) -> list:
        """Every input and target tensor leaf's placements, in trace order: the user's specs
        normalised and checked against the leaves' global shapes once per batch (at parallelize for
        the example inputs, or when a new signature is planned); the plan takes them as they are."""
        leaves = leaves_of((batch.inputs, {})) + leaves_of(batch.targets)
        if batch.placements is None:
            tspec = batch.target_spec if batch.target_spec is not None else self.target_spec_for(batch.inputs,
                                                                                                  batch.targets)
            batch.placements = [role_placements(r, tuple(t.shape), self.mesh, self.input_spec, tspec, self.n_inputs)
                                for r, t in zip(self._roles(batch.inputs, batch.targets), leaves)]
        else:  # local pieces: normalised by prepare; their units and groups fit the global shapes they make?
            for pl, t, name in zip(batch.placements, leaves, self.leaf_names(batch.inputs, batch.targets)):
                check_fits(pl, self.mesh, tuple(t.shape), name)
        return batch.placements

    def prepare(self, args, backend) -> Batch:
        """The Batch of one call's arguments (inputs, then targets)."""
        n = self.n_inputs
        if self.mode == "global":
            return Batch(tuple(args[:n]), tuple(args[n:]))
        per_rank = self._per_rank(args, backend)
        first = per_rank[min(per_rank)]
        inputs, targets = tuple(first[:n]), tuple(first[n:])
        tspec = self.target_spec_for(inputs, targets)  # a target follows an input of its (local) shape
        roles = self._roles(inputs, targets)
        leaves = {r: leaves_of((tuple(a[:n]), {})) + leaves_of(tuple(a[n:])) for r, a in per_rank.items()}
        mine = leaves[min(leaves)]
        pls = [role_placements(role, t.dim(), self.mesh, self.input_spec, tspec, n) for role, t in zip(roles, mine)]
        infos = backend.gather_infos(leaves, [has_replicas(pl, self.mesh) for pl in pls])
        shapes = resolve_local(infos, self.mesh, pls, [describe_role(r) for r in roles], [t.dtype for t in mine])
        stand_ins = iter([torch.empty(s, dtype=t.dtype, device="meta") for s, t in zip(shapes, mine)])
        glob_in, glob_tg = pytree.tree_map(lambda x: next(stand_ins) if isinstance(x, torch.Tensor) else x,
                                           (inputs, targets))
        local = {r: (tuple(a[:n]), tuple(a[n:])) for r, a in per_rank.items()}
        return Batch(tuple(glob_in), tuple(glob_tg), local, tspec, pls)

    def _per_rank(self, args, backend) -> dict:
        """inputs="local": {rank held here: that rank's arguments}."""
        ranks = backend.ranks
        if len(ranks) < self.mesh.size:  # torch backend: this process's rank
            return {ranks[0]: tuple(args)}
        n = self.mesh.size
        for i, a in enumerate(args):
            if not isinstance(a, (list, tuple)) or len(a) != n:
                got = f"a {type(a).__name__} of length {len(a)}" if isinstance(a, (list, tuple)) else type(a).__name__
                raise ShardingError(
                    f'inputs="local" on the {backend.name} backend: argument {i} must be a list of {n} per-rank '
                    f"values (every rank of mesh {self.mesh.shape} runs in this process), got {got}",
                    fix="pass [piece of rank 0, piece of rank 1, ...] for every argument, or use inputs='global'")
        return {r: tuple(a[r] for a in args) for r in range(n)}

    def check_same_inputs(self, backend, executable, batch: Batch) -> None:
        """inputs="global" on the torch backend, first step of each plan: every rank was handed the
        same tensors (one small all-gather of shapes and checksums; collective)."""
        if batch.local is not None or len(backend.ranks) == self.mesh.size or executable.inputs_checked:
            return
        leaves = leaves_of((batch.inputs, {})) + leaves_of(batch.targets)
        infos = backend.gather_infos({backend.ranks[0]: leaves})
        check_same(infos, self.leaf_names(batch.inputs, batch.targets))
        executable.inputs_checked = True
