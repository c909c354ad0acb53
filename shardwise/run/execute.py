"""The plan runner: a Plan's per-rank programs run on a backend (run/backend.py).

An ``Executable`` (one per Plan) hands the backend each rank's ready program and arguments, read
from the Plan (``traced``, ``arg_layouts``, ``state_args``, ``flat_args``, ``program_module``);
``gather`` reassembles a full tensor from the shards the backend holds (``backend.shard_state``).
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from .shards import collect
from ..core.errors import ConfigError
from ..core.layout import Layout, Replicate
from ..core.mesh import Mesh
from ..lower.buckets import bucket_all_reduce, bucket_chunk, bucket_piece, bucket_reduce_scatter, bucket_scalar, wait_bucket
from ..lower.guards import shape_guard
from ..lower.plan import Plan
from ..lower.redistribute import redistribute_local
from ..trace.normalize import is_view_op
from ..trace.value_guards import check_call
from .backend import Backend
from .compiled import INNER_KINDS, CompiledProgram
from .replay import Replay


def gather(backend: Backend, shards: dict, name: str, placements: tuple, grad: bool = False) -> torch.Tensor | None:
    """The full tensor (its ``.grad`` with ``grad``; None where unset) of ``name`` laid out with
    ``placements``: reassembled from every rank's shard when all ranks are held here, else
    redistributed to Replicate with the backend's collectives (collective: every rank calls it)."""
    locals_ = [shards[r][name].grad if grad else shards[r][name] for r in backend.ranks]
    if any(t is None for t in locals_):
        return None
    if len(backend.ranks) == backend.mesh.size:
        return collect([t.detach() for t in locals_], backend.mesh, placements)
    (t,) = locals_
    lay = Layout(backend.shapes[name], t.dtype, placements)
    return redistribute_local(t.detach(), lay, (Replicate(),) * backend.mesh.ndim, backend.mesh, backend.comm,
                              backend.ranks[0])


def gather_held(backend, shards: dict, name: str, placements, dim: int, coord: int, shape: tuple, dtype,
                grad: bool = False) -> torch.Tensor | None:
    """``gather`` for a tensor only the ranks at coordinate ``coord`` of mesh dim ``dim`` hold (a
    pipeline stage's parameters; Replicate on ``dim``): reassembled from those ranks' shards,
    then, on the torch backend, broadcast along ``dim`` to the ranks that do not hold it (the
    others pass a buffer of ``shape`` and ``dtype``; with ``grad``, whether the gradient is set
    goes first). Collective on the torch backend: every rank calls it."""
    mesh = backend.mesh
    if len(backend.ranks) == mesh.size:
        holders = [r for r in backend.ranks if mesh.coord(r)[dim] == coord]
        locals_ = [shards[r][name].grad if grad else shards[r][name] for r in holders]
        if any(t is None for t in locals_):
            return None
        sub = Mesh(tuple(s for m, s in enumerate(mesh.shape) if m != dim) or (1,))
        pl = tuple(p for m, p in enumerate(placements) if m != dim) or (Replicate(),)
        return collect([t.detach() for t in locals_], sub, pl)
    rank = backend.ranks[0]
    full = None
    if mesh.coord(rank)[dim] == coord:
        full = gather(backend, shards, name, placements, grad)
    if grad:
        present = torch.tensor([full is not None], dtype=torch.uint8)
        if not bool(backend.comm.broadcast(present, dim, coord)[0]):
            return None
    buf = full if full is not None else torch.empty(shape, dtype=dtype)
    return backend.comm.broadcast(buf.contiguous(), dim, coord)


