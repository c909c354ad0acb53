"""Identical layers, found structurally, so the ILP solves a repeated layer once.

    aliases = repeated_layers(gm, params, placeholder_placements, free)   # {node: template node}

A layer is the set of graph nodes (forward and backward) that ran in one numbered module
(``transformer.h.7``: prefix ``transformer.h``, index 7; module paths from the trace's
provenance), with that module's parameters' placeholders and the nodes that ran in no module
(the autograd engine's gradient accumulations) joined to the layer of their latest input (the
layer running then; so the residual stream's accumulation from the layer above joins each layer
alike, the last one's included, and GPT-2's 12 layers all match). Layers of one prefix whose node
sequences agree node by node (op, arguments as global shapes and dtypes, outputs, which
earlier node of the layer each input comes from, the parameters' placements or candidates)
are identical; when at least MIN_REPEATS are, the nodes at one position of those layers share
the columns of the first of them in graph order (the first layer's in forward, the last
layer's in backward, which runs first), their template. search/ilp.py then gives an alias its template's
columns (one strategy for all copies), charges its compute and moves once per copy, and
builds each distinct edge between aliased nodes once: the program's size does not grow
with depth. Layers that differ (another shape, a placement the user gave to one of them) keep
their own columns.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from ..trace.provenance import module_path

LAYER = re.compile(r"^(?P<prefix>.*?)\.(?P<index>\d+)(?:\.|$)")
MIN_REPEATS = 3  # fewer identical layers: the full program is small enough, and exact per layer


def layer_key(path: str | None):
    """``transformer.h.7.attn`` -> ("transformer.h", 7); None outside numbered modules."""
    m = LAYER.match(path or "")
    return None if m is None else (m.group("prefix"), int(m.group("index")))


def _layers(gm: fx.GraphModule, params: dict, infer: bool = True) -> dict:
    """{(prefix, index): [nodes in graph order]}; getitems follow their producer; ``infer``: with
    the nodes that ran in no module, by their inputs' layer."""
    out: dict = {}
    where: dict = {}
    inferred: set = set()
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            key = layer_key(params.get(n.name))
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            key = where.get(n.args[0].name)
        elif n.op == "call_function":
            key = layer_key(module_path(n))
            if key is None and not module_path(n):  # ran in no module (a gradient accumulation)
                key = _latest_layer(n, where, order)
                inferred.add(n.name)
        else:
            key = None
        if key is not None:
            where[n.name] = key
            out.setdefault(key, []).append(n)
    shared = _shared(gm, where)
    out = {key: [n for n in nodes if n.name not in shared] for key, nodes in out.items()}
    if not infer:
        out = {key: [n for n in nodes if n.name not in inferred] for key, nodes in out.items()}
    return out


def _shared(gm: fx.GraphModule, where: dict) -> set:
    """Nodes of a layer that several other layers of its prefix read, with the nodes that only
    feed them: the trace merges repeated pure computations (trace/normalize.py), so GPT-2's causal
    mask is made in the first layer and read by every one. They are no layer's own (the first
    layer would differ from the rest); they keep their own columns."""
    shared: set = set()
    for n in reversed(gm.graph.nodes):
        key = where.get(n.name)
        if key is None:
            continue
        others = {k for u in n.users if (k := where.get(u.name)) is not None and k != key and k[0] == key[0]}
        if len(others) >= 2 or (n.users and all(u.name in shared for u in n.users)):
            shared.add(n.name)
    return shared


def _latest_layer(n: fx.Node, where: dict, order: dict):
    """The layer of ``n``'s input made last, among inputs in a layer (None if none is): the layer
    running when ``n`` runs. A residual stream's gradient accumulation adds the gradient from the
    layer above to the one this layer's backward just made: it joins this layer, as the first
    one's joins it (the gradient from above comes from outside the layers there)."""
    inside = [a for a in n.all_input_nodes if a.name in where]
    return where[max(inside, key=lambda a: order[a.name]).name] if inside else None


def _signature(nodes: list, placements: dict, free: dict) -> tuple:
    """What must agree for two layers to share columns (module docstring)."""
    pos = {n.name: i for i, n in enumerate(nodes)}
    sig = []
    for n in nodes:
        ins = tuple(pos.get(a.name, -1) for a in n.all_input_nodes)
        if n.op == "placeholder":
            val = n.meta.get("val")
            shape = (tuple(val.shape), val.dtype) if val is not None else None
            sig.append(("param", shape, tuple(free[n.name]) if n.name in free else placements.get(n.name)))
        elif n.target is operator.getitem:
            sig.append(("getitem", n.args[1], ins))
        else:
            sig.append((str(n.target), _plain(n.args), _plain(n.kwargs), _plain(n.meta.get("val")), ins))
    return tuple(sig)


def _plain(a):
    """An argument or value as plain data: a tensor (or the node making it) as its global shape and
    dtype, containers item by item, anything else printed (what node_call's OpCall holds, without
    building one per node)."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_plain(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _plain(v)) for k, v in sorted(a.items()))
    return repr(a)


def repeated_layers(gm: fx.GraphModule, params: dict, placements: dict, free: dict,
                    min_repeats: int = MIN_REPEATS) -> dict:
    """{node name: template node name} for every node of a layer identical to an earlier one:
    with the gradient accumulations between layers counted in (then the program does not grow
    with depth at all), or, where that leaves fewer than ``min_repeats`` identical layers,
    without them."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for infer in (True, False):
        found = _aliases(_layers(gm, dict(params or {}), infer), order, placements, free, min_repeats)
        if found:
            return found
    return {}


def _aliases(layers: dict, order: dict, placements: dict, free: dict, min_repeats: int) -> dict:
    by_prefix: dict = {}
    for prefix, index in sorted(layers):
        by_prefix.setdefault(prefix, []).append(index)
    aliases = {}
    for prefix, indices in by_prefix.items():
        groups: dict = {}  # signature -> the layers that have it, first one the template
        for i in indices:
            groups.setdefault(_signature(layers[prefix, i], placements, free), []).append(i)
        for same in groups.values():
            if len(same) < min_repeats:
                continue
            for members in zip(*(layers[prefix, i] for i in same)):  # one position of the layer
                first = min(members, key=lambda n: order[n.name])  # backward runs the last layer first
                aliases.update({n.name: first.name for n in members if n is not first})
    return aliases


__all__ = ["repeated_layers", "layer_key", "MIN_REPEATS"]
