"""The plain run of a per-rank program: its fx graph as tight Python with fast callables.

A program's fx code calls every aten op through its ``OpOverload`` (``torch.ops.aten.add.Tensor``):
a Python frame, and arguments matched against the schema by the JIT's boxed path. The same
kernels are reached faster through torch's generated Python bindings (``torch.add``,
``Tensor.reshape``), whose argument parser resolves an overload itself, and a
``torch.library.custom_op`` (attention, index) through its Python function. ``Replay`` runs the
program once as an interpreter (its calibration run: the program's own calls give the results),
and for each aten call tries the bindings of the same name on the same arguments under a
recording dispatch mode: a binding is kept only when it reaches the very aten ops the overload
does (the same calls below autograd, the same output shapes, strides and values), else the
overload's C++ callable (``OpOverload._op``) is used. Random ops are never called twice (their
draws would move the rank's generator): they keep their overload.

It also leaves out work whose result cannot change from step to step:

- ``detach`` and ``alias`` (the program runs under no_grad: the tensor itself will do);
- values that depend on no program argument (causal masks, position ids: aten ops of constants),
  computed once by the calibration run and kept (at most ``FOLD_BYTES`` per program; only
  values read by functional aten ops, which neither write into nor return views of them).

Exactness: every remaining call runs the kernel the program's overload runs, on the same
arguments, in the same order; collectives and a rule's own local calls are called as they are.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.calls import is_pure

FOLD_BYTES = 1 << 20  # constants kept across steps, per program (a long sequence's mask stays per step)
_IDENTITY = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_BINDINGS = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft)


class _Record(TorchDispatchMode):
    """The aten calls that reach the Python dispatch key (below autograd and decompositions)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _flat(x) -> list:
    return [y for v in x for y in _flat(v)] if isinstance(x, (tuple, list)) else [x]


def _same(a, b) -> bool:
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
        elif (x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype or x.device != y.device
              or x.storage_offset() != y.storage_offset() or not torch.equal(x, y)):
            return False
    return True