class Executable:
    """What running one Plan needs beyond the Plan, made once per plan by whoever runs it (the
    ParallelModule): each rank's program as run (with the debug shape guards until a run of it
    has passed them, then plain, or compiled with ``compile=True``), each rank's argument plan,
    and whether a torch-backend run checked that every rank was handed the same global inputs."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.checked_ranks: set = set()  # ranks whose run passed the shape guards: later runs skip them
        self.inputs_checked = False  # inputs="global" on the torch backend (module/inputs.check_same_inputs)
        self._arg_plans: dict = {}  # rank -> _ArgPlan or None
        self._compiled: dict = {}  # rank -> CompiledProgram
        self._replays: dict = {}  # rank -> Replay of the unguarded program
        self._steady: dict | None = None  # {rank: runnable} once every rank here passed its guards
        self._ran: dict = {}  # {rank: what ran its program last} (owns)
        self._owns: dict = {}  # rank -> (what ran, its code, indices, owns(rank, indices))

    def run(self, backend, shards: dict, inputs: tuple, targets: tuple, kwargs: dict | None = None,
            local: dict | None = None) -> dict:
        """Run the plan on every rank held here: {rank: program outputs}. ``local``: {rank: (inputs,
        targets, kwargs)}, each rank's own pieces (inputs="local"); else every rank slices the full
        ones."""
        check_call(self.plan.traced.gm, self.plan.traced.args, inputs, targets, kwargs, local is not None)
        programs = self._steady or self._runnables(backend.ranks)
        if local is not None:  # each rank's pieces as they are (checked by run/inputs.py)
            outs = backend.run(programs, lambda r: self.plan.flat_args(shards[r], *local[r]), self.plan.draws_random)
        else:
            outs = backend.run(programs, lambda r: self.flat_locals(shards, r, inputs, targets, kwargs),
                               self.plan.draws_random)
        if programs is not self._steady:  # (once steady, every rank here is checked)
            self.checked_ranks.update(backend.ranks)
        return outs

    @property
    def steady_programs(self) -> dict | None:
        """{rank: runnable} every later run calls (each rank here passed its guards), else None."""
        return self._steady

    def arg_plan(self, rank: int):
        """How ``flat_locals`` takes rank ``rank``'s arguments from plain tensors (its _ArgPlan),
        None where it takes the pytree path or has not run for that rank yet."""
        return self._arg_plans.get(rank)

    def local_arg_plan(self):
        """inputs="local": how a rank's own pieces (plain positional tensors, passed as they are)
        become its program's arguments (an _ArgPlan), None where they take the pytree path."""
        return _ArgPlan.as_given(self.plan)

    def owns(self, rank: int, indices: tuple) -> bool:
        """Whether the outputs at ``indices`` of rank ``rank``'s last run each hold a buffer of their
        own: one an aten op allocated in that run, or its range of a gradient bucket's reduced buffer,
        which no other of them, no argument and no constant shares (``output_buffers``). False where
        the graph cannot tell (a collective's result) and for a compiled program."""
        ran = self._ran.get(rank)
        code = getattr(ran, "code", None)  # a Replay's is new when it regenerated for a recompiled program
        known = self._owns.get(rank)
        if known is not None and known[0] is ran and known[1] is code and known[2] is indices:
            return known[3]
        gm = ran.program if isinstance(ran, Replay) else ran
        owned = False
        if isinstance(gm, fx.GraphModule):
            bufs = output_buffers(gm.graph)
            owned = _apart([bufs[i] for i in indices])
        self._owns[rank] = (ran, code, indices, owned)
        return owned

    def _runnables(self, ranks: list) -> dict:
        """{rank: runnable(rank)}, built up front, outside the timed collectives; kept once every rank
        passed its guards (``runnable`` gives the same object on every later run then)."""
        programs = self._ran = {r: self.runnable(r) for r in ranks}
        if self.checked_ranks.issuperset(ranks):
            self._steady = programs
        return programs

    def program(self, rank: int) -> torch.fx.GraphModule | CompiledProgram:
        """Rank ``rank``'s program for this run: with the debug shape guards until one run of the
        plan on this rank has passed them (a plan's local shapes are fixed, so later runs would
        check the same shapes again), the plain program after that, or always without debug."""
        plan = self.plan
        guards = plan.debug and rank not in self.checked_ranks
        if plan.compile and not guards:  # parallelize(compile=True)
            if rank not in self._compiled:
                self._compiled[rank] = CompiledProgram(plan.program_module(rank, guards=False), rank)
            return self._compiled[rank]
        return plan.program_module(rank, guards)

    def runnable(self, rank: int):
        """What runs rank ``rank``'s program this time: ``program(rank)`` itself while it has its
        guards or is compiled, else its Replay (run/replay.py: the same calls, as tight Python)."""
        program = self.program(rank)
        if not isinstance(program, torch.fx.GraphModule) or (self.plan.debug and rank not in self.checked_ranks):
            return program
        replay = self._replays.get(rank)
        if replay is None or replay.program is not program:
            replay = self._replays[rank] = Replay(program)
        return replay

    def flat_locals(self, shards: dict, rank: int, inputs: tuple, targets: tuple, kwargs: dict | None = None) -> list:
        """The program's arguments on ``rank``: local state, and this rank's chunk of each full input
        and target. Plain tensor arguments, as traced, take the fast path (_ArgPlan): no pytree work."""
        plan = self.plan
        if rank not in self._arg_plans:
            self._arg_plans[rank] = _ArgPlan.of(plan, rank)
        fast = self._arg_plans[rank]
        if fast is not None and not kwargs:
            args = fast.args(shards[rank], inputs, targets)
            if args is not None:
                return args
        flat = plan.flat_args(shards[rank], inputs, targets, kwargs)
        return [x if lay is None else lay.local_view(x, plan.mesh, rank) for x, lay in zip(flat, plan.arg_layouts)]


