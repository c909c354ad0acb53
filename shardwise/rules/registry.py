"""Rule format and registry.

A rule is data about one aten op: from typed node metadata (an ``OpCall``) it returns the
strategies it supports on ONE mesh dim (``Strategy1D``: a placement per tensor output and
per tensor input), and, for a chosen n-d strategy and a rank, the local call (which
function, which rank-local non-tensor args). Expansion to an n-d mesh is mechanical: the
product of single-dim strategies over mesh dims.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..core.calls import KW_ONLY, OpCall, TensorMeta, flatten_outputs, map_leaves  # noqa: F401 (rules import them here)
from ..core.errors import RuleError, ShardingError, UnsupportedOpError
from ..core.layout import Layout, Partial, Replicate, Shard
from ..core.mesh import Mesh


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
        return [_layout(t.shape, t.dtype, p) for t, p in zip(call.ins, self.ins, strict=True)]

    def out_layouts(self, call: OpCall) -> list[Layout | None]:
        return [None if t is None else _layout(t.shape, t.dtype, p) for t, p in zip(call.outs, self.outs, strict=True)]

    def __repr__(self) -> str:
        fmt = lambda ps: "None" if ps is None else "[" + ", ".join(map(repr, ps)) + "]"  # noqa: E731
        return f"({', '.join(fmt(p) for p in self.ins)}) -> ({', '.join(fmt(p) for p in self.outs)})"


def _layout(shape: tuple, dtype: torch.dtype, placements) -> Layout:
    """Layouts are immutable: one per (shape, dtype, placements), checked once (strategies are
    restated as layouts for every node, rank and candidate)."""
    try:
        return _interned(shape, dtype, placements)
    except TypeError:  # unhashable placements (a list): not interned
        return Layout(shape, dtype, placements)


_interned = functools.lru_cache(maxsize=1 << 16)(Layout)


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
    """One rule row, every property of the rule for ``ops`` in it (the registry maps each op to its row).
    ``blockwise`` has no default: whether the rule is right for any chunk boundaries (elementwise along the
    shard, contractions, whole-dim reductions), so restatable with unit or grouped shards (with_block); index-,
    offset- and collective-based rules are not. A row missing a property raises RuleError naming it and the op."""

    ops: Any  # one op or a list of them (kept as a tuple)
    strategies: Callable[[OpCall], list[Strategy1D]] | None = None
    local: LocalFn | None = None  # None: the op itself, args unchanged
    shape_sensitive: bool = False  # check local output shapes when expanding (views, reshapes)
    name: str = ""
    valid: Callable | None = None  # (call, Strategy, mesh) -> bool: n-d combinations the rule refuses
    blockwise: bool | None = None  # required (see above)
    # (call, Strategy, mesh) -> RedistSteps the local call runs itself (a halo exchange, a statistics
    # all-reduce): the plan counts and prices them with the edges' (Plan.edges)
    comm: Callable | None = None
    # the local call depends on the rank only through the local shapes of the node's values (a
    # view's local sizes), so the local-shape check asks once per distinct local shapes, not per rank
    shape_only: bool = False

    def __post_init__(self):
        ops = tuple(self.ops) if isinstance(self.ops, (list, tuple)) else (self.ops,)
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "name", self.name or getattr(self.strategies, "__name__", ""))
        fns = [(p, getattr(self, p) is None or callable(getattr(self, p))) for p in ("local", "valid", "comm")]
        bad = [p for p, ok in [("ops", ops), ("strategies", callable(self.strategies)), *fns,
                               ("blockwise", isinstance(self.blockwise, bool)),
                               ("shape_sensitive", isinstance(self.shape_sensitive, bool))] if not ok]
        if bad:
            raise RuleError(f"rule row {self.name or '?'} for {', '.join(map(str, ops)) or 'no op'} lacks or "
                            f"mistypes {', '.join(bad)}", fix="give ops, a strategies function, blockwise=True/False, "
                            "and functions (or None) for local, valid and comm")

    def local_call(self, ctx: LocalCtx) -> LocalCall:
        """The rank's call; local args that raise give a RuleError naming the rule, op, strategy and rank."""
        if self.local is None:
            return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)
        try:
            return self.local(ctx)
        except ShardingError:
            raise
        except Exception as e:  # noqa: BLE001 - named and re-raised typed
            raise RuleError(f"local args of rule {self.name} for {ctx.call.op} raised {type(e).__name__}: {e} "
                            f"(strategy {ctx.strategy}, rank {ctx.rank})",
                            fix="fix the rule's local function; check it with shardwise.verify_rule") from e


