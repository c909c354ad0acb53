"""A deep model's figures from a plan of a few of its blocks: the middle block stamped ``m`` more times.

    fig = stamp(plan, layers=32)     # Figures of the 32-block model

The plan covers ``k >= 3`` identical blocks (first, middle, last; search/layers.py's numbered
layers); the deep model differs by ``m = layers - k`` more copies of the middle block between it
and the last, each planned as the middle one is. What that adds is exact under that layout:

- step terms (search/steptime.step_parts), communication bytes and collectives, flops and the
  recomputation activation checkpointing adds (the forward nodes trace/recompute.py copies into
  backward, tagged ``RECOMPUTE``, part of their block): the middle block's share, ``m`` times more;
- memory (lower/memory.py's liveness curve of each rank class's program): a copy of the middle
  block's forward segment (program positions from its first forward node to the next block's)
  changes the bytes live by ``df`` (what it leaves held), a copy of its backward segment by
  ``db``, and every copy's own parameters and buffers stay resident throughout. So positions
  before the copies are as planned, the forward copies run at the middle block's curve plus
  ``i * df`` (i = 1..m), everything after them in forward (and the loss, the last block's
  backward) ``m * df`` higher, the backward copies at the middle block's backward curve plus
  ``m * df + t * db`` (t = 0..m), the rest ``m * (df + db)`` higher; the peak is the largest of
  these (each an endpoint of a linear run). Under mixed precision each copy's masters are cast
  to the compute dtype first thing (lower/program.py), before any block runs, and each cast is
  freed in its block's backward (``db`` counts that): every position carries ``m`` more casts
  of the middle block's masters than planned, less those ``db`` has freed.
- what PyTorch's caching allocator would reserve (``Figures.reserved``, lower/allocator.py): the
  peak rank's allocations themselves at depth (``_deep_events``), each storage of the middle
  block's segments made once per copy and freed where that copy reads it last (in its own
  segments, or the neighbouring copy's: a block's output in the next block's forward, a gradient
  in the previous block's backward), replayed over training steps with AdamW's state. The
  sequence equals the deep plan's own, event for event (tests/cluster/test_stamp.py).

The plan's layout is the planner's choice for the k-block model (search/layers.py solves
identical blocks with shared columns, so a block's strategies do not depend on k unless the
blocks' interface with the rest does): the stamped figures are those of that layout at depth.
"""
from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field

from ...core.errors import ShardingError
from ...lower.allocator import reserves, training_events
from ...lower.memory import master_dtypes
from ...lower.prefetch import CAST_OF
from ...core.layout import Replicate
from ...core.mesh import Mesh
from ...rules.registry import Strategy
from ...search.flops import causal_share, node_time, plan_costs
from ...search.flops import flops as call_flops
from ...search.layers import _layers
from ...search.paths import edges
from ...search.steptime import StepTime, step_parts
from ...trace.recompute import RECOMPUTE


@dataclass
class Figures:
    """One training step of the deep model on the busiest rank (module docstring); memory as traced."""

    layers: int
    step: StepTime  # recomputation included in compute_bwd_s
    recompute_s: float
    recompute_flops: float
    flops: float  # the step's own model flops (attention counted dense), without recomputation
    comm_bytes: float
    comm_bytes_by_dim: dict
    collectives: dict
    params: float  # this rank's resident parameter shards (the masters under mixed precision), bytes
    grads: float  # the gradients the program returns (in their reduce dtype), bytes
    peak: float  # everything live at the peak, params and grads included
    peak_rank: int
    parts: dict = field(default_factory=dict, repr=False)
    comm_bytes_by_dtype: dict = field(default_factory=dict)
    block_stash: float = 0.0  # on the peak rank: what one block's forward leaves held for its backward
    # on the peak rank: what PyTorch's caching allocator would hold over training steps of the program at
    # depth (lower/allocator.py; AdamW's state included), expandable segments and classic segments
    reserved: dict = field(default_factory=dict)
    peak_grads: float = 0.0  # of ``grads``: those made by the peak (a peak in the loss's backward holds none)
    # the step's model flops on one device (every node whole, attention dense), without recomputation: the
    # same for every layout of one step, what their total work is held to (tools/cluster/invariants.py)
    whole_flops: float = 0.0


def blocks(plan) -> tuple:
    """(prefix, {block index: its graph nodes}) of the plan's repeated blocks (the most indexed prefix)."""
    by = _layers(plan.prop.gm, plan.param_placeholders)
    prefixes = Counter(prefix for prefix, _ in by)
    if not prefixes:
        raise ShardingError("the model has no numbered blocks to stamp", fix="plan it at full depth")
    prefix = prefixes.most_common(1)[0][0]
    return prefix, {i: nodes for (p, i), nodes in sorted(by.items()) if p == prefix}


