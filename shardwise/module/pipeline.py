"""Pipeline parallelism as a mesh dim: ``parallelize(..., pipeline=sw.Pipeline(dim="pp", ...))``.

    mesh = sw.Mesh((2, 2, 2), ("pp", "dp", "tp"))
    pm = sw.parallelize(model, mesh, (ids,), pipeline=sw.Pipeline("pp", microbatches=8, schedule="1f1b"))
    pm.plan.stats()["bubble_fraction"]; print(pm.plan.summary())

How a step is planned (``PipelinePlanning.plan``):

1. The step is traced whole, as without a pipeline, then made ready for microbatching
   (trace/microbatch.py: BatchNorm refused, nll_loss 'mean' normalised by the targets' count).
2. Microbatching is data parallelism over time: the step is planned on the *virtual mesh*,
   the mesh with the pipeline dim replaced by a microbatch dim of ``microbatches`` members.
   Every input and target whose dim 0 is the batch (the first input's dim 0) is Shard(0) on
   it (microbatches are torch.chunk's pieces of the batch, as every shard: uneven ones too),
   parameters are Replicate there, and the loss and every gradient end Partial there: a
   microbatch's partial loss and gradients, exact by invariant 4, whose sum over the
   microbatches is one device's. The other mesh dims are planned as ever (dp, tp, FSDP,
   sequence, experts). Collectives on the microbatch dim never run: the prologue reduces
   target-only values over the microbatches (lower/stages.py), the runner sums the rest.
3. The stages: the split points given, or the planner's cut balancing the stages' modelled
   forward + backward times within ``memory_budget`` (search/stages.balance), decided by the
   first step plan and kept (each stage's ranks hold its parameters: ``owner``).
4. The plan (lower/pipeline.PipelinePlan) cuts each virtual rank's program into stage pieces
   and schedules them (search/schedules.py); run/pipeline.py runs them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core.cost import CostModel
from ..core.errors import ConfigError, ShardingError
from ..core.layout import Partial, R, Replicate, Shard
from ..core.mesh import Mesh
from ..lower.pipeline import PipelinePlan
from ..lower.plan import Plan
from ..rules.attention import strategy_filter as attention_filter
from ..search.flops import node_time
from ..search.propagate import Planner
from ..search.schedules import SCHEDULES
from ..search.schedules import check as check_schedule
from ..search.schedules import schedule as make_schedule
from ..search.schedules import simulate
from ..search.stages import assign, balance, forward_runs, resolve
from ..trace.microbatch import check_microbatchable, count_targets, seed_from_shape
from ..trace.precision import MASTER_DTYPE
from ..trace.roles import BUFFER, GRAD, LOSS, PARAM

# The microbatch dim's links in the planner's cost model: a collective there is never a real
# message (the prologue or a sum in the runner), so the search must avoid one wherever it can.
_AVOID_BANDWIDTH, _AVOID_LATENCY = 1.0, 1e3


@dataclass(frozen=True)
class Pipeline:
    """``parallelize(..., pipeline=Pipeline(...))``: run the model's depth as ``mesh[dim]`` stages
    (``stages_per_rank`` each, interleaved), the batch in ``microbatches`` microbatches, on the
    ``schedule`` "1f1b" (default), "gpipe", "interleaved" or "zero-bubble" (ZB-H1).
    ``split_points``: the modules where stages 1, 2, ... begin (``["model.layers.16"]``), in
    forward order; None: the planner's cut (balanced modelled time within memory_budget).
    ``timed``: every step starts and ends on a barrier across the mesh, so the measured
    timeline (``pm.pipeline_timeline()``) counts every rank's idle time against the same span
    (two barriers a step; without them each rank's span runs from its own start)."""

    dim: str = "pp"
    microbatches: int = 4
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split_points: tuple | None = None
    timed: bool = False

    def __post_init__(self):
        if not isinstance(self.timed, bool):
            raise ConfigError(f"Pipeline(timed=...) takes True or False, got {self.timed!r}",
                              fix="timed=True to measure idle time against a common start and end")
        if self.split_points is not None:
            if isinstance(self.split_points, str) or not all(isinstance(s, str) for s in self.split_points):
                raise ConfigError(f"Pipeline(split_points=...) must be a list of module names, got "
                                  f"{self.split_points!r}", fix="e.g. split_points=['model.layers.16']")
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}", fix=f"use one of {SCHEDULES}")


