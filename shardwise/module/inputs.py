"""A ParallelModule's step arguments as the planner and the backends need them.

    step_inputs = StepInputs(model, mesh, n_inputs, input_placements, target_placements, mode, kwarg_names)
    batch = step_inputs.prepare(args, kwargs, backend)  # Batch: global (meta for local) + local pieces
    placements = step_inputs.leaf_placements(batch)     # every tensor leaf's, checked once per batch

A call's positional arguments are the model's first ``n_inputs`` inputs, then the loss's
targets; its keyword arguments are the model's keyword inputs (``pm.step(**batch)`` with a
Hugging Face batch). The ``Batch`` carries the inputs, keyword inputs and targets a plan is
traced and keyed with (global shapes; for ``inputs="local"`` meta stand-ins of the global shapes
the ranks' pieces make), and, for local inputs, each rank's own pieces. ``check_same_inputs`` is
the ``inputs="global"`` check of the first step of each plan. The checks themselves live in
run/inputs.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from ..core.errors import ShardingError
from ..core.layout import R, Shard
from ..core.mesh import Mesh
from ..run.inputs import check_mode, check_same, has_replicas, leaves_of, resolve_local
from ..trace.roles import flatten, forward_arg_names, input_roles, target_roles
from .spec import check_fits, check_input_keys, check_placements, describe_role, role_placements


def _plain_key(batch) -> tuple | None:
    """The shapes and dtypes of a batch of plain positional tensors (None for anything else)."""
    args = (*batch.inputs, *batch.targets)
    if not all(type(x) is torch.Tensor for x in args):
        return None
    return len(batch.inputs), tuple((tuple(x.shape), x.dtype) for x in args)


@dataclass
class Batch:
    """inputs / targets / kwargs: full tensors, or (local inputs) meta tensors of the global shapes.
    local: None, or {rank: (inputs, targets, kwargs)} of the pieces each rank held here was handed.
    target_spec: the target placements the local pieces were checked with (None: global).
    placements: every input and target tensor leaf's, normalised once (``leaf_placements``).
    notes: how placements not given were read (a target following the batch), for the plan."""

    inputs: tuple
    targets: tuple
    kwargs: dict = field(default_factory=dict)
    local: dict | None = None
    target_spec: dict | None = None
    placements: list | None = None
    notes: tuple = ()

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

    def __init__(self, model, mesh: Mesh, n_inputs: int, input_placements, target_placements, mode: str,
                 kwarg_names=()):
        self.model, self.mesh, self.n_inputs = model, mesh, n_inputs
        self.mode = check_mode(mode)
        self.input_spec = _keyed(input_placements, "input_placements")
        self.target_spec = _keyed(target_placements, "target_placements")
        self.names, _ = forward_arg_names(model)
        check_input_keys(self.input_spec, self.names, n_inputs, keywords=tuple(kwarg_names))
        self._read: dict = {}  # (counts, shapes, dtypes) of plain positional tensors -> (placements, notes)

    def _input(self, key, inputs: tuple, kwargs: dict):
        """The input placed under ``key`` (a positional index, a forward-arg or keyword name), or None."""
        if isinstance(key, int):
            return inputs[key] if -len(inputs) <= key < len(inputs) else None
        if key in kwargs:
            return kwargs[key]
        i = self.names.index(key) if key in self.names else None
        return inputs[i] if i is not None and i < len(inputs) else None

    def target_spec_for(self, inputs, targets, kwargs=None) -> tuple[dict, tuple]:
        """(target placements, notes): the explicit ones; else a target shaped like a placed input
        follows it; else, under ``inputs="local"``, a target whose leading dim is the placed inputs'
        local batch takes their batch placement (``_follows_batch``)."""
        spec, notes, kwargs = dict(self.target_spec), [], kwargs or {}
        for j, t in enumerate(targets):
            if j in spec or not isinstance(t, torch.Tensor):
                continue
            for k, pl in self.input_spec.items():
                x = self._input(k, inputs, kwargs)
                if isinstance(x, torch.Tensor) and x.shape == t.shape:
                    spec[j] = pl
                    break
            else:
                if self.mode == "local" and (found := self._follows_batch(j, t, inputs, kwargs)) is not None:
                    spec[j], note = found
                    notes.append(note)
        return spec, tuple(notes)

    def _follows_batch(self, j: int, t: torch.Tensor, inputs: tuple, kwargs: dict):
        """((placements, note) for target ``j``, whose leading dim is a rank's local batch: the
        mesh dims on which every placed input with that many rows on its sharded dim is sharded,
        as Shard(0) of the target), or None where no placed input says so. Placed inputs that
        disagree raise: the target must then be named."""
        if t.dim() == 0:
            return None
        votes = {}
        for k, spec in self.input_spec.items():
            x = self._input(k, inputs, kwargs)
            if not isinstance(x, torch.Tensor):
                continue
            pl = check_placements(spec, self.mesh, x.dim(), f"input {k!r}")
            dims = tuple(m for m, p in enumerate(pl) if getattr(p, "dim", None) is not None and p.dim < x.dim()
                         and x.shape[p.dim] == t.shape[0])
            if dims:
                votes[k] = dims
        if not votes:
            return None
        if len(set(votes.values())) > 1:
            raise ShardingError(
                f"target {j}: its leading dim ({t.shape[0]} rows here) matches the local batch of inputs sharded on "
                f"different mesh dims ({', '.join(f'{k!r} on {[self.mesh.names[m] for m in d]}' for k, d in votes.items())})",
                fix=f"name its placements: target_placements={{{j}: [...]}}")
        (key, dims), = list(votes.items())[:1]
        pl = tuple(Shard(0) if m in dims else R for m in range(self.mesh.ndim))
        return pl, (f"target {j} follows the batch of input {key!r}: {list(pl)} (inputs='local', target_placements "
                    "not given)")

    def _roles(self, inputs, targets, kwargs=None) -> list:
        return (input_roles(self.model, flatten((tuple(inputs), dict(kwargs or {}))))
                + target_roles(flatten(tuple(targets))))

    def leaf_names(self, inputs, targets, kwargs=None) -> list[str]:
        """How errors name the tensor leaves of (inputs, kwargs, targets), in trace order."""
        return [describe_role(r) for r in self._roles(inputs, targets, kwargs)]

    @staticmethod
    def _leaves(inputs, targets, kwargs) -> list:
        return leaves_of((tuple(inputs), dict(kwargs or {}))) + leaves_of(tuple(targets))

    def leaf_placements(self, batch: Batch) -> list:
        """Every input and target tensor leaf's placements, in trace order: the user's specs
        normalised and checked against the leaves' global shapes once per batch (at parallelize for
        the example inputs, or when a new signature is planned); the plan takes them as they are."""
        if batch.placements is None and batch.target_spec is None and not batch.kwargs:
            key = _plain_key(batch)  # the placements read from the same shapes are the same: read once
            if key is not None and key in self._read:
                placements, batch.notes = self._read[key]
                batch.placements = list(placements)
                return batch.placements
        leaves = self._leaves(batch.inputs, batch.targets, batch.kwargs)
        if batch.placements is None:
            key = _plain_key(batch) if batch.target_spec is None and not batch.kwargs else None
            if batch.target_spec is not None:
                tspec = batch.target_spec
            else:
                tspec, batch.notes = self.target_spec_for(batch.inputs, batch.targets, batch.kwargs)
            batch.placements = [role_placements(r, tuple(t.shape), self.mesh, self.input_spec, tspec, self.n_inputs)
                                for r, t in zip(self._roles(batch.inputs, batch.targets, batch.kwargs), leaves)]
            if key is not None:
                self._read[key] = (tuple(batch.placements), batch.notes)
        else:  # local pieces: normalised by prepare; their units and groups fit the global shapes they make?
            for pl, t, name in zip(batch.placements, leaves,
                                   self.leaf_names(batch.inputs, batch.targets, batch.kwargs)):
                check_fits(pl, self.mesh, tuple(t.shape), name)
        return batch.placements

    def prepare(self, args, kwargs, backend) -> Batch:
        """The Batch of one call's arguments (inputs, then targets; keyword inputs)."""
        n, kwargs = self.n_inputs, dict(kwargs or {})
        if self.mode == "global":
            return Batch(tuple(args[:n]), tuple(args[n:]), kwargs)
        per_rank = self._per_rank(args, kwargs, backend)
        first, kw = per_rank[min(per_rank)]
        inputs, targets = tuple(first[:n]), tuple(first[n:])
        tspec, notes = self.target_spec_for(inputs, targets, kw)  # by this rank's (local) shapes
        roles = self._roles(inputs, targets, kw)
        leaves = {r: self._leaves(a[:n], a[n:], k) for r, (a, k) in per_rank.items()}
        mine = leaves[min(leaves)]
        pls = [role_placements(role, t.dim(), self.mesh, self.input_spec, tspec, n) for role, t in zip(roles, mine)]
        infos = backend.gather_infos(leaves, [has_replicas(pl, self.mesh) for pl in pls])
        shapes = resolve_local(infos, self.mesh, pls, [describe_role(r) for r in roles], [t.dtype for t in mine])
        stand_ins = iter([torch.empty(s, dtype=t.dtype, device="meta") for s, t in zip(shapes, mine)])
        glob_in, glob_kw, glob_tg = pytree.tree_map(lambda x: next(stand_ins) if isinstance(x, torch.Tensor) else x,
                                                    (inputs, kw, targets))
        local = {r: (tuple(a[:n]), tuple(a[n:]), k) for r, (a, k) in per_rank.items()}
        return Batch(tuple(glob_in), tuple(glob_tg), dict(glob_kw), local, tspec, pls, notes)

    def _per_rank(self, args, kwargs: dict, backend) -> dict:
        """inputs="local": {rank held here: (that rank's positional arguments, its keyword inputs)}."""
        ranks = backend.ranks
        if len(ranks) < self.mesh.size:  # torch backend: this process's rank
            return {ranks[0]: (tuple(args), kwargs)}
        n = self.mesh.size
        for what, a in [*((f"argument {i}", a) for i, a in enumerate(args)),
                        *((f"keyword input {k!r}", a) for k, a in kwargs.items())]:
            if not isinstance(a, (list, tuple)) or len(a) != n:
                got = f"a {type(a).__name__} of length {len(a)}" if isinstance(a, (list, tuple)) else type(a).__name__
                raise ShardingError(
                    f'inputs="local" on the {backend.name} backend: {what} must be a list of {n} per-rank '
                    f"values (every rank of mesh {self.mesh.shape} runs in this process), got {got}",
                    fix="pass [piece of rank 0, piece of rank 1, ...] for every argument, or use inputs='global'")
        return {r: (tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)}

    def check_same_inputs(self, backend, executable, batch: Batch) -> None:
        """inputs="global" on the torch backend, first step of each plan: every rank was handed the
        same tensors (one small all-gather of shapes and checksums; collective)."""
        if executable.inputs_checked:
            return
        if batch.local is None and len(backend.ranks) < self.mesh.size:  # else each rank's own, or all here
            leaves = self._leaves(batch.inputs, batch.targets, batch.kwargs)
            infos = backend.gather_infos({backend.ranks[0]: leaves})
            check_same(infos, self.leaf_names(batch.inputs, batch.targets, batch.kwargs))
        executable.inputs_checked = True  # checked, or nothing to check: the same for every later run
