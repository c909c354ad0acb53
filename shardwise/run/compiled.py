"""``compile=True``: each rank's program runs through torch.compile (inductor, fullgraph).

The program is the same fx GraphModule ``plan.program(rank)`` prints; compile is how it runs.
Its collectives (lower/comm.py's calls, the bucket launches and waits of lower/buckets.py, the
prefetched gathers of lower/prefetch.py, and an all_reduce a rule's local call runs itself, as
nll_loss's total weight) all reach the rank's collectives through ``shardwise.core.scope.current()``;
while a compiled program runs, that is a :class:`FuncolCollectives`: torch's functional
collectives (``torch.ops._c10d_functional``) on the torch backend's process groups, each
``start_*`` an async op whose ``wait()`` is ``wait_tensor``, so dynamo traces the whole program
as one graph and buckets and prefetches stay asynchronous. Padding and narrowing of uneven
shards are the program's own local ops, traced like the rest.

Compiled once per (plan, rank) on its first call (run/execute.Executable.program) (``first_call_s``: that call's CPU seconds,
gcc's included); with ``debug`` the plan's first run on a rank is the eager program with its shape
guards, as without compile. Functional collectives wait without shardwise's timeouts
(run/distributed.py): a rank that never arrives is torch's process-group timeout's.
Random ops (dropout) draw as in eager: the rank's generator (one device's stream) is made the
default generator around the compiled call, whose random ops inductor leaves as the eager aten
kernels (``fallback_random``), so masks equal one device's. Ops whose local call runs a
collective other than an all_reduce (ring attention's send/recvs, MoE dispatch's uneven
all_to_alls, halo exchanges) are refused at planning (execute.check_compilable), naming the node and op.
The threads backend has no compiled form: parallelize refuses ``compile=True`` there.
shardwise's custom ops are handed to dynamo as their plain functions (``inline_custom_ops``):
attention calls on the whole-call fast path and the aligned index ops become aten's kernels in
inductor's code, with no Python frame per call (the tiny GPT-2's compiled step: 2.1 -> 1.15 ms of
CPU on one process); other attention calls stay the op.
"""
from __future__ import annotations

import os
import weakref
from contextlib import contextmanager

import torch

from ..core.errors import ConfigError
from .collectives import Collectives, current, rank_generator, using, using_generator
from .distributed import _GLOO_OK, movable

# Collective kinds a rule's local call may run itself under compile (traced through current()).
INNER_KINDS = ("all_reduce",)
_c10d = torch.ops._c10d_functional


def check_compile(compile, backend) -> bool:
    """parallelize's ``compile``: a bool; True needs the torch backend (a ConfigError says so)."""
    if not isinstance(compile, bool):
        raise ConfigError(f"compile must be True or False, got {compile!r}",
                          fix="compile=True runs each rank's program through torch.compile (backend='torch')")
    name = backend if isinstance(backend, str) else getattr(backend, "name", type(backend).__name__)
    if compile and name != "torch":
        raise ConfigError(f"compile=True needs backend='torch', got backend={name!r}: the threads backend runs "
                          "every rank as a thread of this process, which torch.compile cannot trace",
                          fix="pass backend='torch' (one process per rank: torchrun, `shardwise run`), or "
                              "compile=False")
    return compile


