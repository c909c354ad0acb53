"""The planning driver: (model, step signature, options) -> a ready Plan.

    planning = Planning(model, options, specs)        # options: module/options.py
    plan = planning.step_plan(batch, placements, loss_fn)   # traced, checked, planned, lowered lazily
    plan.param_choices                                # {parameter: placements} the ILP chose, as data

One Plan per signature (the inputs' and targets' shapes and dtypes, every submodule's training
flag, for forward plans the grad mode), made once: the step traced whole (trace/), every op
checked for a rule, the strategies searched (search/: propagation from the user's placements,
or the ILP, under ``memory_budget`` with cuts against the lowered plan's liveness estimate),
then the Plan built (lower/). The parameters the planner places are chosen by the first step
plan and hold for every later plan (``specs``, shared with the ParallelModule, which shards the
model's state once they are known: module/parallel_module.py).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..core.collector import collect_once
from ..core.errors import ConfigError, MemoryBudgetError
from ..core.units import fmt_bytes
from ..lower.explain import gathered_sources
from ..lower.plan import Plan
from ..rules.attention import strategy_filter as attention_filter
from ..run.execute import check_compilable
from ..search.budget import MemoryRows
from ..search.params import free_params, grad_outputs
from ..search.propagate import Planner
from ..search.recompute import RecomputeChoice
from ..search.solve import solve
from ..search.unsupported import check_rules
from ..trace import LOSS, NoLossError, trace_forward, trace_step
from ..trace.eager_attention import check_request as check_attention_request
from ..trace.microbatch import count_targets, seed_from_shape
from ..trace.recompute import RECOMPUTE, plan_recompute
from .options import DEVICE_MEMORY_RESERVE, Options
from .pipeline import PipelinePlanning
from .recipe_starts import recipe_starts
from .spec import placeholder_specs


def signature(*trees) -> tuple:
    """What a plan is keyed by in the arguments: their nesting and each leaf's shape and dtype."""
    lens, leaves = [], []
    for t in trees:  # plain positional tensors (the common step): no pytree work per step
        if type(t) is tuple:
            lens.append(len(t))
            leaves.extend(t)
        elif type(t) is not dict or t:  # no keyword inputs: as positional only
            break
    else:
        key = tuple([(x.shape, x.dtype) for x in leaves if type(x) is torch.Tensor])  # torch.Size: a tuple
        if len(key) == len(leaves):
            return tuple(lens), key
    import torch.utils._pytree as pytree

    trees = tuple(t for t in trees if not (type(t) is dict and not t))
    leaves, spec = pytree.tree_flatten(trees)
    return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves)


