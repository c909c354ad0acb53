"""ILP planner (the "auto" mode of DESIGN.md): every node's strategy chosen at once.

    prop = solve(planner, gm, placeholder_placements, output_placements, params)
    sw.parallelize(..., planner="ilp")

Propagation (plan/propagate.py) decides node by node and cannot see that a cheap choice
now (carry a partial sum, gather a weight) costs more later. Here one mixed-integer
program (plan/ilp.py; scipy.optimize.milp, HiGHS) minimises communication time (each
unique redistribution once, as the program emits it) plus compute time on the busiest
rank (plan/flops.py), with tie-breakers far below any real time.

1. Propagation runs first: it is the incumbent (always a candidate, so the ILP's optimum
   is never costlier under the cost model) and the fallback.
2. On a 1-d mesh the program offers every strategy: one exact solve.
   On an n-d mesh every strategy of every node is too much (2x2, 2-layer Llama: 477k
   columns, 30 s to build, 70 s in HiGHS), so each round offers, per node, the
   strategies that differ from the incumbent on at most one mesh dim (which dim may
   differ per node): ~60k columns, ~5 s a round. The round's optimum becomes the
   incumbent; rounds repeat while one saves at least 1% (block coordinate descent: a
   local optimum, not a proven global one; on the zoo's GPT-2 and Llama it matched the
   full program's optimum).
3. ``Planner.run(choices=...)`` derives the redistributions exactly as for its own
   choices, so lowering sees an ordinary Propagation.

Under a time limit or a failed solve the cheaper of the best plan found and propagation
is kept; ``prop.solve_report`` (printed by Plan.summary) says which.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.fx as fx

from ..layout import Replicate
from .ilp import Memo, Program, plan_cost
from .params import with_choices
from .propagate import Planner, Propagation

__all__ = ["solve", "plan_cost", "SolveReport"]

TIME_LIMIT_S = 60.0  # for all rounds together
MAX_ROUNDS = 6
MIN_GAIN = 0.01  # another round only if the last one saved at least 1% (later ones save ~0.1%)
DISP = False  # HiGHS's log, for diagnosis


@dataclass
class SolveReport:
    """How the plan was found; printed by Plan.summary()."""

    status: str = "optimal"
    rounds: list = field(default_factory=list)  # per round: (variables, constraints, build s, solve s)
    cost_s: float | None = None  # plan_cost of the chosen plan (seconds)
    objective_s: float | None = None  # the program's optimum (equals cost_s unless it misprices)
    propagation_cost_s: float | None = None

    @property
    def variables(self) -> int:
        return max((r[0] for r in self.rounds), default=0)

    @property
    def constraints(self) -> int:
        return max((r[1] for r in self.rounds), default=0)

    @property
    def seconds(self) -> float:
        return sum(r[2] + r[3] for r in self.rounds)

    def __str__(self) -> str:
        solve_s = sum(r[3] for r in self.rounds)
        cost = "" if self.cost_s is None else (f", est. {self.cost_s * 1e6:.2f} us "
                                               f"(propagation {self.propagation_cost_s * 1e6:.2f} us)")
        return (f"ilp {self.status}: {len(self.rounds)} round(s), up to {self.variables} variables and "
                f"{self.constraints} constraints, {self.seconds:.2f} s ({solve_s:.2f} s in HiGHS){cost}")


def solve(planner: Planner, gm: fx.GraphModule, placeholder_placements: dict, output_placements: list,
          params=(), time_limit: float = TIME_LIMIT_S, max_rounds: int = MAX_ROUNDS, free: dict | None = None,
          grads: dict | None = None) -> Propagation:
    """The Propagation of the ILP's choices; ``prop.solve_report`` says how it went.

    ``free`` ({placeholder: candidate placements}, plan/params.py) are parameters whose placement
    the program chooses too (``grads``: {graph output index: placeholder} of their gradients);
    ``prop.param_choices`` ({placeholder: placements}) says what it chose."""
    free, grads = free or {}, grads or {}
    greedy = planner.run(gm, placeholder_placements, output_placements, params=params)
    report = SolveReport(propagation_cost_s=plan_cost(planner, greedy))
    choices = {name: np_.strategy for name, np_ in greedy.nodes.items()}
    placed = {name: tuple(placeholder_placements.get(name) or (Replicate(),) * planner.mesh.ndim) for name in free}
    objective = report.propagation_cost_s
    near, memo = planner.mesh.ndim > 1, Memo(planner)
    deadline = time.perf_counter() + time_limit
    for k in range(max_rounds if near else 1):
        t0 = time.perf_counter()
        prog = Program(planner, choices, near, memo, free, grads).build(gm, placeholder_placements,
                                                                         output_placements)
        t1 = time.perf_counter()
        res = prog.model.solve(max(deadline - t1, 0.1), DISP)
        report.rounds.append((len(prog.model.cost), len(prog.model.rows), t1 - t0, time.perf_counter() - t1))
        if res.x is None:
            report.status = f"stopped: HiGHS status {res.status} ({res.message}); best plan so far kept"
            break
        value = prog.objective(res.fun)
        gain = value < objective * (1 - MIN_GAIN)
        if value <= objective:
            choices, placed, objective = prog.choices(res.x), prog.param_choices(res.x), value
        if res.status != 0 or time.perf_counter() > deadline:
            report.status = "time limit: best plan found kept"
            break
        if not gain:
            break
        if k == max_rounds - 1:
            report.status = f"stopped after {max_rounds} rounds, still improving"
    if near and report.status == "optimal":
        report.status = "converged (each round lets every node change on one mesh dim; until one saves < 1%)"
    ph, outs = with_choices(placeholder_placements, output_placements, placed, grads)
    best = planner.run(gm, ph, outs, params=params, choices=choices)
    best.param_choices = placed
    report.objective_s, report.cost_s = objective, plan_cost(planner, best)
    if report.cost_s > report.propagation_cost_s:  # only if the program misprices a plan: keep the cheaper
        report.status += f"; propagation kept, the ILP's plan costs {report.cost_s * 1e6:.3f} us"
        best, report.cost_s = greedy, report.propagation_cost_s
        best.param_choices = {name: placeholder_placements.get(name) or (Replicate(),) * planner.mesh.ndim
                              for name in free}
    best.solve_report = report
    return best
