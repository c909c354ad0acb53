"""ILP planner (``planner="ilp"``, docs/architecture.md): every node's strategy chosen at once.

    prop = solve(planner, gm, placeholder_placements, output_placements, params)  # module/planning.py calls it
    sw.parallelize(..., planner="ilp")

Propagation (search/propagate.py) decides node by node and cannot see that a cheap choice
now (carry a partial sum, gather a weight) costs more later. Here one mixed-integer
program (search/ilp.py; scipy.optimize.milp, HiGHS) minimises communication time (each
unique redistribution once, as the program emits it) plus compute time on the busiest
rank (search/flops.py), with tie-breakers far below any real time.

1. Propagation runs first: it is the incumbent (always a candidate, so the ILP's optimum
   is never costlier under the cost model) and the fallback.
2. On a 1-d mesh the program offers every strategy: one exact solve.
   On an n-d mesh every strategy of every node makes a program too large to build and
   solve in seconds, so each round offers, per node, the strategies that differ from the
   incumbent on one mesh dim only, the mesh dims in turn (round k: dim k mod ndim). The
   round's optimum becomes the incumbent; rounds stop once every dim has had one and the
   last saved less than 1% (block coordinate descent: a local optimum, not a proven global
   one), or when the next would not end before the time limit (the last round's time).
   Letting each node pick its own dim in one round (``any_dim``) finds the same plans here
   in a program 3x larger, 5-8x slower to solve (tiny Llama on 2x2: 66k columns, ~6 CPU s
   per LP, against 22k and ~0.8 s).
3. ``Planner.run(choices=...)`` derives the redistributions exactly as for its own
   choices, so lowering sees an ordinary Propagation.

Under a time limit (``parallelize(plan_time_limit=)``, TIME_LIMIT_S by default) or a failed solve
the cheaper of the best plan found and propagation is kept; ``prop.solve_report`` (printed by
Plan.summary) says which. A solve past PROGRESS_AFTER_S shows a progress line on a terminal's
stderr (search/progress.py).

Parameters the user did not place are columns of the same program (search/params.py), repeated
layers share their columns (search/layers.py), and ``memory_budget`` adds rows, refined by cuts
against the plan's liveness estimate (search/budget.py): ``Search`` runs the rounds, ``solve`` cuts
until the estimate fits (``estimate``, module/planning.estimate_peak, passed in: search/ imports no lower/).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from ..core.layout import Replicate
from .budget import MemoryBudgetError, MemoryRows
from .ilp import SCALE, Memo, Program, plan_cost
from .layers import repeated_layers
from .params import optimizer_time, with_choices
from .propagate import Planner, Propagation
from .progress import solve_progress
from .recompute import RecomputeChoice

__all__ = ["Search", "plan_cost", "SolveReport", "solve"]

# For the whole solve (propagation first, the rounds), in CPU seconds of this process (Budget says why):
# parallelize's plan_time_limit. Tiny Llama (2 layers, hidden 64) on 2x2: propagation and the first
# round take ~2.5 s and find the plan a 60-second search finds (within 0.001%); the second round
# (~1.6 s more) saves nothing there, and a 4-second limit does not start it. A model whose first round
# does not fit keeps propagation's plan (the summary's "# planner:" line says so): raise the limit.
TIME_LIMIT_S = 4.0
# With memory_budget rows (each cut solves again) or activation_checkpointing="auto" columns: a plan
# that fits is worth more than a fast one (test_auto_params' FSDP-style budget: ~10 CPU s on 2 cores).
BUDGET_TIME_LIMIT_S = 30.0
MAX_ROUNDS = 8  # 4 per mesh dim on a 2-d mesh
MIN_GAIN = 0.01  # another round only if the last one saved at least 1%
DISP = False  # HiGHS's log, for diagnosis
MAX_STRETCH = 8.0  # Budget: HiGHS's wall-clock limit is at most this many times the CPU seconds left
PROGRESS_AFTER_S = 2.0  # a solve that runs longer shows what it is doing (search/progress.py)
MIN_POINTS = 64  # memory_budget's error: points the least-peak program bounds
MAX_CUTS = 6  # memory_budget: solves with a row added at the estimate's peak each time


@dataclass
class SolveReport:
    """How the plan was found; printed by Plan.summary()."""

    status: str = "optimal"
    rounds: list = field(default_factory=list)  # per round: (variables, constraints, build s, solve s)
    cost_s: float | None = None  # plan_cost of the chosen plan (seconds), or solve's price= of it
    objective_s: float | None = None  # the program's optimum (equals cost_s unless it misprices or price= is given)
    propagation_cost_s: float | None = None  # plan_cost (or price=) of propagation's plan
    cpu_s: float = 0.0  # CPU seconds of this process for the whole solve (propagation, rounds, the final pass)
    # the recipes priced as starts (module/recipe_starts.py): {label: plan_cost, inf when over the budget}
    starts: dict = field(default_factory=dict)
    started_from: str = "propagation"  # the plan the rounds started from

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
        starts = "".join(f", {k} {'over budget' if math.isinf(v) else f'{v * 1e6:.2f} us'}"
                         for k, v in self.starts.items())
        starts = f"; started from {self.started_from}{starts and ' (recipes priced' + starts + ')'}"
        return (f"ilp {self.status}: {len(self.rounds)} round(s), up to {self.variables} variables and "
                f"{self.constraints} constraints, {self.seconds:.2f} s ({solve_s:.2f} s in HiGHS){cost}{starts}")


class Search:
    """Rounds of the program (module docstring, step 2) from an incumbent."""

    def __init__(self, planner, gm, ph, outs, free, grads, memory, report, budget, max_rounds, recompute=None,
                 any_dim=False):
        self.planner, self.gm, self.ph, self.outs = planner, gm, ph, outs
        self.recompute = recompute  # search/recompute.py: the blocks the program may recompute
        self.blocks = frozenset()  # the recomputed blocks of the best plan found
        self.free, self.grads, self.memory, self.report = free, grads, memory, report
        self.budget, self.max_rounds = budget, max_rounds  # budget: a Budget
        self.near, self.memo = planner.mesh.ndim > 1, Memo(planner)
        self.any_dim = any_dim  # each round lets a node differ on any one mesh dim (not dim k mod ndim)
        self.aliases = {}
        self.progress = lambda text: None  # search/progress.py: what the search is doing now

    def program(self, choices, memory=None, dim: int | None = None) -> Program:
        return Program(self.planner, choices, self.near, self.memo, self.free, self.grads, memory,
                       self.aliases, self.recompute, dim).build(self.gm, self.ph, self.outs)

    def realise(self, choices, placed, params, blocks=None) -> Propagation:
        """The Propagation of a solution (``blocks`` recomputed; default: the best plan's)."""
        ph, outs = with_choices(self.ph, self.outs, placed, self.grads, getattr(self.planner, "grad_partial_dim", None))
        blocks = self.blocks if blocks is None else blocks
        if self.recompute is None:
            prop = self.planner.run(self.gm, ph, outs, params=params, choices=choices)
        else:
            prop = self.recompute.realise(self.planner, ph, outs, params, choices, blocks)
        prop.param_choices = placed
        return prop

    def rounds(self, incumbent: tuple) -> tuple:
        """(choices, parameter placements, objective) of the best plan found from ``incumbent``."""
        choices, placed, objective = incumbent
        report, ndim = self.report, self.planner.mesh.ndim
        report.status = "optimal"
        last = 0.0  # CPU seconds the last round took: the next is not started where it would not end in time
        for k in range(self.max_rounds if self.near else 1):
            t0, c0 = time.perf_counter(), time.process_time()
            if self.budget.left() <= 0 or (k and last > self.budget.left()):
                report.status = "time limit: best plan found kept"
                break
            dim = None if not self.near or self.any_dim else k % ndim
            self.progress(f"round {k + 1}" + ("" if dim is None else f" (mesh dim {self.planner.mesh.names[dim]!r})")
                          + f", best {objective * 1e6:.2f} us")
            prog = self.program(choices, self.memory, dim)
            t1 = time.perf_counter()
            bound = self._bound(prog, objective)
            res = prog.model.solve(max(self.budget.wall_left(), 0.1), DISP, bound=bound)
            if res.x is None and res.status == 2 and self.memory is not None:
                raise Infeasible()
            if res.x is None and res.status == 2 and bound is not None:  # nothing cheaper than the incumbent
                report.rounds.append((len(prog.model.cost), len(prog.model.rows), t1 - t0, time.perf_counter() - t1))
                last = time.process_time() - c0
                if k + 1 >= ndim or self.any_dim:
                    break
                continue
            if res.x is None:
                report.rounds.append((len(prog.model.cost), len(prog.model.rows), t1 - t0, time.perf_counter() - t1))
                report.status = f"stopped: HiGHS status {res.status} ({res.message}); best plan so far kept"
                break
            value = prog.value(res)
            gain = value < objective * (1 - MIN_GAIN)
            last_round = not self.near or k == self.max_rounds - 1 or (not gain and (k + 1 >= ndim or self.any_dim))
            # the last round prices its calls; on an n-d mesh (a local search) only where the program's
            # optimum, a lower bound of the priced one, would still save MIN_GAIN (tiny Llama on 2x2:
            # the second round's optimum is 0.17% below the incumbent, its pricing a third LP)
            if last_round and (not self.near or prog.objective(res.fun) < objective * (1 - MIN_GAIN)):
                res, value = self._price_calls(prog, res, value)
            report.rounds.append((len(prog.model.cost), len(prog.model.rows), t1 - t0, time.perf_counter() - t1))
            last = time.process_time() - c0
            if value <= objective or math.isinf(objective):
                choices, placed, objective = prog.choices(res.x), prog.param_choices(res.x), value
                self.blocks = self.recompute.chosen(res.x) if self.recompute is not None else frozenset()
            if res.status != 0 or self.budget.left() <= 0:
                report.status = "time limit: best plan found kept"
                break
            if last_round and not gain:
                break
            if k == self.max_rounds - 1:
                report.status = f"stopped after {self.max_rounds} rounds, still improving"
        if self.near and report.status == "optimal":
            report.status = ("converged (rounds let every node change on one mesh dim, the dims in turn; until one "
                             "saves < 1%)" if not self.any_dim else
                             "converged (each round lets every node change on one mesh dim; until one saves < 1%)")
        return choices, placed, objective

    def _bound(self, prog: Program, objective: float) -> float | None:
        """The MIP's objective cutoff: the incumbent's cost in the program's units (it is a candidate,
        priced at most plan_cost), so HiGHS prunes every branch costlier than the plan already held.
        None under memory rows or recompute columns, where the incumbent need not be feasible."""
        if math.isinf(objective) or self.memory is not None or self.recompute is not None:
            return None
        return (objective - prog.model.offset) * SCALE * (1 + 1e-9) + 1.0

    def _price_calls(self, prog: Program, res, value: float) -> tuple:
        """(res, value) after solving again while ``res`` makes a coalesced gather in part, that
        group then priced by its own call column (search/ilp.py): the cheapest solution seen. What
        that can save is at most the part of the latencies the program did not price (its optimum
        is a lower bound): below MIN_GAIN of the plan, as a round's, it is not worth the MIP."""
        last = res
        while (self.budget.left() > 0 and prog.unpriced(last.x) >= MIN_GAIN * value
               and prog.price_calls(last.x)):
            last = prog.model.solve(max(self.budget.wall_left(), 0.1), DISP)
            if last.x is None:
                break
            if (v := prog.value(last)) < value:
                res, value = last, v
        return res, value

    def least_plan(self, choices, params) -> Propagation | None:
        """The Propagation of the plan the program finds with the least memory (its rows at every
        cut and at up to MIN_POINTS more points), or None."""
        prog = self.program(choices)
        prog.model.cost = [0.0] * len(prog.model.cost)
        z = prog.model.var(1.0 / SCALE)  # the objective: z, in units of memory.scale bytes
        calls = [n for n in self.memory.order if n in prog.nodes]
        sample = calls[:: max(1, len(calls) // MIN_POINTS)]  # the peak may sit where no cut looked yet
        self.memory.points += [p for p in sample if p not in self.memory.points]
        self.memory.add_rows(prog, z)
        res = prog.model.solve(max(self.budget.wall_left(), 1.0), DISP)
        if res.x is None:
            return None
        blocks = self.recompute.chosen(res.x) if self.recompute is not None else frozenset()
        return self.realise(prog.choices(res.x), prog.param_choices(res.x), params, blocks)


class Budget:
    """``time_limit`` as CPU seconds of this process from the solve's start (propagation included), not
    wall-clock ones: on a machine shared with other work a wall-clock limit stops the rounds earlier
    (a loaded 2-core box here: 3-4 wall seconds per CPU second), so the plan would depend on the load,
    and the processes of one torch launch could plan differently (module/agree.py). HiGHS takes a
    wall-clock limit only: it gets the CPU seconds left, stretched by the wall/CPU ratio seen so far."""

    def __init__(self, seconds: float):
        self.cpu0, self.wall0, self.seconds = time.process_time(), time.perf_counter(), seconds

    def left(self) -> float:
        """CPU seconds left (inf: no limit)."""
        return self.seconds - (time.process_time() - self.cpu0)

    def wall_left(self) -> float:
        cpu, wall = time.process_time() - self.cpu0, time.perf_counter() - self.wall0
        stretch = min(max(wall / cpu, 1.0), MAX_STRETCH) if cpu > 0.1 else 1.0
        return max(self.left(), 0.0) * stretch


class Infeasible(Exception):
    """The program has no plan within the memory rows."""


def solve(planner: Planner, gm: fx.GraphModule, placeholder_placements: dict, output_placements: list,
          params: dict | tuple = (), time_limit: float | None = None, max_rounds: int = MAX_ROUNDS,
          free: dict | None = None, grads: dict | None = None, memory: MemoryRows | None = None,
          estimate: Callable | None = None, recompute: RecomputeChoice | None = None,
          price: Callable | None = None, any_dim: bool = False, starts: dict | None = None) -> Propagation:
    """The Propagation of the ILP's choices; ``prop.solve_report`` says how it went.

    ``free`` ({placeholder: candidate placements}, search/params.py) are parameters whose placement
    the program chooses too (``grads``: {graph output index: placeholder} of their gradients);
    ``prop.param_choices`` ({placeholder: placements}) says what it chose. ``memory``
    (search/budget.py) bounds the bytes per rank: cuts at the estimate's peak until the plan's
    liveness estimate (estimate_peak) fits, at most MAX_CUTS; MemoryBudgetError when no plan can.
    ``recompute`` (search/recompute.py): the blocks it may choose to recompute in backward; the
    Propagation is then of the graph with the chosen ones recomputed (``prop.recomputed``).
    ``price`` (Propagation -> seconds): what a plan's step costs when the graph is not run once
    per step (a pipeline's microbatch plan: its schedule's makespan, bubble included,
    module/pipeline.py); the program's candidate and propagation's are compared by it and
    ``cost_s`` is it. The program itself minimises plan_cost (``objective_s``). ``time_limit``: CPU
    seconds (Budget; None: TIME_LIMIT_S, BUDGET_TIME_LIMIT_S with ``memory`` or ``recompute``);
    ``any_dim``: the larger rounds (module docstring, step 2). ``starts`` ({label: {placeholder:
    placements}} of free parameters, module/recipe_starts.py): plans priced like propagation's, the
    cheapest that fits the rounds' start, so the answer is never costlier than any of them."""
    if time_limit is None:
        time_limit = TIME_LIMIT_S if memory is None and recompute is None else BUDGET_TIME_LIMIT_S
    with solve_progress(PROGRESS_AFTER_S, time_limit) as show:
        return _solve(planner, gm, placeholder_placements, output_placements, params, time_limit, max_rounds,
                      free, grads, memory, estimate, recompute, price, any_dim, show, starts or {})


def _solve(planner, gm, placeholder_placements, output_placements, params, time_limit, max_rounds, free, grads,
           memory, estimate, recompute, price, any_dim, show, starts) -> Propagation:
    free, grads = free or {}, grads or {}
    cpu0, budget = time.process_time(), Budget(time_limit)
    greedy = planner.run(gm, placeholder_placements, output_placements, params=params)
    # the program's objective: plan_cost and the optimizer step of the parameters it places (search/params.py);
    # not yet for a pipeline's microbatch plan, whose figure (the schedule's, lower/pipeline.py) leaves it out
    steps = not getattr(planner, "objective_weights", None)
    cost_of = lambda p: plan_cost(planner, p) + (optimizer_time(p, free, planner.cost) if steps else 0.0)  # noqa: E731
    greedy_cost = cost_of(greedy)
    price = price or (lambda p: greedy_cost if p is greedy else cost_of(p))
    report = SolveReport(propagation_cost_s=price(greedy))
    search = Search(planner, gm, placeholder_placements, output_placements, free, grads, memory, report,
                    budget, max_rounds, recompute, any_dim)
    search.progress = show
    search.aliases = repeated_layers(gm, params if isinstance(params, dict) else {}, placeholder_placements, free)
    placed = {name: tuple(placeholder_placements.get(name) or (Replicate(),) * planner.mesh.ndim) for name in free}
    incumbent = ({name: np_.strategy for name, np_ in greedy.nodes.items()}, placed, greedy_cost)
    # with recompute columns the greedy plan's gap is corrected too: rows count every gradient from
    # the start, and would otherwise ask for more blocks recomputed than the estimate needs
    greedy_fits = memory is None or _cut(memory, greedy, estimate, correct=recompute is not None)
    if not greedy_fits:
        incumbent = incumbent[:2] + (math.inf,)
    incumbent = _best_start(search, starts, incumbent, cost_of, memory, estimate, params)
    fits = False
    for _ in range(MAX_CUTS if memory is not None else 1):
        try:
            choices, placed, objective = search.rounds(incumbent)
        except Infeasible:
            break
        best = search.realise(choices, placed, params)
        fits = memory is None or _cut(memory, best, estimate)
        if fits:
            break
        incumbent = (choices, placed, math.inf)  # over budget: a start, never kept for its cost
    if not fits:  # memory_budget: the cuts did not end in a plan that fits; the least-memory plan may
        best = search.least_plan(incumbent[0], params)
        least = None if best is None else estimate(best)[0]
        if least is None or least > memory.budget:
            raise _over_budget(memory, least)
        report.status = "memory_budget: the plan with the least memory"
        objective = cost_of(best)
    report.objective_s, report.cost_s = objective, price(best)
    if report.cost_s > report.propagation_cost_s and greedy_fits:  # the program mispriced a plan: keep the cheaper
        report.status += f"; propagation kept, the ILP's plan costs {report.cost_s * 1e6:.3f} us"
        best, report.cost_s = greedy, report.propagation_cost_s
        best.param_choices = {name: placeholder_placements.get(name) or (Replicate(),) * planner.mesh.ndim
                              for name in free}
    report.cpu_s = time.process_time() - cpu0
    best.solve_report = report
    return best


def _best_start(search: Search, starts: dict, incumbent: tuple, cost_of, memory, estimate, params) -> tuple:
    """The rounds' start: the cheapest of ``incumbent`` (propagation's) and the ``starts`` plans that fit
    (each run through propagation with its parameter placements, priced by ``cost_of``). Starts are
    priced while the time budget lasts, in the order given."""
    planner, report = search.planner, search.report
    for label, start in starts.items():
        if search.budget.left() <= 0:
            break
        search.progress(f"pricing the {label} recipe")
        placed = {**incumbent[1], **{n: tuple(p) for n, p in start.items() if n in search.free}}
        prop = search.realise(None, placed, params, frozenset())
        fits = memory is None or estimate(prop)[0] <= memory.budget
        cost = cost_of(prop) if fits else math.inf
        report.starts[label] = cost
        if cost < incumbent[2]:
            incumbent = ({name: np_.strategy for name, np_ in prop.nodes.items()}, placed, cost)
            report.started_from = label
    return incumbent


def _cut(memory: MemoryRows, prop: Propagation, estimate, correct: bool = True) -> bool:
    """True when ``prop``'s liveness estimate fits the budget; else a row at its peak, and
    (``correct``: a plan the program chose under the rows) each row's bound lowered by what the
    estimate holds there beyond the row for ``prop``. Bounds only tighten, so the cuts end."""
    peak, point, curve = estimate(prop)
    if peak <= memory.budget:
        return True
    if point is not None and point not in memory.points:
        memory.points.append(point)
    for p in memory.points if correct else ():
        if p in curve:
            memory.correction[p] = max(memory.correction.get(p, 0.0), curve[p] - memory.value(p, prop))
    return False


def _over_budget(memory: MemoryRows, least) -> MemoryBudgetError:
    found = (f"the plan with the least memory found needs an estimated {int(least)} bytes per rank" if least
             else "no plan was found")
    err = MemoryBudgetError(
        f"memory_budget {int(memory.budget)} bytes per rank cannot be met: {found} (parameters, gradients, optimizer "
        "state, live activations at the peak)",
        fix=(f"raise memory_budget to at least {int(least)}" if least else "raise memory_budget")
        + ", shard the batch or sequence (input_placements), leave more parameters to the planner, or use more ranks")
    err.least = least  # the smallest peak found (bytes per rank), or None
    return err
