"""Every process of a torch backend plans on its own, from the same model, inputs and options: the
planners are deterministic, so the plans are the same, except where the ILP stopped at its time limit
(plan_time_limit: CPU seconds, search/solve.py Budget), which a process may reach a round earlier. Ranks with different plans
would run programs whose collectives do not meet: a hang until the collective timeout, or, where the
shapes happen to agree, wrong numbers. So at a plan's first run (every rank runs it then: the check
is collective, where making a plan is not, e.g. ``pm.plan`` read on rank 0 alone) its digest is
compared across the mesh (one all_reduce of two int64s per plan, not per step), and a difference
raises on every rank.

    check_same_plan(backend, plan, device)     # PlanMismatchError unless every rank made this plan
"""
from __future__ import annotations

import hashlib

import torch

from ..core.errors import PlanMismatchError


def plan_digest(plan) -> int:
    """A 56-bit digest of what decides the program: every node's strategy (input and output
    placements), the parameters' chosen placements and the blocks recomputed. Built from the
    placements' reprs, so it is the same in every process (no str hash)."""
    h = hashlib.blake2b(digest_size=7)
    prop = plan.prop
    for name, np_ in prop.nodes.items():
        h.update(f"{name}|{np_.strategy.ins!r}|{np_.strategy.outs!r}\n".encode())
    for name, pl in sorted((getattr(plan, "param_choices", None) or {}).items()):
        h.update(f"param {name}|{tuple(pl)!r}\n".encode())
    h.update(f"recomputed {sorted(getattr(prop, 'recomputed', None) or ())!r}".encode())
    return int.from_bytes(h.digest(), "big")


def check_same_plan(backend, plan, device=None) -> None:
    """Collective on the torch backend (every rank runs a plan for the first time at the same call): raise
    PlanMismatchError on every rank unless all made ``plan``'s digest. One process holding every
    rank (the threads backend) made one plan for all: nothing to compare."""
    ranks = list(getattr(backend, "ranks", ()))
    if len(ranks) >= backend.mesh.size:
        return
    d = plan_digest(plan)
    mine = torch.tensor([d, -d], dtype=torch.int64, device=device or "cpu")
    got = backend.reduce({r: mine.clone() for r in ranks}, "max")
    if int(got[0]) == d and -int(got[1]) == d:
        return
    report = getattr(plan.prop, "solve_report", None)
    status = f" (this rank's planner: {report.status})" if report is not None else ""
    raise PlanMismatchError(
        f"rank {ranks[0]} planned this {plan.stage} differently from another rank{status}: their programs "
        "would not meet", fix="the ILP stops at a time limit (plan_time_limit, CPU seconds), which some ranks "
        "may reach a round earlier: raise plan_time_limit, plan with planner='propagate' (no time limit), give the "
        "ranks' processes their own CPUs while they plan, or place the parameters yourself (param_placements) so "
        "less is searched")