class Planning:
    """The plans of one model on one mesh. ``specs`` ({parameter or buffer name: placements}):
    the user's placements, Replicate elsewhere, then the planner's choices once the first step
    plan makes them (the same dict the ParallelModule shards the state with); ``decided``: the
    names whose placements no later plan may change. ``has_loss``: whether the traced call gives
    a loss to differentiate (None until a first step plan was tried)."""

    def __init__(self, model, options: Options, specs: dict, has_loss: bool | None = None):
        self.model, self.options, self.specs = model, options, specs
        self.planner = Planner(options.mesh, options.registry, options.cost, options.replicate_fallback,
                               attention_filter(options.attention), bucket_bytes=options.bucket_bytes)
        self.decided = set(options.given_params)
        self.has_loss = has_loss
        self.no_loss = ""  # why the model has no loss to step (set when has_loss is False)
        self._plans: dict = {}
        self._modules: list | None = None
        self._params: list | None = None
        self.changes = 0  # how many times a plan's choices changed ``specs`` (the ParallelModule re-cuts then)
        # parallelize(pipeline=...): step plans are pipelined (module/pipeline.py)
        self.pipeline = PipelinePlanning(options) if options.pipeline is not None else None

    def modes(self) -> tuple:
        """Every submodule's training flag: a plan traced with dropout on is never reused after
        ``model.eval()`` (or ``model.head.eval()``), and back."""
        if self._modules is None:  # the submodules, listed once (model.modules() walks the tree each call)
            self._modules = list(self.model.modules())
        return tuple([m.training for m in self._modules])

    def trainable(self) -> tuple:
        """Each model parameter's requires_grad: a step plan computes no gradient for a frozen one (no
        backward through what only it needs, nothing reduced for it), so freezing or unfreezing a
        parameter after a step plans that step again."""
        if self._params is None:
            self._params = list(self.model.parameters())
        return tuple([p.requires_grad for p in self._params])

    def step_key(self, batch) -> tuple:
        return ("step", self.modes(), self.trainable(), signature(batch.inputs, batch.targets, batch.kwargs),
                batch.key)

    def planned_step(self, batch) -> Plan | None:
        """The step plan of ``batch``'s signature and the model's modes if one was made, else None."""
        return self._plans.get(self.step_key(batch))

    def forward_key(self, batch) -> tuple:
        grad_mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        return ("forward", self.modes(), grad_mode, signature(batch.inputs, batch.kwargs), batch.key)

    def step_plan(self, batch, placements: list, loss_fn) -> Plan:
        """The plan of forward + backward on ``batch`` (``placements``: each input and target leaf's)."""
        key = self.step_key(batch)
        if key not in self._plans:
            with collect_once():
                opt = self.options
                recompute = "none" if opt.activation_checkpointing == "auto" else opt.activation_checkpointing
                with torch.enable_grad():  # the step differentiates whatever the caller's grad mode
                    traced = trace_step(self.model, batch.inputs, batch.targets, loss_fn, example_kwargs=batch.kwargs,
                                        precision=opt.mixed_precision, recompute=recompute)
                check_recompute(traced.gm, opt.activation_checkpointing)
                if self.pipeline is not None:
                    self._plans[key] = self.pipeline.plan(self, traced, placements, batch.notes)
                    return self._plans[key]
                # the loss's reductions off the step's critical path (trace/microbatch.py): the count of
                # non-ignored targets reduced while forward runs, the backward's seed not waiting for the
                # loss's all_reduce (which joins the gradients' bucket); same numbers as before
                count_targets(traced.gm, early=True)
                seed_from_shape(traced.gm)
                outs = [None if r.kind == LOSS else self.specs[r.name] for r in traced.outputs]
                self._plans[key] = self._make(traced, placements, outs, "step", batch.notes)
        return self._plans[key]

    def forward_plan(self, batch, placements: list) -> Plan:
        """Forward only: no backward is traced, so the plan saves no activations for one. Keyed by
        the grad mode too (a plan first run under ``torch.inference_mode()`` is not reused outside)."""
        key = self.forward_key(batch)
        if key not in self._plans:
            with collect_once():
                traced = trace_forward(self.model, batch.inputs, example_kwargs=batch.kwargs,
                                       precision=self.options.mixed_precision)
                self._plans[key] = self._make(traced, placements, [None] * len(traced.outputs), "forward",
                                              batch.notes)
        return self._plans[key]

    def first_plan(self, batch, placements: list, loss_fn, forward_batch=None) -> Plan:
        """The step plan; without loss_fn, a model whose output is not a loss is planned forward only
        (on ``forward_batch()``, the batch a forward call takes, if given)."""
        if self.has_loss is not None:
            return self.step_plan(batch, placements, loss_fn)
        try:
            plan = self.step_plan(batch, placements, loss_fn)
            self.has_loss = True
        except NoLossError as e:
            self.has_loss, self.no_loss = False, e.message
            if forward_batch is not None:
                batch = forward_batch()
                placements = batch.placements
            plan = self.forward_plan(batch, placements)
        return plan

    # -- one plan ----------------------------------------------------------------------------
    def _make(self, traced, placements: list, outputs: list, stage: str, notes=(), pipelined=None) -> Plan:
        """``pipelined``: module/pipeline.PipelinePlanning planning one microbatch on its virtual
        mesh (its planner; no gradient buckets; parameters never split over microbatches; the
        memory budget is the stage split's to keep)."""
        opt = self.options
        mesh, planner = (opt.mesh, self.planner) if pipelined is None else (pipelined.vmesh, pipelined.planner)
        budget = opt.memory_budget if pipelined is None else None
        bucket_bytes = opt.bucket_bytes if pipelined is None else None
        ph = placeholder_specs(traced, mesh, self.specs, placements)
        params = {n.name: r.name for n, r in zip(traced.placeholder_nodes(), traced.placeholders) if r.kind == "param"}
        traced.keep_gathered(opt.kept_gathered)  # reshard_after_forward: read by search/paths.move_key
        check_rules(traced.gm, opt.registry, planner.fallback_ops)
        check_attention_request(traced.gm, opt.attention, traced.notes)
        if opt.planner == "ilp":
            prop = self._solve(traced, ph, outputs, params, stage, planner, mesh, budget, bucket_bytes, pipelined)
            if prop.gm is not traced.gm:  # blocks recomputed: the plan's graph is the step's
                traced = dataclasses.replace(traced, gm=prop.gm)
        else:
            prop = planner.run(traced.gm, ph, outputs, params=params)
        plan = Plan(prop, params, opt.debug, stage, bucket_bytes, traced, opt.given_params, opt.compile, notes)
        if opt.compile:  # how run/execute.py runs its programs (run/compiled.py)
            check_compilable(plan)
        if pipelined is None:
            self._check_budget(plan)
        self._check_kept(plan, params)
        self._adopt(plan.param_choices)
        return plan

    def _solve(self, traced, ph, outputs, params, stage, planner, mesh, budget, bucket_bytes, pipelined):
        """The ILP's Propagation under ``budget``. The device's implied budget (memory_budget=None)
        is solved without memory rows first, and with them only where that plan's estimate
        exceeds it: the fastest plan, when it fits, is the budget's optimum too, and most plans
        of a model that fits never pay for the rows and their cuts."""
        opt = self.options
        free = free_params(traced, mesh, self.decided)
        if pipelined is not None:
            free = pipelined.free(free)
        grad_ix = {i for i, r in enumerate(traced.outputs) if r.kind == "grad"}
        auto = opt.activation_checkpointing == "auto" and stage == "step"
        def run(bounded: bool):
            memory = MemoryRows(budget, traced.gm, params, stage == "step", opt.cost.optimizer_state, ph, mesh,
                                bucket_bytes, grad_ix) if bounded else None
            # activation_checkpointing="auto": which blocks to recompute is the program's choice too
            recompute = RecomputeChoice(traced.gm) if auto else None
            if memory is not None:
                memory.recompute = recompute
            # the hand recipes as the search's starts, for a device (the cost model knows its memory) or under
            # memory rows: the answer is never costlier than a recipe that fits. Each costs a propagation to
            # price (~1 CPU s for three on a tiny Llama on 2x2), which a threads run on the host (no device
            # memory modelled, planning in seconds) goes without.
            device = getattr(opt.cost, "device_memory", None) is not None
            starts = (recipe_starts(self.model, mesh, free, params)[0]
                      if (bounded or device) and free and pipelined is None else {})
            try:
                return solve(planner, traced.gm, ph, outputs, params=params, free=free,
                             grads=grad_outputs(traced, free), memory=memory,
                             estimate=None if memory is None else lambda p: estimate_peak(p, params, memory),
                             recompute=recompute, time_limit=opt.plan_time_limit, starts=starts,
                             price=None if pipelined is None else pipelined.pricer(traced, params, opt.given_params))
            except MemoryBudgetError as e:
                raise MemoryBudgetError(f"{e.message}; {budget_words(opt)}",
                                        fix=f"{e.fix}; or {over_budget_fix(opt, getattr(e, 'least', None))}") from e

        if budget is None:
            return run(False)
        if opt.budget_source == "device" and not auto:
            prop = run(False)
            probe = MemoryRows(budget, traced.gm, params, stage == "step", opt.cost.optimizer_state, ph, mesh,
                               bucket_bytes, grad_ix)
            if estimate_peak(prop, params, probe)[0] <= budget:
                return prop
        return run(True)

    def _adopt(self, chosen: dict) -> None:
        """The first step plan's parameter placements hold for every later plan; plans made before
        with other placements (forward only, which choose none) are made again when next asked for."""
        if not chosen:
            return
        changed = {name for name, pl in chosen.items() if tuple(pl) != tuple(self.specs[name])}
        self.specs.update(chosen)
        self.decided.update(self.specs)  # later plans (another signature, forward only) keep them all
        if changed:
            self._plans.clear()
            self.changes += 1

    def _check_budget(self, plan: Plan) -> None:
        budget = self.options.memory_budget
        if budget is None:
            return
        need = plan.stats()["peak_memory_bytes"]
        if need > budget:
            raise MemoryBudgetError(
                f"the {plan.stage} plan needs an estimated {need} bytes ({fmt_bytes(need)}) per rank (parameters, "
                f"gradients, optimizer state, peak activations) but {budget_words(self.options)}",
                fix="shard more parameters (param_placements, e.g. Shard(0) on the data dim for fully-sharded "
                    "parameters, or leave them to the planner: \"auto\"), shard the batch or sequence; "
                    + over_budget_fix(self.options, need))

    def _check_kept(self, plan: Plan, params: dict) -> None:
        """reshard_after_forward=False (or per module) on parameters the user placed that the step
        gathers none of (replicated, tensor parallel) cannot be honoured: say so, not nothing."""
        opt = self.options
        kept = {ph for ph, name in params.items() if name in opt.kept_gathered}
        if plan.stage != "step" or not kept or not all(params[ph] in opt.given_params for ph in kept):
            return
        if not kept & gathered_sources(plan):
            names = sorted(params[ph] for ph in kept)
            raise ConfigError(f"reshard_after_forward keeps {len(names)} parameter(s) gathered for backward "
                              f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), but the plan gathers "
                              "none of them: their placements (param_placements) are used where they lie",
                              fix="shard them on a data dim to gather them before use (FSDP: sw.recipes.fsdp), or "
                                  "leave reshard_after_forward at True")


