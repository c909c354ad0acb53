"""The calculator's "pp" dim: the planned blocks' times played on a pipeline schedule.

    pipe = PipeJob(pp=8, microbatches=32, schedule="interleaved", stages_per_rank=2)
    fig = pipeline_figures(pipe, plan, figures, layers, cost, mesh)   # PipeFigures: makespan, bubble_s, ...
    tl = play(stage_times, p2p_s, sched)                              # the schedule's modelled Timeline

A pipeline of ``pp`` ranks runs the model as ``pp * v`` stages (pp outermost, across nodes; the
other mesh dims inside each stage, planned as without a pipeline), the local batch in ``m``
microbatches. The planned 3-block model is planned for one microbatch on the inner mesh; its
figures (stamp.py's per-part StepTime) give, per microbatch:

- a block's forward and backward time (compute, recompute, and the communication the inner dims
  leave exposed, split between the phases as their compute is), and for zero-bubble the weight
  gradient's share of the backward (W): half of it, as each linear layer's backward is two
  matmuls of its forward's flops, one for the input gradient, one for the weight's;
- the rest (embeddings, final norm, head, loss): on the last stage (the head's matmul and the
  loss dominate; the embedding is a lookup);
- the point-to-point message: the block's input activation (the residual stream as the plan
  lays it out, bytes per GPU), sent forward, its gradient backward, priced on the "pp" dim of the
  cluster cost model (across nodes when each stage fills whole nodes).

Stage s holds ``layers // S`` blocks, the first ``layers % S`` one more. The schedule
(search/schedules.py) is played with those times (``simulate``, the same Timeline the
pipeline plans of ``parallelize`` report): its makespan is the step's compute and exposed
communication plus ``bubble_s``, the busiest rank's idle time. Communication of the inner dims
is priced per microbatch (FSDP gathering and reducing per microbatch: an upper bound where a
run keeps parameters gathered across a step's microbatches).

Memory per GPU is the heaviest rank's: its stages' blocks' state (parameters, gradients,
optimizer state as the stamped plan holds them: calc.state_memory; every gradient, as they
accumulate over the microbatches) plus the embeddings' and head's (an upper bound: only the
first and last stages hold them), and the activations: those of the stamped plan of the rank's
blocks and the rest at its peak for one microbatch (its saved values, the gathered and cast
parameters, buckets in flight: the peak less the state), plus, for each further microbatch the
schedule keeps in flight on a stage, each of its blocks' stash (stamp.Figures.block_stash: what
a block's forward leaves held for its backward, made in that forward, >= 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import CliError, ConfigError
from ...search.schedules import SCHEDULES, Action, schedule, simulate
from ...search.steptime import StepTime

W_SHARE = 0.5  # the weight gradient's share of a block's backward (module docstring: two equal matmuls)


@dataclass(frozen=True)
class PipeJob:
    """The pipeline of a Job: ``pp`` ranks, ``microbatches`` per step, the schedule, stages per rank."""

    pp: int = 1
    microbatches: int | None = None  # None: the local batch (microbatches of one sequence, torchtitan's default)
    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: 2 for "interleaved", else 1

    def v(self) -> int:
        return self.stages_per_rank or (2 if self.schedule == "interleaved" else 1)

    def m(self, local_batch: int) -> int:
        return self.microbatches or local_batch

    def check(self, local_batch: int, layers: int):
        """The schedule, or a CliError with a fix."""
        if self.schedule not in SCHEDULES:
            raise CliError(f"unknown --schedule {self.schedule!r}", fix=f"use one of {', '.join(SCHEDULES)}")
        m, v = self.m(local_batch), self.v()
        if local_batch % m:
            raise CliError(f"--local-batch {local_batch} does not split into {m} microbatches",
                           fix="give a local batch that is a multiple of --microbatches")
        if self.pp * v > layers:
            raise CliError(f"{self.pp} pipeline ranks x {v} stages each is more stages than the model's {layers} "
                           "blocks", fix="use a smaller --pp (or fewer stages per rank)")
        try:
            return schedule(self.schedule, self.pp, m, v)
        except ConfigError as e:
            raise CliError(e.message, fix=e.fix) from e


@dataclass
class PipeFigures:
    """One step of the pipeline on its busiest rank: ``makespan_s`` (the schedule played),
    ``busy_s`` (that rank's own work: ``compute_s`` + ``exposed_comm_s``), ``bubble_s`` =
    makespan - busy (idle, waiting for other stages and messages), ``p2p_bytes`` per
    message, ``p2p_s`` its time, the heaviest rank's memory by kind (``memory``: its stages'
    blocks, ``rank_blocks``, and ``in_flight`` microbatch stashes)."""

    makespan_s: float
    busy_s: float
    compute_s: float  # of busy_s: compute, recomputation included
    recompute_s: float
    exposed_comm_s: float  # of busy_s: the inner dims' communication compute does not hide
    bubble_s: float
    bubble_fraction: float
    p2p_bytes: float
    p2p_s: float
    memory: dict
    in_flight: int  # the heaviest rank's stashes at most: microbatches in flight, summed over its stages
    rank_blocks: int  # the blocks that rank holds
    stage_blocks: list
    timeline: object = None

    @property
    def timeline_microbatches(self) -> int:
        return max((a.mb for a in self.timeline.rank_of), default=-1) + 1


def play(stage_times: list, p2p_s: float, sched):
    """The Timeline of ``sched`` with ``stage_times[s] = (forward, backward, weight-gradient
    seconds)`` per microbatch (the backward includes the weight gradient unless the schedule
    splits it off) and ``p2p_s`` per message between ranks."""
    def duration(a: Action) -> float:
        f, b, w = stage_times[a.stage]
        if a.kind == "F":
            return f
        if a.kind == "B":
            return b - w if sched.split_w else b
        return w

    return simulate(sched, duration, lambda a, d: p2p_s)


def stage_blocks(layers: int, n_stages: int) -> list:
    return [layers // n_stages + (s < layers % n_stages) for s in range(n_stages)]


def _terms(t: StepTime, recompute_s: float = 0.0) -> tuple:
    """(compute, recomputation (``recompute_s`` of that compute), exposed communication) of one part."""
    return t.compute_fwd_s + t.compute_bwd_s, recompute_s, t.exposed_comm_s


def _phases(t: StepTime) -> tuple:
    """(forward, backward) seconds of one part: compute (the backward's with its recomputation,
    which the plan runs there) plus its exposed communication, split as the compute is."""
    compute = t.compute_fwd_s + t.compute_bwd_s
    exposed = t.exposed_comm_s
    share = t.compute_fwd_s / compute if compute > 0 else 0.5
    return t.compute_fwd_s + share * exposed, t.compute_bwd_s + (1 - share) * exposed


def pipeline_figures(pipe: PipeJob, plan, figures, layers: int, local_batch: int, cost, mesh, memory_of,
                     state: tuple, activations_of, stash: float) -> PipeFigures:
    """The pipeline step of ``figures`` (stamp.Figures of the microbatch plan ``plan``; module
    docstring). ``cost``/``mesh``: the whole cluster's (mesh dim 0 is "pp"); ``memory_of(params,
    grads)``: memory by kind of those bytes (calc.state_memory); ``state``: (params, grads) bytes
    per block and of the rest, ((pb, gb), (pr, gr)), as the plan holds them (every gradient: they
    accumulate over the microbatches); ``activations_of(n)``: the activations at the peak of one
    microbatch through ``n`` blocks and the rest (stamped); ``stash``: what a block's forward holds
    for its backward, per further microbatch in flight."""
    from .stamp import blocks

    sched = pipe.check(local_batch, layers)
    _, by = blocks(plan)
    mid = len(by) // 2
    parts = figures.parts
    per_block_rec = figures.recompute_s / figures.layers if figures.layers else 0.0
    bf, bb = _phases(parts.get(mid, StepTime()))
    rf, rb = _phases(parts.get(None, StepTime()))
    counts = stage_blocks(layers, sched.n_stages)
    last = sched.n_stages - 1
    times = [(n * bf + (rf if s == last else 0.0), n * bb + (rb if s == last else 0.0), W_SHARE * n * bb)
             for s, n in enumerate(counts)]
    nbytes = boundary_bytes(plan, by[mid])
    p2p_s = cost.collective_time("p2p", nbytes, mesh.shape[0], 0, mesh) if sched.p > 1 else 0.0
    tl = play(times, p2p_s, sched)
    busiest = max(range(sched.p), key=tl.busy)
    blk = _terms(parts.get(mid, StepTime()), per_block_rec)
    rst = _terms(parts.get(None, StepTime()))
    terms = [sched.m * sum(counts[s] * blk[k] + (rst[k] if s == last else 0.0) for s in sched.stages_of(busiest))
             for k in range(3)]
    (pb, gb), (pr, gr) = state
    worst = None
    for r in range(sched.p):  # a rank holds its stages' blocks (v of them when interleaved)
        mine = sched.stages_of(r)
        n = sum(counts[s] for s in mine)
        live = sum(sched.in_flight(s) for s in mine)
        mem = memory_of(n * pb + pr, n * gb + gr)
        # one microbatch through the rank's blocks as planned, and each further one in flight its stash
        held = sum(max(0, sched.in_flight(s) - 1) * counts[s] for s in mine)
        mem["activations"] = activations_of(n) + held * stash
        mem["peak"] = mem["parameters"] + mem["gradients"] + mem["optimizer_state"] + mem["activations"]
        if worst is None or mem["peak"] > worst[0]["peak"]:
            worst = (mem, live, n)
    busy = tl.busy(busiest)
    return PipeFigures(tl.end, busy, terms[0], terms[1], terms[2], tl.end - busy, tl.bubble_fraction(), nbytes, p2p_s,
                       worst[0], worst[1], worst[2], counts, tl)


def boundary_bytes(plan, nodes: list) -> float:
    """Bytes per GPU of what a block reads from before it in forward (the residual stream as
    laid out: a stage boundary's message), on the busiest rank."""
    inside = {n.name for n in nodes}
    mesh, lays = plan.mesh, plan.prop.layouts
    seen, total = set(), 0.0
    for n in nodes:
        if n.op != "call_function" or n.meta.get("autograd_backward"):
            continue
        for a in n.all_input_nodes:
            if a.name in inside or a.op != "call_function" or a.meta.get("autograd_backward") or a.name in seen:
                continue
            seen.add(a.name)
            lay = lays.get(a.name, (None,))[0]
            if lay is not None:
                total += max(lay.local_numel(mesh, r) for r in range(mesh.size)) * lay.itemsize
    return total


__all__ = ["W_SHARE", "PipeFigures", "PipeJob", "boundary_bytes", "pipeline_figures", "play", "stage_blocks"]
