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
communication plus ``bubble_s``, the busiest rank's idle time.

Communication on the data dims is priced as Megatron-LM and torchtitan run a pipeline
(``once_a_step``): once a step, not per microbatch. Each stage's gradients are reduced once,
after its last microbatch's backward: an all-reduce (parameters whole on the data dims,
Megatron's DDP) bucketed under that backward as the model without a pipeline overlaps it; a
reduce-scatter (FSDP) after it, not overlapped (torch.distributed.pipelining, which torchtitan
runs, turns requires_gradient_sync off for every microbatch's backward and runs FSDP's
post-backward once, in its REDUCE_GRAD step after the stage's last backward: torchtitan's
default). What is not hidden ends the rank's step after its last action (``with_tails``): the
previous stage does not wait for it (its input gradient is sent first). A parameter sharded on
the data dims is gathered once, at the stage's first forward (the first unit waited for, the
rest prefetched under it, as without a pipeline: added to that forward), and kept over the
step's microbatches (torchtitan's reshard_after_forward=False under pp, pipelining's
reshard_after_backward=False): no gather for backward. Every other collective (tensor
parallelism's, an activation's, the loss's) runs for every microbatch.

Memory per GPU is the heaviest rank's: its stages' blocks' state (parameters, gradients,
optimizer state as the stamped plan holds them: calc.state_memory; every gradient, as they
accumulate over the microbatches) plus the embeddings' and head's (an upper bound: only the
first and last stages hold them), and the activations: those of the stamped plan of the rank's
blocks and the rest at its peak for one microbatch (its saved values, the gathered and cast
parameters, buckets in flight: the peak less the state), plus, for each further microbatch the
schedule keeps in flight on a stage, each of its blocks' stash (stamp.Figures.block_stash: what
a block's forward leaves held for its backward, made in that forward, >= 0). Parameters sharded
on the data dims are kept gathered through the step (``Kept``): the rank's blocks' and the rest's
gathered compute copies are counted in its activations for the whole step (an upper bound by
the one or two blocks' gathers the planned microbatch's peak holds already), and their gradients,
accumulated unsharded in the reduce dtype over the microbatches until the one reduce-scatter
(FSDP2's unsharded_accumulated_grad), in its gradients beside the shards (an upper bound by the
shards: at the reduce-scatter both are live for a unit, not for all).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import CliError, ConfigError
from ...core.layout import Replicate, Shard
from ...search.paths import edge_times, edges
from ...search.schedules import SCHEDULES, Action, schedule, simulate
from ...search.steptime import StepTime, edge_phases

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


def play(stage_times: list, p2p_s: float, sched, first: list | None = None):
    """The Timeline of ``sched`` with ``stage_times[s] = (forward, backward, weight-gradient
    seconds)`` per microbatch (the backward includes the weight gradient unless the schedule
    splits it off) and ``p2p_s`` per message between ranks; ``first[s]``: seconds stage ``s``'s
    first forward adds once a step (its parameters' gathers: ``once_a_step``)."""
    firsts = {}
    for acts in sched.ranks:  # each stage's first forward, in its rank's order
        for a in acts:
            if a.kind == "F":
                firsts.setdefault(a.stage, a)
    added = {firsts[s]: t for s, t in enumerate(first or ())}

    def duration(a: Action) -> float:
        f, b, w = stage_times[a.stage]
        if a.kind == "F":
            return f + added.get(a, 0.0)
        if a.kind == "B":
            return b - w if sched.split_w else b
        return w

    return simulate(sched, duration, lambda a, d: p2p_s)


def with_tails(tl, sched, tail: list) -> tuple:
    """(makespan, [busy seconds per rank]) of the Timeline ``tl`` with ``tail[s]`` seconds on
    stage ``s``'s rank after that rank's last action: its gradients' reductions, which the
    previous stage does not wait for (its input gradient is sent before them) and which end the
    rank's step (pipelining's REDUCE_GRAD, Megatron's reduction after the last microbatch)."""
    extra = [sum(tail[s] for s in sched.stages_of(r)) for r in range(sched.p)]
    last = [max((tl.finish[a] for a in sched.ranks[r]), default=0.0) for r in range(sched.p)]
    end = max([tl.end] + [last[r] + extra[r] for r in range(sched.p)])
    return end, [tl.busy(r) + extra[r] for r in range(sched.p)]


@dataclass(frozen=True)
class Once:
    """A part's communication on the data dims that a pipeline runs once a step (module docstring),
    per microbatch as the plan prices it: the parameters' gathers (``gather``), the gradients'
    all-reduces (``reduce``, under the last backward) and reduce-scatters (``reduce_after``, after
    it), and the gathers for backward a pipeline does not make (``dropped``)."""

    gather: StepTime = StepTime()
    reduce: StepTime = StepTime()
    reduce_after: StepTime = StepTime()
    dropped: StepTime = StepTime()

    def total(self) -> StepTime:
        return self.gather.plus(self.reduce).plus(self.reduce_after).plus(self.dropped)


