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
``pm.step`` then takes its full path, which plans or picks the plan as before.
"""
from __future__ import annotations

from operator import attrgetter

import torch

from .inputs import Batch

_training, _requires_grad = attrgetter("training"), attrgetter("requires_grad")
_shape = attrgetter("shape", "dtype")


class SteadyStep:
    """``pm.step``'s work for ``plan`` on positional tensors of the signature it was run with."""

    def __init__(self, pm, plan, executable, given: tuple):
        planning = pm.planning
        self.pm, self.plan, self.planning = pm, plan, planning
        self.n_args, self.n_inputs = len(given), pm.step_inputs.n_inputs
        self.types, self.shapes = [torch.Tensor] * len(given), list(map(_shape, given))
        self.programs = executable.steady_programs
        self.arg_plans = {r: executable.arg_plan(r) for r in self.programs}
        self.changes = planning.changes
        self.modes, self.trainable = list(planning.modes()), list(planning.trainable())
        self.modules, self.params = planning._modules, planning._params  # (listed by the calls above)
        self.draws = plan.draws_random

    @classmethod
    def of(cls, pm, plan, batch) -> SteadyStep | None:
        """The steady step of the plan ``pm.step`` just ran on ``batch``, or None where its next
        steps need the full path: keyword or nested inputs, local inputs, a pipeline, ranks still
        checking their guards, arguments not taken by the plain-tensor fast path."""
        executable = pm._executables.get(plan)
        if (pm.planning.pipeline is not None or pm.step_inputs.mode != "global" or batch.kwargs
                or executable is None or executable.steady_programs is None or pm._followed is not plan):
            return None
        given = (*batch.inputs, *batch.targets)
        if any(type(x) is not torch.Tensor for x in given):
            return None
        if any(executable.arg_plan(r) is None for r in executable.steady_programs):
            return None
        return cls(pm, plan, executable, given)

    def __call__(self, args: tuple, kwargs: dict):
        """The step's loss, or None where the full path must run it."""
        # what Planning.step_key reads, compared by map in C against this plan's values: a step's
        # fixed cost is mostly how much Python it runs, from caches the collectives left cold
        if (kwargs or len(args) != self.n_args or self.planning.changes != self.changes
                or list(map(type, args)) != self.types or list(map(_shape, args)) != self.shapes
                or list(map(_training, self.modules)) != self.modes
                or list(map(_requires_grad, self.params)) != self.trainable):
            return None
        pm, n = self.pm, self.n_inputs
        inputs, targets, shards, arg_plans = args[:n], args[n:], pm._shards, self.arg_plans
        outs = pm.backend.run(self.programs, lambda r: arg_plans[r].args(shards[r], inputs, targets), self.draws)
        pm._last_plan = self.plan
        return pm._finish_step(self.plan, outs, lambda: Batch(inputs, targets, {}))
