"""Values the model reads from its inputs while traced, and the guards that re-check them each call.

A model may read a Python value from tensor data in forward only to check its inputs, as Hugging
Face's ``if labels.max() >= vocab_size: raise ValueError(...)`` does. On the trace's fake tensors
that read (``aten._local_scalar_dense``, what ``bool(t)``, ``t.item()`` and ``if t:`` become) has
no data. Where the value is computed from the step's inputs and targets alone (no parameter,
buffer or random draw among its ancestors), the trace holds the real example values
(``Arguments``): the read is answered by running the graph traced so far up to that value on the
real example inputs, and a ``ValueGuard`` keeps that subgraph and the value it gave. Each call runs
the guards on its real, full inputs before any program runs (``ValueGuards.check``); a value that
differs means the model would take another path than the traced one: the model's forward is traced
again with this call's values (fake tensors, nothing computed), so a check that raises raises the
model's own error, as one device does; a model that takes another path without raising gets a
``ValueGuardError`` (parallelize again with inputs like these). A value read from parameters,
buffers or activations stays refused (trace/errors.py).
"""
from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot

from ..core.errors import ShardingError
from .ctc import CTC, ctc_fake
from .errors import user_line

READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
EQUAL = torch.ops.aten.equal.default  # torch.equal(a, b): a Python bool from two tensors (torch.cov's C++ reads one)
GUARDS_META = "sw_value_guards"  # GraphModule.meta key of a trace's ValueGuards


class ValueGuardError(ShardingError):
    """A value the traced step read from its inputs differs in this call, and the model does not raise."""


@dataclass(frozen=True)
class ValueGuard:
    """One value read while tracing: ``program`` computes it from the data arguments at ``indices``
    (positions among the call's input and target tensors, in the trace's flat order; none where it
    depends on constants only); ``value``: what the example gave; ``source``: the model's line that
    read it; ``equal``: the read is torch.equal of the program's two outputs (else ``.item()``)."""

    program: fx.GraphModule
    indices: tuple
    value: object
    source: str | None
    equal: bool = False

    def evaluate(self, data: list):
        with torch.no_grad():
            out = self.program(*[data[i] for i in self.indices])
        return torch.equal(*out) if self.equal else out.item()


@dataclass
class ValueGuards:
    """The guards of one trace, and ``replay(data)``: the model's forward traced again with ``data``'s
    values read (raises the model's own error where it checks them)."""

    guards: list = field(default_factory=list)
    replay: Callable | None = None

    def __bool__(self) -> bool:
        return bool(self.guards)

    def check(self, data: list) -> None:
        """Run every guard on a call's real input and target tensors (``data``, flat, full)."""
        for g in self.guards:
            now = g.evaluate(data)
            if now != g.value:
                self._failed(g, now, data)

    def _failed(self, guard: ValueGuard, now, data: list) -> None:
        if self.replay is not None:
            self.replay(data)  # the model's own error, where its forward raises on these values
        where = f" at {guard.source}" if guard.source else ""
        raise ValueGuardError(
            f"the model read the value {guard.value!r} from its inputs while traced{where}; this call's inputs give "
            f"{now!r}, so the model would take another path than the planned one",
            fix="parallelize again with example inputs like these, or compute the branch with torch.where")


def guards_of(gm: fx.GraphModule) -> ValueGuards:
    """The ValueGuards a capture recorded on ``gm`` (none where it read no value)."""
    return gm.meta.get(GUARDS_META) or ValueGuards()


def data_of(args, inputs: tuple, kwargs: dict | None, targets: tuple) -> list:
    """A call's input and target tensors, flat in the trace's order (``Arguments``)."""
    from .roles import flatten

    return flatten((tuple(inputs), dict(kwargs or {}))).tensors + flatten(tuple(targets)).tensors


