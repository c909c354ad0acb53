"""Activation checkpointing in the joint graph: backward recomputes forward values instead of
reading them saved from forward.

Two sources, one representation (forward nodes repeated inside backward, tagged ``RECOMPUTE``
with their block, so the planner places them, the program runs them and the liveness estimate
sees the saved values die early):

- the model's own ``torch.utils.checkpoint`` regions (non-reentrant, as Hugging Face's
  ``gradient_checkpointing_enable()``): make_fx traces the recomputation where autograd runs it,
  inside backward (trace/joint.py keeps the graph's parameters in the module meanwhile, so the
  recompute reads them); ``checkpoint_recompute`` tags what it traces;
- ``activation_checkpointing=`` (``recompute_blocks``): a pass over the traced graph. A block is
  a repeated layer (trace/provenance.layer_of with an index: ``model.layers.3``); its forward
  nodes that backward reads, and what they are computed from inside the block, are copied just
  before the block's first backward reader, and backward reads the copies. "blocks" recomputes
  from the block's inputs (the residual stream, parameters); "selective" is torchtitan's op-level
  policy (its ``_save_list``): attention's outputs are kept, and of the block's matrix products
  (``MATMUL_OPS``) in forward order the 1st, 3rd, 5th, ... are kept and every second one is
  recomputed, with the cheap ops between them. Any split of saved and recomputed values is exact:
  random ops (dropout) are never recomputed, their outputs stay saved, so a recomputed block
  equals the original bit for bit (same ops, same inputs, same order).
"""
from __future__ import annotations

import contextlib
import operator
import threading

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from ..core.errors import ConfigError
from .errors import TraceError
from .attention import FORWARDS as ATTENTION_FORWARDS
from .normalize import is_mutable
from .provenance import layer_of, module_path

RECOMPUTE = "sw_recompute"  # node meta: the block whose saved activations this node recomputes in backward
REGION = "sw_checkpoint_region"  # meta["custom"]: the torch.utils.checkpoint call a node ran in (either pass)
RECOMPUTE_OF = "sw_recompute_of"  # node meta: the forward node a recompute_blocks copy repeats
POLICIES = ("none", "blocks", "selective", "auto")

aten = torch.ops.aten
# "selective": the ops whose outputs it may keep from forward (recomputing them is what costs)
MATMUL_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                        aten.matmul.default})  # of these every second one in a block is recomputed
SAVED_OPS = MATMUL_OPS | frozenset({aten.convolution.default, *ATTENTION_FORWARDS})
_CUSTOM = "custom"  # a node meta field make_fx copies from the current meta (torch.fx.proxy._COPY_META_FIELDS)
# contexts the tracing pass enters again around torch.utils.checkpoint's recomputation (``recomputed_in``)
_AROUND_RECOMPUTATION: list = []


def _saved_op(n: fx.Node) -> bool:
    t = n.target
    return t in SAVED_OPS or getattr(t, "namespace", None) == "shardwise"  # attention, MoE experts


def selective_saves(members: list) -> set:
    """The forward nodes of one block (in graph order) "selective" keeps: every saved op's output
    but every second matrix product's (the 2nd, 4th, ... in forward order), as torchtitan's
    ``_save_list`` policy counts its ``mm`` calls per checkpointed block."""
    kept, products = set(), 0
    for n in members:
        if n.op != "call_function" or not _saved_op(n):
            continue
        if n.target in MATMUL_OPS:
            products += 1
            if products % 2 == 0:
                continue
        kept.add(n)
    return kept


@contextlib.contextmanager
def recomputed_in(context):
    """While in it, ``context()`` (a context manager) is entered around each recomputation
    ``checkpoint_recompute`` tags: what the tracing pass runs the model under and autograd does not
    carry into backward (a torch function mode: trace/eager_attention.py)."""
    _AROUND_RECOMPUTATION.append(context)
    try:
        yield
    finally:
        _AROUND_RECOMPUTATION.remove(context)


