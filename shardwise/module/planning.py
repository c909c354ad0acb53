"""The ILP planner as parallelize runs it: search/solve.py's rounds from propagation's plan, and
under ``memory_budget`` each plan found lowered and cut against its liveness estimate
(lower/memory.py) until one fits: plan -> lower -> plan again, so it sits beside the pipeline
(as module/parallel_module.py), and search/ imports nothing from lower/ (docs/architecture.md)."""
from __future__ import annotations

import math
import time

import torch.fx as fx

from ..core.layout import Replicate
from ..lower.plan import Plan
from ..search.budget import MemoryBudgetError, MemoryRows
from ..search.layers import repeated_layers
from ..search.params import with_choices
from ..search.propagate import Planner, Propagation
from ..search.solve import MAX_CUTS, MAX_ROUNDS, TIME_LIMIT_S, Infeasible, Search, SolveReport, plan_cost


def solve(planner: Planner, gm: fx.GraphModule, placeholder_placements: dict, output_placements: list,
          params=(), time_limit: float = TIME_LIMIT_S, max_rounds: int = MAX_ROUNDS, free: dict | None = None,
          grads: dict | None = None, memory: MemoryRows | None = None) -> Propagation:
    """The Propagation of the ILP's choices; ``prop.solve_report`` says how it went.

    ``free`` ({placeholder: candidate placements}, search/params.py) are parameters whose placement
    the program chooses too (``grads``: {graph output index: placeholder} of their gradients);
    ``prop.param_choices`` ({placeholder: placements}) says what it chose. ``memory``
    (search/budget.py) bounds the bytes per rank: cuts at the estimate's peak until the plan's
    liveness estimate (estimate_peak) fits, at most MAX_CUTS; MemoryBudgetError when no plan can."""
    free, grads = free or {}, grads or {}
    cpu0 = time.process_time()
    greedy = planner.run(gm, placeholder_placements, output_placements, params=params)
    report = SolveReport(propagation_cost_s=plan_cost(planner, greedy))
    search = Search(planner, gm, placeholder_placements, output_placements, free, grads, memory, report,
                    time.perf_counter() + time_limit, max_rounds)
    search.aliases = repeated_layers(gm, params if isinstance(params, dict) else {}, placeholder_placements, free)
    placed = {name: tuple(placeholder_placements.get(name) or (Replicate(),) * planner.mesh.ndim) for name in free}
    incumbent = ({name: np_.strategy for name, np_ in greedy.nodes.items()}, placed, report.propagation_cost_s)
    greedy_fits = memory is None or _cut(memory, greedy, params, correct=False)
    if not greedy_fits:
        incumbent = incumbent[:2] + (math.inf,)
    fits = False
    for _ in range(MAX_CUTS if memory is not None else 1):
        try:
            choices, placed, objective = search.rounds(incumbent)
        except Infeasible:
            break
        ph, outs = with_choices(placeholder_placements, output_placements, placed, grads)
        best = planner.run(gm, ph, outs, params=params, choices=choices)
        best.param_choices = placed
        fits = memory is None or _cut(memory, best, params)
        if fits:
            break
        incumbent = (choices, placed, math.inf)  # over budget: a start, never kept for its cost
    if not fits:  # memory_budget: the cuts did not end in a plan that fits; the least-memory plan may
        best = search.least_plan(incumbent[0], params)
        least = None if best is None else estimate_peak(best, params, memory)[0]
        if least is None or least > memory.budget:
            raise _over_budget(memory, least)
        report.status = "memory_budget: the plan with the least memory"
        objective = plan_cost(planner, best)
    report.objective_s, report.cost_s = objective, plan_cost(planner, best)
    if report.cost_s > report.propagation_cost_s and greedy_fits:  # the program mispriced a plan: keep the cheaper
        report.status += f"; propagation kept, the ILP's plan costs {report.cost_s * 1e6:.3f} us"
        best, report.cost_s = greedy, report.propagation_cost_s
        best.param_choices = {name: placeholder_placements.get(name) or (Replicate(),) * planner.mesh.ndim
                              for name in free}
    report.cpu_s = time.process_time() - cpu0
    best.solve_report = report
    return best


def _cut(memory: MemoryRows, prop: Propagation, params, correct: bool = True) -> bool:
    """True when ``prop``'s liveness estimate fits the budget; else a row at its peak, and
    (``correct``: a plan the program chose under the rows) each row's bound lowered by what the
    estimate holds there beyond the row for ``prop``. Bounds only tighten, so the cuts end."""
    peak, point, curve = estimate_peak(prop, params, memory)
    if peak <= memory.budget:
        return True
    if point is not None and point not in memory.points:
        memory.points.append(point)
    for p in memory.points if correct else ():
        if p in curve:
            memory.correction[p] = max(memory.correction.get(p, 0.0), curve[p] - memory.value(p, prop))
    return False


def estimate_peak(prop, params: dict, memory: MemoryRows) -> tuple:
    """(bytes per rank at the peak, optimizer state included, as Plan.stats() counts them; the
    graph node at that peak; {graph node: bytes while it runs}) of a planned Propagation,
    from the plan's liveness estimate (lower/memory.py) on its busiest rank."""
    plan = Plan(prop, params, debug=False, stage="step" if memory.training else "forward",
                bucket_bytes=memory.bucket_bytes)
    mem = plan.memory()
    optimizer = plan.cost.optimizer_bytes(mem["parameters"]) if memory.training else 0
    est = plan.memory_estimate(mem["rank"])
    order = [n.name for n in plan.program_module(mem["rank"], guards=False).graph.nodes]
    curve = {name: b + optimizer for name, b in est.curve if name in memory.order}
    return mem["peak"] + optimizer, memory.point_of(est.peak_node, order), curve


def _over_budget(memory: MemoryRows, least) -> MemoryBudgetError:
    found = (f"the plan with the least memory found needs an estimated {int(least)} bytes per rank" if least
             else "no plan was found")
    return MemoryBudgetError(
        f"memory_budget {int(memory.budget)} bytes per rank cannot be met: {found} (parameters, gradients, optimizer "
        "state, live activations at the peak)",
        fix=(f"raise memory_budget to at least {int(least)}" if least else "raise memory_budget")
        + ", shard the batch or sequence (input_placements), leave more parameters to the planner, or use more ranks")