def output_buffers(graph: fx.Graph) -> list:
    """Per output of a program's graph: the buffers it may be a view of, each named by the call that
    allocates it (its node, or (node, i) for result i of a call with several), as a frozenset; None
    where the graph cannot tell (a program argument or constant, a call not of an aten op, a graph
    with ``set_``, which makes a tensor share another's buffer). An aten op's schema says which
    results alias its arguments (trace/normalize.is_view_op adds aten._unsafe_view, which aliases
    without saying so); every other aten result is a new buffer. A gradient bucket's reduced
    buffer (``wait_bucket``) is new too (the bucket's own, made each run, lower/buckets.py), and a
    member's result (``bucket_piece`` / ``bucket_chunk``) holds only its element range of it (a
    ``_Span``), which ``_apart`` tells apart from its neighbours'; a scalar member's
    (``bucket_scalar``) is a copy."""
    env: dict = {}
    shares = False
    for n in graph.nodes:
        t, value = n.target, None
        if n.op != "call_function":
            pass
        elif t is shape_guard:  # returns its value
            value = env[n.args[0]]
        elif t is wait_bucket:
            value = frozenset({n}) if _launches_bucket(n.args[0]) else None
        elif t is bucket_scalar:  # a copy
            value = frozenset({n})
        elif t is bucket_piece or t is bucket_chunk:
            flat, offset, shape = n.args[:3]
            got = env.get(flat)
            value = None if got is None else frozenset(_Span(b, offset, offset + math.prod(shape)) for b in got)
        elif t is operator.getitem:
            src = n.args[0]
            value = frozenset({(src, n.args[1])}) if _allocates(src.target, several=True) else env[src]
        elif _allocates(t):
            value = frozenset({n})
        elif is_view_op(t) or isinstance(t, torch._ops.OpOverload) and t.namespace == "aten":  # aliased results
            shares = shares or t._schema.name == "aten::set_"
            got = [env[a] for a in n.all_input_nodes]
            value = None if not got or any(b is None for b in got) else frozenset().union(*got)
        env[n] = value
    outs = graph.find_nodes(op="output")[0].args[0]
    outs = (outs,) if isinstance(outs, fx.Node) else outs
    return [None if shares or not isinstance(a, fx.Node) else env[a] for a in outs]


class _Span(NamedTuple):
    """Elements [start, end) of one buffer (output_buffers' name for it)."""

    buffer: object
    start: int
    end: int


def _launches_bucket(handle) -> bool:
    return isinstance(handle, fx.Node) and handle.target in (bucket_all_reduce, bucket_reduce_scatter)