class Registry:
    """An explicit op -> Rule table handed to the planner (no global monkey-patching)."""

    def __init__(self, rules: Iterable[Rule] = ()):
        self._rules: dict[Any, Rule] = {}
        self.loaded = False  # the built-in families are registered (rules.load_all)
        self.add(*rules)

    def add(self, *rows: Rule) -> None:
        for row in rows:
            self._rules.update(dict.fromkeys(row.ops, row))

    def register(self, ops: Any, strategies: Callable | None = None, *, local: LocalFn | None = None,
                 shape_sensitive: bool = False, valid: Callable | None = None, comm: Callable | None = None,
                 blockwise: bool = False) -> Callable:
        """``registry.register(op, fn)`` or as a decorator ``@registry.register(op)``; ops may be a list."""

        def deco(fn):
            self.add(Rule(ops, fn, local, shape_sensitive, valid=valid, blockwise=blockwise, comm=comm))
            return fn

        return deco if strategies is None else deco(strategies)

    def get(self, op: Any, node: str | None = None, source: str | None = None) -> Rule:
        r = self._rules.get(op)
        if r is None:
            raise UnsupportedOpError(op, node=node, source=source)
        return r

    def __contains__(self, op) -> bool:
        return op in self._rules

    def ops(self) -> frozenset:
        return frozenset(self._rules)

    def copy(self) -> "Registry":
        new = Registry()
        new._rules, new.loaded = dict(self._rules), self.loaded
        return new


DEFAULT = Registry()


def rule(ops: Any, *, local: LocalFn | None = None, shape_sensitive: bool = False, blockwise: bool = False,
         valid: Callable | None = None, comm: Callable | None = None, registry: Registry | None = None) -> Callable:
    """Register a user rule: ``@shardwise.rule(torch.ops.mylib.op.default)`` over a function
    ``OpCall -> list[Strategy1D]``, the row's other properties as Rule's. Check it with ``shardwise.verify_rule``."""
    return (registry or DEFAULT).register(ops, local=local, shape_sensitive=shape_sensitive, valid=valid, comm=comm,
                                          blockwise=blockwise)


# -- expansion to the n-d mesh ------------------------------------------------------------
def _check_1d(call: OpCall, s: Strategy1D, rule: Rule):
    if len(s.outs) != len(call.outs) or len(s.ins) != len(call.ins):
        raise RuleError(f"rule {rule.name or call.op} returned {s} with {len(s.ins)} inputs/{len(s.outs)} outputs; "
                        f"{call.op} has {len(call.ins)} tensor inputs and {len(call.outs)} outputs",
                        fix="return one placement per tensor input and per output (None where not a tensor)")


def expand(call: OpCall, rule: Rule, mesh: Mesh, dropped: list | None = None) -> list[Strategy]:
    """Product of the rule's single-mesh-dim strategies over mesh dims, invalid ones dropped
    (those the local-shape check drops go to ``dropped`` as (strategy, why): the verifier lists them)."""
    one = list(dict.fromkeys(rule.strategies(call)))
    for s in one:
        _check_1d(call, s, rule)
    out = []
    for combo in itertools.product(one, repeat=mesh.ndim):
        outs = tuple(None if call.outs[i] is None else tuple(s.outs[i] for s in combo) for i in range(len(call.outs)))
        ins = tuple(tuple(s.ins[i] for s in combo) for i in range(len(call.ins)))
        st = Strategy(outs, ins, tuple(s.tag for s in combo))
        if not _layouts_exist(call, st) or (rule.valid is not None and not rule.valid(call, st, mesh)):
            continue
        why = local_shape_refusal(call, rule, st, mesh) if rule.shape_sensitive else None
        if why is None:
            out.append(st)
        elif dropped is not None:
            dropped.append((st, why))
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


def run_local(lc: LocalCall, tensors: list):
    """Run a LocalCall with its TensorMeta leaves replaced by ``tensors`` in order."""
    it = iter(tensors)
    args, kwargs = map_leaves(lambda x: next(it) if isinstance(x, TensorMeta) else x, (lc.args, lc.kwargs))
    return lc.fn(*args, **kwargs)


_REFUSALS = (RuntimeError, ValueError, IndexError)  # how a local call or its meta run refuses local shapes


def local_shape_refusal(call: OpCall, rule: Rule, st: Strategy, mesh: Mesh, layouts: tuple | None = None) -> str | None:
    """None if the local op produces, on every rank, the local output shapes (and dtypes) the layouts
    promise; otherwise why not. Local args or a meta run that refuse (a RuntimeError, ValueError or
    IndexError, e.g. offsets of a grouped shard) drop the strategy; any other error is a bug and
    raises (RuleError from the local args). ``layouts``: st's (in, out) layouts, where the caller made them."""
    try:
        layouts = layouts or (st.in_layouts(call), st.out_layouts(call))
    except ValueError as e:
        return f"layouts: {e}"
    ranks = _distinct_ranks(st, mesh)
    if rule.shape_only and len(ranks) > 1:
        ranks = _distinct_shapes(ranks, layouts, mesh)
    for rank in ranks:
        ctx = LocalCtx(call, st, mesh, rank, layouts)
        try:
            lc = rule.local_call(ctx)
            ins = tuple((tuple(ctx.local_in_shape(i)), t.dtype) for i, t in enumerate(call.ins))
        except _REFUSALS as e:
            if isinstance(e, RuleError) and not isinstance(e.__cause__, _REFUSALS + (type(None),)):
                raise
            return f"rank {rank}: local args raised {type(e.__cause__ or e).__name__}: {e.__cause__ or e}"
        got = _meta_out_shapes(lc, ins)
        if isinstance(got, str):
            return f"rank {rank}: the local op raised {got}"
        for i, (t, g) in enumerate(zip(call.outs, got)):
            if t is not None and g != (ctx.local_out_shape(i), t.dtype):
                return f"rank {rank}: output {i} is {g[0]}:{g[1]}, the layout says {ctx.local_out_shape(i)}:{t.dtype}"
    return None


