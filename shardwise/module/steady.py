"""The steady step: ``pm.step`` on a plan that already ran, as few Python steps as can tell it is
the same plan.

A full step builds the call's Batch, the plan key (every submodule's training flag, every
parameter's requires_grad, the arguments' shapes and dtypes), looks the plan up, checks whether
the shards follow it, and only then runs the rank's program. Once a plan has run and every rank
here passed its guards, a SteadyStep keeps what that lookup found and checks only what could
pick another plan (the same facts, compared in place with the plan's values: no key built or
hashed), so the fixed Python of a step (what weighs most per op on a small program, run from
cold caches between collectives) is a few comparisons, the inputs' slices, the program and the
gradients. Anything it does not recognise (keyword inputs, a tensor subclass, another shape or
dtype, a mode or requires_grad flipped, placements the planner changed) returns None:
``pm.step`` then takes its full path, which plans or picks the plan as before. With
``inputs="local"`` (LocalSteadyStep) the ranks first agree, in one small all-gather, that
every rank's pieces are still the plan's.
"""
from __future__ import annotations

from operator import attrgetter

import torch

from ..core.layout import Layout
from ..run.inputs import checksum, chunk_holders, has_replicas
from ..trace.value_guards import check_call
from .inputs import Batch

_training, _requires_grad = attrgetter("training"), attrgetter("requires_grad")
_shape = attrgetter("shape", "dtype")


class SteadyStep:
    """``pm.step``'s work for ``plan`` on positional tensors of the signature it was run with."""

    def __init__(self, pm, plan, executable, given: tuple, arg_plans: dict):
        planning = pm.planning
        self.pm, self.plan, self.planning = pm, plan, planning
        self.n_args, self.n_inputs = len(given), pm.step_inputs.n_inputs
        self.types, self.shapes = [torch.Tensor] * len(given), list(map(_shape, given))
        self.programs, self.arg_plans = executable.steady_programs, arg_plans
        self.changes = planning.changes
        self.modes, self.trainable = list(planning.modes()), list(planning.trainable())
        self.modules, self.params = planning._modules, planning._params  # (listed by the calls above)
        self.draws = plan.draws_random

    @classmethod
    def of(cls, pm, plan, batch) -> SteadyStep | None:
        """The steady step of the plan ``pm.step`` just ran on ``batch``, or None where its next
        steps need the full path: keyword or nested inputs, a pipeline, ranks still checking their
        guards, arguments not taken by the plain-tensor fast path."""
        executable = pm._executables.get(plan)
        if (pm.planning.pipeline is not None or batch.kwargs
                or executable is None or executable.steady_programs is None or pm._followed is not plan):
            return None
        if batch.local is not None:
            return LocalSteadyStep.of(pm, plan, executable, batch)
        given = (*batch.inputs, *batch.targets)
        if any(type(x) is not torch.Tensor for x in given):
            return None
        arg_plans = {r: executable.arg_plan(r) for r in executable.steady_programs}
        if any(a is None for a in arg_plans.values()):
            return None
        return cls(pm, plan, executable, given, arg_plans)

    def _same_model(self, args: tuple, kwargs: dict) -> bool:
        """What Planning.step_key reads besides the arguments' shapes, compared by map in C against
        this plan's values: a step's fixed cost is mostly how much Python it runs, from caches the
        collectives left cold."""
        return (not kwargs and len(args) == self.n_args and self.planning.changes == self.changes
                and list(map(_training, self.modules)) == self.modes
                and list(map(_requires_grad, self.params)) == self.trainable)

    def __call__(self, args: tuple, kwargs: dict):
        """The step's loss, or None where the full path must run it."""
        if (not self._same_model(args, kwargs) or list(map(type, args)) != self.types
                or list(map(_shape, args)) != self.shapes):
            return None
        n, shards, arg_plans = self.n_inputs, self.pm._shards, self.arg_plans
        inputs, targets = args[:n], args[n:]
        check_call(self.plan.traced.gm, self.plan.traced.args, inputs, targets)  # (a value the model read)
        return self._run(lambda r: arg_plans[r].args(shards[r], inputs, targets), lambda: Batch(inputs, targets, {}))

    def _run(self, args_of, batch_of):
        """The plan's programs on ``args_of(rank)``, then the step's tail (ParallelModule._finish_step)."""
        outs = self.pm.backend.run(self.programs, args_of, self.draws)
        self.pm._last_plan = self.plan
        return self.pm._finish_step(self.plan, outs, batch_of)