@dataclass(frozen=True)
class PipelineOptions:
    """The checked pipeline of one ParallelModule: its config and the mesh dim it runs on."""

    config: Pipeline
    dim: int
    vmesh: Mesh


def check_pipeline(pipeline, mesh: Mesh, *, backend, inputs: str, compile: bool) -> PipelineOptions | None:
    """The checked ``pipeline=`` option (None: no pipeline); a ConfigError with a fix otherwise."""
    if pipeline is None:
        return None
    if not isinstance(pipeline, Pipeline):
        raise ConfigError(f"pipeline= takes a shardwise.Pipeline, got {type(pipeline).__name__}",
                          fix='e.g. pipeline=sw.Pipeline(dim="pp", microbatches=8, schedule="1f1b")')
    if pipeline.dim not in mesh.names:
        raise ConfigError(f"pipeline dim {pipeline.dim!r} is not a dim of mesh {mesh.shape} {mesh.names}",
                          fix=f"name one of {mesh.names}, or add a pipeline dim, e.g. "
                              f"sw.Mesh((2, *{mesh.shape}), ('pp', *{mesh.names}))")
    dim = mesh.dim_index(pipeline.dim)
    c = pipeline
    check_schedule(c.schedule, mesh.shape[dim], c.microbatches, c.stages_per_rank)
    n_stages = mesh.shape[dim] * c.stages_per_rank
    if c.split_points is not None and len(c.split_points) != n_stages - 1:
        raise ConfigError(f"{n_stages} pipeline stages ({mesh.shape[dim]} ranks x {c.stages_per_rank}) need "
                          f"{n_stages - 1} split points, got {len(c.split_points)}: {list(c.split_points)}",
                          fix="name the module where each stage after the first begins, or split_points=None")
    if inputs != "global":
        raise ConfigError('pipeline= needs inputs="global": every stage slices its microbatches from the batch',
                          fix='pass the full batch on every rank (inputs="global", the default)')
    if compile:
        raise ConfigError("compile=True does not run pipeline stages yet", fix="pass compile=False with pipeline=")
    names = list(mesh.names)
    names[dim] = next(n for n in ("mb", "microbatch", "pp:mb") if n not in mesh.names)
    shape = list(mesh.shape)
    shape[dim] = c.microbatches
    return PipelineOptions(c, dim, Mesh(tuple(shape), tuple(names)))


def virtual_cost(cost: CostModel, mesh: Mesh, vmesh: Mesh, dim: int) -> CostModel:
    """``cost`` per mesh dim of the virtual mesh, the microbatch dim made prohibitive."""
    bw = tuple(_AVOID_BANDWIDTH if m == dim else cost.bandwidth_of(m, mesh) for m in range(mesh.ndim))
    lat = tuple(_AVOID_LATENCY if m == dim else cost.latency_of(m, mesh) for m in range(mesh.ndim))
    return dataclasses.replace(cost, bandwidth=bw, latency=lat)