def _distinct_ranks(st: Strategy, mesh: Mesh) -> list[int]:
    """The first rank of each set that sees the same local call: a rank enters it only through its
    coordinates on the mesh dims where some input or output is not Replicate (shard extents and
    offsets, partial groups), so ranks that differ only elsewhere run the same local op on the
    same shapes (on (2, 2, 2), a strategy sharded on one mesh dim needs 2 ranks checked, not 8)."""
    dims = [m for m in range(mesh.ndim) if any(p is not None and not isinstance(p[m], Replicate)
                                                for p in st.ins + st.outs)]
    seen: dict = {}
    for rank in range(mesh.size):
        c = mesh.coord(rank)
        seen.setdefault(tuple(c[m] for m in dims), rank)
    return list(seen.values())


def _distinct_shapes(ranks: list, layouts: tuple, mesh: Mesh) -> list[int]:
    """The first of ``ranks`` for each distinct tuple of local shapes of ``layouts`` (ins, outs)."""
    lays = [lay for group in layouts for lay in group if lay is not None]
    if all(lay.uniform(mesh) for lay in lays):
        return ranks[:1]
    seen: dict = {}
    for rank in ranks:
        seen.setdefault(tuple(lay.local_shape(mesh, rank) for lay in lays), rank)
    return list(seen.values())


def local_shapes_match(call: OpCall, rule: Rule, st: Strategy, mesh: Mesh) -> bool:
    return local_shape_refusal(call, rule, st, mesh) is None


_META_RUNS: dict = {}  # (fn, printed args, local inputs) -> output (shape, dtype)s (a str: the op raised, why)
_META_RUNS_MAX = 1 << 16


def _meta_out_shapes(lc: LocalCall, ins: tuple):
    """Output (shape, dtype)s of ``lc`` run on meta tensors ``ins`` ((shape, dtype) each), or the error
    it raised (a str). Memoised on plain values (the op, the printed args, the inputs): expanding a
    view on an n-d mesh asks the same question for most ranks and strategies, and each meta
    run goes through the dispatcher."""
    key = (lc.fn, repr((lc.args, sorted(lc.kwargs.items()))), ins)
    if key in _META_RUNS:
        return _META_RUNS[key]
    try:
        outs = flatten_outputs(run_local(lc, [torch.empty(s, dtype=d, device="meta") for s, d in ins]))
        got = [(list(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in outs]
    except _REFUSALS as e:
        got = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if len(_META_RUNS) >= _META_RUNS_MAX:
        _META_RUNS.clear()
    _META_RUNS[key] = got
    return got


_BLOCKED: dict = {}  # (call key, id(rule), strategy, mesh dim, block, mesh) -> (rule, with_block's answer)
_BLOCKED_MAX = 1 << 16


def with_block(call: OpCall, rule: Rule, st: Strategy, m: int, block: tuple, mesh: Mesh):
    """_with_block, memoised on plain values: the planner restates a node's strategies for every
    set of blocks its inputs may arrive in (the ILP: per round), each set repeating most blocks,
    and each restatement runs the local call on every rank."""
    key = (call.key, id(rule), st, m, block, mesh)
    got = _BLOCKED.get(key)
    if got is not None and got[0] is rule:
        return got[1]
    new = _with_block(call, rule, st, m, block, mesh)
    if len(_BLOCKED) >= _BLOCKED_MAX:
        _BLOCKED.clear()
    _BLOCKED[key] = (rule, new)
    return new


def _with_block(call: OpCall, rule: Rule, st: Strategy, m: int, block: tuple, mesh: Mesh):
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
        layouts = new.in_layouts(call), new.out_layouts(call)
    except ValueError:  # ShardingError: the block does not divide some dim
        return None
    try:
        if rule.valid is not None and not rule.valid(call, new, mesh):
            return None
    except ValueError:  # a hook that asks for offsets of a grouped shard
        return None
    return new if local_shape_refusal(call, rule, new, mesh, layouts) is None else None


def with_blocks(call: OpCall, rule: Rule, st: Strategy, cuts: tuple, mesh: Mesh):
    """``st`` restated on several mesh dims at once, ``cuts`` = ((mesh dim, block), ...) in order
    (with_block on each in turn; None where any step refuses): a flattened batch arrives in units
    on the data dim while a fused projection's features arrive in groups on the tensor dim."""
    for m, block in cuts:
        st = with_block(call, rule, st, m, block, mesh)
        if st is None:
            return None
    return st


def blocks_of(layouts) -> set:
    """{(mesh dim, (unit, groups))} of the unit or grouped shards among ``layouts``."""
    return {(m, p.block) for lay in layouts if lay is not None for m, p in enumerate(lay.placements)
            if isinstance(p, Shard) and p.block != (1, 1)}
