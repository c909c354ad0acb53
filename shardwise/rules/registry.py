"""Rule format and registry.

A rule is data about one aten op: from typed node metadata (an ``OpCall``) it returns the
strategies it supports on ONE mesh dim (``Strategy1D``: a placement per tensor output and
per tensor input), and, for a chosen n-d strategy and a rank, the local call (which
function, which rank-local non-tensor args). Expansion to an n-d mesh is mechanical: the
product of single-dim strategies over mesh dims.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree

from ..errors import RuleError, UnsupportedOpError
from ..layout import Layout, Partial, Replicate, Shard
from ..mesh import Mesh

R = Replicate()


@dataclass(frozen=True)
class TensorMeta:
    """What a rule may know about a tensor: its global shape and dtype."""

    shape: tuple
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def of(t) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in t.shape), t.dtype)

    def __repr__(self) -> str:
        return f"T{list(self.shape)}:{str(self.dtype).replace('torch.', '')}"


def _is_tensor(x) -> bool:
    return isinstance(x, (TensorMeta, torch.Tensor))


@dataclass(frozen=True)
class OpCall:
    """One node: the op, its args with tensors as TensorMeta, and its (flattened) tensor outputs."""

    op: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outs: tuple = ()  # TensorMeta or None per flattened output

    @cached_property
    def ins(self) -> list[TensorMeta]:
        """Tensor inputs in pytree order of (args, kwargs) (computed once: the planner asks per
        strategy and rank)."""
        return [x for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, TensorMeta)]

    @property
    def out(self) -> TensorMeta:
        return self.outs[0]

    def arg(self, i: int, name: str, default=None):
        """Positional-or-keyword arg ``i`` / ``name`` with its schema default."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    @staticmethod
    def from_values(op, args, kwargs, out) -> "OpCall":
        """Build from real or fake tensors (the tracer and the verifier both use this)."""
        conv = lambda x: TensorMeta.of(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        args, kwargs = pytree.tree_map(conv, (tuple(args), dict(kwargs)))
        outs = tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in flatten_outputs(out))
        return OpCall(op, args, kwargs, outs)


def flatten_outputs(out) -> list:
    if isinstance(out, (tuple, list)):
        return [o for x in out for o in flatten_outputs(x)]
    return [out]


@dataclass(frozen=True)
class Strategy1D:
    """Placements on one mesh dim: one per flattened output (None: not a tensor) and per tensor input.

    ``tag`` names a family of strategies (e.g. "ring") so a planner option can select them.
    """

    outs: tuple
    ins: tuple
    tag: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return f"{list(self.ins)} -> {list(self.outs)}"


@dataclass(frozen=True)
class Strategy:
    """Placements on the whole mesh: per output / input, a tuple with one placement per mesh dim."""

    outs: tuple
    ins: tuple
    tags: tuple = field(default=(), compare=False)  # the Strategy1D tag chosen on each mesh dim

    def in_layouts(self, call: OpCall) -> list[Layout]:
        return [Layout(t.shape, t.dtype, p) for t, p in zip(call.ins, self.ins, strict=True)]

    def out_layouts(self, call: OpCall) -> list[Layout | None]:
        return [None if t is None else Layout(t.shape, t.dtype, p) for t, p in zip(call.outs, self.outs, strict=True)]

    def __repr__(self) -> str:
        fmt = lambda ps: "None" if ps is None else "[" + ", ".join(map(repr, ps)) + "]"  # noqa: E731
        return f"({', '.join(fmt(p) for p in self.ins)}) -> ({', '.join(fmt(p) for p in self.outs)})"


@dataclass
class LocalCtx:
    """Everything a rule's local-args function may use: the call, the chosen strategy, mesh, rank."""

    call: OpCall
    strategy: Strategy
    mesh: Mesh
    rank: int
    layouts: tuple | None = field(default=None, repr=False, compare=False)  # (ins, outs), built once

    def _layouts(self) -> tuple:
        if self.layouts is None:
            self.layouts = (self.strategy.in_layouts(self.call), self.strategy.out_layouts(self.call))
        return self.layouts

    def in_layout(self, i: int) -> Layout:
        return self._layouts()[0][i]

    def out_layout(self, i: int = 0) -> Layout:
        return self._layouts()[1][i]

    def local_out_shape(self, i: int = 0) -> list[int]:
        return list(self.out_layout(i).local_shape(self.mesh, self.rank))

    def local_in_shape(self, i: int) -> list[int]:
        return list(self.in_layout(i).local_shape(self.mesh, self.rank))

    def in_offset(self, i: int, dim: int | None = None):
        """Where this rank's chunk of input ``i`` starts: per dim, or along ``dim`` only (a dim
        split in groups has no start, so asking for it raises)."""
        return self.in_layout(i).local_offset(self.mesh, self.rank, dim)

    def out_offset(self, i: int = 0, dim: int | None = None):
        return self.out_layout(i).local_offset(self.mesh, self.rank, dim)

    def partial_group_index(self, out: int = 0) -> tuple[int, ...]:
        """Coordinates on the mesh dims where output ``out`` is Partial (0 == 'the holder')."""
        c = self.mesh.coord(self.rank)
        return tuple(c[m] for m, p in enumerate(self.strategy.outs[out]) if isinstance(p, Partial))