def budget_words(opt: Options) -> str:
    """Where the budget a plan missed came from, in words."""
    b = opt.memory_budget
    if opt.budget_source == "device":
        return (f"memory_budget (None: the cost model's device memory {fmt_bytes(opt.cost.device_memory)} less a "
                f"{DEVICE_MEMORY_RESERVE:.0%} reserve for the allocator and the communication library) is "
                f"{int(b)} bytes ({fmt_bytes(b)})")
    return f"memory_budget is {int(b)} bytes ({fmt_bytes(b)})"


def over_budget_fix(opt: Options, least) -> str:
    """What would fit a plan needing ``least`` bytes per rank (None: unknown): more ranks (the
    state divides over them), checkpointing, a pipeline dim, or no budget."""
    parts = []
    if least:
        ranks = opt.mesh.size * least / opt.memory_budget
        parts.append(f"about {math.ceil(ranks)} ranks or more instead of {opt.mesh.size} (a data dim sharding "
                     "parameters, gradients and optimizer state: FSDP)")
    if opt.activation_checkpointing in ("none", "selective"):
        parts.append('activation_checkpointing="blocks" (or "selective", "auto")')
    if opt.pipeline is None:
        parts.append('a pipeline dim (pipeline=sw.Pipeline(dim="pp", microbatches=8))')
    parts.append("a smaller batch or sequence per rank")
    if opt.budget_source == "device":
        parts.append('memory_budget=float("inf") for no budget')
    return "try " + "; ".join(parts)