class CompiledProgram:
    """A per-rank program (``program``, an fx GraphModule) run through torch.compile; called like it."""

    def __init__(self, program: torch.fx.GraphModule, rank: int):
        self.program, self.rank = program, rank
        self.code, self.graph = program.code, program.graph
        self.first_call_s: float | None = None  # CPU seconds of the first call (compile, gcc's included)
        self.inlined = 0  # custom-op calls handed to dynamo as their plain calls (inline_custom_ops)
        compiled, self.inlined = inline_custom_ops(program)
        # fallback_random: random ops run as the eager aten kernels on the default generator (not
        # inductor's own RNG), so a draw is the one eager would make from the same state
        self._fn = torch.compile(compiled, backend="inductor", fullgraph=True, dynamic=False,
                                 options={"fallback_random": True})

    def __call__(self, *args):
        fc = FuncolCollectives.of(current())
        if self.first_call_s is not None:
            with using(fc, process_wide=True), _drawing_from_default():
                return self._fn(*args)
        t0 = _cpu_seconds()
        try:
            with using(fc, process_wide=True), _drawing_from_default():
                out = self._fn(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            raise ConfigError(f"compile=True: torch.compile could not compile rank {self.rank}'s program: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
                              fix="pass compile=False (the same program, run op by op), and report the op") from e
        self.first_call_s = _cpu_seconds() - t0
        return out


def inline_custom_ops(program: torch.fx.GraphModule) -> tuple:
    """(a copy of ``program`` to compile, how many calls it changed): shardwise's custom-op calls
    go through their plain functions (ops/attention/op.attention_or_op, attention_backward_or_op;
    trace/index_rows.index_rows), which dynamo traces: an attention call on the whole-call fast path
    (fused.whole_call_scale, decided on the traced values: the run's shapes, strides and dtypes
    under dynamic=False) becomes aten's kernel call and index_aligned aten.index, which inductor
    runs without a Python frame; any other attention call (ring or Ulysses pieces, score mods)
    stays the op. The same calls on the same values as the ops' own bodies, so the same numbers.
    ``program`` itself is unchanged (the eager program shares it)."""
    from ..ops.attention.op import attention_backward_or_op, attention_or_op
    from ..trace.index_rows import index_rows

    ops = torch.ops.shardwise
    plain = {ops.attention.default: attention_or_op, ops.attention_backward.default: attention_backward_or_op,
             ops.index_aligned.default: index_rows}
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    changed = 0
    for n in graph.nodes:
        if n.op == "call_function" and n.target in plain:
            n.target = plain[n.target]
            changed += 1
    return torch.fx.GraphModule(program, graph), changed


@contextmanager
def _drawing_from_default():
    """The rank's generator (scope.rank_generator(): one device's stream) as the process's default
    generator for the duration: the compiled program's random ops draw from the default one
    (dynamo takes no Generator argument), and the rank's generator takes the advanced state back."""
    gen = rank_generator()
    if gen is None:
        yield
        return
    saved = torch.random.get_rng_state()
    torch.random.set_rng_state(gen.get_state())
    try:
        with using_generator(None, process_wide=True):
            yield
    finally:
        gen.set_state(torch.random.get_rng_state())
        torch.random.set_rng_state(saved)


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (inductor's gcc runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _Pending:
    """A launched functional collective: ``wait()`` is ``wait_tensor`` and then ``then``; with
    ``launched=False`` (a one-member group: nothing was sent) ``t`` is the result as it is, since
    inductor cannot lower ``wait_tensor`` of a tensor no collective made."""

    def __init__(self, t: torch.Tensor, then=None, launched: bool = True):
        self.t, self.then, self.launched = t, then, launched

    def wait(self) -> torch.Tensor:
        got = _c10d.wait_tensor(self.t) if self.launched else self.t
        return got if self.then is None else self.then(got)


_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # TorchCollectives -> its functional twin


class FuncolCollectives(Collectives):
    """The torch backend's collectives (``base``: run/distributed.TorchCollectives, whose process
    groups per mesh dim it uses by name) as torch's functional collectives, traceable by dynamo."""

    def __init__(self, base):
        super().__init__(base.mesh, base.rank)
        self.base = base

    @classmethod
    def of(cls, comm) -> "FuncolCollectives":
        """The functional twin of ``comm`` (one per TorchCollectives: dynamo guards on its identity)."""
        if isinstance(comm, FuncolCollectives):
            return comm
        if not hasattr(comm, "_groups"):
            raise ConfigError(f"compile=True runs on the torch backend's collectives, not {type(comm).__name__}",
                              fix="pass backend='torch', or compile=False")
        twin = _TWINS.get(comm)
        if twin is None:
            twin = _TWINS[comm] = cls(comm)
        return twin

    def group_size(self, mesh_dim) -> int:
        return self.base.group_size(mesh_dim)

    def group_index(self, mesh_dim) -> int:
        return self.base.group_index(mesh_dim)

    def _name(self, mesh_dim):
        """(process group name or None for a one-member group, group size)."""
        _, pg, ranks = self.base._group(mesh_dim)
        return (None if pg is None else pg.group_name), len(ranks)

    def start_all_reduce(self, t, mesh_dim, op="sum"):
        name, _ = self._name(mesh_dim)
        if name is None:
            return _Pending(t, launched=False)
        t = t.contiguous()
        if t.dtype in _GLOO_OK:
            return _Pending(_c10d.all_reduce(t, op, name))
        wide = torch.float32 if t.is_floating_point() else torch.int64
        return _Pending(_c10d.all_reduce(t.to(wide), op, name), lambda got: got.to(t.dtype))

    def all_reduce(self, t, mesh_dim, op="sum"):
        return self.start_all_reduce(t, mesh_dim, op).wait()

    def start_reduce_scatter(self, t, mesh_dim, op="sum"):
        name, n = self._name(mesh_dim)
        self.check_stacked(t, mesh_dim, n, "reduce_scatter")
        if name is None:
            return _Pending(t[0], launched=False)
        shape = t.shape[1:]
        flat = t.contiguous().view(-1)
        back = None
        if t.dtype not in _GLOO_OK:
            back, flat = t.dtype, flat.to(torch.float32 if t.is_floating_point() else torch.int64)
        return _Pending(_c10d.reduce_scatter_tensor(flat, op, n, name),
                        lambda got: (got if back is None else got.to(back)).view(shape))

    def reduce_scatter(self, t, mesh_dim, op="sum"):
        return self.start_reduce_scatter(t, mesh_dim, op).wait()

    def start_all_gather(self, t, mesh_dim):
        name, n = self._name(mesh_dim)
        if name is None:
            return _Pending(t.unsqueeze(0), launched=False)
        buf, back = movable(t)
        return _Pending(_c10d.all_gather_into_tensor(buf.reshape(-1), n, name),
                        lambda got: _back(got.view(n, *buf.shape), back))

    def all_gather(self, t, mesh_dim):
        return self.start_all_gather(t, mesh_dim).wait()

    def all_to_all(self, t, mesh_dim):
        name, n = self._name(mesh_dim)
        self.check_stacked(t, mesh_dim, n, "all_to_all")
        if name is None:
            return t
        buf, back = movable(t)
        split = [buf[0].numel()] * n
        got = _c10d.wait_tensor(_c10d.all_to_all_single(buf.reshape(-1), split, split, name))
        return _back(got.view(buf.shape), back)

    def send_recv(self, t, mesh_dim, shift=1):
        raise ConfigError("compile=True: send_recv (a ring shift inside an op's local call) is not compiled",
                          fix="pass compile=False")

    def barrier(self):
        raise ConfigError("compile=True: no barrier inside a compiled program", fix="pass compile=False")


def _back(t: torch.Tensor, dtype):
    return t if dtype is None else t.view(dtype)
