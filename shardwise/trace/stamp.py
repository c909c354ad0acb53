"""A deep model's repeated blocks traced once: its training step (or its forward, for an
inference plan) is traced with five of its N blocks and the graph of blocks 3..N-2 is stamped
from block 3's nodes.

make_fx costs about as much per block as everything else in planning put together (GPT-2 small:
~0.05 s of CPU per block, forward and backward), so a 24-block model would trace twice as long
as a 12-block one. When a ModuleList holds N >= MIN_BLOCKS blocks of one structure:

1. ``fingerprint``: the whole model's forward and loss run once under fake tensors, each aten op
   recorded with its arguments (a tensor as where it came from: which block, relative to the
   reading one, and which op there; a parameter by its name inside its block) and its outputs'
   shapes, strides and dtypes. The same is recorded for the model with the list shortened to
   blocks (0, 1, 2, 3, N-1). Stamping goes on only if the full record is the short one with its
   block 3 repeated for blocks 3..N-2: same ops, same constants, same wiring, before, between
   and after the blocks (an alternating attention, a per-layer constant, a loop over ``len(self.layers)``
   all differ here). This costs ~1/5 of tracing a block.
2. The short model is traced (make_fx, as capture.py does), and ``Stamp.graph`` checks that
   block 3's nodes are block 2's node for node, once shifted by one block: the same ops and
   metadata, reading the same positions of the previous block's forward, the next block's
   backward and their own block's parameters. Any difference and the full model is traced.
3. The full graph is then written in the order the full trace makes it: blocks 0-2 and N-1 as
   traced, blocks 3..N-2 as copies of block 3 (forward in block order, backward in reverse), each
   reading its neighbours' copies and its own parameters' new placeholders, module paths
   renamed; the gradients output in the full model's parameter order. A forward-only trace has
   no backward segments and returns the model's outputs, whose structure the full model's
   fingerprint run must give too (a tuple of every layer's hidden states would not).

Everything after capture (functionalisation, provenance, recompute, the plan) runs on the full
graph. tests/trace/test_stamp.py checks the stamped graph against the full trace, node for node,
names included, over Hugging Face families and our own models.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.calls import leaves, map_leaves
from .base import Arguments, finish
from .capture import model_patches
from .precision import traced_dtypes
from .provenance import module_path

MIN_BLOCKS = 8  # fewer: the five traced blocks are most of the model
KEPT = 3  # blocks 0..KEPT-1 traced as they are; block KEPT is the template; then the last block
SHORT = KEPT + 2


@dataclass
class Repeats:
    """A ModuleList of N structurally identical blocks, at ``prefix`` (``transformer.h``)."""

    prefix: str
    parent: torch.nn.Module
    attr: str
    blocks: torch.nn.ModuleList
    notes: list = field(default_factory=list)  # the full model's capture notes (from its fingerprint run)

    @property
    def n(self) -> int:
        return len(self.blocks)

    @contextlib.contextmanager
    def shortened(self):
        """The model with the list holding blocks 0..KEPT and N-1 only."""
        keep = [self.blocks[i] for i in (*range(KEPT + 1), self.n - 1)]
        setattr(self.parent, self.attr, torch.nn.ModuleList(keep))
        try:
            yield
        finally:
            setattr(self.parent, self.attr, self.blocks)

    def block(self, name: str | None) -> tuple[int, str] | None:
        """``transformer.h.7.attn.c_attn`` -> (7, "attn.c_attn"); None outside the list."""
        if not name or not name.startswith(self.prefix + "."):
            return None
        head, _, rest = name[len(self.prefix) + 1:].partition(".")
        return (int(head), rest) if head.isdigit() else None

    def path(self, index, rest: str) -> str:
        """(7, "attn.c_attn") -> ``transformer.h.7.attn.c_attn``."""
        return f"{self.prefix}.{index}" + (f".{rest}" if rest else "")

    def short_name(self, full: str) -> str:
        """A full model's parameter name -> the short model's name of it, or of the template's
        (block KEPT) for a stamped block."""
        b = self.block(full)
        if b is None:
            return full
        i, rest = b
        return self.path(SHORT - 1 if i == self.n - 1 else min(i, KEPT), rest)


def _signature(block: torch.nn.Module) -> tuple:
    return (tuple((n, type(m)) for n, m in block.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))


def find_repeats(model: torch.nn.Module) -> Repeats | None:
    """The longest ModuleList of at least MIN_BLOCKS distinct blocks of one structure (not one
    nested in such a list), or None."""
    best = None
    for path, mod in model.named_modules():
        if not path or not isinstance(mod, torch.nn.ModuleList) or len(mod) < MIN_BLOCKS:
            continue
        if best is not None and path.startswith(best.prefix + "."):
            continue
        if len({id(b) for b in mod}) != len(mod) or len({_signature(b) for b in mod}) != 1:
            continue
        if best is None or len(mod) > best.n:
            parent, _, attr = path.rpartition(".")
            best = Repeats(path, model.get_submodule(parent), attr, mod)
    return best


# --- 1. the forward fingerprint ---------------------------------------------------------------

class _Record(TorchDispatchMode):
    """Each aten op as (op, encoded arguments, outputs' shapes/strides/dtypes), in runs of one block."""

    def __init__(self, n: int, origins: dict):
        super().__init__()
        self.n, self.origins, self.block = n, origins, None
        self.runs: list = []
        self.count: dict = {}
        self.keep: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        b = self.block
        enc = map_leaves(lambda x: self._encode(x, b), (args, kwargs))
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        i = self.count.get(b, 0)
        self.count[b] = i + 1
        if not self.runs or self.runs[-1][0] != b:
            self.runs.append((b, []))
        self.runs[-1][1].append((func, enc, tuple((tuple(t.shape), t.stride(), t.dtype) for t in outs)))
        for j, t in enumerate(outs):
            self.origins[id(t)] = ("t", b, i, j)
        self.keep.append(outs)  # ids stay unique
        return out

    def _encode(self, x, b):
        if not isinstance(x, torch.Tensor):
            return x
        o = self.origins.get(id(x))
        if o is None:
            return ("?", tuple(x.shape), x.stride(), x.dtype)
        kind, pb, *rest = o
        if pb is None:
            return o
        # another block: by offset from a block; from outside the blocks, the first ones by index
        # and the later ones from the end (the short model's block KEPT is the full one's N-2)
        return (kind, pb - b if b is not None else pb if pb < KEPT else pb - self.n, *rest)


def stamped_trace(model, args: Arguments, fake: list, example: tuple, probe: Callable, traced: Callable,
                  precision=None, recompute: str = "none", grads: bool = True) -> tuple | None:
    """(graph, notes, the Stamp) of ``model`` traced with five blocks of a repeated list and stamped,
    or None where the model has no such list or its blocks differ (then trace it whole).
    ``probe(arguments)``: what ``fingerprint`` runs (the forward and loss, or the forward);
    ``traced(arguments, record)``: what base.finish traces (the step, or the forward); ``grads``:
    a training step (False: forward only, stamped without backward segments); ``example``:
    (inputs, kwargs, targets) the short model's Arguments are made from."""
    repeats = find_repeats(model)
    if repeats is None:
        return None
    with model_patches(repeats.notes):
        full = fingerprint(probe(args), repeats, args.state_names, fake)
    if full is None or not middle_alike(full, repeats.n):
        return None
    inputs, kwargs, targets = example
    with repeats.shortened():
        short_args, short_real = Arguments.of(model, inputs, kwargs, targets)
        short_fake = short_args.fake(short_real, grads=grads,
                                     dtypes=traced_dtypes(short_args.param_names, short_real, precision))
        with model_patches(None):
            short = fingerprint(probe(short_args), repeats, short_args.state_names, short_fake)
        if short is None or not same_but_repeated(full, short, repeats.n):
            return None
        record: dict = {}
        stamp = Stamp(repeats, short_args.state_names, args.state_names, record, grads)
        try:
            gm, notes = finish(traced(short_args, record), args, short_fake, buffers=True, recompute=recompute,
                               stamp=stamp)
        except Exception:  # noqa: BLE001 - the short model failed where the full one may not: trace that
            return None
    if gm is None:
        return None
    notes.insert(len(repeats.notes), f"trace: {repeats.prefix}'s {repeats.n} blocks traced as {SHORT}, blocks "
                                     f"{KEPT}..{repeats.n - 2} stamped from block {KEPT}'s graph (trace/stamp.py)")
    return gm, notes, stamp


def fingerprint(run, repeats: Repeats, names: list[str], fake: list) -> list | None:
    """The runs of ``run(fake)`` (forward and loss, or forward): [(block or None, [ops])], then
    (None, the structure of what it returned: its pytree spec and each leaf's shape and dtype, or
    value); ``names``: the flat argument's parameter/buffer names (None for inputs). None if the
    forward fails here."""
    origins, inputs = {}, 0
    for name, t in zip(names, fake):
        b = repeats.block(name) if name else None
        origins[id(t)] = ("p", b[0], b[1]) if b else ("a", None, name if name else inputs)
        inputs += name is None
    blocks = getattr(repeats.parent, repeats.attr)  # the list the model holds now: full or shortened
    record = _Record(len(blocks), origins)
    handles = []
    for i, blk in enumerate(blocks):
        def pre(mod, args, i=i):
            record.block = i

        def post(mod, args, out):
            record.block = None
        handles += [blk.register_forward_pre_hook(pre), blk.register_forward_hook(post, always_call=True)]
    mode = next((t.fake_mode for t in fake if hasattr(t, "fake_mode")), None)
    try:
        with mode or contextlib.nullcontext(), record:
            out = run(fake)
    except Exception:  # noqa: BLE001 - the trace proper reports it (or traces without stamping)
        return None
    finally:
        for h in handles:
            h.remove()
    flat, spec = tree_flatten(out)
    shape = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("v", repr(x)) for x in flat)
    return [*record.runs, (None, ("returned", spec, shape))]


