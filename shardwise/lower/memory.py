"""Peak memory per rank from a liveness analysis of the per-rank program.

    est = program_memory(plan, rank)      # MemoryEstimate: peak, resident, gradients, curve
    print(est.table())                    # bytes live after every node, the peak marked

The per-rank program (lower/program.py, without debug guards) is run once on meta tensors
(nothing is allocated: meta kernels, the same storages and views as fake tensors at half their
cost; a call repeated with the same sizes, a repeated block's or another rank class's, is made
from the first one's outputs without dispatch, a view remade on its argument: a quarter in all; a
program with no meta kernel for some op runs on fake tensors) with collectives that allocate what
the torch backend's allocate
(run/distributed.py: a fresh result per collective; a bucket reduced in place in its own
flat buffer; a started gather's output buffer; a model of core/collectives.py's interface,
as lower/ never imports run/). That run gives, for every node, the storages its value
holds and the most bytes it has live while it runs (padding, stacked collective buffers, a
bucket's flat copy, kernel outputs it drops). The analysis then walks the graph:

- a storage is counted once, from the node that allocates it to the last use of any value
  that aliases it (a view extends its base's life, never adds bytes);
- a value read by the program's output lives to the end: each gradient is counted once, as
  the program's result that becomes ``.grad``;
- the program's arguments (parameters, buffers, this rank's inputs and targets) are
  resident: held by the caller for the whole step;
- at each node the live bytes are those of earlier values still to be read, plus the node's
  own peak while it runs; the largest over nodes is the peak.

The estimate assumes gradients from a previous step were freed (``zero_grad()`` sets them to
None, as torch's does); accumulating into existing ``.grad`` holds one more copy of them.
Optimizer state is not part of the program and is not counted here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.calls import is_pure
from ..core.layout import Layout
from ..core.scope import using, using_generator
from ..trace.precision import MASTER_DTYPE
from . import comm
from .prefetch import CAST_OF, gathered as prefetched, gathered_source, program_argument


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank during one run of its program.

    ``peak``: the most bytes live at once, resident arguments included; ``resident``: the
    program's arguments (``parameters`` of them parameters); ``gradients``: bytes of the
    gradients the program returns; ``peak_node``: the node running at the peak; ``curve``:
    ((node, bytes live while it runs), ...) in program order."""

    rank: int
    peak: int
    resident: int
    parameters: int
    gradients: int
    peak_node: str
    curve: tuple = field(repr=False)
    exact: bool = True  # False: the program could not run on fake tensors (data-dependent sizes):
    #                     planned local sizes, each value its own allocation (an upper bound)
    live_after: tuple = field(default=(), repr=False)  # bytes live after each node, in program order
    # per graph output that is a gradient, its share of ``gradients`` (a storage several gradients
    # hold, a bucket, split evenly among them): {output index: bytes}
    grad_shares: dict = field(default_factory=dict, repr=False)
    masters: int = 0  # of ``parameters``: the masters the program casts first (mixed precision)
    copies: int = 0  # bytes of those casts (the parameters compute reads) live at the peak
    # the allocations behind the curve, for lower/allocator.py: every storage the program allocates as
    # (position allocated, position of its last read, bytes, a gradient's), in program order, the last
    # read len(curve) where it outlives the run (a gradient, the loss); (position, bytes) of what a node
    # allocates and drops while it runs beyond what it keeps; the resident arguments' bytes per storage,
    # and of them the parameters' (what the optimizer updates and sizes its state by), as (placeholder, bytes)
    intervals: tuple = field(default=(), repr=False)
    temps: tuple = field(default=(), repr=False)
    resident_storages: tuple = field(default=(), repr=False)
    param_storages: tuple = field(default=(), repr=False)
    peak_gradients: int = 0  # of ``gradients``: those made by the peak (the rest are made after it)

    @property
    def activations(self) -> int:
        """What the peak holds beyond the resident arguments and the gradients made by then."""
        return self.peak - self.resident - self.peak_gradients

    def table(self, top: int | None = None) -> str:
        """``node  bytes`` per line in program order (``top``: only the largest ``top``)."""
        rows = sorted(self.curve, key=lambda r: -r[1])[:top] if top else self.curve
        width = max((len(n) for n, _ in rows), default=4)
        lines = [f"# memory of rank {self.rank}: peak {self.peak} bytes at {self.peak_node} "
                 f"(resident {self.resident}, gradients {self.gradients})"]
        lines += [f"{n.ljust(width)} {b}" + ("  <- peak" if n == self.peak_node else "") for n, b in rows]
        return "\n".join(lines)


