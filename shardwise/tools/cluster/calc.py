"""The cluster calculator: a model on N GPUs of a kind, before the job starts.

    job = Job("llama3-8b", gpu="h100", gpus=64, gpus_per_node=8, seq=8192, local_batch=2,
              precision="bf16", checkpoint="selective", memory_budget=80 * 2**30)
    est = estimate(job, mesh=(8, 8))         # Estimate: the layout chosen, memory by kind, step, tokens/s, fits
    rows = compare(job, meshes)              # several factorisations of the same GPUs, ranked
    best = search_mesh(job)                  # the factorisation itself (inner dims inside a node)
    job = Job("llama3-405b", gpus=512, pp=8, microbatches=32, schedule="interleaved")   # a pipeline

Each mesh is planned through the same planner as ``parallelize`` (trace, search, lower) on a model
of ``Job.planned`` blocks with the real shapes (batch, sequence, hidden sizes), priced by a cluster
cost model (core/cost.py CostModel.cluster: links per mesh dim from the node layout, achieved
rates by op class, overlap), and stamped to full depth (stamp.py). The candidate layouts of a mesh:

- "planner": every parameter placed by the ILP (``param_placements="auto"``), the batch on the
  data dims; the time-optimal layout of the cost model;
- "fsdp": every parameter sharded on the data dims (sw.recipes.fsdp), gathered before use;
- "fsdp+tp": Megatron's placements on the "tp" dim and FSDP's on the data dims (2-d meshes);
- "dp+tp": Megatron's placements on the "tp" dim, every parameter whole on the data dims (its
  gradient all-reduced once a step); only when asked for (``Job.candidates``, ``--layout``).

The estimate is the fastest candidate that fits the memory budget (the GPU's memory unless
given), or the one needing the least memory when none fits. With ``pp > 1`` the mesh given is
one pipeline stage's (the "pp" dim is outermost, across nodes): the blocks are planned for one
microbatch on it and played on the schedule (pipeline.py: the bubble, the point-to-point
messages, the data dims' communication once a step, the heaviest stage's memory with its
microbatches in flight and its parameters kept gathered).

The blocks are planned as ``parallelize`` plans a training step, with its own policies: the model
is built in float32 and ``--mixed-precision bf16`` is ``sw.MixedPrecision(param_dtype=bfloat16,
reduce_dtype=float32)`` (float32 master shards, bf16 compute, parameters gathered in bf16,
gradients cast to float32 where made and reduced in it: trace/precision.py);
``--activation-checkpointing`` is parallelize's ``activation_checkpointing`` ("selective", and
"full" for its "blocks": trace/recompute.py puts the recomputed forward into the traced
backward). Memory by kind, the step (recomputation included) and the bytes sent all come from
that plan, stamped to depth; only AdamW's state is added beside it (the cost model's
``optimizer_bytes`` of the master shards, as ``Plan.stats()`` counts it).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from ...core.cost import CostModel, GPUS
from ...core.errors import CliError, ShardingError
from ...core.layout import Replicate, Shard
from ...core.mesh import Mesh
from ...core.precision import MixedPrecision
from ...module import recipes
from . import models
from .pipeline import PipeFigures, PipeJob, pipeline_figures
from ...lower.allocator import ALLOCATORS
from .invariants import check_estimate, mark_excess_work
from .stamp import Figures, stamp

DATA_DIMS = ("dp", "fsdp", "dp_shard", "data")
PLANNED_BLOCKS = 3
# --mixed-precision: parallelize's mixed_precision= (FSDP2's MixedPrecisionPolicy as torchtitan runs it)
PRECISIONS = {"bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "fp32": None}
_PRECISION_ALIASES = {"bfloat16": "bf16", "float32": "fp32", "none": "fp32"}
# --activation-checkpointing: parallelize's activation_checkpointing= ("full": every block recomputed)
CHECKPOINTING = {"none": "none", "selective": "selective", "full": "blocks", "blocks": "blocks"}
MASTER_ITEMSIZE = 4  # the model is built in float32: its parameters (the masters) hold 4 bytes per element


@dataclass(frozen=True)
class Job:
    """What to estimate: a named model (models.NAMED) or a config.json, on ``gpus`` GPUs."""

    model: str | None = None
    gpu: str = "h100"
    gpus: int = 8
    gpus_per_node: int = 8
    seq: int = 2048
    local_batch: int = 1
    precision: str = "bf16"
    checkpoint: str = "none"
    memory_budget: float | None = None
    config_path: str | None = None
    candidates: tuple = ("planner", "fsdp", "fsdp+tp")
    planned: int = PLANNED_BLOCKS
    pp: int = 1  # pipeline ranks (the outermost mesh dim)
    microbatches: int | None = None  # per step with pp > 1 (None: the local batch, one sequence each)
    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: 2 for "interleaved"
    # PyTorch's caching allocator the run uses, for the memory it reserves (lower/allocator.py):
    # "expandable" (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan runs) or "segments"
    allocator: str = "expandable"

    def config(self):
        return models.config(self.model, self.config_path)

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """parallelize's ``mixed_precision=`` for ``precision`` (None: float32 throughout)."""
        key = (self.precision or "fp32").lower()
        key = _PRECISION_ALIASES.get(key, key)
        if key not in PRECISIONS:
            raise CliError(f"unknown --mixed-precision {self.precision!r}", fix="use bf16 or fp32")
        return PRECISIONS[key]

    @property
    def activation_checkpointing(self) -> str:
        """parallelize's ``activation_checkpointing=`` for ``checkpoint``."""
        key = (self.checkpoint or "none").lower()
        if key not in CHECKPOINTING:
            raise CliError(f"unknown --activation-checkpointing {self.checkpoint!r}",
                           fix="use none, selective or full")
        return CHECKPOINTING[key]

    @property
    def allocator_mode(self) -> str:
        """``allocator``, checked: a key of stamp.Figures.reserved."""
        if self.allocator not in ALLOCATORS:
            raise CliError(f"unknown --allocator {self.allocator!r}", fix=f"use one of {', '.join(ALLOCATORS)}")
        return self.allocator

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the blocks' matmuls run in (the cost model's peak rate)."""
        mp = self.mixed_precision
        return torch.float32 if mp is None else mp.param_dtype

    @property
    def pipe(self) -> PipeJob:
        return PipeJob(self.pp, self.microbatches, self.schedule, self.stages_per_rank)


@dataclass
class Layout:
    """One candidate layout of one mesh, estimated."""

    name: str
    placements: dict  # {parameter: placements} of the planned blocks' parameters
    figures: Figures
    # per GPU at the peak: parameters, gradients (those made by then), optimizer_state (state_memory),
    # activations (the rest of the program's peak: saved and recomputed values, gathered parameters
    # and the masters' compute copies), peak; "reserved": what PyTorch's caching allocator would
    # hold for them over training steps (lower/allocator.py, Job.allocator; not under a pipeline)
    memory: dict
    optimizer_s: float = 0.0  # AdamW's update of this GPU's shards after backward
    plan: object = field(repr=False, default=None)
    plan_s: float = 0.0
    pipeline: PipeFigures | None = None  # pp > 1: the schedule played (memory is then its heaviest stage's)
    # {mesh dim: size} where this layout computes whole on every rank on purpose (FSDP leaves a "tp" dim idle)
    replicated: dict = field(default_factory=dict)
    # its step's total work over the least candidate's, where beyond invariants.WORK_TOLERANCE (else None)
    excess_work: float | None = None
    # "planner" only: {recipe: that recipe's step time over this layout's} (> 1: the planner wins by that
    # factor), and a note where the search's own layout lost to a recipe that fits and the recipe's is kept
    vs_recipes: dict = field(default_factory=dict)
    note: str = ""

    @property
    def step_time_s(self) -> float:
        if self.pipeline is not None:
            return self.pipeline.makespan_s + self.optimizer_s
        return self.figures.step.total_s + self.optimizer_s


@dataclass
class Estimate:
    job: Job
    mesh: Mesh
    layout: Layout  # the chosen candidate
    candidates: list
    global_batch: int
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool
    budget: float
    seconds: float  # wall seconds this estimate took

    @property
    def step_time_s(self) -> float:
        return self.layout.step_time_s


def data_dims(mesh: Mesh) -> list[str]:
    """The mesh dims the batch is split on: those named like data parallelism, else all but "tp"."""
    named = [n for n in mesh.names if n in DATA_DIMS]
    return named or [n for n in mesh.names if n != "tp"] or [mesh.names[0]]


def default_names(shape: tuple) -> tuple:
    return {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp")}.get(len(shape)) or tuple(f"d{i}" for i in range(len(shape)))


def estimate(job: Job, mesh=None, names=None, plans: dict | None = None) -> Estimate:
    """The estimate of ``job`` on ``mesh`` (a shape; default: every GPU on one data dim). With
    ``job.pp > 1``, ``mesh`` is one pipeline stage's (``job.gpus / job.pp`` GPUs) and the
    estimate's mesh is ("pp", *names). ``plans``: a dict the caller keeps to reuse the planned
    blocks of earlier estimates planned alike (the same blocks, microbatch, mesh, GPU and
    policies; only the depth, pipeline or budget differ)."""
    t0 = time.perf_counter()
    if job.pp < 1 or job.gpus % job.pp:
        raise CliError(f"--pp {job.pp} does not divide --gpus {job.gpus}", fix="give a pipeline size dividing the GPUs")
    inner = job.gpus // job.pp
    shape = tuple(mesh) if mesh is not None else (inner,)
    if math.prod(shape) != inner:
        what = f"--gpus {job.gpus}" if job.pp == 1 else f"--gpus {job.gpus} / --pp {job.pp} = {inner} per stage"
        raise CliError(f"mesh {'x'.join(map(str, shape))} has {math.prod(shape)} GPUs but {what}",
                       fix="give a mesh whose sizes multiply to the GPU count (per pipeline stage with --pp)")
    names = tuple(names) if names else default_names(shape)
    mesh = Mesh(shape, names)
    cfg, _, _, _ = job.config(), job.mixed_precision, job.activation_checkpointing, job.allocator_mode  # checked first
    layers = models.layers_of(cfg)
    dp = math.prod(mesh.shape[mesh.names.index(d)] for d in data_dims(mesh))
    batch = job.local_batch * dp
    if layers < job.planned:
        raise CliError(f"the model has {layers} blocks, fewer than the {job.planned} planned", fix="plan it whole")
    m = 1
    if job.pp > 1:
        m = job.pipe.m(job.local_batch)
        job.pipe.check(job.local_batch, layers)
    model, inputs = models.build(cfg, job.planned, batch // m, job.seq, torch.float32)
    alike = (models.with_layers(cfg, job.planned).to_json_string(), batch // m, job.seq, job.gpu, job.gpus_per_node,
             mesh.shape, mesh.names, job.precision, job.checkpoint)
    cost = CostModel.cluster(job.gpu, mesh, job.gpus_per_node, compute_dtype=job.compute_dtype)
    whole = mesh if job.pp == 1 else Mesh((job.pp, *shape), ("pp", *names))
    whole_cost = cost if job.pp == 1 else CostModel.cluster(job.gpu, whole, job.gpus_per_node,
                                                             compute_dtype=job.compute_dtype)
    budget = float(job.memory_budget or cost.device_memory)
    cands, refs = [], []
    listed = _candidates(job, mesh)
    # the recipes the planner's answer is compared with (never worse than one that fits), planned where not listed
    wanted = listed + [r for r in _recipes(mesh) if "planner" in listed and r not in listed]
    for name in wanted:
        lay = _layout(name, model, inputs, mesh, cost, layers, job, {} if plans is None else plans, alike)
        if job.pp > 1:
            _pipelined(lay, job, layers, whole_cost, whole, cost)
        (cands if name in listed else refs).append(lay)
    if "planner" in listed:
        mark_excess_work(cands + refs, whole.size)  # which recipes' figures are the layouts their names promise
        i = listed.index("planner")
        cands[i] = never_worse(cands[i], [c for c in cands + refs if c.name != "planner"], budget)
    mark_excess_work(cands, whole.size)  # among the candidates shown (invariants.check_estimate)
    sound = [c for c in cands if c.excess_work is None] or cands  # figures of the layout each name promises
    fitting = [c for c in sound if c.memory["peak"] <= budget]
    chosen = (min(fitting, key=lambda c: c.step_time_s) if fitting
              else min(sound, key=lambda c: c.memory["peak"]))
    step = chosen.step_time_s
    tokens = batch * job.seq / step / job.gpus
    peak_flops = cost.flops
    mfu = chosen.figures.flops * m / job.pp / step / peak_flops  # each GPU: its 1/pp of the model, m microbatches
    est = Estimate(job, whole, chosen, cands, batch, tokens, mfu, bool(fitting), budget, time.perf_counter() - t0)
    check_estimate(est)  # figures that cannot be true raise here (invariants.py)
    return est


def _pipelined(lay: Layout, job: Job, layers: int, cost: CostModel, mesh: Mesh, inner_cost: CostModel) -> None:
    """``lay`` (planned for one microbatch) played on ``job``'s pipeline (pipeline.py): its
    pipeline figures, the heaviest stage's memory and optimizer step."""
    plan, fig = lay.plan, lay.figures
    deeper = layers if layers > job.planned else job.planned + 1
    a = stamp(plan, job.planned, reserve=False)
    b = fig if deeper == layers else stamp(plan, deeper, reserve=False)
    k = deeper - job.planned
    block = ((b.params - a.params) / k, (b.grads - a.grads) / k)  # resident state is linear in the blocks
    rest = (a.params - job.planned * block[0], a.grads - job.planned * block[1])
    stamped = {job.planned: a, deeper: b}

    def activations_of(n: int) -> float:
        """One microbatch through ``n`` blocks and the rest: the stamped peak less its state (at
        least the planned blocks: an upper bound for fewer)."""
        n = max(n, job.planned)
        if n not in stamped:
            stamped[n] = stamp(plan, n, reserve=False)
        return activations(stamped[n])

    mp = job.mixed_precision
    grad_dtype = (mp and (mp.reduce_dtype or mp.param_dtype)) or torch.float32  # FSDP2's: reduce, else param dtype
    lay.pipeline = pipeline_figures(job.pipe, plan, fig, layers, job.local_batch, cost, mesh,
                                    lambda p, g: state_memory(inner_cost, p, g), (block, rest), activations_of,
                                    b.block_stash, tuple(data_dims(plan.mesh)), grad_dtype.itemsize)
    lay.memory = lay.pipeline.memory
    heaviest = lay.pipeline.rank_blocks * block[0] + rest[0]
    lay.optimizer_s = optimizer_time(inner_cost, heaviest / MASTER_ITEMSIZE)