def stamp(plan, layers: int, reserve: bool = True) -> Figures:
    """Figures of the ``layers``-block model from ``plan`` of k of its blocks (module docstring);
    ``reserve``: with what the caching allocator would hold on the peak rank (``Figures.reserved``)."""
    prefix, by = blocks(plan)
    k = len(by)
    if k < 3 or sorted(by) != list(range(k)):
        raise ShardingError(f"stamping needs a plan of at least 3 numbered blocks, got {sorted(by)}",
                            fix="plan 3 or more blocks")
    mid, m = k // 2, layers - k
    if m < 0:
        raise ShardingError(f"the plan has {k} blocks, more than the {layers} asked for")
    part = {n.name: i for i, nodes in by.items() for n in nodes}
    part_of = part.get
    parts = step_parts(plan.prop, plan.cost, plan.bucket_bytes, part_of)  # recomputation in compute_bwd_s
    total = StepTime(overlap=plan.cost.overlap)
    for p in parts.values():
        total = total.plus(p)
    total = total.plus(parts.get(mid, StepTime()), m)
    rec_s, rec_flops = _recompute(plan, part_of)
    flops, comm, by_dim, by_dtype, kinds, whole = _additive(plan, part_of, mid, m)
    memory = [_memory(plan, rep, by, mid, m) for rep in plan.rank_classes.reps]
    worst = max(memory, key=lambda x: (x[2], -x[3]))
    deep = _deep_events(plan, worst[3], plan.memory_estimate(worst[3]), by[mid], worst[5])
    reserved = {}
    if reserve:
        reserved = reserves(training_events(*deep, state=plan.cost.optimizer_state))
    return Figures(layers, total, sum(rec_s.values()) + m * rec_s.get(mid, 0.0),
                   sum(rec_flops.values()) + m * rec_flops.get(mid, 0.0), flops, comm, by_dim, kinds,
                   worst[0], worst[1], worst[2], worst[3], parts, by_dtype, worst[4], reserved, _peak_grads(deep),
                   whole)


def deep_peak(deep: tuple) -> tuple:
    """(peak bytes, its position) of the deep program from its allocations (``_deep_events``): the
    bytes live at each position as lower/memory.py counts them (what earlier positions left, what
    this one makes, what it drops while it runs), the first position where they are most. Equal
    to the peak the liveness curve stamps (``_memory``; tests/cluster/test_stamp.py)."""
    resident, _, intervals, temps, n = deep
    change = [0] * (n + 2)
    for a, d, b, _ in intervals:
        change[a] += b
        change[min(d, n) + 1] -= b
    spikes = dict(temps)
    live = best = sum(resident)
    at = 0
    for p in range(n):
        live += change[p]
        if live + spikes.get(p, 0) > best:
            best, at = live + spikes.get(p, 0), p
    return best, at


def _peak_grads(deep: tuple) -> int:
    """Bytes of the gradients made by the deep program's peak (they live to its end once made)."""
    _, at = deep_peak(deep)
    return sum(b for a, _, b, g in deep[2] if g and a <= at)


def recomputed(plan) -> list:
    """The names of the plan's nodes that recompute forward values in backward (``RECOMPUTE``)."""
    return [n.name for n in plan.prop.gm.graph.nodes if RECOMPUTE in n.meta and n.name in plan.prop.nodes]


def _recompute(plan, part_of) -> tuple:
    """({block: seconds}, {block: flops}) of the recompute nodes (each on its busiest rank, as
    step_parts prices them into ``compute_bwd_s``)."""
    secs, flops = {}, {}
    costs = plan.costs
    for name in recomputed(plan):
        np_ = plan.prop.nodes[name]
        b = part_of(name)
        secs[b] = secs.get(b, 0.0) + node_time(plan.cost, np_.call, np_.strategy, plan.mesh)
        flops[b] = flops.get(b, 0.0) + costs.node_flops.get(name, 0.0)
    return secs, flops