_PHASE_KEY = {"blocking": "blocking_s", "fwd": "overlap_fwd_s", "bwd": "overlap_bwd_s"}


def once_a_step(plan, part_of, data: tuple) -> dict:
    """{part: Once} of ``plan``'s collectives on the data dims (mesh dim names ``data``) that a
    pipeline runs once a step: each non-scalar graph output's reduction (a gradient's: FSDP's
    where it ends sharded on a data dim) and each move of a parameter whose collectives are all
    on the data dims; an edge's part as
    search/steptime.step_parts assigns it, so that ``parts[k] - once[k].total()`` is the part's
    per-microbatch time."""
    prop, names = plan.prop, plan.mesh.names
    nodes = {n.name: n for n in prop.gm.graph.nodes}
    overlap = bool(getattr(plan.cost, "overlap", False))
    out: dict = {}
    for (dst, src, steps), phase, times in zip(edges(prop), edge_phases(prop, plan.bucket_bytes),
                                               edge_times(prop, plan.cost, plan.bucket_bytes)):
        comm = [s for s in steps if s.is_collective]
        if not comm:
            continue
        if dst == "output":
            if not steps[0].src.shape:  # the loss: reduced for every microbatch
                continue
            dst_pl = steps[-1].dst.placements  # sharded on a data dim: FSDP's gradient, else DP's (whole there)
            fsdp = any(isinstance(dst_pl[i], Shard) for i, n in enumerate(names) if n in data)
            kind, part = ("reduce_after" if fsdp else "reduce"), part_of(src)
        elif src in plan.param_placeholders and all(names[s.mesh_dim] in data for s in comm):
            kind, part = ("dropped" if nodes[dst].meta.get("autograd_backward") else "gather"), part_of(dst)
        else:
            continue
        once = out.get(part, Once())
        add = StepTime(overlap=overlap, **{_PHASE_KEY[phase]: sum(times)})
        out[part] = Once(**{**once.__dict__, kind: getattr(once, kind).plus(add)})
    return out


def _added(base: float, more: float, compute: float, overlap: bool) -> float:
    """What ``more`` seconds of communication overlappable with ``compute`` expose beside ``base``
    seconds already overlapped with it (steptime.StepTime.exposed_comm_s's max(0, comm - compute))."""
    if not overlap:
        return more
    return max(0.0, base + more - compute) - max(0.0, base - compute)


def once_seconds(mb: StepTime, once: Once, split_w: bool) -> tuple:
    """(seconds added to a stage's first forward, after its last backward) by its once-a-step
    communication ``once`` beside its per-microbatch terms ``mb``: the gathers prefetched under the
    first forward (the first unit's waited for: FSDP gathers at the forward, lazily), the
    all-reduces bucketed under the last backward (its weight-gradient share when the schedule
    splits it off) and what that does not hide, the reduce-scatters after it."""
    g, r = once.gather, once.reduce
    first = g.blocking_s + _added(mb.overlap_fwd_s, g.overlap_fwd_s, mb.compute_fwd_s, mb.overlap) + g.overlap_bwd_s
    compute = mb.compute_bwd_s * (W_SHARE if split_w else 1.0)
    last = (r.blocking_s + r.overlap_fwd_s + _added(mb.overlap_bwd_s, r.overlap_bwd_s, compute, mb.overlap)
            + once.reduce_after.comm_s)
    return first, last