def never_worse(planner: Layout, recipes: list, budget: float) -> Layout:
    """The planner's layout, or the best recipe's (the fastest of ``recipes`` whose peak fits
    ``budget`` and whose figures are the layout its name promises) where the search's own layout
    does not fit or is slower: the planner's answer is never worse than a recipe in the same model.
    ``vs_recipes`` says by how much it wins over each; ``note`` why a recipe's placements were kept."""
    sound = [r for r in recipes if r.excess_work is None]
    fitting = [r for r in sound if r.memory["peak"] <= budget]
    best = min(fitting, key=lambda r: r.step_time_s, default=None)
    out = planner
    own_fits = planner.memory["peak"] <= budget
    if best is not None and (not own_fits or planner.step_time_s > best.step_time_s):
        why = "does not fit" if not own_fits else f"is slower ({planner.step_time_s:.4g} s a step)"
        out = dataclasses.replace(best, name="planner", note=(
            f"the search's own layout {why} (peak {planner.memory['peak'] / 2**30:.1f} GiB); the {best.name} "
            f"recipe's placements are kept ({best.step_time_s:.4g} s, {best.memory['peak'] / 2**30:.1f} GiB)"))
    out.vs_recipes = {r.name: r.step_time_s / out.step_time_s for r in sound}
    return out