class PipelinePlanning:
    """Step plans of one pipelined ParallelModule (module docstring). ``stages``: the split, made
    by the first step plan and kept (the state is sharded by its ``owner``)."""

    def __init__(self, options):
        self.options = options
        po: PipelineOptions = options.pipeline
        self.config, self.dim, self.vmesh = po.config, po.dim, po.vmesh
        self.mesh = options.mesh
        self.vcost = virtual_cost(options.cost, self.mesh, self.vmesh, self.dim)
        self.planner = Planner(self.vmesh, options.registry, self.vcost, options.replicate_fallback,
                               attention_filter(options.attention), bucket_bytes=None)
        self.planner.grad_partial_dim = self.dim
        self.schedule = make_schedule(self.config.schedule, self.mesh.shape[self.dim], self.config.microbatches,
                                      self.config.stages_per_rank)
        self.planner.objective_weights = objective_weights(self.schedule)
        self.stages = None
        self._cuts = None  # the planner's split: indices of the forward runs starting stages 1, 2, ...

    @property
    def fallback_ops(self):
        return self.planner.fallback_ops

    def free(self, free: dict) -> dict:
        """The ILP's candidate placements of free parameters, none split over microbatches."""
        return {ph: [c for c in cands if isinstance(c[self.dim], Replicate)] for ph, cands in free.items()}

    def owner_of(self, name: str) -> int | None:
        """The pipeline coordinate of the ranks holding parameter or buffer ``name`` (None: unknown yet)."""
        if self.stages is None:
            return None
        return self.schedule.rank_of(self.stages.owner.get(name, 0))

    def holds(self, rank: int, name: str) -> bool:
        return self.mesh.coord(rank)[self.dim] == self.owner_of(name)

    # -- one step plan -----------------------------------------------------------------------------
    def plan(self, planning, traced, placements: list, notes=()) -> PipelinePlan:
        check_microbatchable(traced.gm)  # first: BatchNorm's running statistics are buffer updates too
        for r in traced.outputs:
            if r.kind not in (LOSS, GRAD):
                raise ConfigError(f"pipeline=: the traced step updates buffer {r.name!r} in place (e.g. running "
                                  "statistics); a pipelined step cannot", fix="train without pipeline=, or make "
                                  "the buffer a constant")
        notes = tuple(notes) + tuple(count_targets(traced.gm))
        seed_from_shape(traced.gm)
        vplacements = self._microbatched(traced, placements)
        outs = [self._partial(None if r.kind == LOSS else planning.specs[r.name]) for r in traced.outputs]
        plan = planning._make(traced, vplacements, outs, "step", notes, pipelined=self)
        stages = self._split(plan)
        if self.stages is not None and stages.owner != self.stages.owner:
            raise ShardingError("pipeline: a step of another signature splits the model into other stages than "
                                "the first step did", fix="report this: the split is kept per model")
        self.stages = stages
        return self._pipeline_plan(plan, stages, notes)

    def _partial(self, placements) -> tuple:
        out = list(placements) if placements is not None else [R] * self.mesh.ndim
        out[self.dim] = Partial()
        return tuple(out)

    def _microbatched(self, traced, placements: list) -> list:
        """Each input and target leaf's placements on the virtual mesh: Shard(0) on the microbatch
        dim where its dim 0 is the batch, Replicate there otherwise."""
        leaves = [n.meta["val"] for n, r in zip(traced.placeholder_nodes(), traced.placeholders)
                  if r.kind not in (PARAM, BUFFER)]
        batch = next((t.shape[0] for t in leaves if t.dim() > 0), None)
        if batch is None:
            raise ConfigError("pipeline=: no input has a batch dim to split into microbatches",
                              fix="pass inputs whose dim 0 is the batch")
        out = []
        for t, pl, name in zip(leaves, placements, traced.placeholders[len(traced.placeholders) - len(leaves):]):
            pl = list(pl)
            if not isinstance(pl[self.dim], Replicate):
                raise ConfigError(f"{name.describe()} is placed {pl[self.dim]!r} on the pipeline dim "
                                  f"{self.mesh.names[self.dim]!r}; that dim runs stages, the batch is split into "
                                  "microbatches by the pipeline itself", fix="leave the pipeline dim out of the "
                                  "input placements (Replicate)")
            pl[self.dim] = Shard(0) if t.dim() > 0 and t.shape[0] == batch else R
            out.append(tuple(pl))
        return out

    # -- the split ----------------------------------------------------------------------------------
    def _split(self, plan, keep: bool = True):
        """The stages of ``plan``'s graph: at the split points given, else at the forward runs
        the first step plan's balance chose (``self._cuts``: run indices, the same runs in a
        step of another signature; ``keep``: this plan's balance is the one kept)."""
        traced = plan.traced
        gm, roles = traced.gm, traced.placeholders
        if self.config.split_points is not None:
            return assign(gm, roles, resolve(gm, self.config.split_points))
        runs = forward_runs(gm)
        cuts = self._cuts if self._cuts is not None else self._balance(plan, runs)
        if keep:
            self._cuts = cuts
        return assign(gm, roles, [runs[i].first for i in cuts])

    def _balance(self, plan, runs: list) -> list:
        if self.schedule.n_stages == 1:
            return []
        gm, roles = plan.traced.gm, plan.traced.placeholders
        per_run = assign(gm, roles, [r.first for r in runs[1:]], check=False)
        costs, state, act = self._run_figures(plan, per_run, len(runs))
        return balance(costs, state, act, self.schedule.in_flight, self.schedule.n_stages,
                       self.options.memory_budget)

    def pricer(self, traced, params: dict, given_params):
        """The step time of a candidate microbatch plan (a Propagation of ``traced``'s graph) as
        the pipeline runs it: cut into the stages this plan would get and scheduled,
        ``PipelinePlan.stats()["est_step_time_s"]`` (the modelled timeline, bubble and messages
        included, plus the epilogue). The ILP's search compares its candidates by it
        (search/solve.py ``price``), so the step time a pipeline plan reports is the one its
        planner minimised."""
        def price(prop) -> float:
            t = traced if prop.gm is traced.gm else dataclasses.replace(traced, gm=prop.gm)
            plan = Plan(prop, params, False, "step", None, t, given_params)
            return self._pipeline_plan(plan, self._split(plan, keep=False)).stats()["est_step_time_s"]
        return price

    def _pipeline_plan(self, plan, stages, notes=()) -> PipelinePlan:
        return PipelinePlan(plan, self.mesh, self.vmesh, self.dim, self.config, self.schedule, stages,
                            self.options.cost, notes)

    def _run_figures(self, plan, per_run, k: int) -> tuple:
        """Per forward run: modelled forward + backward seconds of one microbatch, state bytes
        (parameters, gradients, optimizer state) and bytes kept for backward per microbatch."""
        prop, vm, cost = plan.prop, self.vmesh, self.options.cost
        costs, state, act = [0.0] * k, [0.0] * k, [0.0] * k
        for name, np_ in prop.nodes.items():
            costs[per_run.of[name]] += node_time(cost, np_.call, np_.strategy, vm, np_.rule)
        for n, r in zip(plan.traced.placeholder_nodes(), plan.traced.placeholders):
            if r.kind in (PARAM, BUFFER):
                lay = prop.layouts[n.name][0]
                numel = max(lay.local_numel(vm, x) for x in range(vm.size))
                master = n.meta.get(MASTER_DTYPE)  # mixed precision: the master beside the compute copy
                resident = numel * (lay.itemsize if master is None else _itemsize(master))
                b = numel * lay.itemsize + (resident if master is not None else 0)
                if r.requires_grad:  # gradients as the master (reduce dtype), the optimizer's state
                    b += resident * (1 + cost.optimizer_state)
                state[per_run.of[n.name]] += b
        for n in plan.traced.gm.graph.nodes:
            if n.op == "call_function" and not n.meta.get("autograd_backward") and any(
                    u.meta.get("autograd_backward") for u in n.users):
                for lay in prop.layouts.get(n.name, ()):
                    if lay is not None:
                        act[per_run.of[n.name]] += max(lay.local_numel(vm, x) for x in range(vm.size)) * lay.itemsize
        return costs, state, act