class ValueFakeMode(FakeTensorMode):
    """The trace's fake mode: CTC losses at fixed shapes (trace/ctc.py), and a value read (``_local_scalar_dense``) goes to ``reader`` first, which
    answers it from the real example inputs or returns None (then the fake mode refuses it as usual)."""

    def __init__(self, data: list | None = None, **kwargs):
        super().__init__(**kwargs)
        self.data = data  # the real input and target tensors, flat; None: no value is read
        self.reader: ValueReader | None = None

    def dispatch(self, func, types, args=(), kwargs=None):
        if func in CTC:  # (its log_alpha at the widest the targets allow, trace/ctc.py)
            out = ctc_fake(self, args)
            if out is not None:
                return out
        if (func in READS or func is EQUAL) and self.reader is not None:
            value = self.reader.read(args[:2] if func is EQUAL else args[:1])
            if value is not None:
                return value
        return super().dispatch(func, types, args, kwargs)


class ValueReader:
    """Answers value reads of one make_fx trace (``tracer``: its proxy tracer, taken when the traced
    function starts) from ``data``, recording a ValueGuard per read in ``guards``."""

    def __init__(self, data: list, guards: list):
        self.data, self.guards = data, guards
        self._local = threading.local()

    def start(self) -> None:
        """Called first thing in the traced function (the proxy mode is the innermost mode then)."""
        mode = get_proxy_mode()
        self._local.tracer = None if mode is None else mode.tracer

    def read(self, tensors: tuple):
        """The value of ``tensors[0].item()`` (one tensor) or ``torch.equal(*tensors)`` (two)."""
        tracer = getattr(self._local, "tracer", None)
        if tracer is None:
            return None
        slots = [get_proxy_slot(t, tracer, None) for t in tensors]
        if any(s is None for s in slots):
            return None
        program, indices = _subgraph([s.proxy.node for s in slots], tracer, len(self.data))
        if program is None or any(self.data[i].device.type == "meta" for i in indices):
            return None  # (meta examples, as inputs="local" traces with, hold no values either)
        equal = len(tensors) == 2
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            value = ValueGuard(program, indices, None, None, equal).evaluate(self.data)
        self.guards.append(ValueGuard(program, indices, value, user_line(traceback.extract_stack()), equal))
        return value


def _subgraph(nodes: list, tracer, n_data: int):
    """(a GraphModule computing ``nodes`` (one: its value; more: a tuple) from data placeholders, their
    data indices), or (None, ()) where they depend on a parameter or buffer, or on a random draw."""
    graph = nodes[0].graph
    places = list(graph.find_nodes(op="placeholder"))
    first_data = len(places) - n_data
    index = {p: i - first_data for i, p in enumerate(places)}
    needed, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "placeholder" and index[n] < 0:
            return None, ()
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and (
                torch.Tag.nondeterministic_seeded in n.target.tags):
            return None, ()
        stack.extend(n.all_input_nodes)
    sub, env = fx.Graph(), {}
    for n in graph.nodes:
        if n in needed:
            env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(env[nodes[0]] if len(nodes) == 1 else tuple(env[n] for n in nodes))
    used = [n for n in graph.nodes if n in needed and n.op == "placeholder"]
    return fx.GraphModule(tracer.root, sub), tuple(index[p] for p in used)


def erase_reads(gm: fx.GraphModule) -> None:
    """The answered reads leave the graph: nothing uses their nodes (the value went to Python)."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and (n.target in READS or n.target is EQUAL) and not n.users:
            gm.graph.erase_node(n)


def check_call(gm: fx.GraphModule, args, inputs: tuple, targets: tuple, kwargs: dict | None = None,
               local: bool = False) -> None:
    """Before a call of a traced ``gm`` (``args``: its Arguments) runs: its value guards on the call's
    full inputs. ``local``: each rank holds only its pieces (inputs="local"), which cannot answer a
    value of the whole input: refused where there are guards."""
    guards = guards_of(gm)
    if not guards:
        return
    if local:
        raise ValueGuardError(
            f"the model reads a value from its inputs ({guards.guards[0].source}), which needs the full inputs; "
            "with inputs='local' each rank holds only its pieces",
            fix="pass inputs='global', or move the check on the inputs out of the model's forward")
    guards.check(data_of(args, inputs, kwargs, targets))