def _apart(picked: list) -> bool:
    """Whether no two of ``picked`` (output_buffers' sets) may share memory: every set known, no
    buffer in two of them, and element ranges of one buffer (``_Span``) disjoint from each other
    and from any output holding that buffer whole."""
    if any(b is None for b in picked):
        return False
    whole, ranges = set(), {}
    for bufs in picked:
        for b in bufs:
            if isinstance(b, _Span):
                ranges.setdefault(b.buffer, []).append((b.start, b.end))
            elif b in whole:
                return False
            else:
                whole.add(b)
    for base, spans in ranges.items():
        spans.sort()
        if base in whole or any(lo < hi_prev for (_, hi_prev), (lo, _) in zip(spans, spans[1:])):
            return False
    return True


def _allocates(target, several: bool = False) -> bool:
    """An aten op whose results are all new buffers (no alias in its schema); ``several``: and more
    than one of them (several returns, or a list)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" or is_view_op(target):
        return False
    rets = target._schema.returns
    if any(r.alias_info is not None for r in rets):
        return False
    return not several or len(rets) > 1 or (len(rets) == 1 and isinstance(rets[0].type, torch.ListType))


class _ArgPlan:
    """How rank ``rank``'s program arguments come from the local state and the step's
    positional tensors when the plan was traced with exactly those (no constants, no nesting):
    each input's local slice as one basic index worked out once (None: the whole tensor; a
    slice, or a tuple of them for a split past dim 0). ``x[index]`` is the view ``narrow`` makes,
    in one call whatever the number of split dims, and the cheapest view torch's Python makes.
    ``of`` returns None for other plans (nested inputs, dims split in groups): the pytree path."""

    def __init__(self, state_names: list, index: list):
        self.state_names, self.index = state_names, index
        self.whole = all(ix is None for ix in index)  # every rank takes every input whole

    @classmethod
    def of(cls, plan, rank: int):
        if plan.state_args is None:
            return None
        index = []
        for lay in plan.arg_layouts:
            if lay is None:
                continue
            ext = lay.extents(plan.mesh, rank)
            if any(g != 1 for g, _, _ in ext):
                return None
            cut = [(off, n) != (0, lay.shape[d]) for d, (_, off, n) in enumerate(ext)]
            if not any(cut):
                index.append(None)
                continue
            last = max(d for d, c in enumerate(cut) if c)
            slices = tuple(slice(off, off + n) if cut[d] else slice(None) for d, (_, off, n) in enumerate(ext[:last + 1]))
            index.append(slices[0] if last == 0 else slices)
        return cls(plan.state_args, index)

    @classmethod
    def as_given(cls, plan):
        if plan.state_args is None:
            return None
        return cls(plan.state_args, [None] * sum(lay is not None for lay in plan.arg_layouts))

    def args(self, state: dict, inputs: tuple, targets: tuple) -> list | None:
        """The program's arguments, or None where the step's arguments are not the plain tensors
        this plan was traced with (the pytree path then)."""
        given = (*inputs, *targets)
        if len(given) != len(self.index):
            return None
        for x in given:
            if type(x) is not torch.Tensor:
                return None
        out = [state[n] for n in self.state_names]
        if self.whole:
            out.extend(given)
            return out
        for x, ix in zip(given, self.index):
            out.append(x if ix is None else x[ix])
        return out


def check_compilable(plan: Plan) -> bool:
    """True, or a ConfigError for an op of ``plan`` whose local call runs a collective not traced here.
    Random ops compile (run/compiled.py draws them from the rank's stream)."""
    graph = {n.name: n for n in plan.prop.gm.graph.nodes}
    for name, np_ in plan.prop.nodes.items():
        if np_.rule.comm is None:
            continue
        kinds = sorted({s.kind for s in np_.rule.comm(np_.call, np_.strategy, plan.mesh)} - set(INNER_KINDS))
        if kinds:
            raise ConfigError(
                f"compile=True: node '{name}' ({graph[name].target}) runs {', '.join(kinds)} inside its local call "
                "(its strategy communicates within the op), which the compiled program cannot trace",
                fix="pass compile=False, or placements that keep this op's communicating dim whole "
                    "(e.g. attention='ulysses' or 'gather' instead of ring attention)")
    return True
