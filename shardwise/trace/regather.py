"""Views of a parameter that backward reads are taken again in backward.

nn.Linear computes ``t(w)`` in forward and its backward reads that ``t``: a sharded weight
gathered for forward (FSDP) would then stay gathered, held by its view, until its gradient is
made, so every layer's full weights stay alive through backward and FSDP's memory saving is
gone. Here each such view chain (ops whose schema returns an alias of their input: t,
transpose, expand, ... of a parameter placeholder; normalize.is_view) is
repeated just before its first backward reader, so backward reads the parameter itself, which
the program gathers again for backward (search/paths.move_key: a program argument moved by a
collective is moved once per phase), as FSDP2 does. A view costs nothing, so a replicated or
locally sharded parameter loses nothing; the forward chain keeps its forward readers.
"""
from __future__ import annotations

import torch.fx as fx

from .normalize import is_view
from .roles import PARAM, PlaceholderRole


def views_again_in_backward(gm: fx.GraphModule, roles: list[PlaceholderRole]) -> list[str]:
    """Repeat, for backward readers, every forward view chain of a parameter (module docstring)."""
    params = {n for n, r in zip(gm.graph.find_nodes(op="placeholder"), roles) if r.kind == PARAM}
    views: set = set()  # forward nodes that are view chains of a parameter
    for n in gm.graph.nodes:
        if (is_view(n) and not n.meta.get("autograd_backward") and n.args
                and (n.args[0] in params or n.args[0] in views)):
            views.add(n)
    again: dict = {}  # forward view -> its backward copy
    for n in list(gm.graph.nodes):
        if n.meta.get("autograd_backward") and any(a in views for a in n.all_input_nodes):
            n.args, n.kwargs = fx.map_arg((n.args, n.kwargs), lambda a: _again(gm, a, n, views, again))
    return [f"{len(again)} parameter view(s) taken again in backward"] if again else []


def _again(gm: fx.GraphModule, a: fx.Node, before: fx.Node, views: set, again: dict) -> fx.Node:
    """``a`` itself, or (a forward view chain of a parameter) its backward copy, made before
    ``before`` the first time a backward node asks for it."""
    if a not in views:
        return a
    if a not in again:
        src = _again(gm, a.args[0], before, views, again)
        with gm.graph.inserting_before(before):
            copy = gm.graph.create_node("call_function", a.target, (src, *a.args[1:]), dict(a.kwargs),
                                        name=f"{a.name}_again")
        copy.meta = {**a.meta, "autograd_backward": True}
        again[a] = copy
    return again[a]