def activations(fig: Figures) -> float:
    """The stamped peak less the state resident in it: the masters and the gradients made by then."""
    return fig.peak - fig.params - fig.peak_grads


LAYOUTS = ("planner", "fsdp", "fsdp+tp", "dp+tp")  # the layouts a Job may name (``--layout``)
_NEED_TP = ("fsdp+tp", "dp+tp")


def _recipes(mesh: Mesh) -> list[str]:
    """The recipe layouts of ``mesh``: FSDP, and with a "tp" dim FSDP x TP and DP x TP (Megatron on "tp")."""
    return ["fsdp"] + (["fsdp+tp", "dp+tp"] if "tp" in mesh.names else [])


def _candidates(job: Job, mesh: Mesh) -> list[str]:
    unknown = [c for c in job.candidates if c not in LAYOUTS]
    if unknown:
        raise CliError(f"unknown layout {unknown[0]!r}", fix=f"use one of {', '.join(LAYOUTS)}")
    out = [c for c in job.candidates if c not in _NEED_TP or "tp" in mesh.names]
    if not out:
        raise CliError(f"{' and '.join(job.candidates)} need a mesh dim named tp; mesh {mesh.names} has none",
                       fix="name a mesh dim tp (--mesh 8x8 --names dp,tp), or ask for --layout planner or fsdp")
    return out