def check_recompute(gm, checkpointing: str) -> None:
    """activation_checkpointing other than "none" on a step with no repeated layer to recompute
    cannot be honoured: a ConfigError, not a plan that silently saves everything."""
    if checkpointing == "none":
        return
    found = any(RECOMPUTE in n.meta for n in gm.graph.nodes) if checkpointing != "auto" else bool(
        plan_recompute(gm, "blocks"))
    if not found:
        raise ConfigError(f"activation_checkpointing={checkpointing!r} found no repeated layer to recompute: no "
                          "forward op ran in a module with an index in its path (model.layers.3, transformer.h.0) "
                          "and was read by backward",
                          fix="keep the layers in an nn.ModuleList or nn.Sequential, or checkpoint regions yourself "
                              "with torch.utils.checkpoint(..., use_reentrant=False)")


def estimate_peak(prop, params: dict, memory: MemoryRows) -> tuple:
    """(bytes per rank at the peak, optimizer state included, as Plan.stats() counts them; the
    graph node at that peak; {graph node: bytes while it runs}) of a planned Propagation, from
    the lowered plan's liveness estimate (lower/memory.py) on its busiest rank: what the ILP's
    memory cuts (search/solve.py) are made against."""
    plan = Plan(prop, params, debug=False, stage="step" if memory.training else "forward",
                bucket_bytes=memory.bucket_bytes)
    mem = plan.memory()
    optimizer = plan.cost.optimizer_bytes(mem["updated"]) if memory.training else 0
    est = plan.memory_estimate(mem["rank"])
    order = [n.name for n in plan.program_module(mem["rank"], guards=False).graph.nodes]
    curve = {name: b + optimizer for name, b in est.curve if name in memory.order}
    return mem["peak"] + optimizer, memory.point_of(est.peak_node, order), curve