def _additive(plan, part_of, mid: int, m: int) -> tuple:
    """(model flops, comm bytes, bytes by mesh-dim name, bytes by dtype sent, {kind: count}, the
    model flops of every node whole) with the middle block m times more. Model flops count attention dense (the PaLM / torchtitan
    convention for MFU: a causal mask's skipped half counted as done), everything else as
    search/flops.py does, and leave out the recomputation (not the model's work)."""
    costs = plan_costs(plan.prop, plan.cost)
    again = set(recomputed(plan))
    dense = {n: f / causal_share(plan.prop.nodes[n].call) for n, f in costs.node_flops.items() if n not in again}
    flops = sum(dense.values()) + m * sum(f for n, f in dense.items() if part_of(n) == mid)
    whole = {n: _whole_flops(plan.prop.nodes[n].call) for n in dense}
    whole = sum(whole.values()) + m * sum(f for n, f in whole.items() if part_of(n) == mid)
    comm, by_dim, by_dtype, kinds = 0.0, dict.fromkeys(plan.mesh.names, 0.0), {}, Counter()
    for dst, src, steps in edges(plan.prop):
        times = 1 + m * (part_of(src if dst == "output" else dst) == mid)
        for s in steps:
            if s.is_collective:
                comm += times * s.bytes
                by_dim[plan.mesh.names[s.mesh_dim]] += times * s.bytes
                dtype = str(s.src.dtype).replace("torch.", "")
                by_dtype[dtype] = by_dtype.get(dtype, 0.0) + times * s.bytes
                kinds[s.kind] += times
    return flops, comm, by_dim, by_dtype, dict(kinds), whole


def _whole_flops(call) -> float:
    """``call``'s flops on one device (every tensor whole), attention counted dense."""
    st = Strategy(tuple(None if o is None else (Replicate(),) for o in call.outs), ((Replicate(),),) * len(call.ins))
    return call_flops(call, st, _ONE) / causal_share(call)


_ONE = Mesh((1,))


def _memory(plan, rank: int, by: dict, mid: int, m: int) -> tuple:
    """(params, grads, peak, rank, the block's stash (``_stash``), its _Segments) of ``rank``'s program at
    depth (module docstring)."""
    est = plan.memory_estimate(rank)
    names = [name for name, _ in est.curve]
    pos = {name: i for i, name in enumerate(names)}
    ops = lambda i, back: [pos[n.name] for n in by[i] if n.op == "call_function" and n.name in pos
                            and bool(n.meta.get("autograd_backward")) == back]
    fwd, bwd = (lambda i: ops(i, False)), (lambda i: ops(i, True))
    f0, f1, b0, b1 = min(fwd(mid)), min(fwd(mid + 1)), min(bwd(mid)), min(bwd(mid - 1))
    if not (f0 < f1 <= b1 and b0 < b1 and f1 <= b0):
        raise ShardingError(f"rank {rank}'s program does not run block {mid} as one forward and one backward "
                            "segment", fix="plan the model at full depth")
    before = lambda p: est.live_after[p - 1] if p > 0 else est.resident
    df, db = before(f1) - before(f0), before(b1) - before(b0)
    live = [b for _, b in est.curve]
    seg_f, seg_b = max(live[f0:f1]), max(live[b0:b1])
    runs = [max(live[:f1]),  # as planned, the middle block's forward included
            seg_f + max(df, m * df) if m else 0,  # its forward copies
            max(live[f1:b0], default=0) + m * df,  # the last block's forward, the loss, its backward
            seg_b + m * df + max(0, m * db),  # the backward copies and the middle block's own backward
            max(live[b1:], default=0) + m * (df + db)]
    resident, params, grads, casts = _block_state(plan, rank, by[mid], est)
    starts: dict = {}
    for a, d, b, _ in est.intervals:
        starts.setdefault(a, []).append((d, b))
    graph = {n.name: n for n in plan.program_module(rank, guards=False).graph.nodes}
    kinds = [str(graph[n].target) if n in graph else n for n in names]
    seg = _Segments(f0, f1, b0, b1, min(bwd(mid + 1)), len(names), m, min(fwd(mid - 1)), starts, kinds)
    return (est.parameters + m * params, est.gradients + m * grads, max(runs) + m * (resident + casts), rank,
            _stash(est, f0, f1, seg.bb), seg)


def _stash(est, f0: int, f1: int, back: int) -> int:
    """Bytes the block whose forward runs at positions [f0, f1) leaves held for the backward (made
    there, last read at ``back`` or later: saved values, its output the next block saves). Not
    the change of the bytes live over the segment (``df``): that also counts the parameter
    gathers prefetched for the next block and frees of what earlier positions made (the casts of
    the masters, this block's prefetched gathers), and goes negative where those outweigh it."""
    return sum(b for a, d, b, *rest in est.intervals if f0 <= a < f1 and d >= back and not (rest and rest[0]))