def _tag(hook, fields: dict) -> None:
    """Add ``fields`` to the custom meta of the nodes traced while ``hook`` is open (kept on it to undo)."""
    meta = fx_traceback.get_current_meta()
    hook._sw_custom = meta.get(_CUSTOM)
    meta[_CUSTOM] = {**(meta.get(_CUSTOM) or {}), **fields}


def _untag(hook) -> None:
    meta = fx_traceback.get_current_meta()
    if hook._sw_custom is None:
        meta.pop(_CUSTOM, None)
    else:
        meta[_CUSTOM] = hook._sw_custom


@contextlib.contextmanager
def checkpoint_recompute():
    """While tracing: nodes torch.utils.checkpoint recomputes in backward get
    ``meta["custom"][RECOMPUTE]``, read by ``tag_checkpointed`` after capture, and run under the
    contexts ``recomputed_in`` registered."""
    from torch.utils import checkpoint as ck

    reentrant = getattr(ck, "CheckpointFunction", None)
    hook = getattr(ck, "_recomputation_hook", None)
    if hook is None or reentrant is None:  # another torch: the recompute is traced, only not tagged
        yield
        return
    enter, leave, own, apply = hook.__enter__, hook.__exit__, reentrant.__dict__.get("apply"), reentrant.apply
    fwd = ck._checkpoint_hook  # the forward of a region: its draws are tagged with the region (its frame)
    fwd_init, fwd_enter, fwd_exit, rec_init = fwd.__init__, fwd.__enter__, fwd.__exit__, hook.__init__
    fwd_own = {k: fwd.__dict__[k] for k in ("__enter__", "__exit__") if k in fwd.__dict__}
    tracing = threading.get_ident()

    def on_tracing_thread(patch, original):
        """``patch`` on the tracing thread, ``original`` on any other: the patches are process-wide."""
        def chosen(*args, **kwargs):
            return (patch if threading.get_ident() == tracing else original)(*args, **kwargs)
        return chosen

    def region_init(self, frame, *rest):
        fwd_init(self, frame, *rest)
        self._sw_region = id(frame)

    def region_enter(self):
        _tag(self, {REGION: self._sw_region})
        return fwd_enter(self)

    def region_exit(self, *exc):
        _untag(self)
        return fwd_exit(self, *exc)

    def recompute_init(self, target_frame_ref, *rest):
        rec_init(self, target_frame_ref, *rest)
        self._sw_region = id(target_frame_ref())

    def tagged_enter(self):
        _tag(self, {RECOMPUTE: "torch.utils.checkpoint", REGION: getattr(self, "_sw_region", None)})
        self._sw_around = contextlib.ExitStack()
        for context in _AROUND_RECOMPUTATION:
            self._sw_around.enter_context(context())
        return enter(self)

    def tagged_exit(self, *exc):
        _untag(self)
        try:
            return leave(self, *exc)
        finally:
            self._sw_around.close()

    def refuse(*args, **kwargs):
        raise ConfigError("torch.utils.checkpoint(use_reentrant=True) runs its backward through its own "
                          "torch.autograd.backward, which the traced step's torch.autograd.grad cannot follow "
                          "(one device refuses .grad() with it too)",
                          fix="checkpoint with use_reentrant=False (Hugging Face's gradient_checkpointing_enable() "
                              "default), or drop it and pass parallelize(activation_checkpointing=\"blocks\")")

    hook.__enter__, hook.__exit__, reentrant.apply = (on_tracing_thread(tagged_enter, enter),
                                                      on_tracing_thread(tagged_exit, leave),
                                                      on_tracing_thread(refuse, apply))
    hook.__init__ = on_tracing_thread(recompute_init, rec_init)
    fwd.__init__, fwd.__enter__, fwd.__exit__ = (on_tracing_thread(region_init, fwd_init),
                                                 on_tracing_thread(region_enter, fwd_enter),
                                                 on_tracing_thread(region_exit, fwd_exit))
    try:
        yield
    finally:
        hook.__enter__, hook.__exit__, hook.__init__, fwd.__init__ = enter, leave, rec_init, fwd_init
        for k in ("__enter__", "__exit__"):
            if k in fwd_own:
                setattr(fwd, k, fwd_own[k])
            else:
                delattr(fwd, k)
        if own is None:
            del reentrant.apply  # back to torch.autograd.Function's
        else:
            reentrant.apply = own