def objective_weights(schedule) -> tuple:
    """The planner's objective for a microbatch plan (search/steptime.step_time ``weights``): its
    time ``T`` (everything but the graph outputs' moves) counts as the schedule's makespan when
    ``T`` is split evenly over its stages, forward a third and backward two thirds of each (the
    weight gradient half the backward under zero-bubble): ``simulate`` of those durations, per
    unit of T; the outputs' moves (the epilogue: each stage's gradients reduced once a step, the
    stages' in parallel) count 1 / (pipeline ranks). The bubble of an even split is so in the
    program's objective; the plan's own split and messages are in the price it is chosen by
    (``pricer``)."""
    unit = 1.0 / schedule.n_stages
    durations = {"F": unit / 3, "B": 2 * unit / 3 - (unit / 3 if schedule.split_w else 0.0), "W": unit / 3}
    return simulate(schedule, lambda a: durations[a.kind]).end, 1.0 / schedule.p


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_step_targets(pipeline, loss_fn, example_targets) -> None:
    """A pipelined model with a loss_fn is planned (its stages cut, its state sharded by stage)
    at parallelize: the targets must be known then."""
    if pipeline is not None and loss_fn is not None and example_targets is None:
        raise ConfigError("pipeline= with loss_fn needs example_targets= at parallelize: the stages, and so which "
                          "rank holds which parameter, come from the traced training step",
                          fix="pass example_targets=(y,) (the targets of one batch) to parallelize")


__all__ = ["Pipeline", "PipelineOptions", "PipelinePlanning", "check_pipeline", "check_step_targets",
           "objective_weights"]