@dataclass(frozen=True)
class _Segments:
    """Program positions of the middle block's forward [f0, f1) and backward [b0, b1) segments, the
    next block's backward's start ``bb`` (its forward starts at f1, the previous block's backward at
    b1), ``n`` positions in all, and ``m`` copies: where each position and each copy's falls in the
    deep program (module docstring: the copies' forwards follow the middle block's, their backwards
    run between the next block's and the middle block's, the last copy's first)."""

    f0: int
    f1: int
    b0: int
    b1: int
    bb: int
    n: int
    m: int
    fp: int  # the previous block's forward's start
    starts: dict = field(repr=False)  # planned position -> [(last read, bytes)] of the values made there
    kinds: list = field(repr=False)  # per planned position: its call's target, for ``_same_place``
    aligned: dict = field(default_factory=dict, repr=False)  # (block start, middle's start, length) -> offsets

    def orig(self, p: int) -> int:
        """The deep position of the planned program's position ``p``."""
        lf, lb = self.f1 - self.f0, self.b1 - self.b0
        return p if p < self.f1 else p + self.m * lf if p < self.b0 else p + self.m * (lf + lb)

    def fwd(self, c: int, o: int) -> int:
        """Copy ``c``'s forward position ``o`` (copy 0: the middle block itself)."""
        return self.f0 + o if c == 0 else self.f1 + (c - 1) * (self.f1 - self.f0) + o

    def bwd(self, c: int, o: int) -> int:
        """Copy ``c``'s backward position ``o``."""
        lf, lb = self.f1 - self.f0, self.b1 - self.b0
        return self.orig(self.b0 + o) if c == 0 else self.b0 + self.m * lf + (self.m - c) * lb + o

    def death(self, c: int, a: int, d: int, nbytes: int) -> int:
        """Where a value copy ``c`` made at planned position ``a`` dies, planned to die at ``d``: in
        its own segments; in the next copy's (a block's output read by the next block's forward, or
        saved for its backward) or the previous copy's backward (a gradient read by the block
        before), at the offset a middle block reads such a value (``_like``: the first and last
        planned blocks may run a node more or less before the read); or where planned."""
        lf, lb = self.f1 - self.f0, self.b1 - self.b0
        if self.f0 <= d < self.f1:
            return self.fwd(c, d - self.f0)
        if self.b0 <= d < self.b1:
            return self.bwd(c, d - self.b0)
        if c < self.m and self.f1 <= d < self.f1 + lf:
            return self.fwd(c + 1, self._like(self._same_place(self.fp, self.f0, lf, a), nbytes, self.f0, self.f1,
                                              d - self.f1))
        if c < self.m and self.bb <= d < min(self.b0, self.bb + lb):
            return self.bwd(c + 1, self._like(self._same_place(self.fp, self.f0, lf, a), nbytes, self.b0, self.b1,
                                              d - self.bb))
        if c > 0 and self.b1 <= d < self.b1 + lb:
            return self.bwd(c - 1, self._like(self._same_place(self.bb, self.b0, lb, a), nbytes, self.b0, self.b1,
                                              d - self.b1))
        if c > 0 and self.b1 + lb <= d < self.n:
            # read past a middle block's backward, by the first block's longer backward or by the step's
            # tail (a gradient bucket the last bucketed all_reduce takes): a copy's is taken at the end of
            # the previous copy's backward, as the deep plan's own allocations show (tests/cluster/test_stamp.py)
            return self.bwd(c - 1, lb - 1)
        return self.orig(d)

    def _same_place(self, start: int, mid: int, length: int, a: int) -> int:
        """The position in the neighbouring block's segment from ``start`` of the middle block's
        position ``a`` (its segment from ``mid``): the two segments' calls aligned (difflib), as
        the bucket passes put their launches and waits at other offsets in the first and last
        blocks (the last block's backward launches no chain's later step for a block after it);
        the same offset where ``a``'s call has no match."""
        key = (start, mid, length)
        if key not in self.aligned:
            ours, theirs = self.kinds[mid:mid + length], self.kinds[start:start + length]
            match = difflib.SequenceMatcher(None, ours, theirs, autojunk=False)
            self.aligned[key] = {i + t: j + t for i, j, n in match.get_matching_blocks() for t in range(n)}
        return start + self.aligned[key].get(a - mid, a - mid)

    def _like(self, at: int, nbytes: int, lo: int, hi: int, fallback: int) -> int:
        """The offset in [lo, hi) where a value of ``nbytes`` made at ``at`` (the same place in the
        block before) is last read; ``fallback`` where there is none."""
        for d, b in self.starts.get(at, ()):
            if b == nbytes and lo <= d < hi:
                return d - lo
        return fallback