def program_memory(plan, rank: int) -> MemoryEstimate:
    """The liveness estimate of ``plan``'s program on ``rank`` (see the module docstring): one
    meta run of the program, ~0.1 ms per node (Plan.memory_estimate keeps it). Activation
    checkpointing is in the program itself (trace/recompute.py: the recomputed forward runs in
    backward), so its values' two lives are two values here."""
    gm = plan.program_module(rank, guards=False)
    # the calls seen on meta tensors are keyed by their sizes, not by rank: every rank class's
    # program reuses them (a second class runs mostly from the first's)
    facts = _run_on_meta_or_fake(gm, plan, rank, plan.prop.lowered.setdefault(("memory", "calls"), {}))
    if facts is None:  # a data-dependent program (e.g. MoE token dispatch)
        return _walk(gm, _planned_facts(gm, plan, rank), plan, rank, False)
    return _walk(gm, facts, plan, rank, True)


def plan_memory(plan) -> dict:
    """Plan.memory()'s figures, the busiest rank's: {"parameters", "masters", "gradients",
    "peak_activations", "peak", "rank", "exact", "updated"}, each what is live at the peak:
    masters + parameters + gradients + peak_activations == peak; "gradients" are those made by
    then (a peak in the loss's backward holds none; MemoryEstimate.gradients has them all). Under
    mixed precision "masters" are the resident master shards and "parameters" the compute copies
    live at the peak (plus any parameter not cast); without it
    "masters" is 0 and "parameters" the resident parameters. "updated": the bytes the optimizer
    updates (the resident parameters, masters included: what its state is sized by). ``exact``
    False when some rank's program could not run on fake tensors (an upper bound from planned
    sizes, see MemoryEstimate.exact). Ranks of one class (search/classes.py) run programs of the
    same shapes, so the first rank of each class is estimated for all of it."""
    ests = [plan.memory_estimate(r) for r in plan.rank_classes.reps]  # one rank stands for its class
    worst = max(ests, key=lambda e: (e.peak, -e.rank))
    params = worst.parameters - worst.masters + worst.copies
    return {"parameters": params, "masters": worst.masters, "gradients": worst.peak_gradients,
            "peak_activations": worst.peak - worst.masters - params - worst.peak_gradients,
            "peak": worst.peak, "rank": worst.rank, "exact": all(e.exact for e in ests),
            "updated": worst.parameters}


# -- the fake run ---------------------------------------------------------------------
def _run_on_meta_or_fake(gm: fx.GraphModule, plan, rank: int, memo: dict) -> "_Facts | None":
    """What a run on meta tensors saw; on fake tensors where a meta kernel is missing; None where
    neither runs (sizes that depend on data). ``memo``: the meta run's calls made so far (_Interpreter),
    kept by the caller for the next program."""
    for meta in (True, False):
        mode, args = _fake_args(plan, gm, rank, meta)  # outside the try: a failure here is a bug, not data
        try:
            return _run_fake(gm, mode, args, plan.mesh, rank, memo if meta else None)
        except Exception:  # noqa: BLE001, S112 - the next way, then planned sizes
            continue
    return None


