"""Redistribution paths: change a tensor's placements as a short list of single-mesh-dim steps.

Planning is a shortest-path search over placement states (one placement per mesh dim);
an edge changes one mesh dim and is allowed only if the result is exactly the layout it
claims. Mesh dims that shard the same tensor dim nest in mesh-dim order, so a step on
mesh dim ``m`` that touches tensor dim ``d`` is only correct when no later mesh dim
shards ``d`` (its chunk would otherwise be interleaved with the later dim's chunks).
Partials are reduced innermost first: a Partial on ``m`` may only be reduced when no
later mesh dim holds a Partial with a different op (sum of maxes != max of sums).
One search from a source answers every destination, and searches, edges and steps are
memoised per (shape, dtype, mesh, cost model) for the whole process (``_Space``): the
planner prices hundreds of strategies per node on an n-d mesh. What the planner asks
(bytes, times, steps) lives here, with the identity of a move (``move_key``) and a plan's
moves, each once (``edges``): what the ILP prices and the program emits (lower/program.py);
running the steps on a rank is lower/redistribute.py.
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading

import torch
import torch.fx as fx

from ..core.cost import CostModel, sent_bytes
from ..core.errors import ShardingError
from ..core.collective_kinds import KINDS, RedistStep, kind as kind_of
from ..core.layout import Layout, Partial, PlacementSpec, R, Replicate, Shard, normalize_placements
from ..core.mesh import Mesh
from ..trace import KEEP_GATHERED, tensor_arg_nodes
from ..trace.provenance import fsdp_unit

DEFAULT_COST = CostModel()


class _Shapes:
    """Memoised per-rank local shapes of each placement state (the planner's hot path).

    One per _Space (shape, dtype, mesh, cost); races between rank threads only compute an
    entry twice.
    """

    def __init__(self, shape, dtype, mesh: Mesh):
        self.shape, self.dtype, self.mesh = shape, dtype, mesh
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._cache: dict = {}
        self._group_max: dict = {}
        self._times: dict = {}
        self._layouts: dict = {}  # state -> Layout

    def layout(self, state) -> Layout:
        """The Layout of ``state``, made once (its checks are not cheap; every mesh dim asks)."""
        lay = self._layouts.get(state)
        if lay is None:
            lay = self._layouts[state] = Layout(self.shape, self.dtype, state)
        return lay

    def of(self, state) -> list[tuple[int, ...]]:
        state = _unreduced(state)
        if state not in self._cache:
            lay = self.layout(state)
            self._cache[state] = [lay.local_shape(self.mesh, r) for r in range(self.mesh.size)]
        return self._cache[state]

    def time(self, cost: CostModel, kind: str, nbytes: int, m: int) -> float:
        """``cost.collective_time`` of one step on mesh dim ``m``, memoised (many edges move
        the same bytes)."""
        key = (kind, nbytes, m)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = cost.collective_time(kind, nbytes, self.mesh.shape[m], m, self.mesh)
        return t

    def group_max(self, state, m: int) -> list[tuple[int, ...]]:
        """Per group along mesh dim ``m``: the elementwise max of its members' local shapes."""
        key = (_unreduced(state), m)
        if key not in self._group_max:
            lay = self.layout(key[0])
            n_groups = self.mesh.size // self.mesh.shape[m]
            if lay.uniform(self.mesh):  # every rank the same shape: every group's max is it
                self._group_max[key] = [lay.local_shape(self.mesh, 0)] * n_groups
            else:
                shapes = self.of(state)
                self._group_max[key] = [tuple(max(col) for col in zip(*(shapes[r] for r in g)))
                                        for g in self.mesh.groups(m)]
        return self._group_max[key]


def _unreduced(state) -> tuple:
    """``state`` with every Partial read as Replicate: the same local shapes (each rank holds
    the whole extent), so shape memos need one entry for both."""
    return tuple(R if isinstance(p, Partial) else p for p in state)


def _step_bytes(kind: str, src, dst, m: int, shapes: _Shapes, src_dim=None, dst_dim=None) -> int:
    """Bytes each rank sends for one step: cost.sent_bytes of the padded chunks (the
    whole local buffer for an all_reduce), max over the groups along ``m``."""
    n, k = shapes.mesh.shape[m], kind_of(kind)
    if not k.communicates or n == 1:
        return 0
    if k.chunk == "piece":  # the local split n ways along dst_dim: src extents, dst extent on dst_dim
        pairs = zip(shapes.group_max(src, m), shapes.group_max(dst, m))
        chunks = [s[:dst_dim] + (d[dst_dim],) + s[dst_dim + 1:] for s, d in pairs]
    else:  # the source's (padded) local chunk, or the destination's
        chunks = shapes.group_max(src if k.chunk == "src" else dst, m)
    return max(sent_bytes(kind, n, math.prod(c), shapes.itemsize) for c in chunks)


def _later_shards(state, m: int, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in state[m + 1:])


def _later_other_partial(state, m: int, op: str) -> bool:
    return any(isinstance(p, Partial) and p.op != op for p in state[m + 1:])


def _transition(state, m: int, new):
    """(kind, src_dim, dst_dim, op) for changing mesh dim ``m`` to ``new``, or None if invalid."""
    cur = state[m]
    if isinstance(cur, Shard):
        if isinstance(new, Replicate) and not _later_shards(state, m, cur.dim):
            return "all_gather", cur.dim, None, None
        if isinstance(new, Shard) and new.dim != cur.dim and not (
                _later_shards(state, m, cur.dim) or _later_shards(state, m, new.dim)):
            return "all_to_all", cur.dim, new.dim, None
        return None  # Shard -> Partial goes through Replicate
    if isinstance(cur, Replicate):
        if isinstance(new, Shard):
            return None if _later_shards(state, m, new.dim) else ("slice", None, new.dim, None)
        return "partial_local", None, None, new.op  # Replicate -> Partial is always local
    if isinstance(new, Partial) or _later_other_partial(state, m, cur.op):
        return None  # Partial(a) -> Partial(b) goes through Replicate; inner partials first
    if isinstance(new, Replicate):
        return "all_reduce", None, None, cur.op
    return None if _later_shards(state, m, new.dim) else ("reduce_scatter", None, new.dim, cur.op)


def _options(src, dst, m: int, ndim: int) -> tuple:
    """What mesh dim ``m`` may hold on the way from ``src`` to ``dst``: Replicate, a plain shard
    of every dim, the special placement of ``src`` (a Partial, a unit or grouped shard), the
    special shard of ``dst``. Only the last depends on ``dst``, so one search serves nearly every
    destination. A Partial the source does not hold on ``m`` never lies on a cheapest path to a
    state without it: entering one is local (from Replicate) and leaving it is a collective
    where keeping the Replicate needed nothing or a slice, valid in the same states (a Partial
    reads as Replicate for shapes and only restricts what other mesh dims may do), so the path
    without it is better on (time, steps); _Space._find enters the destination's own Partials
    last. Left out, the space a search explores is several times smaller (3 of ``4 + ndim``
    options per mesh dim), and the search order of the options kept is as if they were there."""
    opts = [R] + [Shard(d) for d in range(ndim)]
    for p in (src[m], dst[m] if isinstance(dst[m], Shard) else None):
        if isinstance(p, (Partial, Shard)) and p not in opts:
            opts.append(p)
    return tuple(opts)


class _Search:
    """Dijkstra from one source on (time, number of steps), resumed until a destination is
    settled: the predecessors are those of a search stopped at that destination (ties go to
    the path found first), shared by every destination asked for. States are ints (ids of
    coded states, see _Space.state_id): hashing them is the inner loop. An entry popped for
    a settled state is stale (only a strictly better candidate is pushed, so a state's best
    entry pops before its stale ones), which is the test ``(t, k) > best[state]`` was."""

    def __init__(self, space: "_Space", src: int, options: tuple):
        self.space, self.options = space, options
        self.adjacent = space.adjacency(options)  # state id -> its edges under these options
        self.time, self.count, self.prev, self.done = {src: 0.0}, {src: 0}, {}, set()
        self.tie = itertools.count(1)
        self.heap = [(0.0, 0, 0, src)]

    def settle(self, dst: int) -> bool:
        """Search on until ``dst`` is settled (False: unreachable). Best (time, steps) are kept
        as two dicts, compared time first: no tuple per relaxation."""
        bt, bk, prev, heap, done, adjacent, tie = (self.time, self.count, self.prev, self.heap, self.done,
                                                   self.adjacent, self.tie)
        pop, push = heapq.heappop, heapq.heappush
        while dst not in done and heap:
            t, k, _, i = pop(heap)
            if i in done:
                continue
            done.add(i)
            edges = adjacent.get(i)
            if edges is None:
                edges = self.space.edges(i, self.options, adjacent)
            k += 1
            for j, dt in edges:
                nt = t + dt
                old = bt.get(j)
                if old is None or nt < old or (nt == old and k < bk[j]):
                    bt[j] = nt
                    bk[j] = k
                    prev[j] = i
                    push(heap, (nt, k, next(tie), j))
        return dst in done


_MISSING = object()


class _Space:
    """Redistributions of one (shape, dtype) on one mesh under one cost model: the search
    graph's edges, the searches under way per source and the steps found.

    The planner asks for the cheapest move from an input's layout to the input placements
    of every strategy of a node (a 5-d permute on a 2x2x2 mesh has 729), and the ILP from
    every layout a value may arrive in to every one its consumers may take: one search from
    the source answers them all, and edge weights are shared by every search in the space.
    States are numbered once per space (coded placements -> id; a finite set: options per
    mesh dim to the power of the mesh's dims), so searches and edge memos key on ints.
    Spaces are shared by every plan in the process and keyed on plain values (mesh shape and
    names, never a Mesh object); a lock keeps rank threads from resuming a search together.
    """

    MAX_ENTRIES = 1 << 15  # per memo; past it the memo starts afresh (results never depend on it)

    def __init__(self, shape, dtype, mesh: Mesh, cost: CostModel):
        self.shapes, self.cost = _Shapes(shape, dtype, mesh), cost
        self.lock = threading.Lock()
        self._codes: dict = {}  # placement -> code
        self._placements: list = []  # code -> placement
        self._ids: dict = {}  # coded state -> id
        self._states: list = []  # id -> coded state
        self._edge_rows: list = []  # id -> per mesh dim {code: (next id, time, edge) or None}
        self._adjacent: dict = {}  # coded options -> {id: ((next id, time, edge), ...)}
        self._searches: dict = {}  # (src id, special shards of dst) -> _Search
        self._steps: dict = {}  # (src, dst) -> tuple of RedistStep
        self._step_objs: dict = {}  # (id, next id) -> RedistStep
        self._unreduced: list = []  # code -> code of the placement with the same local shapes
        self._moves: dict = {}  # (kind, m, src dim, dst dim, unreduced src, unreduced dst) -> (bytes, time) or None
        self._ustates: list = []  # id -> coded state with every Partial read as Replicate
        self._transitions: dict = {}  # (coded state from mesh dim m on, code) -> _transition's answer
        self.encode((R,))  # code 0: Replicate, what a Partial reads as for shapes

    @staticmethod
    def _put(memo: dict, key, value):
        if len(memo) >= _Space.MAX_ENTRIES:
            memo.clear()
        memo[key] = value
        return value

    def encode(self, state) -> tuple:
        """Placements -> small ints (a hash of ints is C; of frozen dataclasses, Python)."""
        out = []
        for p in state:
            c = self._codes.get(p)
            if c is None:
                c = self._codes[p] = len(self._placements)
                self._placements.append(p)
                self._unreduced.append(0 if isinstance(p, Partial) else c)
            out.append(c)
        return tuple(out)

    def decode(self, coded) -> tuple:
        return tuple(self._placements[c] for c in coded)

    def state_id(self, coded: tuple) -> int:
        i = self._ids.get(coded)
        if i is None:
            i = self._ids[coded] = len(self._states)
            self._states.append(coded)
            self._edge_rows.append([{} for _ in coded])
            self._ustates.append(tuple(self._unreduced[x] for x in coded))
        return i

    def layout(self, i: int) -> Layout:
        return self.shapes.layout(self.decode(self._states[i]))

    def adjacency(self, options: tuple) -> dict:
        """{state id: its edges} under coded ``options``, shared by the searches using them."""
        adj = self._adjacent.get(options)
        return adj if adj is not None else self._put(self._adjacent, options, {})

    def edges(self, i: int, options: tuple, adjacent: dict) -> tuple:
        """Every valid single-mesh-dim change of state ``i`` among coded ``options``, in option
        order, as (next id, time); kept in ``adjacent``."""
        state, rows, out = self._states[i], self._edge_rows[i], []
        for m, opts in enumerate(options):
            cur, row = state[m], rows[m]
            for c in opts:
                if c == cur:
                    continue
                e = row.get(c, _MISSING)
                if e is _MISSING:
                    e = row[c] = self._edge(state, m, c)
                if e is not None:
                    out.append(e[:2])
        out = tuple(out)
        if len(adjacent) >= _Space.MAX_ENTRIES:
            adjacent.clear()
        adjacent[i] = out
        return out

    def _edge(self, state: tuple, m: int, c: int):
        """``_edge`` on coded states, as (next id, time, edge). The transition depends only on
        mesh dims ``m`` onwards (what later dims shard or hold partial), so it is memoised on
        that suffix; bytes and time on the states with every Partial read as Replicate (the
        same local shapes, so the same bytes: a space holds several partial states per shape
        state)."""
        tkey = (state[m:], c)
        tr = self._transitions.get(tkey, _MISSING)
        if tr is _MISSING:
            tr = self._transitions[tkey] = _transition(self.decode(state), m, self._placements[c])
        if tr is None:
            return None
        kind, sd, dd, op = tr
        nxt = state[:m] + (c,) + state[m + 1:]
        if not KINDS[kind].communicates:
            return self.state_id(nxt), 0.0, (kind, m, sd, dd, op, 0, 0.0)
        u = self._unreduced
        us = self._ustates[self._ids[state]]
        key = (kind, m, sd, dd, us, us[:m] + (u[c],) + us[m + 1:])
        move = self._moves.get(key, _MISSING)
        if move is _MISSING:
            e = _edge(self.decode(state), m, self._placements[c], self.shapes, self.cost)
            move = self._moves[key] = e and e[1][-2:]
        if move is None:
            return None
        return self.state_id(nxt), move[1], (kind, m, sd, dd, op, *move)

    def plan(self, src: tuple, dst: tuple) -> tuple:
        with self.lock:
            key = (src, dst)
            steps = self._steps.get(key)
            if steps is None:
                steps = self._put(self._steps, key, self._find(src, dst))
            return steps

    def _find(self, src: tuple, dst: tuple) -> tuple:
        """The search's path to ``dst`` with every Partial the source does not hold there read as
        Replicate, then those Partials entered (local steps). The same (time, steps) as a search
        that may enter them anywhere: on a cheapest path, moving each last entry to the end keeps
        every step valid (a Partial only restricts other mesh dims) and changes no bytes."""
        late = [m for m, (p, s) in enumerate(zip(dst, src)) if isinstance(p, Partial) and p != s]
        base = dst
        if late:
            self.shapes.layout(dst)  # an impossible destination is named as asked
            base = tuple(R if m in late else p for m, p in enumerate(dst))
        isrc, idst = self.state_id(self.encode(src)), self.state_id(self.encode(base))
        key = (isrc, tuple(p if isinstance(p, Shard) and p.block != (1, 1) else None for p in base))
        search = self._searches.get(key)  # options depend on dst only through its special shards
        if search is None:
            ndim = len(self.shapes.shape)
            options = tuple(self.encode(_options(src, base, m, ndim)) for m in range(len(src)))
            search = self._put(self._searches, key, _Search(self, isrc, options))
        if not search.settle(idst):  # cannot happen: gather/reduce last-to-first, then slice first-to-last
            raise ShardingError(f"no redistribution from {list(src)} to {list(dst)} on mesh {self.shapes.mesh.shape}")
        out, i = [], idst
        while i != isrc:
            before = search.prev[i]
            out.append(self.step(before, i))
            i = before
        out.reverse()
        for m in late:  # Replicate -> Partial, always valid and local
            c = self.encode((dst[m],))[0]
            state = self._states[idst]
            row = self._edge_rows[idst][m]
            if c not in row:
                row[c] = self._edge(state, m, c)
            nxt = row[c][0]
            out.append(self.step(idst, nxt))
            idst = nxt
        return tuple(out)

    def step(self, a: int, b: int) -> RedistStep:
        """The step from state ``a`` to state ``b`` (one mesh dim changes, so the edge is unique),
        memoised: paths from many sources share their last steps."""
        st = self._step_objs.get((a, b))
        if st is None:
            sa, sb = self._states[a], self._states[b]
            m = next(m for m in range(len(sa)) if sa[m] != sb[m])
            kind, m, sd, dd, op, nbytes, t = self._edge_rows[a][m][sb[m]][2]
            st = self._put(self._step_objs, (a, b), RedistStep(kind, m, self.layout(a), self.layout(b), sd, dd, op,
                                                                nbytes, t))
        return st


def _edge(state, m: int, new, shapes: _Shapes, cost: CostModel):
    """(next state, (kind, m, src dim, dst dim, op, bytes, time)) for changing mesh dim ``m`` of
    ``state`` to ``new``, or None where that is no valid step."""
    tr = _transition(state, m, new)
    if tr is None:
        return None
    kind, sd, dd, op = tr
    nxt = state[:m] + (new,) + state[m + 1:]
    if not KINDS[kind].communicates:
        return nxt, (kind, m, sd, dd, op, 0, 0.0)
    try:
        nbytes = _step_bytes(kind, state, nxt, m, shapes, sd, dd)
    except ShardingError:  # a unit shard nested in a chunk of partial blocks: no such layout
        return None
    return nxt, (kind, m, sd, dd, op, nbytes, shapes.time(cost, kind, nbytes, m))


_SPACES: dict = {}  # (shape, dtype, mesh shape, mesh names, cost) -> _Space, least recently used first
_SPACES_LOCK = threading.Lock()
MAX_SPACES = 64


def _space(shape, dtype, mesh: Mesh, cost: CostModel) -> _Space:
    key = (shape, dtype, mesh.shape, mesh.names, cost)
    with _SPACES_LOCK:
        sp = _SPACES.pop(key, None)
        if sp is None:
            sp = _Space(shape, dtype, Mesh(mesh.shape, mesh.names), cost)
            while len(_SPACES) >= MAX_SPACES:
                del _SPACES[next(iter(_SPACES))]
        _SPACES[key] = sp
        return sp


def _plan(shape, dtype, src, dst, mesh: Mesh, cost: CostModel) -> tuple:
    """Cheapest plan on (time, number of steps), fewest steps among equals."""
    return _space(shape, dtype, mesh, cost).plan(src, dst)


def plan_redistribute(layout: Layout, dst_placements: PlacementSpec, mesh: Mesh,
                      cost_model: CostModel | None = None) -> list[RedistStep]:
    """Steps that turn ``layout`` into ``dst_placements`` on ``mesh`` in the least estimated time.

    Every intermediate layout is valid; ``[]`` when nothing changes.
    """
    src = normalize_placements(layout.placements, mesh, layout.ndim, "source layout")
    dst = normalize_placements(dst_placements, mesh, layout.ndim, "destination placements")
    cost = DEFAULT_COST if cost_model is None else cost_model
    return list(_plan(tuple(layout.shape), layout.dtype, src, dst, mesh, cost))


def reduces(src, dst) -> bool:
    """True when moving placements ``src`` to ``dst`` reduces a partial sum on some mesh dim."""
    return any(isinstance(a, Partial) and a != b for a, b in zip(src, dst))


def move_key(src: fx.Node, steps, backward: bool) -> tuple:
    """What one emitted redistribution serves: (producer, destination placements), and for a
    program argument moved by a collective also the phase (gathered again for backward, FSDP's
    reshard after forward), unless it is kept gathered (``KEEP_GATHERED``)."""
    key = (src.name, steps[-1].dst.placements)
    if (backward and src.op == "placeholder" and not src.meta.get(KEEP_GATHERED)
            and any(s.is_collective for s in steps)):
        key += ("backward",)
    return key


def edges(prop) -> list:
    """The redistributions a Propagation's program emits, each once: (consumer, producer, steps)
    per ``move_key``, a program argument gathered again for backward consumers counted again,
    and the collectives a local call runs itself (Rule.comm, consumer == producer): what the
    ILP prices (search/ilp.plan_cost) and the Plan reports."""
    seen, out = set(), []
    graph_nodes = {n.name: n for n in prop.gm.graph.nodes}
    for name, np_ in prop.nodes.items():
        back = bool(graph_nodes[name].meta.get("autograd_backward"))
        for src, steps in zip(tensor_arg_nodes(graph_nodes[name]), np_.in_steps):
            key = steps and move_key(src, steps, back)  # the program's own key: FSDP gathers twice
            if steps and key not in seen:
                seen.add(key)
                out.append((name, src.name, steps))
        if np_.rule.comm is not None:  # collectives the local call runs itself (a halo exchange)
            inner = np_.rule.comm(np_.call, np_.strategy, prop.mesh)
            if inner:
                out.append((name, name, inner))
    outs = graph_nodes["output"].args[0] if "output" in graph_nodes else ()
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    for o, steps in zip(outs, prop.output_steps):
        if steps and isinstance(o, fx.Node) and (o.name, steps[-1].dst.placements) not in seen:
            seen.add((o.name, steps[-1].dst.placements))
            out.append(("output", o.name, steps))
    return out


def grouped_dims(step: RedistStep) -> tuple:
    """(tensor dim, groups) of the shards in groups that this step makes or undoes."""
    found = {}
    for lay in (step.src, step.dst):
        p = lay.placements[step.mesh_dim]
        if isinstance(p, Shard) and p.groups > 1:
            found[p.dim] = p.groups
    return tuple(sorted(found.items()))


def coalesced_gather(src: fx.Node, steps: list[RedistStep], consumer: fx.Node | None, backward: bool,
                     bucket_bytes: int | None) -> tuple | None:
    """(unit, phase, mesh dim, dtype): the ONE all_gather call the program makes this move in,
    or None. lower/prefetch.py coalesces (when ``bucket_bytes`` is not None) every program argument
    moved by a single plain all_gather for a node, per FSDP unit of that first ``consumer``."""
    if (bucket_bytes is None or consumer is None or src.op != "placeholder" or len(steps) != 1
            or steps[0].kind != "all_gather" or grouped_dims(steps[0])):
        return None
    return fsdp_unit(consumer), backward, steps[0].mesh_dim, steps[0].src.dtype


def gather_call_latency(cost: CostModel, mesh: Mesh, mesh_dim: int) -> float:
    """The one latency of a coalesced all_gather call on ``mesh_dim`` (its members share it)."""
    return cost.collective_time("all_gather", 0, mesh.shape[mesh_dim], mesh_dim, mesh)


def edge_times(prop, cost: CostModel, bucket_bytes: int | None) -> list:
    """Per edge of ``edges(prop)``, its steps' seconds as the program runs them: a graph output's
    (a gradient's; not a scalar's, the loss's) reductions in their buckets (cost.bucketed_time); a
    coalesced all_gather (coalesced_gather) its bandwidth, its call's one latency on the first
    member of each group."""
    nodes, groups, out = {n.name: n for n in prop.gm.graph.nodes}, set(), []
    for dst, src, steps in edges(prop):
        consumer = None if dst in ("output", src) else nodes[dst]
        back = consumer is not None and bool(consumer.meta.get("autograd_backward"))
        group = coalesced_gather(nodes[src], steps, consumer, back, bucket_bytes)
        times = [cost.bucketed_time(s, prop.mesh, bucket_bytes if dst == "output" and s.src.shape else None)
                 for s in steps]  # a scalar output (the loss) is a call of its own (lower/buckets._key)
        if group is not None:
            times[0] -= gather_call_latency(cost, prop.mesh, steps[0].mesh_dim) * (group in groups)
            groups.add(group)
        out.append(times)
    return out