def _random(op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def _functional(op) -> bool:
    """An op that neither writes into its arguments nor returns a view of them."""
    s = op._schema
    return not s.is_mutable and all(r.alias_info is None for r in s.returns)


def _candidates(op):
    """Python bindings of ``op``'s name: torch.<name> and friends, then the Tensor method."""
    name = op._schema.name.split("::", 1)[1]
    out = [getattr(m, name) for m in _BINDINGS if hasattr(m, name)]
    if hasattr(torch._C.TensorBase, name):
        out.append(getattr(torch._C.TensorBase, name))
    return out


def _python_kernel(op):
    """The Python function of a ``torch.library.custom_op`` with one kernel for every device
    and nothing else registered below autograd (shardwise's attention and index ops): what the
    dispatcher would end up calling, without its autograd and redispatch frames (no grad here)."""
    from torch._library.custom_ops import OPDEFS

    d = OPDEFS.get(op._schema.name)
    if d is None or op._overloadname != "default" or set(d._backend_fns) != {None} or d._torch_dispatch_fns:
        return None
    return d._init_fn


def fast_callable(op, args, kwargs):
    """(result of ``op(*args, **kwargs)``, the fastest callable that runs the same kernels on
    arguments like these)."""
    rec = _Record()
    with rec:
        want = op(*args, **kwargs)
    if _random(op):
        return want, op._op
    if op.namespace != "aten":
        fn = _python_kernel(op)
        return want, (fn if fn is not None and _same(fn(*args, **kwargs), want) else op._op)
    for fn in _candidates(op):
        rec_b = _Record()
        try:
            with rec_b:
                got = fn(*args, **kwargs)
        except (TypeError, RuntimeError):
            continue
        if rec_b.calls == rec.calls and _same(got, want):
            return want, fn
    return want, op._op


class Replay:
    """``program`` (an unguarded per-rank fx.GraphModule) run as generated Python (see the module
    docstring); called like it. Rebuilt when the program is recompiled (its ``code`` changes).
    ``code`` is the generated source, ``node_of(exc)`` the node a failure was raised at."""

    def __init__(self, program: fx.GraphModule):
        self.program = program
        self.graph = program.graph
        self._built_from = None  # the program's code the replay was generated from
        self._fn = None
        self.code = program.code
        self.folded: dict = {}  # node name -> value kept across steps
        self._failed_at = None  # (exception, node) of a failed calibration run

    def __call__(self, *args):
        if self._built_from is self.program.code:
            return self._fn(*args)
        return self._calibrate(args)

    # -- the calibration run ----------------------------------------------------------------
    def _calibrate(self, args):
        nodes = list(self.graph.nodes)
        env, fns, const = {}, {}, set()
        ai = iter(args)
        out = None
        for n in nodes:
            try:
                if n.op == "placeholder":
                    env[n.name] = next(ai)
                elif n.op == "get_attr":
                    env[n.name] = getattr(self.program, n.target)
                    const.add(n.name)
                elif n.op == "call_function":
                    env[n.name], fns[n.name] = self._run_node(n, env)
                    if self._foldable(n, const):
                        const.add(n.name)
                elif n.op == "output":
                    out = fx.node.map_arg(n.args[0], lambda a: env[a.name])
            except BaseException as e:
                self._failed_at = (e, n.name)
                raise
        self.folded, const = self._fold(nodes, const, env)
        self._generate(nodes, fns, const, {n.name: env[n.name] for n in nodes if n.op == "get_attr"})
        self._built_from = self.program.code
        return out

    @staticmethod
    def _run_node(n: fx.Node, env: dict):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a.name])
        t = n.target
        if isinstance(t, torch._ops.OpOverload):
            if t in _IDENTITY and not torch.is_grad_enabled():
                return args[0], None  # the tensor itself (see the module docstring)
            return fast_callable(t, args, kwargs)
        return t(*args, **kwargs), t

    @staticmethod
    def _foldable(n: fx.Node, const: set) -> bool:
        t = n.target
        if not all(a.name in const for a in n.all_input_nodes):
            return False
        if t is operator.getitem or is_pure(t):
            return True
        return isinstance(t, torch._ops.OpOverload) and not _random(t) and not t._schema.is_mutable

    @staticmethod
    def _fold(nodes: list, const: set, env: dict) -> tuple[dict, set]:
        """(the constants to keep: those read by any non-constant consumer, the nodes computed
        once), provided every such consumer is a functional aten op: nothing writes into,
        aliases or returns a kept value."""
        output = nodes[-1]
        changed = True
        while changed:
            changed = False
            for n in nodes:
                if n.name not in const:
                    continue
                users = [u for u in n.users if u.name not in const]
                if (n in output.all_input_nodes or any(
                        u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload)
                        or not _functional(u.target) for u in users)):
                    const.discard(n.name)
                    changed = True
        kept = {n.name: env[n.name] for n in nodes if n.name in const and any(u.name not in const for u in n.users)}
        size = sum(t.numel() * t.element_size() for v in kept.values() for t in _flat(v) if isinstance(t, torch.Tensor))
        if size > FOLD_BYTES:
            return {}, set()
        return kept, const

    # -- code generation ----------------------------------------------------------------------
    def _generate(self, nodes: list, fns: dict, const: set, attrs: dict):
        """Compile the replay function: one line per call not folded, each value dropped after its
        last read (as fx's code does); folded values and get_attr tensors are its globals."""
        glob: dict = {**attrs, **self.folded}
        const = const | set(attrs)
        names: dict = {}

        def name_of(obj, hint: str) -> str:
            key = id(obj)
            if key not in names:
                base = "_sw_" + "".join(c if c.isalnum() else "_" for c in hint)
                names[key] = f"{base}_{len(names)}"
                glob[names[key]] = obj
            return names[key]

        def render(a) -> str:
            if isinstance(a, fx.Node):
                return a.name
            if isinstance(a, (list, tuple)):
                inner = ", ".join(render(x) for x in a)
                return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
            if a is None or isinstance(a, (bool, int, str)) or (isinstance(a, float) and math.isfinite(a)):
                return repr(a)
            return name_of(a, "c")

        params = [n.name for n in nodes if n.op == "placeholder"]
        body: list[tuple[str, list]] = []  # (line, names read)
        for n in nodes:
            if n.op != "call_function" or n.name in const:
                continue
            reads = [a.name for a in n.all_input_nodes if a.name not in const]
            if n.target is operator.getitem:
                line = f"{n.name} = {render(n.args[0])}[{render(n.args[1])}]"
            elif fns[n.name] is None:
                line = f"{n.name} = {render(n.args[0])}"
            else:
                fn = fns[n.name]
                hint = str(n.target).replace("aten.", "") if isinstance(n.target, torch._ops.OpOverload) else getattr(
                    fn, "__name__", "fn")
                parts = [render(a) for a in n.args] + [f"{k}={render(v)}" for k, v in n.kwargs.items()]
                line = f"{n.name} = {name_of(fn, hint)}({', '.join(parts)})"
            body.append((line, reads))
        ret = render(nodes[-1].args[0])
        body.append((f"return {ret}", [a.name for a in nodes[-1].all_input_nodes if a.name not in const]))
        last: dict = {}
        for i, (_, reads) in enumerate(body):
            for r in reads:
                last[r] = i
        lines = [f"def replay({', '.join(params)}):"]
        for i, (line, reads) in enumerate(body):
            dead = sorted({r for r in reads if last[r] == i})
            tail = f";  {' = '.join(dead)} = None" if dead and not line.startswith("return") else ""
            lines.append(f"    {line}{tail}")
        src = "\n".join(lines) + "\n"
        scope: dict = {}
        exec(compile(src, f"<shardwise replay of {self.program.__class__.__name__}>", "exec"), glob, scope)
        self._fn, self.code = scope["replay"], src

    # -- failures --------------------------------------------------------------------------
    def node_of(self, exc: BaseException) -> str | None:
        """The node ``exc`` was raised at (by the calibration run, or a line of the generated code)."""
        if self._failed_at is not None and self._failed_at[0] is exc:
            return self._failed_at[1]
        if self._fn is None:
            return None
        code, lineno, tb = self._fn.__code__, None, exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                lineno = tb.tb_lineno
            tb = tb.tb_next
        lines = self.code.splitlines()
        if lineno is None or not 0 < lineno <= len(lines):
            return None
        head = lines[lineno - 1].strip().split(" = ", 1)[0]
        return head if head.isidentifier() else None