def _fake_args(plan, gm: fx.GraphModule, rank: int, meta: bool = True) -> tuple:
    """(mode, local arguments): each placeholder's planned local shape on ``rank``, contiguous, on the
    meta device (``meta``; the mode moves tensors the program makes to it) or fake on the plan's.
    Program placeholders carry the traced names (lower/program.py), the keys of the plan's layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = _OnMeta() if meta else FakeTensorMode(allow_non_fake_inputs=True)
    device = _META if meta else _device(plan)
    masters = master_dtypes(plan)
    out = []
    with mode:
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            lay = plan.prop.layouts[n.name][0]
            out.append(torch.empty(tuple(lay.local_shape(plan.mesh, rank)), dtype=masters.get(n.name, lay.dtype),
                                   device=device))
    return mode, out


def master_dtypes(plan) -> dict:
    """{placeholder: its master's dtype} of the parameters the program casts first (mixed precision)."""
    return {n.name: n.meta[MASTER_DTYPE] for n in plan.prop.gm.graph.find_nodes(op="placeholder")
            if MASTER_DTYPE in n.meta}


def _device(plan) -> torch.device:
    for n in plan.prop.gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


_META = torch.device("meta")


class _OnMeta(TorchDispatchMode):
    """Tensors the program makes itself (``arange``, ``full``, a ``_to_copy`` to a device) on the meta
    device, as its arguments are: what a fake run's device bookkeeping does, without fake tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs and kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": _META}
        return func(*args, **(kwargs or {}))


class _Facts:
    """What the fake run saw: per node, the storages its value holds (key -> bytes), the ones
    it allocated, and its own peak (bytes it allocated that were live at once)."""

    def __init__(self):
        self.holds: dict = {}      # node -> {storage key: bytes}
        self.allocs: dict = {}     # node -> {storage key: bytes} allocated by the node and kept
        self.transient: dict = {}  # node -> most bytes the node had allocated at once
        self.pins: list = []       # the storages of every value, kept so no key is reused


class _Allocations(TorchDispatchMode):
    """Every storage created while a node runs, with the most bytes of them alive at once
    (a storage is dead once its weak reference expires: Python frees it on its last reference)."""

    def __init__(self, before: set):
        super().__init__()
        self.live: dict = {}  # key -> (weak ref, bytes)
        self.peak, self.before = 0, before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in _tensors(out):
            key, nbytes = _storage(t)
            if key is not None and key not in self.live and key not in self.before:
                self.live[key] = (StorageWeakRef(t.untyped_storage()), nbytes)
        self.peak = max(self.peak, sum(b for _, b in self.live.values()))
        return out


def _tensors(value) -> list:
    if isinstance(value, _Started):
        value = value.value
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _storage(t: torch.Tensor):
    """(a key naming ``t``'s storage, its bytes); (None, 0) for an empty one."""
    s = t.untyped_storage()
    nbytes = s.nbytes()
    return (StorageWeakRef(s).cdata, nbytes) if nbytes else (None, 0)


class _Interpreter(fx.Interpreter):
    """The fake run. An op call seen before (the same op on tensors of the same sizes, strides and
    dtypes, the same other arguments: a repeated block's) whose outputs were fresh tensors of their
    own storages or views of its arguments, nothing else kept, is not dispatched again: its
    outputs are made empty with the sizes and strides it gave (views on their arguments), and its
    own peak is the one it had (``_Memo``; on the meta device)."""

    def __init__(self, gm, facts: _Facts, memo: dict | None):
        super().__init__(gm)
        self.facts, self.known = facts, set()
        self.memo = memo  # call signature -> _Memo, or None where every call must run (fake tensors)

    def run_node(self, n: fx.Node):
        if n.op != "call_function":
            out = super().run_node(n)
            self._note(n, out, {})
            return out
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        sig = _signature(n.target, args, kwargs) if self.memo is not None else None
        memo = self.memo.get(sig) if sig is not None else None
        if memo is not None:
            out = memo.make(_tensors((args, kwargs)) if memo.views else ())
            self.facts.transient[n] = memo.transient
            self._note(n, out, {})
            return out
        track = _Allocations(self.known)
        with self._set_current_node(n), track:
            out = n.target(*args, **kwargs)
        kept = {}
        for k, (ref, b) in track.live.items():
            if not ref.expired():  # held by the value (a started collective's buffers): pinned,
                kept[k] = b        # so that its key is never reused by a later allocation
                self.facts.pins.append(torch.UntypedStorage._new_with_weak_ptr(ref.cdata))
        self.facts.transient[n] = track.peak
        if sig is not None and sig not in self.memo:
            self.memo[sig] = _Memo.of(out, kept, track.peak, _tensors((args, kwargs)))
        self._note(n, out, kept)
        return out

    def _note(self, n, out, kept: dict):
        holds = dict(kept)  # a started collective's buffers are held by its handle, not returned
        for t in _tensors(out):
            key, nbytes = _storage(t)
            if key is not None:
                holds[key] = nbytes
                self.facts.pins.append(t.untyped_storage())
        self.facts.holds[n] = holds
        self.facts.allocs[n] = {k: b for k, b in holds.items() if k not in self.known}
        self.known.update(holds)


def _signature(target, args, kwargs):
    """A hashable key of an aten op's (or a core/calls.pure function's) call on these values, or None
    (another callable, or an argument that is neither a tensor nor a plain value)."""
    if not (isinstance(target, torch._ops.OpOverload) or is_pure(target)):
        return None
    try:
        key = (target, _sig(args), _sig(kwargs))
        hash(key)
    except (_Unkeyed, TypeError):
        return None
    return key


class _Unkeyed(Exception):
    pass


def _sig(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.stride(), v.dtype, v.storage_offset(), v.requires_grad)
    if isinstance(v, (tuple, list)):  # fx's immutable_list among them
        return (type(v), tuple(_sig(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, _sig(x)) for k, x in v.items()))
    t = type(v)
    if v is None or t in (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format):
        return v
    raise _Unkeyed


@dataclass(frozen=True)
class _Memo:
    """How a call's outputs were made: a tensor or a tuple/list of them (or of None), each either
    the only view of a fresh storage of exactly its bytes at offset 0 (what ``torch.empty_strided``
    makes) or a view of one of the call's tensor arguments (a reshape, a transpose: remade with
    ``as_strided`` on that argument, which shares its storage as the view did)."""

    kind: type  # torch.Tensor, tuple or list
    # per output: None where it gave None, (sizes, strides, dtype) where fresh, or ("view",
    # index among the call's tensor arguments, sizes, strides, storage offset)
    outs: tuple
    transient: int
    views: bool  # some output is a view of an argument

    @staticmethod
    def of(out, kept: dict, peak: int, ins: list):
        outs = [out] if isinstance(out, torch.Tensor) else out
        if not isinstance(outs, (list, tuple)) or not all(t is None or isinstance(t, torch.Tensor) for t in outs):
            return None
        of_arg = {}  # storage key -> (index of the first argument holding it, its dtype)
        for i, t in enumerate(ins):
            key, _ = _storage(t)
            if key is not None:
                of_arg.setdefault(key, (i, t.dtype))
        keys, made = [], []
        for t in outs:
            if t is None:
                made.append(None)
                continue
            key, nbytes = _storage(t)
            if key is not None and key in of_arg:
                i, dtype = of_arg[key]
                if t.dtype != dtype:  # a view as another dtype: as_strided would not remake it
                    return None
                made.append(("view", i, tuple(t.shape), t.stride(), t.storage_offset()))
                continue
            if key is None or t.storage_offset() != 0 or nbytes != _span(t.shape, t.stride()) * t.element_size():
                return None
            keys.append(key)
            made.append((tuple(t.shape), t.stride(), t.dtype))
        if len(set(keys)) != len(keys) or set(kept) != set(keys):
            return None
        return _Memo(torch.Tensor if isinstance(out, torch.Tensor) else type(out), tuple(made), peak,
                     any(o is not None and o[0] == "view" for o in made))

    def make(self, ins):
        made = [None if o is None else ins[o[1]].as_strided(o[2], o[3], o[4]) if o[0] == "view"
                else torch.empty_strided(o[0], o[1], dtype=o[2], device=_META) for o in self.outs]
        return made[0] if self.kind is torch.Tensor else self.kind(made)


def _span(size, stride) -> int:
    """Elements a tensor of ``size`` and ``stride`` reaches from its first one (0 when empty)."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _run_fake(gm: fx.GraphModule, mode, args: list, mesh, rank: int, memo: dict | None) -> _Facts:
    """``memo``: calls already made on meta tensors (signature -> _Memo), added to; None on fake tensors."""
    facts = _Facts()
    with mode, using(_ModelCollectives(mesh, rank)), using_generator(None), torch.no_grad():
        _Interpreter(gm, facts, memo).run(*args)
    return facts


class _Started:
    """A started collective of the model: ``wait()`` gives ``value``, dropping ``held`` (the input
    a started reduce_scatter or all_gather keeps alive until then, as the torch backend's)."""

    def __init__(self, value, held=None):
        self.value, self.held = value, held

    def wait(self) -> torch.Tensor:
        self.held = None
        return self.value


class _ModelCollectives:
    """The torch backend's allocations without communication: a fresh result per collective,
    a started all_reduce reduced in the caller's own buffer, a started reduce_scatter or
    all_gather holding its input until waited. It has the methods a program calls on its rank's
    collectives (core/collectives.Collectives'); another one raises AttributeError, and the
    estimate falls back to planned sizes as for any program that cannot run on fake tensors."""

    def __init__(self, mesh, rank: int):
        self.mesh, self.rank, self._coord = mesh, rank, mesh.coord(rank)

    def group_size(self, mesh_dim: int) -> int:
        return self.mesh.shape[mesh_dim]

    def group_index(self, mesh_dim: int) -> int:
        return self._coord[mesh_dim]

    def all_reduce(self, t, mesh_dim, op="sum"):
        return t.clone(memory_format=torch.contiguous_format)

    def start_all_reduce(self, t, mesh_dim, op="sum"):
        return _Started(t)

    def all_gather(self, t, mesh_dim):
        return t.new_empty((self.group_size(mesh_dim), *t.shape))

    def start_all_gather(self, t, mesh_dim):
        out = self.all_gather(t, mesh_dim)
        return _Started(out, held=t)

    def reduce_scatter(self, t, mesh_dim, op="sum"):
        return t.new_empty(t.shape[1:])

    def start_reduce_scatter(self, t, mesh_dim, op="sum"):
        out = self.reduce_scatter(t, mesh_dim, op)
        return _Started(out, held=t)

    def all_to_all(self, t, mesh_dim):
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def send_recv(self, t, mesh_dim, shift=1):
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def barrier(self):
        return None


# -- the analysis -----------------------------------------------------------------------
def _planned_facts(gm: fx.GraphModule, plan, rank: int) -> _Facts:
    """Facts without running the program: each planned value and each collective's result
    its own allocation of its planned local size (no aliasing known, no kernel temporaries)."""
    facts, mesh = _Facts(), plan.mesh
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            lays = [_as_master(plan, n.name, lay) for lay in plan.prop.layouts[n.name][:1]]
        elif "sw_step" in n.meta:
            lays = [n.meta["sw_step"].dst]
        else:
            lays = plan.prop.layouts.get(n.name, ()) if n.op == "call_function" else ()
        nbytes = sum(lay.local_numel(mesh, rank) * lay.itemsize for lay in lays if lay is not None)
        facts.holds[n] = facts.allocs[n] = {("planned", n.name): nbytes} if nbytes else {}
        facts.transient[n] = nbytes
    return facts


def _as_master(plan, name: str, lay):
    """Placeholder ``name``'s layout in its master's dtype (mixed precision: the program's argument)."""
    dtype = master_dtypes(plan).get(name)
    return lay if dtype is None else Layout(lay.shape, dtype, lay.placements)


def _walk(gm: fx.GraphModule, facts: _Facts, plan, rank: int, exact: bool = True) -> MemoryEstimate:
    nodes = list(gm.graph.nodes)
    end = len(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last = {n: max((end if u.op == "output" else pos[u] for u in n.users), default=pos[n]) for n in nodes}
    resident, storages = {}, []
    params = masters = 0
    cast_names = master_dtypes(plan)
    for n in nodes:
        if n.op == "placeholder":
            resident.update(facts.holds.get(n, {}))
            storages += [(n.name, b) for b in facts.holds.get(n, {}).values()]
            if n.name in plan.param_placeholders:
                params += sum(facts.holds.get(n, {}).values())
            if n.name in cast_names:
                masters += sum(facts.holds.get(n, {}).values())
    dies = {}  # storage key -> position of the last read of any value holding it
    for n in nodes:
        for k in facts.holds.get(n, {}):
            if k not in resident:
                dies[k] = max(dies.get(k, -1), last[n])
    size = {k: b for n in nodes for k, b in facts.allocs.get(n, {}).items()}
    free_at: dict = {}
    for k, i in dies.items():
        free_at.setdefault(i, []).append(k)
    base = sum(resident.values())
    live, peak, peak_node, curve, after = base, base, nodes[0].name if nodes else "", [], []
    intervals, temps = [], []
    grads = _gradient_storages(gm, facts, plan)
    for i, n in enumerate(nodes):
        made = [(k, b) for k, b in facts.allocs.get(n, {}).items() if k not in resident]
        intervals += [(i, dies[k], b, k in grads) for k, b in made]
        kept = sum(b for _, b in made)
        if facts.transient.get(n, 0) > kept:
            temps.append((i, facts.transient[n] - kept))
        during = live + max(facts.transient.get(n, 0), kept)
        curve.append((n.name, during))
        if during > peak:
            peak, peak_node = during, n.name
        live += kept
        live -= sum(size.get(k, 0) for k in free_at.get(i, ()))
        after.append(live)
    at = next((i for i, n in enumerate(nodes) if n.name == peak_node), 0)
    copies = sum(b for i, n in enumerate(nodes) if CAST_OF in n.meta and i <= at
                 for k, b in facts.allocs.get(n, {}).items() if dies.get(k, -1) >= at)
    at_peak = sum(b for a, _, b, grad in intervals if grad and a <= at)
    return MemoryEstimate(rank, peak, base, params, sum(grads.values()), peak_node, tuple(curve), exact,
                          tuple(after), _gradient_shares(gm, facts, plan), masters, copies, tuple(intervals),
                          tuple(temps), tuple(storages), tuple(s for s in storages if s[0] in plan.param_placeholders),
                          at_peak)


def _gradient_shares(gm: fx.GraphModule, facts: _Facts, plan) -> dict:
    """{graph output index: bytes} of the gradients, each storage split evenly among the gradients holding it."""
    traced = getattr(plan, "traced", None)
    if traced is None:
        return {}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    grads = {i: facts.holds.get(v, {}) for i, (v, role) in enumerate(zip(vals, traced.outputs))
             if role.kind == "grad" and isinstance(v, fx.Node)}
    holders: dict = {}
    for held in grads.values():
        for k in held:
            holders[k] = holders.get(k, 0) + 1
    return {i: sum(b / holders[k] for k, b in held.items()) for i, held in grads.items()}


def _gradient_storages(gm: fx.GraphModule, facts: _Facts, plan) -> dict:
    """{storage key: bytes} of the gradients among the program's outputs (each storage once)."""
    traced = getattr(plan, "traced", None)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    if traced is None:
        return {}
    seen = {}
    for v, role in zip(vals, traced.outputs):
        if role.kind == "grad" and isinstance(v, fx.Node):
            seen.update(facts.holds.get(v, {}))
    return seen


# -- gathered arguments (FSDP) ----------------------------------------------------------
@dataclass(frozen=True)
class Gathered:
    """One all_gather of a program argument (an FSDP-style parameter) on one rank: the gathered
    value's name, bytes, where it is gathered (launched, if prefetched), first and last read
    (program positions), and the first backward node's position."""

    name: str
    source: str
    bytes: int
    gathered_at: int
    first_read: int
    last_read: int
    backward_at: int

    @property
    def held_into_backward(self) -> bool:
        """Read in forward and kept for backward (FSDP would free it and gather it again)."""
        return self.first_read < self.backward_at <= self.last_read


def gathered_arguments(plan, rank: int = 0) -> list:
    """Every all_gather of a program argument in ``plan``'s program on ``rank`` with its
    lifetime (see Gathered): a gathered parameter that FSDP frees after forward and gathers
    again for backward shows ``held_into_backward`` False."""
    gm = plan.program_module(rank, guards=False)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    backward_at = backward_start(plan, nodes)
    out = []
    for n in nodes:
        if n.op != "call_function" or n.target not in (comm.all_gather, prefetched):
            continue
        src, launch = (n.args[0], n) if n.target is comm.all_gather else gathered_source(n)
        src = program_argument(src)
        if src is None:
            continue
        lay = plan.prop.layouts[src.name][0]
        reads = [len(nodes) if u.op == "output" else pos[u] for u in n.users] or [pos[n]]
        dim, sizes = n.args[-2], n.args[-1]
        shape = list(lay.local_shape(plan.mesh, rank))
        shape[dim] = sum(sizes)
        start = pos[launch]
        out.append(Gathered(n.name, src.name, math.prod(shape) * lay.itemsize, start, min(reads), max(reads),
                            backward_at))
    return out


def backward_start(plan, nodes: list) -> int:
    """Position of the program's first backward node (traced with ``autograd_backward``
    metadata; planned nodes keep their names in the program); len(nodes) if none."""
    back = {n.name for n in plan.prop.gm.graph.nodes if n.meta.get("autograd_backward")}
    return next((i for i, n in enumerate(nodes) if n.name in back), len(nodes))
