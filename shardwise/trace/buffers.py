"""Buffers a training step updates (BatchNorm's running statistics) become graph outputs.

In training mode ``aten.native_batch_norm`` writes the new running mean and variance into
its inputs without its schema saying so, and functionalisation leaves a trailing ``copy_``
into the placeholder for every other updated buffer (``num_batches_tracked += 1``). A
functional step returns new values instead of writing them:

- ``native_batch_norm(training=True)`` on running statistics becomes
  ``_native_batch_norm_legit_functional``, which returns the updated statistics (outputs 3
  and 4); they are written back with a ``copy_`` like the others.
- every ``copy_`` into a buffer placeholder is removed and its value appended to the graph's
  outputs; ``gm.meta["buffer_updates"]`` lists the buffer names in output order, and the
  caller writes them back after the step (``ParallelModule.step``).

Anything else that writes into a placeholder stays and is refused by ``check_functional``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .roles import BUFFER

aten = torch.ops.aten
BN, BN_FUNCTIONAL = aten.native_batch_norm.default, aten._native_batch_norm_legit_functional.default


def _functional_batch_norm(gm: fx.GraphModule, placeholders: set) -> None:
    """Training batch norms -> the functional op; later reads of the running statistics read its
    new ones (as functionalisation does for a visible mutation), and buffer placeholders get a
    ``copy_`` of them. Statistics that are not placeholders (InstanceNorm's running stats
    repeated per sample, reduced into the buffer afterwards) are just rewired."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not BN or len(n.args) < 8 or not n.args[5]:
            continue
        rm, rv = n.args[3], n.args[4]
        if not isinstance(rm, fx.Node) or not isinstance(rv, fx.Node):
            continue
        vals = fx.node.map_arg(n.args, lambda a: a.meta["val"])
        with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
            n.meta["val"] = BN_FUNCTIONAL(*vals)
        n.target = BN_FUNCTIONAL
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        with gm.graph.inserting_after(n):
            for k, dst in ((4, rv), (3, rm)):
                new = gm.graph.call_function(operator.getitem, (n, k))
                new.meta["val"] = n.meta["val"][k]
                for user in [u for u in dst.users if u is not n and order.get(u, -1) > order[n]]:
                    user.replace_input_with(dst, new)
                if dst in placeholders:
                    (out,) = gm.graph.find_nodes(op="output")
                    with gm.graph.inserting_before(out):
                        gm.graph.call_function(aten.copy_.default, (dst, new))


def buffer_updates(gm: fx.GraphModule, roles: list) -> list[str]:
    """Turn buffer writes into extra graph outputs; return the buffer names in output order."""
    phs = dict(zip(gm.graph.find_nodes(op="placeholder"), roles))
    buffers = {n for n, r in phs.items() if r.kind == BUFFER}
    _functional_batch_norm(gm, buffers)
    names, values = [], []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in buffers and not n.users:
            names.append(phs[n.args[0]].name)
            values.append(n.args[1])
            gm.graph.erase_node(n)
    if names:
        (out,) = gm.graph.find_nodes(op="output")
        outs = out.args[0]
        out.args = ((*outs, *values) if isinstance(outs, (tuple, list)) else (outs, *values),)
        gm.recompile()
    gm.meta["buffer_updates"] = names
    return names