@dataclass(frozen=True)
class LocalCall:
    """What a rank runs for a node: ``fn(*args, **kwargs)`` with TensorMeta leaves standing for local tensors."""

    fn: Callable
    args: tuple
    kwargs: dict


LocalFn = Callable[[LocalCtx], LocalCall]


@dataclass(frozen=True)
class Rule:
    op: Any
    strategies: Callable[[OpCall], list[Strategy1D]]
    local: LocalFn | None = None  # None: the op itself, args unchanged
    shape_sensitive: bool = False  # check local output shapes when expanding (views, reshapes)
    name: str = ""
    valid: Callable | None = None  # (call, Strategy, mesh) -> bool: n-d combinations the rule refuses
    blockwise: bool = False  # right for any chunk boundaries, so restatable with unit or grouped shards (with_block)
    # (call, Strategy, mesh) -> RedistSteps the local call runs itself (a halo exchange, a statistics
    # all-reduce): the plan counts and prices them with the edges' (Plan.edges)
    comm: Callable | None = None

    def local_call(self, ctx: LocalCtx) -> LocalCall:
        if self.local is None:
            return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
        return self.local(ctx)


class Registry:
    """An explicit op -> Rule table handed to the planner (no global monkey-patching)."""

    def __init__(self, rules: Iterable[Rule] = ()):
        self._rules: dict[Any, Rule] = {}
        for r in rules:
            self.add(r)

    def add(self, rule: Rule) -> Rule:
        self._rules[rule.op] = rule
        return rule

    def register(self, ops, strategies=None, *, local=None, shape_sensitive=False, valid=None, comm=None):
        """``registry.register(op, fn)`` or as a decorator ``@registry.register(op)``; ops may be a list."""
        ops = list(ops) if isinstance(ops, (list, tuple)) else [ops]

        def deco(fn):
            for op in ops:
                self.add(Rule(op, fn, local, shape_sensitive, getattr(fn, "__name__", ""), valid, comm=comm))
            return fn

        return deco if strategies is None else deco(strategies)

    def get(self, op, node: str | None = None, source: str | None = None) -> Rule:
        r = self._rules.get(op)
        if r is None:
            raise UnsupportedOpError(op, node=node, source=source)
        return r

    def __contains__(self, op) -> bool:
        return op in self._rules

    def ops(self) -> frozenset:
        return frozenset(self._rules)

    def copy(self) -> "Registry":
        return Registry(self._rules.values())


DEFAULT = Registry()


def rule(ops, *, local: LocalFn | None = None, shape_sensitive: bool = False, registry: Registry | None = None):
    """Register a user rule: ``@shardwise.rule(torch.ops.mylib.op.default)`` over a function
    ``OpCall -> list[Strategy1D]``. Check it with ``shardwise.verify_rule``."""
    return (registry or DEFAULT).register(ops, local=local, shape_sensitive=shape_sensitive)


def registered_ops(registry: Registry | None = None) -> frozenset:
    """The aten overloads (and custom ops) that have a rule."""
    from . import load_all

    load_all()
    return (registry or DEFAULT).ops()


# -- expansion to the n-d mesh ------------------------------------------------------------
def _check_1d(call: OpCall, s: Strategy1D, rule: Rule):
    if len(s.outs) != len(call.outs) or len(s.ins) != len(call.ins):
        raise RuleError(
            f"rule {rule.name or rule.op} returned {s} with {len(s.ins)} inputs/{len(s.outs)} outputs; "
            f"{call.op} has {len(call.ins)} tensor inputs and {len(call.outs)} outputs"
        )


def expand(call: OpCall, rule: Rule, mesh: Mesh) -> list[Strategy]:
    """Product of the rule's single-mesh-dim strategies over mesh dims, invalid ones dropped."""
    one = list(dict.fromkeys(rule.strategies(call)))
    for s in one:
        _check_1d(call, s, rule)
    out = []
    for combo in itertools.product(one, repeat=mesh.ndim):
        outs = tuple(None if call.outs[i] is None else tuple(s.outs[i] for s in combo) for i in range(len(call.outs)))
        ins = tuple(tuple(s.ins[i] for s in combo) for i in range(len(call.ins)))
        st = Strategy(outs, ins, tuple(s.tag for s in combo))
        if not _layouts_exist(call, st):
            continue
        if rule.valid is not None and not rule.valid(call, st, mesh):
            continue
        if rule.shape_sensitive and not local_shapes_match(call, rule, st, mesh):
            continue
        out.append(st)
    return out