def _inputs_placements(mesh: Mesh) -> dict:
    dims = data_dims(mesh)
    return {0: {d: Shard(0) for d in dims}, 1: {d: Shard(0) for d in dims}}


def _params(name: str, model, mesh: Mesh):
    dims = tuple(data_dims(mesh))
    if name == "planner":
        return "auto", "ilp"
    if name == "fsdp":
        return recipes.fsdp(model, dims), "propagate"
    tp = recipes.megatron(model, "tp", size=mesh.shape[mesh.dim_index("tp")])
    if name == "fsdp+tp":
        return recipes.merge(tp, recipes.fsdp(model, dims, beside=tp)), "propagate"
    # "dp+tp": parameters whole on the data dims (their gradients all-reduced once a step), Megatron on tp
    return recipes.merge(tp, {n: {d: Replicate() for d in dims} for n, _ in model.named_parameters()}), "propagate"


def _layout(name: str, model, inputs, mesh: Mesh, cost: CostModel, layers: int, job: Job, plans: dict,
            alike: tuple) -> Layout:
    t = time.perf_counter()
    if (name, alike) not in plans:
        plans[name, alike] = _plan(name, model, inputs, mesh, cost, job)
    plan = plans[name, alike]
    fig = stamp(plan, layers, reserve=job.pp == 1)  # a pipeline's memory is its schedule's (pipeline.py)
    mem = state_memory(cost, fig.params, fig.peak_grads)  # the gradients made by the peak
    mem["activations"] = activations(fig)
    mem["peak"] = mem["parameters"] + mem["gradients"] + mem["optimizer_state"] + mem["activations"]
    if fig.reserved:
        mem["reserved"] = fig.reserved[job.allocator_mode].reserved  # what the caching allocator would hold
    placements = {plan.param_placeholders[ph]: plan.prop.layouts[ph][0].placements for ph in plan.param_placeholders}
    return Layout(name, placements, fig, mem, optimizer_time(cost, fig.params / MASTER_ITEMSIZE), plan,
                  time.perf_counter() - t, replicated=_replicated(name, mesh))


