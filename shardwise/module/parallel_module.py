"""parallelize(model, mesh, example_inputs, ...) -> ParallelModule.

    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), (x,),
                        input_placements={"x": {"dp": sw.Shard(0)}}, loss_fn=loss_fn)
    loss = pm.step(x, y); opt = pm.optimizer(torch.optim.AdamW, lr=1e-3); opt.step()

A ParallelModule holds the model's state, sharded onto the ranks this process runs, and runs
steps and forward calls: it asks the planning driver (planning.py) for the plan of each call's
signature and runs it (run/execute.py's Executable, one per plan) on the backend.
"""
from __future__ import annotations

import bisect

import torch

from ..core.errors import ConfigError, ShardingError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..lower.buckets import DEFAULT_BUCKET_BYTES
from ..lower.plan import Plan
from ..run.backend import make_backend
from ..run.execute import Executable, gather, gather_held
from ..run.inputs import leaves_of
from ..run.pipeline import PipelineExecutable
from .agree import check_same_plan
from .grads import clip_grad_norm_, grad_norm
from .inputs import StepInputs
from .kv_cache import KVCache
from .options import DEFAULT_PLANNER, check_options
from .pipeline import check_step_targets
from .planning import Planning
from .spec import param_specs
from .steady import SteadyStep


class ParallelModule:
    """A model laid out on a mesh. Holds the local shards of every rank this process runs.

    On the torch backend, building one is collective (every rank builds it, in the same order:
    process groups per mesh dim, sync_module_states, local input shapes), and so are step,
    __call__, gradients, state_dict, sync_to, grad_norm and clip_grad_norm_.

    example_inputs: a tuple for ``model(*inputs)``, a dict for ``model(**inputs)`` (a Hugging Face
        batch), or a tuple and ``example_kwargs`` for both; later calls pass the same way
        (``pm.step(*inputs, *targets, **kwargs)``, ``pm(**batch)``).
    input_placements / target_placements: {forward-arg name, keyword input's name or index:
        placements}; a target shaped like a placed input follows that input unless named here;
        with ``inputs="local"`` a target whose leading dim is the local batch of the placed inputs
        takes their batch placement (the plan's summary says so in its first lines).
    param_placements: {param or buffer name: placements}, or "auto". With planner="ilp" (what
        "auto" picks when nothing is placed or a memory_budget is given) every trainable parameter
        not named is placed by the planner together with the node strategies (search/params.py:
        replicated, tensor parallel, or FSDP-style: sharded, gathered before use, gradient
        reduce-scattered), in the first step plan; with "propagate" they stay Replicate.
    loss_fn: loss_fn(output, *targets) -> scalar; None: the model's output (or its .loss).
    backend: "threads" (every rank here) or "torch" (this process's rank; needs a process group).
    memory_budget: bytes per rank (parameters, gradients, optimizer state, peak activations); with
        planner="ilp" a constraint of the program (search/budget.py; MemoryBudgetError when no plan
        fits); a plan whose estimated peak exceeds it raises MemoryBudgetError. None (default): the
        cost model's device memory less module/options.DEVICE_MEMORY_RESERVE, or no budget where it
        has none (the "cpu" preset, CostModel()); float("inf"): no budget.
    inputs: "global" (every rank passes the full inputs and targets; on the torch backend the
        first step of each plan checks that they are the same on every rank) or "local" (each
        rank passes its own piece as its placements lay it out, the DDP habit; on the threads
        backend each argument is then a list of per-rank values). See run/inputs.py.
    sync_module_states: torch backend: broadcast rank 0's parameters and buffers into the model
        on every rank before sharding it (DDP's convention), so ranks that built their model with
        different seeds all train rank 0's. Collective.
    attention: "auto" | "ulysses" | "ring" | "gather": which sequence-parallel attention to allow.
    replicate_fallback: ops (or their names) without a rule to run replicated, reported in the plan.
    planner: "auto" (default: "ilp" when no input, target or parameter is placed or a
        memory_budget is given, else "propagate"; ``choose_planner``), "propagate" (node by node
        in graph order, from the user's placements; fast) or "ilp" (every node's strategy, and
        every parameter not placed, chosen together by an integer program minimising the
        estimated communication plus compute time, search/solve.py, scipy/HiGHS; propagation's plan
        is its incumbent, so never costlier under cost_model; on an n-d mesh a local optimum;
        deterministic: the same graph, mesh and costs give the same plan, unless the time limit
        stops it: on the torch backend a plan's first run compares it across the ranks and
        PlanMismatchError raised where they differ). The "# planner:" line of plan.summary()
        says how the solve went.
    plan_time_limit: CPU seconds the ILP planner may take per plan (default None: 4, search/solve.py
        TIME_LIMIT_S, or 30 with a memory_budget or activation_checkpointing="auto", whose cuts and
        columns solve more; float("inf"): none): where it runs out, the best plan found so far is kept
        (propagation's at worst) and the "# planner:" line says so. A progress line shows on a
        terminal's stderr from 2 s on.
    cost_model: link and compute figures (shardwise.CostModel; default: the preset of the
        device the model lives on, CostModel.for_device); registry: the rule table to use;
    debug: check every local result's shape against the plan (on by default) on the first run of
        each plan on each rank (a plan's local shapes are fixed; later runs skip the guards).
    bucket_bytes: independent all_reduces (the gradients') are coalesced into flat buckets of at
        most this many bytes (default 25 MiB, as DDP), each launched asynchronously as soon as its
        last member is computed and waited for before its first use (lower/buckets.py), likewise
        reduce_scatters; the all_gathers of sharded parameters are coalesced per block (FSDP2's
        units: each indexed layer, plus one root for the rest), one call per block started a
        block ahead (prefetch, lower/prefetch.py). None: each collective where it is first needed,
        no prefetch.
    compile: run each rank's program through torch.compile (inductor, fullgraph; torch backend only,
        a ConfigError otherwise): the same program (``pm.plan.program(rank)`` prints it), its
        collectives as torch's functional collectives, compiled once per plan and rank on its first
        run (run/compiled.py). An op whose local call communicates other than by an all_reduce
        (ring attention, MoE dispatch, halo exchanges) raises a ConfigError at planning.
    reshard_after_forward: FSDP2's option, for parameters gathered before use (sharded on a data
        dim): True (default) frees each after its last forward read and gathers it again for
        backward; False keeps it gathered until backward's last read (one gather less per
        parameter and step, its full size held through the step); {module or parameter name:
        bool} per module, the most specific name deciding ("" is the whole model), e.g.
        ``{"layers.11": False}`` for the last block, whose backward comes right after its forward.
    mixed_precision: ``sw.MixedPrecision(param_dtype, reduce_dtype, output_dtype)`` (FSDP2's policy;
        core/precision.py): the parameters and the optimizer state stay in their dtype (the masters),
        each rank casts its shards to ``param_dtype`` before anything moves them, gradients are
        reduced in ``reduce_dtype`` and land in ``.grad`` in the masters' dtype.
    activation_checkpointing: "none" | "blocks" (backward recomputes every repeated layer from its
        input) | "selective" (torchtitan's: keeps attention's and every other matmul's outputs)
        | "auto" (the ILP decides per layer, save or recompute, under ``memory_budget``; see
        trace/recompute.py). torch.utils.checkpoint regions of the model are recomputed in any case.
    pipeline: ``sw.Pipeline(dim="pp", microbatches=m, schedule="1f1b" | "gpipe" | "interleaved" |
        "zero-bubble", stages_per_rank=v, split_points=None)``: the model's depth split into
        stages along mesh dim ``dim``, the batch run in ``m`` microbatches on the schedule, the
        other mesh dims planned inside each stage (module/pipeline.py). Each rank holds its
        stages' parameters; ``pm.step`` only (a forward call raises). With loss_fn, pass
        example_targets (the stages are cut from the traced step at parallelize). With
        mixed_precision and activation_checkpointing ("blocks", "selective"; "auto" raises a
        ConfigError) the stages are cut from the step traced with them.
    """

    def __init__(self, model, mesh: Mesh, example_inputs: tuple | dict, *, input_placements=None, param_placements="auto",
                 loss_fn=None, backend="threads", target_placements=None, example_targets=None,
                 memory_budget=None, replicate_fallback=(), cost_model=None, registry=None, debug=True,
                 attention="auto", planner=DEFAULT_PLANNER, inputs="global", sync_module_states=True,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, compile=False, reshard_after_forward=True, example_kwargs=None,
                 mixed_precision=None, activation_checkpointing="none", pipeline=None, plan_time_limit=None):
        self.options = check_options(
            model, mesh, backend=backend, planner=planner, input_placements=input_placements,
            target_placements=target_placements, param_placements=param_placements, memory_budget=memory_budget,
            bucket_bytes=bucket_bytes, compile=compile, reshard_after_forward=reshard_after_forward,
            registry=registry, replicate_fallback=replicate_fallback, cost_model=cost_model, debug=debug,
            attention=attention, mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
            pipeline=pipeline, inputs=inputs, plan_time_limit=plan_time_limit)
        check_step_targets(pipeline, loss_fn, example_targets)
        example_inputs, example_kwargs = _example(example_inputs, example_kwargs)
        self.model, self.mesh, self.loss_fn = model, mesh, loss_fn
        self.step_inputs = StepInputs(model, mesh, len(example_inputs), input_placements, target_placements, inputs,
                                      kwarg_names=example_kwargs)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        canonical = {id(t): n for n, t in state.items()}
        # model.state_dict() also lists tied aliases (e.g. lm_head.weight = wte.weight)
        self.aliases = {k: canonical[id(t)] for k, t in model.state_dict(keep_vars=True).items() if id(t) in canonical}
        # {parameter or buffer: placements}: the user's, then the planner's choices (planning.py)
        self.specs = param_specs({n: tuple(t.shape) for n, t in state.items()}, param_placements, mesh)
        self.planning = Planning(model, self.options, self.specs, has_loss=None if loss_fn is None else True)
        self.backend = make_backend(backend, mesh)
        # every process plans on its own: a plan's first run checks it is every rank's (module/agree.py)
        self._device = next((t.device for t in state.values() if t.device.type == "cuda"), None)
        if sync_module_states:
            self.backend.broadcast_state(model)
        self._shards = None  # {rank: {name: local tensor}}, made once the placements are known (shards)
        self._followed = None  # the step plan whose parameters' requires_grad the shards last took
        self._executables: dict = {}  # Plan -> Executable
        self._last_plan = None
        self._steady = None  # the last step's SteadyStep (steady.py): its next steps skip the plan lookup
        example_args = example_inputs + tuple(example_targets or ())
        example = self.step_inputs.prepare(example_args, example_kwargs, self.backend)
        self.step_inputs.leaf_placements(example)  # a wrong input placement fails here, at parallelize
        self._example = example
        self._kv_cache = KVCache(model)  # forward calls run without the model's KV cache (kv_cache.py)
        self._forward_example = lambda: self._forward_batch(example_args, example_kwargs, example, placed=True)
        if loss_fn is None or example_targets is not None:  # plan now: the state is then sharded once
            self._last_plan = self.planning.first_plan(example, example.placements, loss_fn, self._forward_example)

    # -- the state and the plans ----------------------------------------------------------
    @property
    def shards(self) -> dict:
        """{rank held here: {parameter or buffer name: local shard}}. Made from the model once the
        placements are known: at parallelize when the first plan is made there, else when first
        asked for (the first step, or ``pm.optimizer`` before it: then the parameters the planner
        places are cut again in place at the first step plan, ``_adopt``)."""
        if self._shards is None:
            pipe = self.planning.pipeline
            if pipe is None:
                self._shards = self.backend.shard_state(self.model, self.specs)
            else:  # a pipeline stage's ranks hold that stage's parameters and buffers
                self._shards = self.backend.shard_state(self.model, self.specs, keep=pipe.holds)
            self._cut = dict(self.specs)  # the placements the shards were cut with
            self._cut_at = self.planning.changes  # ... as the planning had changed specs so far
        return self._shards

    @property
    def planner(self):
        """The strategy search's Planner (its cost model, registry and mesh)."""
        return self.planning.planner

    @property
    def has_loss(self) -> bool | None:
        return self.planning.has_loss

    def _step_plan(self, batch) -> Plan:
        # a plan of this signature was made with the placements its leaves give: they are read only to plan
        plan = self.planning.planned_step(batch)
        if plan is None:
            plan = self.planning.step_plan(batch, self.step_inputs.leaf_placements(batch), self.loss_fn)
        if plan is not self._followed:  # e.g. a parameter frozen or thawed since: the shards follow
            self._follow_requires_grad()
            self._followed = plan
        self._adopt()
        self._last_plan = plan
        return plan

    def _follow_requires_grad(self) -> None:
        """The local shards take their model parameter's requires_grad (freezing goes through the
        model, as the plans read it): a frozen parameter's shards leave pm.parameters() and get no
        .grad, as in torch."""
        if self._shards is None:
            return
        flags = dict((n, p.requires_grad) for n, p in self.model.named_parameters())
        for shards in self._shards.values():
            for name, t in shards.items():
                want = flags.get(name)
                if isinstance(t, torch.nn.Parameter) and want is not None and t.requires_grad != want:
                    t.requires_grad_(want)

    def _forward_plan(self, batch) -> Plan:
        plan = self.planning.forward_plan(batch, self.step_inputs.leaf_placements(batch))
        if self._last_plan is None or self.planning.has_loss is False:
            self._last_plan = plan
        return plan

    def _adopt(self) -> None:
        """Shards cut before the planner chose their parameters' placements (an optimizer made
        before the first step) are cut again in place (``.data``: optimizers keep them)."""
        if self._shards is None or self._cut_at == self.planning.changes:  # specs as they were cut
            return
        for name, pl in self.specs.items():
            if tuple(pl) == tuple(self._cut[name]):
                continue
            full = gather(self.backend, self._shards, name, self._cut[name]) if self.planning.pipeline is None \
                else self._gather(name, placements=self._cut[name])
            layout = Layout(full.shape, full.dtype, tuple(pl))
            for rank, shards in self._shards.items():
                if name in shards:
                    shards[name].data = layout.local_view(full, self.mesh, rank).clone()
            self._cut[name] = tuple(pl)
        self._cut_at = self.planning.changes

    def _executable(self, plan: Plan) -> Executable:
        if plan not in self._executables:
            self._executables[plan] = Executable(plan) if self.planning.pipeline is None else PipelineExecutable(plan)
        return self._executables[plan]

    def _gather(self, name: str, grad: bool = False, placements=None, shards=None):
        """The full tensor of ``name`` (its ``.grad``), from the ranks that hold it (collective)."""
        placements = self.specs[name] if placements is None else placements
        shards = self.shards if shards is None else shards
        pipe = self.planning.pipeline
        if pipe is None:
            return gather(self.backend, shards, name, placements, grad)
        t = dict([*self.model.named_parameters(), *self.model.named_buffers()])[name]
        return gather_held(self.backend, shards, name, placements, pipe.dim, pipe.owner_of(name), tuple(t.shape),
                           t.dtype, grad)

    @property
    def owner_dims(self) -> tuple:
        """Mesh dims whose coordinate says which ranks hold a tensor at all (a pipeline's: each
        stage's ranks hold its parameters), not how it is laid out: counted by grad norms and
        checkpoints as a shard would be."""
        return () if self.planning.pipeline is None else (self.planning.pipeline.dim,)

    def pipeline_timeline(self):
        """The measured timeline of the last pipelined step (search/schedules.Timeline): per
        pipeline rank held here (threads: every one; torch: this process's) each action's start
        and end in seconds from the step's start, ``idle_fraction(r)``, ``bubble_fraction()``,
        ``table()``, and ``held_bytes`` (the most bytes each rank kept between actions). Compare
        with the modelled one, ``pm.plan.timeline``; ``sw.Pipeline(timed=True)`` makes every
        rank's span the same (barriers around each step). None before the first step."""
        if self.planning.pipeline is None:
            raise ConfigError("pipeline_timeline() measures pipelined steps, and this module has no pipeline=",
                              fix='parallelize(..., pipeline=sw.Pipeline("pp", microbatches=m)) on a mesh with a '
                                  '"pp" dim')
        if self._last_plan is None or self._last_plan not in self._executables:
            return None
        return self._executables[self._last_plan].timeline()

    @property
    def plan(self) -> Plan:
        """The plan of the last step (or forward, if no step has been planned yet)."""
        if self._last_plan is None:
            return self._forward_plan(self._forward_example())
        return self._last_plan

    # -- modes ------------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """The model's training flag (``pm.train()`` / ``pm.eval()`` set it on the model)."""
        return self.model.training

    def train(self, mode: bool = True) -> "ParallelModule":
        """As ``nn.Module.train``: sets the model's (and every submodule's) training flag; the next
        step or call uses (or plans) the plan of that mode."""
        self.model.train(mode)
        return self

    def eval(self) -> "ParallelModule":
        return self.train(False)

    # -- running ----------------------------------------------------------------------
    def step(self, *args, **kwargs):
        """Forward + backward on the inputs and targets (full tensors, or with ``inputs="local"`` each
        rank's pieces); returns the full loss. Each local parameter shard's ``.grad`` gets the
        gradient added, as ``loss.backward()`` does (``pm.zero_grad()`` / ``opt.zero_grad()`` start
        afresh). Collective on the torch backend: every rank calls it."""
        steady = self._steady
        if steady is not None:  # the last step's plan, if these arguments and the model's flags pick it
            loss = steady(args, kwargs)
            if loss is not None:
                return loss
        if self.has_loss is False:
            raise ShardingError(
                f"this ParallelModule has no loss to step: {self.planning.no_loss}; it was planned for inference, "
                "so pm(*inputs) works but pm.step does not",
                fix="pass loss_fn=lambda output, *targets: <scalar> to parallelize (and the targets to pm.step), "
                    "or have the model return a scalar loss (or an output with .loss)")
        batch = self.step_inputs.prepare(args, kwargs, self.backend)
        plan = self._step_plan(batch)
        outs = self._run(plan, batch)
        loss = self._finish_step(plan, outs, lambda: batch)
        self._steady = SteadyStep.of(self, plan, batch)
        return loss

    def _finish_step(self, plan: Plan, outs: dict, batch_of) -> torch.Tensor:
        """After a step's run (the full path's or the steady one's): each rank's gradients into
        ``.grad``, the buffers it updated written, and the loss (replicated: any rank's).
        ``batch_of()``: the step's Batch, asked for only where a gradient's buffer is not known to
        be its own (``_accumulate`` then checks it against the arguments)."""
        traced, executable = plan.traced, self._executables[plan]
        for rank, res in outs.items():
            owned = executable.owns(rank, traced.grad_indices)
            self._accumulate(rank, res, traced.grad_outputs, None if owned else batch_of(), owned)
        self._write_buffers(plan, outs)
        loss = res[0]
        return loss.detach() if loss.requires_grad else loss  # (programs run without autograd)

    def _accumulate(self, rank: int, outs: list, slots: tuple, batch, owned: bool = False) -> None:
        """Add the gradients among a rank's program outputs (``slots``: (parameter name, output index),
        TracedStep.grad_outputs: a parameter unused by the loss has none) into ``.grad`` (None: the
        gradient itself). An output that shares storage with a parameter or an input, overlaps another
        gradient, or is not contiguous (an expanded view of one value), is copied first, as autograd
        does, so an in-place update of one ``.grad`` (clipping, ``add_``) works and never writes into
        anything else. Disjoint views of one bucket's buffer are kept as they are (DDP's
        gradient_as_bucket_view): no copy per step. ``owned``: the program made each gradient a
        buffer of its own (Executable.owns), so only its layout is looked at."""
        shards = self._shards[rank]  # (cut by the run)
        if owned:
            for name, i in slots:
                p, g = shards[name], _materialized(outs[i])
                if not p.requires_grad:
                    _frozen_shard(name)
                if g.dtype != p.dtype:  # mixed precision: reduced in reduce_dtype, kept in the master's
                    g = g.to(p.dtype)
                if p.grad is not None:
                    p.grad.add_(g)
                else:
                    p.grad = g if g.is_contiguous() else g.clone(memory_format=torch.contiguous_format)
            return
        args = batch.local[rank] if batch.local is not None else (batch.inputs, batch.targets)
        taken = {t.untyped_storage().data_ptr() for t in [*shards.values(), *leaves_of(args)] if t.numel()}
        held: dict = {}  # storage -> the byte ranges of the gradients kept in it so far, sorted (_Ranges)
        for name, i in slots:
            g = outs[i]
            if g is None:  # not this rank's (a pipeline stage's): .grad stays as it is
                continue
            p, g = shards[name], _materialized(g.detach())
            if not p.requires_grad:
                _frozen_shard(name)
            if g.dtype != p.dtype:  # mixed precision: reduced in reduce_dtype, kept in the master's
                g = g.to(p.dtype)
            if p.grad is not None:
                p.grad.add_(g)
                continue
            ptr, lo = g.untyped_storage().data_ptr(), g.data_ptr()
            hi = lo + g.numel() * g.element_size()
            ranges = held.get(ptr)
            owned = g.is_contiguous() and not (g.numel() and (ptr in taken or (ranges is not None
                                                                                 and ranges.overlaps(lo, hi))))
            p.grad = g if owned else g.clone(memory_format=torch.contiguous_format)
            if owned:
                (held[ptr] if ranges is not None else held.setdefault(ptr, _Ranges())).add(lo, hi)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every local shard held here (as ``nn.Module.zero_grad``)."""
        for p in self.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The total gradient norm of the whole model, equal to one device's: each element counted
        once (a replicated shard by one rank of its group). Collective on the torch backend."""
        return grad_norm(self, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach=None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole sharded model: returns the total norm
        (equal to one device's) and scales every local gradient shard by
        ``min(1, max_norm / (total + 1e-6))``. torch's own clip_grad_norm_ over ``pm.parameters()``
        would count each replicated shard once per rank. Collective on the torch backend."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    def __call__(self, *inputs, **kwargs):
        """Forward only; returns the full outputs in the model's output structure. Honours the
        training flag (``pm.eval()``: dropout off). A Hugging Face model runs with use_cache=False:
        its output holds no KV cache (module/kv_cache.py). Collective on the torch backend."""
        if self.planning.pipeline is not None:
            raise ConfigError("a pipelined ParallelModule runs training steps only (pm.step); forward calls are not "
                              "pipelined yet", fix="pm.sync_to(model) and call the model, or parallelize it again "
                              "without pipeline= for inference")
        batch = self._forward_batch(inputs, kwargs)
        plan = self._forward_plan(batch)
        outs = self._run(plan, batch)
        self._write_buffers(plan, outs)
        return plan.traced.rebuild(list(next(iter(outs.values()))))

    def _forward_batch(self, inputs: tuple, kwargs: dict, prepared=None, placed: bool = False):
        """The Batch of a forward call: keyword inputs with use_cache=False where the model would
        return a KV cache (kv_cache.py); ``prepared``: these arguments' Batch, if nothing changes;
        ``placed``: its leaves' placements read too."""
        per_rank = self.mesh.size if self.step_inputs.mode == "local" and len(self.backend.ranks) == self.mesh.size \
            else None
        dropped = self._kv_cache.drop(kwargs, per_rank)
        if dropped is kwargs and prepared is not None:
            return prepared
        batch = self.step_inputs.prepare(inputs, dropped, self.backend)
        if placed:
            self.step_inputs.leaf_placements(batch)
        return batch

    def _run(self, plan: Plan, batch) -> dict:
        """{rank: program outputs} of ``plan`` on ``batch`` on every rank held here."""
        executable = self._executable(plan)
        if not executable.inputs_checked:  # the plan's first run here: every rank runs it now (collective)
            check_same_plan(self.backend, plan, self._device)
            self.step_inputs.check_same_inputs(self.backend, executable, batch)
        return executable.run(self.backend, self.shards, batch.inputs, batch.targets, batch.kwargs, batch.local)

    def _write_buffers(self, plan, outs: dict) -> None:
        """Buffers the traced call updated (BatchNorm running statistics in training mode) take
        their new values on every rank held here, as eager training writes them in place."""
        updates = plan.traced.buffer_outputs
        if not updates:
            return
        for rank, res in outs.items():
            for name, i in updates:
                self.shards[rank][name].copy_(res[i])

    def forward(self, *inputs, **kwargs):
        return self(*inputs, **kwargs)

    # -- state ------------------------------------------------------------------------
    def parameters(self) -> list:
        """The local parameter shards of every rank this process holds (torch.optim works on them)."""
        return [p for rank in sorted(self.shards) for p in self.shards[rank].values()
                if isinstance(p, torch.nn.Parameter) and p.requires_grad]

    def named_local_parameters(self, rank: int) -> dict:
        return {n: p for n, p in self.shards[rank].items() if isinstance(p, torch.nn.Parameter)}

    def _keeps_gathered(self, rank0_only: bool) -> bool:
        """Whether this process keeps what a gather returns (rank0_only: rank 0 only)."""
        return not rank0_only or 0 in self.backend.ranks

    def gradients(self, rank0_only: bool = False) -> dict:
        """{name: full gradient} (None where unset), gathered from the local shards.
        Collective on the torch backend: every rank must call it (on one rank alone it raises a
        CollectiveError once the backend's timeout passes). ``rank0_only``: ranks other than 0 get {}."""
        keep = self._keeps_gathered(rank0_only)
        out = {}
        for n in [n for n, p in self.model.named_parameters() if p.requires_grad]:
            g = self._gather(n, grad=True)
            if keep:
                out[n] = g
        return out

    def state_dict(self, rank0_only: bool = False) -> dict:
        """Full parameters and buffers, gathered, under the keys of ``model.state_dict()``.
        Collective on the torch backend: every rank must call it (on one rank alone it raises a
        CollectiveError once the backend's timeout passes). ``rank0_only=True``: rank 0 gets the
        state, the other ranks ``{}`` (each tensor is still gathered collectively, and dropped on
        them one at a time, so they never hold the whole model)."""
        keep = self._keeps_gathered(rank0_only)
        full = {}
        for n in self.specs:
            t = self._gather(n)
            if keep:
                full[n] = t
        return {k: full[n] for k, n in self.aliases.items()} if keep else {}

    def sync_to(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """Copy the trained full parameters and buffers into ``model`` (default: the module given to
        parallelize; or another instance of it) in place, and return it: evaluation scripts and
        ``save_pretrained`` then see the trained weights. Non-persistent buffers are copied too.
        Collective on the torch backend: every rank calls it."""
        model = self.model if model is None else model
        own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        missing, extra = sorted(set(self.specs) - set(own)), sorted(set(own) - set(self.specs))
        if missing or extra:
            raise ShardingError(f"sync_to: the model has other parameters/buffers than the parallelized one: "
                                f"missing {missing}, unexpected {extra}",
                                fix="pass a module of the same architecture (e.g. a fresh copy of the original)")
        for name in self.specs:
            full = self._gather(name)
            if tuple(own[name].shape) != tuple(full.shape):
                raise ShardingError(f"sync_to: {name!r} has shape {tuple(own[name].shape)} in the model, "
                                    f"{tuple(full.shape)} in the parallelized one",
                                    fix="pass a module of the same architecture and sizes")
            with torch.no_grad():
                own[name].copy_(full)
        return model

    def load_state_dict(self, full_state: dict) -> None:
        """Copy full tensors into the local shards (in place, so optimizers keep their references).
        Every rank passes the full state; no communication."""
        unknown = set(full_state) - set(self.aliases)
        # non-persistent buffers (e.g. rotary inv_freq) are not in a state dict: not required
        missing = set(self.aliases.values()) - {self.aliases[k] for k in full_state if k in self.aliases}
        if unknown or missing:
            raise ShardingError(f"load_state_dict: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}",
                                fix="pass a full state dict with the keys of model.state_dict()")
        for key, t in full_state.items():
            name = self.aliases[key]
            want = Layout(t.shape, t.dtype, self.specs[name])
            for rank, shards in self.shards.items():
                if name not in shards:  # another pipeline stage's
                    continue
                local = shards[name]
                piece = want.local_view(t, self.mesh, rank)
                if piece.shape != local.shape:
                    raise ShardingError(f"load_state_dict: {name!r} has shape {tuple(t.shape)}, which does not match "
                                        f"the model's parameter")
                with torch.no_grad():
                    local.copy_(piece)

    def optimizer(self, cls, **kwargs):
        """``cls(local shards of every rank held here, **kwargs)``; elementwise optimizers such as
        AdamW then update each shard exactly as on one device. The result is still a ``cls``
        (step, zero_grad, param_groups, schedulers) whose state is addressable by parameter name
        and rank (shardwise.module.optim.ShardedOptimizer), so pm.save / pm.load can reshard it."""
        from .optim import make_optimizer

        self._optimizer = make_optimizer(self, cls, **kwargs)
        return self._optimizer

    # -- checkpoint (module/checkpoint: DCP, resharding, DTensor interop) -------------
    def _opt(self, optimizer):
        return optimizer if optimizer is not None else getattr(self, "_optimizer", None)

    def save(self, path, optimizer=None, extra=None, step=None) -> None:
        """Sharded checkpoint through torch.distributed.checkpoint: each rank writes only its shards
        (each region once), optimizer state included; any placement (uneven, nested, unit, groups).
        Also the training state: ``step`` (or ``extra["step"]``), every rank's random generators and
        ``extra`` (a picklable dict: data position, scheduler state). The checkpoint at ``path`` is
        replaced only once the new one is complete, with a manifest of its files' sizes and
        checksums. Collective on the torch backend."""
        from .checkpoint import save

        save(self, path, optimizer, extra, step)

    def load(self, path, optimizer=None, rng=None) -> dict:
        """Load a DCP checkpoint saved on any mesh and placements (by pm.save, or a DTensor / FSDP2 job
        as {"model": ..., "optim": ...} with the same global shapes) into the local shards, in place,
        and the optimizer's state if given; checked against its manifest first (a damaged file raises
        CheckpointCorruptError). Returns the saved ``extra`` plus "step" (None if not saved) and
        restores the random generators (``rng``: None where saved for these ranks, True required,
        False never). Collective on the torch backend."""
        from .checkpoint import load

        return load(self, path, optimizer, rng)

    def sharded_state_dict(self, optimizer=None) -> dict:
        """{"model": ..., "optim": ...} whose tensors are views of the local shards as DCP chunks:
        dcp.save writes it, dcp.load fills it in place (pm.load also sets up optimizer state)."""
        from .checkpoint import sharded_state_dict

        return sharded_state_dict(self, optimizer)

    def optimizer_state_dict(self, optimizer=None) -> dict:
        """The full optimizer state as one device's optimizer over model.parameters() holds it
        (default: the last optimizer made by pm.optimizer). Collective on the torch backend."""
        from .checkpoint import optimizer_state_dict

        opt = self._opt(optimizer)
        if opt is None:
            raise ShardingError("optimizer_state_dict: no optimizer", fix="make one with pm.optimizer(...)")
        if self.planning.pipeline is not None and self.backend.name == "torch":
            raise ConfigError("optimizer_state_dict under pipeline= on the torch backend: each stage's processes hold "
                              "only their stage's state", fix="save with pm.save(path, optimizer=opt) (DCP), or "
                              "gather on the threads backend")
        return optimizer_state_dict(self, opt)

    def to_dtensors(self, rank: int | None = None) -> dict:
        """{state-dict key: DTensor} of ``rank``'s shards over a DeviceMesh equal to the mesh (without
        process groups); a ShardingError names a parameter whose placement DTensor cannot express."""
        from .checkpoint import to_dtensors

        return to_dtensors(self, rank)

    def dtensor_state(self, optimizer=None) -> dict:
        """Torch backend: {"model": DTensors, "optim": ...} of this rank over a DeviceMesh with process
        groups, ready for dcp.save. Collective the first time (it builds the mesh)."""
        from .checkpoint import dtensor_state

        return dtensor_state(self, optimizer)


class _Ranges:
    """Disjoint byte ranges [lo, hi) of one storage, sorted: an overlap test is two comparisons
    (a bucket's gradients are many views of one buffer)."""

    def __init__(self):
        self.starts: list = []
        self.ends: list = []

    def overlaps(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self.starts, lo)
        return (i > 0 and self.ends[i - 1] > lo) or (i < len(self.starts) and self.starts[i] < hi)

    def add(self, lo: int, hi: int) -> None:
        i = bisect.bisect_right(self.starts, lo)
        self.starts.insert(i, lo)
        self.ends.insert(i, hi)


def _example(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """(positional example inputs, keyword example inputs) from a tuple, a dict, or both."""
    if isinstance(example_inputs, dict):
        if example_kwargs:
            raise ShardingError("example_inputs is a dict of keyword inputs and example_kwargs is given too",
                                fix="pass the keyword inputs once: example_inputs={...} or example_kwargs={...}")
        example_inputs, example_kwargs = (), example_inputs
    if not isinstance(example_inputs, tuple):
        raise ShardingError(f"example_inputs must be a tuple for model(*inputs) or a dict for model(**inputs), got "
                            f"{type(example_inputs).__name__}", fix="wrap a single input as (x,)")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ShardingError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}",
                            fix="e.g. example_kwargs={'attention_mask': mask}")
    return example_inputs, dict(example_kwargs or {})


def parallelize(model, mesh: Mesh, example_inputs: tuple | dict, *, input_placements=None, param_placements="auto",
                loss_fn=None, backend="threads", target_placements=None, example_targets=None,
                memory_budget=None, replicate_fallback=(), cost_model=None, registry=None, debug=True,
                attention="auto", planner=DEFAULT_PLANNER, inputs="global", sync_module_states=True,
                bucket_bytes=DEFAULT_BUCKET_BYTES, compile=False, reshard_after_forward=True,
                example_kwargs=None, mixed_precision=None, activation_checkpointing="none",
                pipeline=None, plan_time_limit=None) -> ParallelModule:
    """Lay ``model`` out on ``mesh``; see ParallelModule for the arguments (the same, with the same defaults)."""
    return ParallelModule(**locals())


def _materialized(g: torch.Tensor) -> torch.Tensor:
    """A gradient as a tensor with storage: an efficient zero tensor (sgn's gradient, the factory
    rule's ``_efficientzerotensor``) has none to look at and cannot be updated in place."""
    return torch.zeros_like(g) if g._is_zerotensor() else g


def _frozen_shard(name: str):
    raise ShardingError(f"the local shard of {name!r} was frozen (requires_grad=False) but its model parameter was "
                        "not: the step's plan computes its gradient",
                        fix=f"freeze through the model: pm.model.get_parameter({name!r}).requires_grad_(False) "
                            "(the next step plans without its gradient and the shards follow)")