def kept_gathered(plan, nodes: list, data: tuple, grad_itemsize: int) -> tuple:
    """(bytes, their gradients' bytes) per GPU of the parameters among ``nodes`` sharded on the
    data dims, gathered on them: the compute copies a pipeline keeps gathered through the step and
    the unsharded gradients it accumulates in the reduce dtype (``grad_itemsize``) until the one
    reduce-scatter (module docstring)."""
    mesh, lays = plan.mesh, plan.prop.layouts
    dims = [i for i, n in enumerate(mesh.names) if n in data]
    params = grads = 0
    for n in nodes:
        lay = lays.get(n.name, (None,))[0] if n.op == "placeholder" and n.name in plan.param_placeholders else None
        if lay is None or not any(isinstance(lay.placements[i], Shard) for i in dims):
            continue
        whole = lay.with_placements(tuple(Replicate() if i in dims else p for i, p in enumerate(lay.placements)))
        k = whole.max_local_numel(mesh)
        params += k * lay.itemsize
        grads += k * grad_itemsize
    return params, grads


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
                     state: tuple, activations_of, stash: float, data: tuple = (), grad_itemsize: int = 4) -> PipeFigures:
    """The pipeline step of ``figures`` (stamp.Figures of the microbatch plan ``plan``; module
    docstring). ``cost``/``mesh``: the whole cluster's (mesh dim 0 is "pp"); ``memory_of(params,
    grads)``: memory by kind of those bytes (calc.state_memory); ``state``: (params, grads) bytes
    per block and of the rest, ((pb, gb), (pr, gr)), as the plan holds them (every gradient: they
    accumulate over the microbatches); ``activations_of(n)``: the activations at the peak of one
    microbatch through ``n`` blocks and the rest (stamped); ``stash``: what a block's forward holds
    for its backward, per further microbatch in flight; ``data``: the plan's data dims (their
    communication once a step); ``grad_itemsize``: the reduce dtype's."""
    from .stamp import blocks

    sched = pipe.check(local_batch, layers)
    _, by = blocks(plan)
    mid = len(by) // 2
    part = {n.name: i for i, nodes in by.items() for n in nodes}
    once = once_a_step(plan, part.get, data)
    blk_once, rst_once = once.get(mid, Once()), once.get(None, Once())
    # per microbatch: each part less what the pipeline runs once a step
    blk_mb = figures.parts.get(mid, StepTime()).plus(blk_once.total(), -1)
    rst_mb = figures.parts.get(None, StepTime()).plus(rst_once.total(), -1)
    per_block_rec = figures.recompute_s / figures.layers if figures.layers else 0.0
    bf, bb = _phases(blk_mb)
    rf, rb = _phases(rst_mb)
    counts = stage_blocks(layers, sched.n_stages)
    last = sched.n_stages - 1
    times = [(n * bf + (rf if s == last else 0.0), n * bb + (rb if s == last else 0.0), W_SHARE * n * bb)
             for s, n in enumerate(counts)]
    extra = [once_seconds(_stage(blk_mb, rst_mb, n, s == last), _stage_once(blk_once, rst_once, n, s == last),
                          sched.split_w) for s, n in enumerate(counts)]
    nbytes = boundary_bytes(plan, by[mid])
    p2p_s = cost.collective_time("p2p", nbytes, mesh.shape[0], 0, mesh) if sched.p > 1 else 0.0
    tl = play(times, p2p_s, sched, [f for f, _ in extra])
    end, busy = with_tails(tl, sched, [b for _, b in extra])
    busiest = max(range(sched.p), key=busy.__getitem__)
    blk = _terms(blk_mb, per_block_rec)
    rst = _terms(rst_mb)
    terms = [sched.m * sum(counts[s] * blk[k] + (rst[k] if s == last else 0.0) for s in sched.stages_of(busiest))
             for k in range(3)]
    terms[2] += sum(sum(extra[s]) for s in sched.stages_of(busiest))
    (pb, gb), (pr, gr) = state
    inside = set(part)
    kept_blk = kept_gathered(plan, by[mid], data, grad_itemsize)
    kept_rst = kept_gathered(plan, [n for n in plan.prop.gm.graph.nodes if n.name not in inside], data, grad_itemsize)
    worst = None
    for r in range(sched.p):  # a rank holds its stages' blocks (v of them when interleaved)
        mine = sched.stages_of(r)
        n = sum(counts[s] for s in mine)
        live = sum(sched.in_flight(s) for s in mine)
        gathered, unsharded = (n * kept_blk[k] + kept_rst[k] for k in range(2))
        mem = memory_of(n * pb + pr, n * gb + gr + unsharded)
        # one microbatch through the rank's blocks as planned, each further one in flight its stash, and
        # the parameters kept gathered through the step
        held = sum(max(0, sched.in_flight(s) - 1) * counts[s] for s in mine)
        mem["activations"] = activations_of(n) + held * stash + gathered
        mem["peak"] = mem["parameters"] + mem["gradients"] + mem["optimizer_state"] + mem["activations"]
        if worst is None or mem["peak"] > worst[0]["peak"]:
            worst = (mem, live, n)
    bubble_fraction = 1.0 - sum(busy) / (sched.p * end) if end > 0 else 0.0
    return PipeFigures(end, busy[busiest], terms[0], terms[1], terms[2], end - busy[busiest], bubble_fraction, nbytes,
                       p2p_s, worst[0], worst[1], worst[2], counts, tl)


def _stage(blk: StepTime, rest: StepTime, n: int, has_rest: bool) -> StepTime:
    """A stage's terms: ``n`` blocks', and the rest's on the last stage."""
    out = StepTime(overlap=blk.overlap).plus(blk, n)
    return out.plus(rest) if has_rest else out


def _stage_once(blk: Once, rest: Once, n: int, has_rest: bool) -> Once:
    return Once(**{k: _stage(getattr(blk, k), getattr(rest, k), n, has_rest) for k in Once.__dataclass_fields__})


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


__all__ = ["W_SHARE", "Once", "PipeFigures", "PipeJob", "boundary_bytes", "kept_gathered", "once_a_step", "once_seconds",
           "pipeline_figures", "play", "stage_blocks", "with_tails"]