def _plan(name: str, model, inputs, mesh: Mesh, cost: CostModel, job: Job):
    """The blocks planned through ``parallelize`` in layout ``name``."""
    from ...module.parallel_module import parallelize

    params, planner = _params(name, model, mesh)
    try:
        # no budget on the planned blocks: fits is the stamped full depth's, decided here (estimate)
        pm = parallelize(model, mesh, inputs, input_placements=_inputs_placements(mesh), param_placements=params,
                         planner=planner, cost_model=cost, mixed_precision=job.mixed_precision,
                         activation_checkpointing=job.activation_checkpointing, memory_budget=float("inf"))
    except ShardingError as e:
        raise ShardingError(f"planning the {name} layout on {mesh!r} failed: {e.message}", fix=e.fix) from e
    return pm.plan


def _replicated(name: str, mesh: Mesh) -> dict:
    """The mesh dims ``name`` computes whole on, on purpose: FSDP shards the batch and the
    parameters on the data dims only, so every rank of the others (a "tp" dim) runs the same step."""
    if name != "fsdp":
        return {}
    data = set(data_dims(mesh))
    return {n: s for n, s in zip(mesh.names, mesh.shape) if n not in data and s > 1}


def state_memory(cost: CostModel, params: float, grads: float) -> dict:
    """Memory per GPU by kind from the plan's own bytes (stamped): ``parameters``, the resident
    parameter shards (the float32 masters under mixed precision); ``gradients``, as the program
    returns them (in the reduce dtype), those made by the peak where the caller gives that;
    ``optimizer_state``, AdamW's moments over the masters (the cost model's ``optimizer_bytes``, as
    ``Plan.stats()`` counts them)."""
    return {"parameters": params, "gradients": grads, "optimizer_state": cost.optimizer_bytes(params)}