def middle_alike(full: list, n: int) -> bool:
    """Do blocks KEPT..N-2 of the full model's record run the same ops? (Checked before the short
    model is run at all: a model whose layers alternate stops here.)"""
    middle = [ops for b, ops in full if b is not None and KEPT <= b <= n - 2]
    return len(middle) == n - 1 - KEPT and all(ops == middle[0] for ops in middle)


def same_but_repeated(full: list, short: list, n: int) -> bool:
    """Is the full model's record the short one's with block KEPT's run repeated for KEPT..N-2?"""
    def label(b):
        return None if b is None else b if b < KEPT else SHORT - 1 if b == n - 1 else KEPT
    template = next((ops for b, ops in short if b == KEPT), None)
    collapsed, last = [], None
    for b, ops in full:
        lab = label(b)
        if lab == KEPT and template is not None and ops != template:
            return False
        if not (lab == KEPT and last == KEPT):
            collapsed.append((lab, ops))
        last = lab
    return template is not None and collapsed == list(short)


# --- 2. and 3. the short graph, checked and stamped --------------------------------------------

_COMPARED = ("stack_trace", "autograd_backward", "custom")


def _val_key(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_val_key(x) for x in v)
    return v


@dataclass
class Stamp:
    """Rewrites the short model's pass-1 graph into the full model's (``graph``)."""

    repeats: Repeats
    short_names: list  # per placeholder of the short graph: its parameter/buffer name, or None
    full_names: list  # per placeholder of the full graph
    record: dict  # the short trace's: a step's gradients' names (``grad_names``), in output order; a forward's
    # output structure (``out``)
    backward: bool = True  # False: a forward-only graph (trace/forward.py), its outputs the model's

    @property
    def short_grads(self) -> list:
        return self.record["grad_names"]

    def full_grads(self) -> list[str]:
        """The full trace's gradient names (those whose short name, or template's, has one)."""
        have = set(self.short_grads)
        return [n for n in self.full_names if n is not None and self.repeats.short_name(n) in have]

    def graph(self, gm: fx.GraphModule) -> fx.GraphModule | None:
        nodes = list(gm.graph.nodes)
        segments = self._segments(nodes)
        if segments is None:
            return None
        pos = {n: (kind, b, i) for (kind, b), seg in segments.items() for i, n in enumerate(seg)}
        phs = [n for n in nodes if n.op == "placeholder"]
        if len(phs) != len(self.short_names):
            return None
        param_of = {p: self.repeats.block(name) for p, name in zip(phs, self.short_names) if name}
        if not all(self._matches(segments, kind, pos, param_of) for kind in ("FB" if self.backward else "F")):
            return None
        if not self._readers_known(nodes, segments, pos):
            return None
        return self._write(gm, nodes, segments, pos, phs)

    def _block(self, n: fx.Node) -> int | None:
        b = self.repeats.block(module_path(n))
        return None if b is None else b[0]

    def _segments(self, nodes: list) -> dict | None:
        """{("F"|"B", block): nodes}: forward of blocks 1..KEPT (from a block's first node to the
        next block's), backward of blocks KEPT-1..KEPT+1 (from its first node to the previous block's)."""
        first: dict = {}
        for i, n in enumerate(nodes):
            b = self._block(n)
            if b is not None and n.op == "call_function":
                first.setdefault(("B" if n.meta.get("autograd_backward") else "F", b), i)
        fwd = [first.get(("F", b)) for b in range(KEPT - 1, KEPT + 2)]
        bwd = [first.get(("B", b)) for b in range(KEPT + 1, KEPT - 3, -1)] if self.backward else []
        if None in fwd or None in bwd or fwd != sorted(fwd) or bwd != sorted(bwd) or (bwd and fwd[-1] >= bwd[0]):
            return None
        if not self.backward and any(k == "B" for k, _ in first):
            return None
        segs = {("F", KEPT - 1 + j): nodes[fwd[j]:fwd[j + 1]] for j in range(2)}
        if self.backward:
            segs.update({("B", KEPT + 1 - j): nodes[bwd[j]:bwd[j + 1]] for j in range(3)})
        # block 1's forward: only where block 2's forward reads it; from its first node to block 2's
        start = first.get(("F", KEPT - 2))
        if start is None or start >= fwd[0]:
            return None
        segs[("F", KEPT - 2)] = nodes[start:fwd[0]]
        for (kind, b), seg in segs.items():
            for n in seg:
                if (n.op != "call_function" or self._block(n) not in (b, None)
                        or bool(n.meta.get("autograd_backward")) != (kind == "B")):
                    return None
        return segs

    def _key(self, a, b: int, pos: dict, param_of: dict):
        """An argument of a node of block ``b``, as the shift compares it."""
        if not isinstance(a, fx.Node):
            return a
        if a in pos:
            kind, ab, i = pos[a]
            return (kind, ab - b, i)
        if a in param_of and param_of[a] is not None:
            return ("P", param_of[a][0] - b, param_of[a][1])
        return ("N", a)

    def _node_key(self, n: fx.Node, b: int, pos: dict, param_of: dict) -> tuple:
        args = fx.node.map_aggregate((n.args, n.kwargs), lambda a: self._key(a, b, pos, param_of))
        meta = tuple(n.meta.get(k) for k in _COMPARED)
        stack = tuple((self._relabel(p, b), c) for p, c in (n.meta.get("nn_module_stack") or {}).values())
        return (n.op, n.target, args, meta, stack, _val_key(n.meta.get("val")))

    def _relabel(self, path: str, b: int) -> str:
        got = self.repeats.block(path)
        return path if got is None or got[0] != b else self.repeats.path("#", got[1])

    def _matches(self, segments: dict, kind: str, pos: dict, param_of: dict) -> bool:
        """Block KEPT's ``kind`` segment is block KEPT-1's, shifted by one block."""
        a, b = segments[(kind, KEPT)], segments[(kind, KEPT - 1)]
        return len(a) == len(b) and all(self._node_key(x, KEPT, pos, param_of) == self._node_key(y, KEPT - 1, pos, param_of)
                                        for x, y in zip(a, b))

    def _readers_known(self, nodes: list, segments: dict, pos: dict) -> bool:
        """The template's nodes are read only by its own block, its neighbours and the output
        (its parameters' gradients): the places ``_write`` rewires."""
        template = set(segments[("F", KEPT)]) | set(segments.get(("B", KEPT), ()))
        near = (set(segments[("F", KEPT - 1)]) | set(segments.get(("B", KEPT - 1), ()))
                | set(segments.get(("B", KEPT + 1), ())))
        for n in template:
            for u in n.users:
                if u in template or u in near or u.op == "output" or self._block(u) in (KEPT - 1, KEPT + 1):
                    continue
                return False
        return not any(n.op == "get_attr" for n in template)

    def _write(self, gm: fx.GraphModule, nodes: list, segments: dict, pos: dict, phs: list) -> fx.GraphModule | None:
        rep, n_blocks = self.repeats, self.repeats.n
        new = fx.Graph()
        env: dict = {}
        by_short = dict(zip(self.short_names, phs))
        ph_full: dict = {}  # full parameter/buffer name -> its new placeholder
        n_short_state = sum(x is not None for x in self.short_names)
        n_full_state = sum(x is not None for x in self.full_names)
        for i, name in enumerate(self.full_names):
            src = by_short[rep.short_name(name)] if name else phs[i - n_full_state + n_short_state]
            p = new.placeholder(f"arg{i}_1")
            p.meta = dict(src.meta)
            b = rep.block(name) if name else None
            if b is not None and KEPT < b[0] < n_blocks - 1:  # a stamped block's: a placeholder of its own
                p.meta["val"] = _fresh(src.meta["val"])
            else:
                env[src] = p
            if name is not None:
                ph_full[name] = p
        copies: dict = {}  # ("F"|"B", block) -> its nodes, in the template's order

        def neighbour(kind: str, b: int, i: int) -> fx.Node:
            if KEPT <= b <= n_blocks - 2:
                return copies[(kind, b)][i]
            return env[segments[(kind, b if b < KEPT else KEPT + 1)][i]]

        name_of = dict(zip(phs, self.short_names))

        def stamp(kind: str, k: int) -> None:
            made = copies[(kind, k)] = []

            def arg(a):
                if not isinstance(a, fx.Node):
                    return a
                if a in pos:
                    akind, ab, i = pos[a]
                    if ab == KEPT:
                        return made[i] if akind == kind else copies[(akind, k)][i]
                    return neighbour(akind, k + ab - KEPT, i)
                b = rep.block(name_of.get(a))
                return env[a] if b is None else ph_full[rep.path(k + b[0] - KEPT, b[1])]
            for n in segments[(kind, KEPT)]:
                c = new.create_node(n.op, n.target, fx.node.map_aggregate(n.args, arg),
                                    fx.node.map_aggregate(n.kwargs, arg), name=_name(new, n), type_expr=n.type)
                c.meta = {**n.meta, "nn_module_stack": self._renamed(n.meta.get("nn_module_stack"), KEPT, k)}
                if c.meta["nn_module_stack"] is None:
                    del c.meta["nn_module_stack"]
                made.append(c)

        def real(u: fx.Node):
            """A traced node's argument: the template's nodes are the stamped copy next to ``u``."""
            def arg(a):
                if isinstance(a, fx.Node) and a in pos and pos[a][1] == KEPT:
                    kind, _, i = pos[a]
                    return copies[(kind, KEPT if self._near(u, pos) == KEPT - 1 else n_blocks - 2)][i]
                return env[a] if isinstance(a, fx.Node) else a
            return arg

        f_first = segments[("F", KEPT)][0]
        b_first = segments[("B", KEPT)][0] if self.backward else None
        template = set(segments[("F", KEPT)]) | set(segments.get(("B", KEPT), ()))
        for n in nodes:
            if n.op == "placeholder":
                continue
            if n is f_first:
                for k in range(KEPT, n_blocks - 1):
                    stamp("F", k)
            if n is b_first:
                for k in range(n_blocks - 2, KEPT - 1, -1):
                    stamp("B", k)
            if n in template:
                continue
            if n.op == "output":
                out = self._outputs(n, env, segments, pos, copies)
                if out is None:
                    return None
                env[n] = new.output(out, type_expr=n.type)
                env[n].meta = dict(n.meta)
                continue
            arg = real(n)
            c = new.create_node(n.op, n.target, fx.node.map_aggregate(n.args, arg),
                                fx.node.map_aggregate(n.kwargs, arg), name=_name(new, n), type_expr=n.type)
            c.meta = dict(n.meta)
            b = self._block(n)
            if b == SHORT - 1:
                c.meta["nn_module_stack"] = self._renamed(n.meta["nn_module_stack"], b, n_blocks - 1)
            env[n] = c
        gm.graph = new
        return gm

    def _near(self, u: fx.Node, pos: dict) -> int | None:
        """The block a traced node reading the template belongs to: KEPT-1 or KEPT+1."""
        if u in pos:
            return pos[u][1]
        return self._block(u)

    def _renamed(self, stack: dict | None, b: int, k: int) -> dict | None:
        if not stack:
            return stack
        out = {}
        for key, (path, cls) in stack.items():
            got = self.repeats.block(path)
            new_path = path if got is None or got[0] != b else self.repeats.path(k, got[1])
            out[new_path if key == path else key] = (new_path, cls)
        return out

    def _outputs(self, out: fx.Node, env: dict, segments: dict, pos: dict, copies: dict):
        """(loss, *gradients of ``full_grads()``): a stamped block's gradient is its copy of the
        template's. Forward only: the short graph's outputs, none of them the template's."""
        if not self.backward:
            outs = leaves(out.args[0])
            if any(isinstance(a, fx.Node) and a in pos and pos[a][1] == KEPT for a in outs):
                return None
            return fx.node.map_aggregate(out.args[0], lambda a: env[a] if isinstance(a, fx.Node) else a)
        loss, *grads = out.args[0]
        by_name = dict(zip(self.short_grads, grads))
        result = [env[loss]]
        for name in self.full_grads():
            g = by_name[self.repeats.short_name(name)]
            b = self.repeats.block(name)
            if b is not None and KEPT <= b[0] <= self.repeats.n - 2:
                if g not in pos or pos[g][1] != KEPT:
                    return None
                kind, _, i = pos[g]
                result.append(copies[(kind, b[0])][i])
            else:
                result.append(env[g])
        return tuple(result)


def _name(graph: fx.Graph, n: fx.Node) -> str | None:
    """The name make_fx gives a node it creates (graph order decides the numbering): an aten op's
    packet name (``view``, ``view_1``, ...; proxy_tensor.proxy_call); else from the target."""
    if n.op == "get_attr":
        return n.name
    if isinstance(n.target, torch._ops.OpOverload):
        return graph._target_to_str(n.target.overloadpacket.__name__)
    return None


def _fresh(val):
    """A new fake tensor like ``val`` (its own placeholder: make_fx tells inputs apart by identity)."""
    with val.fake_mode:
        t = torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype, device=val.device)
    return t.requires_grad_(val.requires_grad) if val.requires_grad else t