def tag_checkpointed(gm: fx.GraphModule) -> list[str]:
    """Nodes a checkpointed region recomputed (``checkpoint_recompute``): ``RECOMPUTE`` = their block;
    its random draws read the forward's (``_random_from_forward``)."""
    count = 0
    for n in gm.graph.nodes:
        custom = n.meta.get(_CUSTOM)
        if isinstance(custom, dict) and RECOMPUTE in custom:
            n.meta[RECOMPUTE] = block_of(n) or "(checkpointed region)"
            count += 1
    if not count:
        return []
    reused = _random_from_forward(gm)
    return [f"{count} node(s) recomputed in backward by torch.utils.checkpoint"
            + (f"; {reused} random draw(s) in them read forward's" if reused else "")]


def _random(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers: a seeded op, but an attention kernel only with dropout (its
    ``dropout_p`` > 0; without, it draws nothing, and a region kept on it would set alike blocks apart)."""
    if n.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    if n.target in ATTENTION_FORWARDS:
        names = [a.name for a in n.target._schema.arguments]
        i = names.index("dropout_p") if "dropout_p" in names else None
        p = n.kwargs.get("dropout_p", n.args[i] if i is not None and i < len(n.args) else 0.0)
        return p != 0.0
    return True


def _region(n: fx.Node):
    custom = n.meta.get(_CUSTOM)
    return custom.get(REGION) if isinstance(custom, dict) else None


def _random_from_forward(gm: fx.GraphModule) -> int:
    """torch.utils.checkpoint recomputes its region's random ops (dropout) with the forward's random
    state (``preserve_rng_state``), so they draw the forward's numbers again; traced, they would
    draw anew from the rank's stream: other masks, wrong gradients, and a stream advanced twice.
    So the k-th recomputed draw of a region (``checkpoint_recompute`` tags both passes with the
    region) reads the k-th forward draw of that region instead: the recompute runs the region's
    forward again in order, stopping early at most, so its draws are a prefix of the forward's."""
    forward: dict = {}
    for n in gm.graph.nodes:
        if _random(n) and RECOMPUTE not in n.meta and _region(n) is not None:
            forward.setdefault(_region(n), []).append(n)
    used: dict = {}
    reused = 0
    for n in list(gm.graph.nodes):
        if not (_random(n) and RECOMPUTE in n.meta):
            continue
        region = _region(n)
        k = used[region] = used.get(region, -1) + 1
        twins = forward.get(region, [])
        twin = twins[k] if k < len(twins) else None
        if twin is None or twin.target != n.target or _shapes(twin) != _shapes(n):
            raise TraceError(f"{n.target} recomputed by torch.utils.checkpoint (node {n.name!r}) has no forward draw "
                             "to repeat", op=n.target,
                             fix="keep random ops (dropout) outside the checkpointed function, or use "
                                 "parallelize(activation_checkpointing=\"blocks\") instead of torch.utils.checkpoint")
        n.replace_all_uses_with(twin)
        gm.graph.erase_node(n)  # a random op is impure to fx: dead-code elimination would keep it drawing
        reused += 1
    return reused


def regions_on_draws_only(graph: fx.Graph) -> None:
    """Right after capture: the checkpoint region stays only on random nodes, where
    ``_random_from_forward`` reads it. Elsewhere it would set alike blocks apart and stop stamping
    (trace/stamp.py compares ``custom``); blocks with checkpointed draws are traced whole, each
    region its own."""
    for n in graph.nodes:
        custom = n.meta.get(_CUSTOM)
        if isinstance(custom, dict) and REGION in custom and not _random(n):
            rest = {k: v for k, v in custom.items() if k != REGION}
            if rest:
                n.meta[_CUSTOM] = rest
            else:
                del n.meta[_CUSTOM]


def _shapes(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    return tuple(tuple(v.shape) for v in (val if isinstance(val, (tuple, list)) else (val,)) if v is not None)


def block_of(n: fx.Node) -> str | None:
    """The repeated layer (``model.layers.3``) a node ran in, or None."""
    layer = layer_of(module_path(n) or "")
    return layer if any(part.isdigit() for part in layer.split(".")) else None


def _recomputable(n: fx.Node) -> bool:
    t = n.target
    if n.op != "call_function" or n.meta.get("autograd_backward"):
        return False
    if isinstance(t, torch._ops.OpOverload):
        return not (torch.Tag.nondeterministic_seeded in t.tags or is_mutable(t))
    return t is operator.getitem


def plan_recompute(gm: fx.GraphModule, policy: str) -> dict:
    """{block: [its forward nodes backward will recompute, in graph order]} under ``policy``."""
    if policy in ("none", None):
        return {}
    blocks: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.meta.get("autograd_backward") and (b := block_of(n)):
            blocks.setdefault(b, set()).add(n)
    out = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for b, members in blocks.items():
        # kept: what cannot be recomputed, the block's outputs (read by forward nodes after it: the
        # next block's input, a checkpoint's boundary), and for "selective" the costly ops' outputs
        saved = selective_saves(sorted(members, key=order.__getitem__)) if policy == "selective" else set()
        keep = {n for n in members if not _recomputable(n) or n in saved
                or any(u not in members and not u.meta.get("autograd_backward") and u.op != "output"
                       for u in n.users)}
        # a getitem of a kept node is kept too (it only names one of its outputs)
        keep |= {n for n in members if n.target is operator.getitem and n.args[0] in keep}
        wanted = [n for n in members if n not in keep and any(u.meta.get("autograd_backward") for u in n.users)]
        chosen, stack = set(), list(wanted)
        while stack:
            n = stack.pop()
            if n in chosen:
                continue
            chosen.add(n)
            stack.extend(a for a in n.all_input_nodes if a in members and a not in keep)
        if chosen:
            out[b] = [n for n in gm.graph.nodes if n in chosen]
    return out


def recompute_blocks(gm: fx.GraphModule, policy: str, only=None) -> list[str]:
    """Copy each block's recomputed nodes (``plan_recompute``; ``only``: these blocks) before its
    first backward reader; backward then reads the copies (module docstring)."""
    plan = plan_recompute(gm, policy)
    if only is not None:
        plan = {b: ns for b, ns in plan.items() if b in only}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    copied = 0
    for block, nodes in plan.items():
        chosen = set(nodes)
        readers = [u for n in nodes for u in n.users if u.meta.get("autograd_backward")]
        if not readers:
            continue
        first = min(readers, key=order.__getitem__)
        env: dict = {}
        with gm.graph.inserting_before(first):
            for n in nodes:
                c = gm.graph.node_copy(n, lambda a, env=env: env.get(a, a))
                c.meta = {**n.meta, "autograd_backward": True, RECOMPUTE: block, RECOMPUTE_OF: n.name}
                env[n] = c
        copies = set(env.values())
        for n in nodes:
            for u in list(n.users):
                if u.meta.get("autograd_backward") and u not in copies:
                    u.replace_input_with(n, env[n])
        copied += len(chosen)
    return [f"activation checkpointing ({policy}): {copied} node(s) of {len(plan)} block(s) recomputed in backward"
            ] if copied else []