def optimizer_time(cost: CostModel, params: float) -> float:
    """AdamW's step on ``params`` elements of float32 state, memory-bound: it reads the parameter,
    its gradient and both moments and writes the parameter and both moments, 28 bytes each."""
    return params * 28 / (cost.memory_bandwidth * cost.memory_efficiency)


def factorisations(gpus: int, gpus_per_node: int) -> list[tuple]:
    """1-d (every GPU data parallel) and 2-d (data x tp) meshes of ``gpus``, tp inside a node."""
    out = [(gpus,)]
    for tp in (2, 4, 8, 16):
        if tp <= gpus_per_node and gpus % tp == 0 and gpus // tp >= 1 and tp < gpus:
            out.append((gpus // tp, tp))
    return out


def pipeline_sizes(job: Job) -> list[int]:
    """The pipeline sizes ``compare`` tries: ``job.pp`` when given (> 1), else 1 and every power
    of two whose stages fill whole nodes (pp outermost, across nodes), with at least one block
    per stage and a schedule the local batch allows."""
    if job.pp > 1:
        return [job.pp]
    layers = models.layers_of(job.config())
    out, pp = [1], 2
    while job.gpus % pp == 0 and (job.gpus // pp) % job.gpus_per_node == 0:
        try:
            dataclasses.replace(job, pp=pp).pipe.check(job.local_batch, layers)
            out.append(pp)
        except CliError:
            pass
        pp *= 2
    return out


def compare(job: Job, meshes=None, progress=None) -> list[Estimate]:
    """Estimates of several factorisations of ``job.gpus`` (default: ``factorisations`` of each
    stage's GPUs for every pipeline size of ``pipeline_sizes``), fitting ones first, then by
    tokens per second per GPU. ``meshes``: shapes of one stage, for ``job.pp``. ``progress(done,
    total, label)``: called before each estimate (the CLI's bar)."""
    if meshes:
        todo = [(job, shape) for shape in meshes]
    else:
        todo = [(dataclasses.replace(job, pp=pp), shape) for pp in pipeline_sizes(job)
                for shape in factorisations(job.gpus // pp, job.gpus_per_node)]
    rows = []
    for j, shape in todo:
        if progress is not None:
            progress(len(rows), len(todo), ("" if j.pp == 1 else f"pp {j.pp} x ") + "x".join(map(str, shape)))
        rows.append(estimate(j, shape))
    return sorted(rows, key=lambda e: (not e.fits, -e.tokens_per_s_per_gpu))


def search_mesh(job: Job) -> Estimate:
    """The best factorisation (``compare``'s first)."""
    return compare(job)[0]


def gpu_names() -> list[str]:
    return sorted(GPUS)


__all__ = ["Job", "Estimate", "Layout", "estimate", "compare", "search_mesh", "factorisations", "pipeline_sizes",
           "torch"]
