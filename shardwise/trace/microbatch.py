"""The traced step made ready for microbatching (a pipeline runs the batch in microbatches).

    check_microbatchable(gm)      # MicrobatchError for an op whose meaning needs the whole batch
    notes = count_targets(gm)      # nll_loss 'mean': its normaliser read from the targets alone
    seed_from_shape(gm)            # the backward's seed: ones of the loss's dtype, not of its value

The last two serve every step plan too (module/planning.py, with ``count_targets(gm,
early=True)``): data parallel, the count is all-reduced while the forward runs and the backward
starts without waiting for the loss's all_reduce, which joins the gradients' bucket at the end
(DDP's step has no collective before its backward either).

Microbatching is data parallelism over time: the batch is planned sharded over a virtual mesh
dim of one member per microbatch (module/pipeline.py), so every mean already lowers to a
partial sum divided by the global count (invariant 4) and the microbatches' partial losses and
gradients add up exactly. Two things stand in the way:

- an op that normalises over the batch by statistics of activations (BatchNorm in training:
  each microbatch would see its own batch statistics): ``check_microbatchable`` raises,
  naming it;
- nll_loss 'mean' divides by the total weight of the non-ignored targets, which a sharded
  batch all-reduces inside the op (rules/loss.py): across microbatches that reduction would
  need every microbatch's logits at once. ``count_targets`` rewrites it into the 'sum' loss
  divided by the count of non-ignored targets, computed from the targets alone: the pipeline
  runner reduces that count over the microbatches before any stage runs, so each
  microbatch's loss and gradient are already divided by the whole batch's count, whatever the
  spread of ignored labels (-100) over the microbatches.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..core.errors import MicrobatchError

aten = torch.ops.aten
MEAN, SUM = 1, 2
NLL_FORWARD = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
# batch norm's forward ops and the position of their ``training`` flag (True where constant)
BATCH_STATS = {aten.native_batch_norm.default: 5, aten._native_batch_norm_legit_functional.default: 5,
               aten._native_batch_norm_legit.no_stats: True, aten._native_batch_norm_legit.default: 5,
               aten.cudnn_batch_norm.default: 5}


def check_microbatchable(gm: fx.GraphModule) -> None:
    """Raise MicrobatchError for the first op whose result depends on the whole batch's
    activations (BatchNorm in training mode), naming it and the ways out."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in BATCH_STATS:
            continue
        pos = BATCH_STATS[n.target]
        training = pos if isinstance(pos, bool) else bool(n.args[pos] if len(n.args) > pos
                                                          else n.kwargs.get("training", True))
        if training:
            where = _module(n)
            raise MicrobatchError(
                f"{n.target} at node '{n.name}'{where} normalises by the statistics of the whole batch; a pipeline "
                "runs the batch in microbatches, each of which would see only its own statistics (a different "
                "result from one device's)", op=n.target, node=n.name,
                fix="put the BatchNorm in eval mode (pm.eval() / module.eval(): running statistics), replace it by "
                    "LayerNorm or GroupNorm, or train without pipeline= (data parallel BatchNorm is exact)")


def _module(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack")
    return f" in module '{list(stack.values())[-1][0]}'" if stack else ""


_LIKE = {aten.ones_like.default: aten.new_ones.default, aten.zeros_like.default: aten.new_zeros.default}


def seed_from_shape(gm: fx.GraphModule) -> None:
    """``ones_like(loss)``, the backward's seed, made ``new_ones(loss, [])``: it reads the loss's
    dtype, never its value, so the seed needs no loss reduced over the microbatches (a partial
    sum per microbatch) before the backward starts (rules/factory.py takes any input placement
    of new_*)."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _LIKE and n.meta["val"].dim() == 0:
            kwargs = {k: v for k, v in n.kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(_LIKE[n.target], (n.args[0], []), kwargs)
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
    gm.recompile()


def count_targets(gm: fx.GraphModule, early: bool = False) -> list[str]:
    """Rewrite every unweighted nll_loss 'mean' into sum / count of non-ignored targets (module
    docstring); returns notes for the plan. Weighted ones are left alone (their total weight
    then needs the microbatches' logits: the pipeline raises naming them). ``early``: the count,
    with the ops that make the targets it reads, moves to the graph's start (``_hoist``), so a
    batch-sharded step launches the count's all_reduce before its forward and waits for it only
    at the loss (lower/buckets.py), where nll_loss 'mean' all-reduced its total weight in place."""
    notes = []
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in NLL_FORWARD:
            continue
        x, t = n.args[0], n.args[1]
        weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        red = n.args[3] if len(n.args) > 3 else n.kwargs.get("reduction", MEAN)
        ignore = n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100)
        if red != MEAN or weight is not None:
            continue
        count = _rewrite(gm, n, x, t, ignore)
        if early:
            _hoist(gm.graph, count)
        notes.append(f"{n.name}: nll_loss 'mean' taken as its sum over the count of targets != {ignore}, "
                     "the count reduced over the microbatches first")
    if notes:
        gm.graph.lint()
        gm.recompile()
    return notes


def _rewrite(gm: fx.GraphModule, n: fx.Node, x: fx.Node, t: fx.Node, ignore: int) -> None:
    g = gm.graph
    mode = n.meta["val"][0].fake_mode
    dtype = n.meta["val"][0].dtype

    def node(target, args, kwargs=None):
        new = g.call_function(target, args, kwargs or {})
        new.meta.update({k: v for k, v in n.meta.items() if k != "val"})  # provenance: module, source, seq_nr
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with mode:
            new.meta["val"] = target(*vals, **(kwargs or {}))
        return new

    with g.inserting_after(n):
        summed = node(n.target, (x, t, None, SUM, ignore))
    with g.inserting_after(summed):
        total = node(operator.getitem, (summed, 0))
    with g.inserting_after(total):
        keep = node(aten.ne.Scalar, (t, ignore))
    with g.inserting_after(keep):
        count = node(aten.sum.default, (keep,), {"dtype": dtype})
    with g.inserting_after(count):
        loss = node(aten.div.Tensor, (total, count))
    for user in list(n.users):
        assert user.target is operator.getitem, user
        user.replace_all_uses_with(loss if user.args[1] == 0 else count)
        g.erase_node(user)
    g.erase_node(n)
    return count


def _hoist(g: fx.Graph, node: fx.Node) -> None:
    """Move ``node`` and the ops it depends on to just after the graph's placeholders (their
    order kept), when every one of them is an aten op that draws no random numbers (a function
    of the step's inputs alone: running it earlier changes nothing but when)."""
    nodes = list(g.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    chain, todo = set(), [node]
    while todo:
        x = todo.pop()
        if x in chain or x.op in ("placeholder", "get_attr"):
            continue
        pure = isinstance(x.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in x.target.tags
        if x.op != "call_function" or not (pure or x.target is operator.getitem):
            return
        chain.add(x)
        todo.extend(x.all_input_nodes)
    anchor = max((n for n in nodes if n.op in ("placeholder", "get_attr")), key=at.__getitem__, default=None)
    if anchor is None:
        return
    for x in sorted(chain, key=at.__getitem__):
        anchor.append(x)
        anchor = x