def _deep_events(plan, rank: int, est, nodes: list, seg: _Segments) -> tuple:
    """(resident bytes, parameter bytes, intervals, temps, positions) of ``rank``'s program at depth, for
    lower/allocator.training_events: the middle block's forward and backward segments copied ``m``
    times, each copy's values dying in its own segments or its neighbours' (``_Segments.death``);
    each copy's arguments beside the middle block's, and its masters' compute copies cast where the
    middle block's are (first thing) and freed in its own backward."""
    m, f0, f1, b0, b1 = seg.m, seg.f0, seg.f1, seg.b0, seg.b1
    own = {n.name for n in nodes if n.op == "placeholder"}
    casts = {i for i, n in enumerate(plan.program_module(rank, guards=False).graph.nodes)
             if n.meta.get(CAST_OF) in own}
    last_cast = max((a for a, *_ in est.intervals if a in casts), default=0)
    intervals, temps = [], []  # (order, interval): order (deep position, copy, planned position)
    for a, d, b, g in est.intervals:
        if f0 <= a < f1 or b0 <= a < b1:  # the middle block's own work: once per copy
            for c in range(m + 1):
                at = seg.fwd(c, a - f0) if a < f1 else seg.bwd(c, a - b0)
                intervals.append(((at, 0, 0), (at, seg.death(c, a, d, b), b, g)))
        elif a in casts:  # a master's compute copy, cast first thing: each copy's after the middle block's
            intervals.append(((a, 0, 0), (a, seg.death(0, a, d, b), b, g)))
            intervals += [((last_cast, c, a), (last_cast, seg.death(c, a, d, b), b, g)) for c in range(1, m + 1)]
        elif f1 <= a < b0 <= d < b1:  # the next block's gradient, read by the last copy's backward
            intervals.append(((seg.orig(a), 0, 0), (seg.orig(a), seg.bwd(m, d - b0), b, g)))
        else:
            intervals.append(((seg.orig(a), 0, 0), (seg.orig(a), seg.orig(d), b, g)))
    for p, b in est.temps:
        if f0 <= p < f1:
            temps += [(seg.fwd(c, p - f0), b) for c in range(m + 1)]
        elif b0 <= p < b1:
            temps += [(seg.bwd(c, p - b0), b) for c in range(m + 1)]
        else:
            temps.append((seg.orig(p), b))
    return (_with_copies(est.resident_storages, own, m), _with_copies(est.param_storages, own, m),
            tuple(iv for _, iv in sorted(intervals, key=lambda x: x[0])), tuple(temps), seg.orig(seg.n))


def _with_copies(storages: tuple, own: set, m: int) -> tuple:
    """The bytes of ``storages`` ((placeholder, bytes), in program order) with the middle block's
    (``own``) ``m`` more times right after it, as a deep model's arguments are ordered."""
    out, block = [], [b for name, b in storages if name in own]
    last = max((i for i, (name, _) in enumerate(storages) if name in own), default=len(storages) - 1)
    for i, (_, b) in enumerate(storages):
        out.append(b)
        if i == last:
            out += block * m
    return tuple(out)


def _block_state(plan, rank: int, nodes: list, est) -> tuple:
    """(resident bytes: the block's program arguments (masters in their own dtype), its parameters'
    bytes, the bytes its gradients hold in the program (lower/memory.py's shares), the bytes of its
    masters' compute copies the program casts first thing) on ``rank``."""
    mesh, lays = plan.mesh, plan.prop.layouts
    masters = master_dtypes(plan)
    placeholders = [n.name for n in nodes if n.op == "placeholder" and lays[n.name][0] is not None]
    numel = {ph: lays[ph][0].local_numel(mesh, rank) for ph in placeholders}
    own = {ph: numel[ph] * (masters[ph].itemsize if ph in masters else lays[ph][0].itemsize) for ph in placeholders}
    resident = sum(own.values())
    params = sum(own[ph] for ph in placeholders if ph in plan.param_placeholders)
    casts = sum(numel[ph] * lays[ph][0].itemsize for ph in placeholders if ph in masters)
    names = {plan.param_placeholders[ph] for ph in placeholders if ph in plan.param_placeholders}
    grads = 0.0
    if plan.traced is not None:
        grads = sum(est.grad_shares.get(i, 0.0) for i, role in enumerate(plan.traced.outputs)
                    if role.kind == "grad" and role.name in names)
    return resident, params, grads, casts
