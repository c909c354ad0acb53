"""parallelize's options, checked once where they are given: each keyword that shapes a plan or
how it runs is validated here (a wrong value raises a typed error naming it, with a fix), and the
planning driver (planning.py) and the ParallelModule read the checked ``Options``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.cost import CostModel
from ..core.errors import ConfigError, ShardingError
from ..core.mesh import Mesh
from ..core.precision import MixedPrecision, check_precision
from ..lower.buckets import check_bucket_bytes
from ..rules import DEFAULT, Registry, load_all
from ..run.compiled import check_compile
from ..search.solve import TIME_LIMIT_S
from ..search.unsupported import check_fallback
from ..trace.recompute import POLICIES as CHECKPOINTING
from .pipeline import PipelineOptions, check_pipeline
from .spec import kept_gathered

PLANNERS = ("auto", "propagate", "ilp")
DEFAULT_PLANNER = "auto"  # the one place that picks the default
# memory_budget=None budgets the cost model's device memory less this share of it: what a rank's
# program cannot count yet must hold. The CUDA context and cuBLAS/cuDNN workspaces (~0.5-1 GiB),
# NCCL's channel and proxy buffers (~1-2 GiB on 8-64 GPUs) and the caching allocator's
# fragmentation (reserved beyond allocated: a few % in steady training, lower/allocator.py): ~8 GiB
# of an 80 GiB GPU. One constant for every device, so a budget is read off the device's memory alone.
DEVICE_MEMORY_RESERVE = 0.10


@dataclass(frozen=True)
class Options:
    """What every plan of one ParallelModule is made with. ``planner``: "ilp" or "propagate" ("auto"
    resolved by ``choose_planner``); ``kept_gathered``: the parameters reshard_after_forward keeps
    gathered from forward into backward; ``given_params``: the parameters the user placed."""

    mesh: Mesh
    planner: str
    registry: Registry
    cost: CostModel
    memory_budget: float | None  # bytes per rank, resolved (resolve_memory_budget); None: no budget
    bucket_bytes: int | None
    debug: bool
    compile: bool
    attention: str
    replicate_fallback: tuple
    kept_gathered: frozenset
    given_params: frozenset
    mixed_precision: MixedPrecision | None = None
    activation_checkpointing: str = "none"
    pipeline: PipelineOptions | None = None  # parallelize(pipeline=...): module/pipeline.py
    plan_time_limit: float | None = None  # CPU seconds per ILP solve (search/solve.py Budget); None: its default
    budget_source: str = "given"  # where memory_budget came from: "given" or "device" (the cost model's)


def choose_planner(planner: str, input_placements, target_placements, param_placements, memory_budget,
                   checkpointing: str = "none") -> str:
    """"auto": the ILP when the layout is left to shardwise (no input, target or parameter placed),
    a memory_budget must steer it or it decides what to recompute (activation_checkpointing="auto");
    propagation from the placements a user gave, which state an intent (this sequence parallel,
    that weight column-parallel) that the cost-optimal plan of a small model would drop
    (replicating tiny compute is cheaper than any collective)."""
    if planner not in PLANNERS:
        raise ConfigError(f"unknown planner {planner!r}; expected one of {PLANNERS}",
                          fix='use planner="auto" (the default), "propagate" (fast, from your placements) or "ilp" '
                              "(global)")
    if planner == "propagate" and checkpointing == "auto":
        raise ConfigError('activation_checkpointing="auto" is decided by the ILP planner, but planner="propagate"',
                          fix='use planner="auto" or "ilp", or choose activation_checkpointing="blocks" or '
                              '"selective" yourself')
    if planner != "auto":
        return planner
    left = not input_placements and not target_placements and not (isinstance(param_placements, dict)
                                                                     and param_placements)
    return "ilp" if left or memory_budget is not None or checkpointing == "auto" else "propagate"


def check_checkpointing(value) -> str:
    """``activation_checkpointing``: one of trace/recompute.POLICIES (None: "none")."""
    value = "none" if value is None else value
    if value not in CHECKPOINTING:
        raise ConfigError(f"activation_checkpointing must be one of {CHECKPOINTING}, got {value!r}",
                          fix='"blocks" recomputes every repeated layer from its input, "selective" keeps every '
                              'other matmul output and attention\'s, "auto" lets the ILP choose per layer under '
                              'memory_budget')
    return value


def device_cost_model(model) -> CostModel:
    """The cost model of the device ``model``'s first parameter (or buffer) lives on (core/cost.py)."""
    first = next(iter([*model.parameters(), *model.buffers()]), None)
    device = first.device if first is not None else torch.device("cpu")
    return CostModel.for_device(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")


def check_plan_time_limit(seconds) -> float | None:
    """``plan_time_limit``: positive CPU seconds per ILP solve (None: search/solve.py's default; inf: no limit)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigError(f"plan_time_limit must be a positive number of seconds, got {seconds!r}",
                          fix=f"e.g. plan_time_limit=30 to let the ILP search longer (default {TIME_LIMIT_S:g}), "
                              'float("inf") for no limit, or planner="propagate" for no search')
    return float(seconds)


def check_memory_budget(memory_budget) -> float | None:
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget > 0):
        raise ShardingError(f"memory_budget must be a positive number of bytes per rank, got {memory_budget!r}",
                            fix='e.g. memory_budget=8 * 2**30 for 8 GiB per rank, float("inf") for no budget, or '
                                "None for the cost model's device memory")
    return memory_budget


def resolve_memory_budget(memory_budget, cost: CostModel) -> tuple:
    """(bytes per rank or None for no budget, "given" | "device"): ``memory_budget`` checked;
    ``float("inf")``: no budget; None: the cost model's ``device_memory`` less
    DEVICE_MEMORY_RESERVE, or no budget where it has none (the "cpu" preset, the generic
    CostModel(): a threads run on the host, whose memory is not modelled)."""
    memory_budget = check_memory_budget(memory_budget)
    if memory_budget is None:
        device = getattr(cost, "device_memory", None)
        return (None, "given") if device is None else (float(device) * (1 - DEVICE_MEMORY_RESERVE), "device")
    return (None, "given") if memory_budget == float("inf") else (float(memory_budget), "given")


def check_options(model, mesh, *, backend, planner, input_placements, target_placements, param_placements,
                  memory_budget, bucket_bytes, compile, reshard_after_forward, registry, replicate_fallback,
                  cost_model, debug, attention, mixed_precision=None, activation_checkpointing="none",
                  pipeline=None, inputs="global", plan_time_limit=None) -> Options:
    """The checked Options of one ``parallelize`` call (see ParallelModule for each keyword)."""
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"mesh must be a shardwise.Mesh, got {type(mesh).__name__}",
                            fix='e.g. sw.Mesh((2, 2), ("dp", "tp"))')
    check_fallback(replicate_fallback)
    checkpointing = check_checkpointing(activation_checkpointing)
    piped = check_pipeline(pipeline, mesh, backend=backend, inputs=inputs, compile=compile)
    if piped is not None and checkpointing == "auto":
        raise ConfigError('activation_checkpointing="auto" is not decided under pipeline= yet: the ILP prices '
                          "recomputation against memory_budget, and a pipeline keeps the budget by its stage split",
                          fix='choose activation_checkpointing="blocks" or "selective" with pipeline=')
    # a budget the user gives steers "auto" to the ILP; the device's implied one does not overrule placements
    given = None if memory_budget is None or memory_budget == float("inf") else memory_budget
    chosen = choose_planner(planner, input_placements, target_placements, param_placements, given, checkpointing)
    cost = cost_model or device_cost_model(model)
    budget, source = resolve_memory_budget(memory_budget, cost)
    if piped is not None and planner == "auto" and all(s == 1 for m, s in enumerate(mesh.shape) if m != piped.dim):
        chosen = "propagate"  # the pipeline dim alone: the batch over microbatches is the only layout
    return Options(
        pipeline=piped,
        mesh=mesh,
        planner=chosen,
        registry=load_all(registry or DEFAULT),
        cost=cost,
        memory_budget=budget,
        budget_source=source,
        bucket_bytes=check_bucket_bytes(bucket_bytes),
        debug=debug,
        compile=check_compile(compile, backend),
        attention=attention,
        replicate_fallback=tuple(replicate_fallback),
        kept_gathered=kept_gathered(reshard_after_forward, model),
        given_params=frozenset(param_placements) if isinstance(param_placements, dict) else frozenset(),
        mixed_precision=check_precision(mixed_precision),
        activation_checkpointing=checkpointing,
        plan_time_limit=check_plan_time_limit(plan_time_limit),
    )