def _layouts_exist(call: OpCall, st: Strategy) -> bool:
    """Combinations a Layout refuses (e.g. a shard in groups nested under another) are dropped."""
    if not any(isinstance(p, Shard) and p.groups > 1 for pls in st.ins + st.outs if pls for p in pls):
        return True  # only shards in groups can make a combination of valid 1-d placements invalid
    try:
        st.in_layouts(call), st.out_layouts(call)
    except ValueError:
        return False
    return True


def to_meta(x, shape):
    return torch.empty(shape, dtype=x.dtype, device="meta")


def run_local(lc: LocalCall, tensors: list):
    """Run a LocalCall with its TensorMeta leaves replaced by ``tensors`` in order."""
    it = iter(tensors)
    args, kwargs = pytree.tree_map(lambda x: next(it) if isinstance(x, TensorMeta) else x, (lc.args, lc.kwargs))
    return lc.fn(*args, **kwargs)


def local_shapes_match(call: OpCall, rule: Rule, st: Strategy, mesh: Mesh) -> bool:
    """Does the local op produce, on every rank, the local output shapes the layouts promise?"""
    try:
        layouts = st.in_layouts(call), st.out_layouts(call)
    except ValueError:
        return False
    for rank in range(mesh.size):
        ctx = LocalCtx(call, st, mesh, rank, layouts)
        try:
            lc = rule.local_call(ctx)
            ins = tuple((tuple(ctx.local_in_shape(i)), t.dtype) for i, t in enumerate(call.ins))
        except (RuntimeError, ValueError, IndexError):
            return False
        got = _meta_out_shapes(lc, ins)
        if got is None:
            return False
        for i, (t, g) in enumerate(zip(call.outs, got)):
            if t is not None and g != ctx.local_out_shape(i):
                return False
    return True


_META_RUNS: dict = {}  # (fn, printed args, local inputs) -> output shapes (None: the op raised)
_META_RUNS_MAX = 1 << 16


def _meta_out_shapes(lc: LocalCall, ins: tuple):
    """Output shapes of ``lc`` run on meta tensors ``ins`` ((shape, dtype) each), or None if
    it raises. Memoised on plain values (the op, the printed args, the inputs): expanding a
    view on an n-d mesh asks the same question for most ranks and strategies, and each meta
    run goes through the dispatcher."""
    key = (lc.fn, repr((lc.args, sorted(lc.kwargs.items()))), ins)
    if key in _META_RUNS:
        return _META_RUNS[key]
    try:
        outs = flatten_outputs(run_local(lc, [torch.empty(s, dtype=d, device="meta") for s, d in ins]))
        got = [list(o.shape) if isinstance(o, torch.Tensor) else None for o in outs]
    except (RuntimeError, ValueError, IndexError):
        got = None
    if len(_META_RUNS) >= _META_RUNS_MAX:
        _META_RUNS.clear()
    _META_RUNS[key] = got
    return got


def with_block(call: OpCall, rule: Rule, st: Strategy, m: int, block: tuple, mesh: Mesh):
    """``st`` with every plain shard on mesh dim ``m`` cut as ``block`` = (unit, groups) (see
    Shard), if the rule's ``valid`` hook and a meta run of its local call accept it (None
    otherwise). The planner uses this for inputs that arrive as unit or grouped shards; the
    verifier checks such variants numerically. Only blockwise rules qualify: elementwise along
    the shard, so any set of whole indices works. A local call that needs chunk offsets raises
    for groups (no single offset), which drops the variant."""
    unit, groups = block

    def sub(pl):
        if pl is None or not isinstance(pl[m], Shard) or pl[m].block != (1, 1):
            return pl
        return pl[:m] + (Shard(pl[m].dim, unit, groups),) + pl[m + 1:]

    if not rule.blockwise or "offsets" in st.tags[m:m + 1] or not any(isinstance(p[m], Shard) for p in st.ins):
        return None  # ("offsets": a strategy whose local args depend on where chunks start)
    cut = {p[m].block for p in st.ins + st.outs if p is not None and isinstance(p[m], Shard)} - {(1, 1)}
    if cut and (groups > 1 or any(g > 1 for _, g in cut)):
        return None  # the rule's own grouped strategies (split/cat of parts) are not restated
    new = Strategy(tuple(sub(p) for p in st.outs), tuple(sub(p) for p in st.ins), st.tags)
    try:
        new.in_layouts(call), new.out_layouts(call)
    except ValueError:  # ShardingError: the block does not divide some dim
        return None
    try:
        if rule.valid is not None and not rule.valid(call, new, mesh):
            return None
    except ValueError:  # a hook that asks for offsets of a grouped shard
        return None
    return new if local_shapes_match(call, rule, new, mesh) else None


def blocks_of(layouts) -> set:
    """{(mesh dim, (unit, groups))} of the unit or grouped shards among ``layouts``."""
    return {(m, p.block) for lay in layouts if lay is not None for m, p in enumerate(lay.placements)
            if isinstance(p, Shard) and p.block != (1, 1)}