class LocalSteadyStep(SteadyStep):
    """inputs="local": each rank passes its own pieces. No rank can tell alone that another's piece
    changed (8 rows -> 7 on 2 ranks leaves rank 0's 4 rows as they were), so each step the ranks
    agree in one small all-gather (``backend.gather_rows``) instead of the full path's exchange of
    every piece's shape: each rank says whether its pieces have the plan's local shapes and dtypes
    and the model its flags, and gives the checksum of each piece other ranks hold alike (a mesh dim
    that does not shard it). A flag down anywhere, or holders' checksums apart, and every rank (each
    reads the same rows) takes the full path, which plans anew or names what differs. Once made it
    gathers every step whatever this rank found: a rank that skipped it would meet the others'
    gather with its full path's."""

    def __init__(self, pm, plan, executable, batch, arg_plan):
        pieces = {r: (*i, *t) for r, (i, t, _) in batch.local.items()}
        super().__init__(pm, plan, executable, pieces[min(pieces)], {r: arg_plan for r in executable.steady_programs})
        mesh, self.backend = pm.mesh, pm.backend
        self.shapes_of = {r: list(map(_shape, p)) for r, p in pieces.items()}
        self.one_rank = len(self.backend.ranks) < mesh.size  # the torch backend: this process's rank
        self.glob_in, self.glob_tg = batch.inputs, batch.targets  # (meta tensors of the global shapes)
        glob = (*batch.inputs, *batch.targets)
        self.summed = [i for i, pl in enumerate(batch.placements) if has_replicas(pl, mesh)]
        self.holders = []  # per summed piece: (its checksum's columns, each rank's first holder of its chunk)
        for col, i in enumerate(self.summed):
            rep = chunk_holders(Layout(tuple(glob[i].shape), glob[i].dtype, batch.placements[i]), mesh)
            self.holders.append((slice(1 + 2 * col, 3 + 2 * col), torch.tensor(rep)))
        self.down = torch.zeros(1 + 2 * len(self.summed), dtype=torch.int64)

    @classmethod
    def of(cls, pm, plan, executable, batch) -> LocalSteadyStep | None:
        given = [x for i, t, _ in batch.local.values() for x in (*i, *t)]
        arg_plan = executable.local_arg_plan()
        if arg_plan is None or any(type(x) is not torch.Tensor for x in given):
            return None
        return cls(pm, plan, executable, batch, arg_plan)

    def _pieces(self, args: tuple) -> dict | None:
        """{rank held here: its positional tensors}, as ``StepInputs._per_rank`` reads them."""
        ranks = self.backend.ranks
        if self.one_rank:
            return {ranks[0]: args}
        if any(type(a) not in (list, tuple) or len(a) != len(ranks) for a in args):
            return None
        return {r: tuple(a[r] for a in args) for r in ranks}

    def _row(self, piece) -> torch.Tensor:
        """This rank's say: [1, checksums of its pieces held alike], or all zeros."""
        if piece is None:
            return self.down
        return torch.tensor([1, *(v for i in self.summed for v in checksum(piece[i]))], dtype=torch.int64)

    def __call__(self, args: tuple, kwargs: dict):
        pieces = self._pieces(args) if self._same_model(args, kwargs) else None
        rows = {}
        for r in self.backend.ranks:
            p = None if pieces is None else pieces[r]
            ok = p is not None and list(map(type, p)) == self.types and list(map(_shape, p)) == self.shapes_of[r]
            rows[r] = self._row(p if ok else None)
        got = self.backend.gather_rows(rows)  # (collective on the torch backend)
        if not (bool(got[:, 0].all()) and all(torch.equal(got[:, c], got[rep, c]) for c, rep in self.holders)):
            return None
        n, shards, arg_plans = self.n_inputs, self.pm._shards, self.arg_plans
        local = {r: (p[:n], p[n:], {}) for r, p in pieces.items()}
        return self._run(lambda r: arg_plans[r].args(shards[r], *local[r][:2]),
                         lambda: Batch(self.glob_in, self.glob_tg, {}, local))
