"""What every figure of the cluster calculator must satisfy, checked where the figures are made.

    check_layout(layout, budget)      # one candidate: memory parts, resident state, reserve
    check_estimate(est)               # the chosen one's fit, and the candidates' total work alike

A figure that breaks one of these cannot be true (a negative activation figure is a wrong
formula, not a small number), so the calculator raises ``FiguresError`` naming the layout and
the figures instead of printing them:

- every memory part (parameters, gradients, optimizer state, activations, the reserve) >= 0;
- the live peak is the sum of its parts and holds at least the resident state (parameters and
  optimizer state);
- what the caching allocator reserves is at least the live peak (it never holds less than it
  serves);
- ``fits`` is exactly "the chosen layout's live peak is within the budget";
- the step's total work (model flops per GPU x GPUs, recomputation apart) is the same for every
  layout of the same step within ``WORK_TOLERANCE``, once a layout that computes whole on some
  mesh dims on purpose (``Layout.replicated``: FSDP on a mesh with a "tp" dim it leaves idle) is
  divided by that replication; the step's work is the model's flops on one device where known
  (``step_work``), else the least of the layouts'.
"""
from __future__ import annotations

import math

from ...core.errors import ShardingError

WORK_TOLERANCE = 0.15
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations")
_SLACK = 1e-6  # relative: sums of float bytes


class FiguresError(ShardingError):
    """The calculator made a figure that cannot be true (module docstring): a bug to report."""


def _fail(what: str, layout) -> None:
    raise FiguresError(f"the {layout.name} layout's figures cannot be true: {what}",
                       fix="report it with the command line (tools/cluster/invariants.py names the invariant); "
                           "leave that layout out with --layout meanwhile")


def check_layout(layout, budget: float) -> None:
    """One candidate's memory figures (module docstring)."""
    mem = layout.memory
    for part in (*MEMORY_PARTS, "reserved"):
        if part in mem and not mem[part] >= 0:
            _fail(f"{part} is {mem[part] / 2 ** 30:.2f} GiB, below zero", layout)
    peak = mem["peak"]
    parts = sum(mem[p] for p in MEMORY_PARTS)
    if not math.isclose(peak, parts, rel_tol=_SLACK, abs_tol=1.0):
        _fail(f"the peak {peak / 2 ** 30:.2f} GiB is not the sum of its parts ({parts / 2 ** 30:.2f} GiB)", layout)
    resident = mem["parameters"] + mem["optimizer_state"]
    if peak < resident * (1 - _SLACK):
        _fail(f"the live peak {peak / 2 ** 30:.2f} GiB is below the resident state (parameters and optimizer "
              f"state, {resident / 2 ** 30:.2f} GiB)", layout)
    if mem.get("reserved") is not None and mem["reserved"] < peak * (1 - _SLACK):
        _fail(f"the caching allocator's reserve {mem['reserved'] / 2 ** 30:.2f} GiB is below the live peak "
              f"{peak / 2 ** 30:.2f} GiB", layout)


def total_work(layout, gpus: int) -> float:
    """Model flops of the step over ``gpus`` GPUs, less what ``layout`` replicates on purpose."""
    return layout.figures.flops * gpus / math.prod(layout.replicated.values())


def step_work(layouts: list, work: dict) -> float:
    """The step's work every layout's total is held to: the model's flops on one device
    (``Figures.whole_flops``, the same traced step whatever the layout), where the figures carry it
    and no layout is pipelined; else the least of the layouts' totals. Not the least total, where
    the model's count is known: a layout that replicates on purpose (FSDP leaving "tp" idle) may
    still split part of the compute on that dim (Llama 3.1 70B on 32 x 8: its parameters sliced
    there before their gather, 1.99x the step's flops, not 8x), so its total divided by the
    replication undercut the step's and made layouts that split the compute as their name
    promises read ~4x above it."""
    whole = [getattr(lay.figures, "whole_flops", 0.0) for lay in layouts]
    if all(w > 0 for w in whole) and not any(getattr(lay, "pipeline", None) for lay in layouts):
        return max(whole)
    return min(work.values())


def mark_excess_work(layouts: list, gpus: int) -> None:
    """Set each layout's ``excess_work``: its total work over the step's (``step_work``) where that
    is more than ``WORK_TOLERANCE`` above it (a plan that computes on some ranks what others
    compute too, not on purpose: the figures are its program's, but not the layout its name
    promises), else None. Such a layout is said so in the report and not chosen while another is
    within the tolerance (calc.estimate)."""
    work = {id(lay): total_work(lay, gpus) for lay in layouts}
    least = step_work(layouts, work)
    for lay in layouts:
        ratio = work[id(lay)] / least if least > 0 else 1.0
        lay.excess_work = ratio if ratio > 1 + WORK_TOLERANCE else None


def check_estimate(est) -> None:
    """Every candidate's memory (``check_layout``), the fit, and the work: every layout more than
    ``WORK_TOLERANCE`` above the least says so (``mark_excess_work``), and the chosen one is
    within it unless every candidate is above."""
    for lay in est.candidates:
        check_layout(lay, est.budget)
    if est.fits != (est.layout.memory["peak"] <= est.budget):
        raise FiguresError(f"fits is {est.fits} but the {est.layout.name} layout's live peak is "
                           f"{est.layout.memory['peak'] / 2 ** 30:.2f} GiB against a budget of "
                           f"{est.budget / 2 ** 30:.2f} GiB", fix="report it with the command line")
    gpus = est.mesh.size
    work = {id(lay): total_work(lay, gpus) for lay in est.candidates}
    least = step_work(est.candidates, work)
    for lay in est.candidates:
        said = getattr(lay, "excess_work", None)
        over = work[id(lay)] > least * (1 + WORK_TOLERANCE)
        if over != (said is not None):
            _fail(f"its step's total work is {work[id(lay)] / least:.2f}x the step's and it "
                  f"{'does not say so' if over else 'says otherwise'}", lay)
    if est.layout.excess_work is not None and any(c.excess_work is None for c in est.candidates):
        _fail("chosen though it does more than the step's work and another candidate does not", est.layout)


__all__ = ["FiguresError", "MEMORY_PARTS", "WORK_TOLERANCE", "check_estimate", "check_layout", "mark_excess_work", "step_work",
           "total_work"]
