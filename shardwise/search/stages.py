"""Pipeline stages of the traced step: which stage runs each node, and where to cut.

    runs = forward_runs(gm)                       # the model's pieces in forward order
    starts = resolve(gm, ["model.layers.16"])     # split points -> the first node of each stage
    stages = assign(gm, roles, starts)            # Stages: node -> stage, parameter -> owner
    cut = balance(costs, state, act, inflight, n_stages, budget)   # run indices starting stages 1..

A stage is a contiguous run of the forward pass. Forward nodes take the stage of their
position in the forward order (the trace records ops as they run); a stage starts at the
first forward node that ran in its split point's module. A backward node runs in the stage of
its module (the forward op's, trace/provenance.py links them) when that module's forward ran
in one stage; otherwise (the autograd engine's gradient accumulations, a root module whose
forward spans stages) where the gradients it reads meet: the lowest of their stages, as the
backward runs from the last stage down; reading no gradient, at the latest stage of the
forward values it reads; reading neither (a constant, a parameter's transpose), at the highest
stage reading it. (Data alone cannot tell: a rotary or mask table from stage 0 is read by
every stage's backward.) A parameter or
buffer is owned by the lowest stage that reads it (a tied embedding and head: the embedding's
stage, which then sends it to the head's stage and receives the head's gradient share, both
by point-to-point messages). Model inputs, targets and constants are read where needed.

The planner's cut (no split points) balances the stages' modelled forward + backward times:
a dynamic program over the forward runs (the maximal stretches of the forward pass in one
layer, search/layers.py's notion: the embeddings, each block, the head, the loss) that
minimises the largest stage time, each stage's parameters, gradients, optimizer state and
in-flight activations within the memory budget.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from ..core.errors import ConfigError, MemoryBudgetError
from ..trace.provenance import layer_of, module_path
from ..trace.roles import BUFFER, PARAM


def is_backward(n: fx.Node) -> bool:
    return bool(n.meta.get("autograd_backward"))


def forward_nodes(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and not is_backward(n)]


@dataclass(frozen=True)
class Run:
    """A maximal stretch of the forward pass in one layer (``layer_of`` its module path)."""

    layer: str
    first: str  # the name of its first forward node
    module: str  # that node's module path (how a split point names it)


TOP = layer_of("")


def forward_runs(gm: fx.GraphModule) -> list[Run]:
    """The forward pass as runs of one layer each, in order (getitems stay with their producer;
    ops in no module, such as a residual add between blocks or the loss, join the run before)."""
    runs: list[Run] = []
    for n in forward_nodes(gm):
        if n.target is operator.getitem:
            continue
        layer = layer_of(module_path(n) or "")
        if runs and layer == TOP:
            continue
        if not runs or runs[-1].layer != layer:
            runs.append(Run(layer, n.name, module_path(n) or ""))
    return runs


def resolve(gm: fx.GraphModule, split_points) -> list[str]:
    """The first forward node of each split point's module, each after the previous one."""
    fwd = forward_nodes(gm)
    out, pos = [], 0
    for sp in split_points:
        for i in range(pos, len(fwd)):
            path = module_path(fwd[i]) or ""
            if fwd[i].target is not operator.getitem and (path == sp or path.startswith(sp + ".")):
                out.append(fwd[i].name)
                pos = i + 1
                break
        else:
            seen = [r.module for r in forward_runs(gm)]
            raise ConfigError(f"pipeline split point {sp!r} names no module that runs after the previous split point "
                              f"in the forward pass (the forward runs through {_shorten(seen)})",
                              fix="name the modules where stages 1, 2, ... begin, in forward order, e.g. "
                                  "split_points=['model.layers.16'] (or None: the planner chooses)")
    return out


def _shorten(names: list, k: int = 8) -> str:
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


@dataclass(frozen=True)
class Stages:
    """``of``: {graph node name: stage} for every call node; ``owner``: {parameter or buffer
    name: stage}; ``starts``: the first forward node of stages 1, 2, ...; ``names``: their
    module paths (the split points, as the summary prints them)."""

    n: int
    of: dict
    owner: dict
    starts: tuple
    names: tuple

    def layers(self, gm: fx.GraphModule) -> list[list[str]]:
        """Per stage, the layers its forward runs through."""
        out: list = [[] for _ in range(self.n)]
        for n in forward_nodes(gm):
            layer = layer_of(module_path(n) or "")
            if layer not in out[self.of[n.name]]:
                out[self.of[n.name]].append(layer)
        return out


def assign(gm: fx.GraphModule, roles: list, starts: list[str], check: bool = True) -> Stages:
    """Stages of every node with stages beginning at ``starts`` (module docstring); with
    ``check``, an edge the schedule could not run (a backward value flowing to a later stage)
    raises a ConfigError."""
    begins = set(starts)
    of: dict = {}
    stage, by_module = 0, {}
    for n in forward_nodes(gm):
        if n.name in begins:
            stage += 1
        of[n.name] = stage
        by_module.setdefault(module_path(n), set()).add(stage)
    pending = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not is_backward(n):
            continue
        if n.target is operator.getitem and n.args[0].name in of:
            of[n.name] = of[n.args[0].name]
            continue
        path = module_path(n)
        if path and len(by_module.get(path, ())) == 1 and not n.meta.get("gradient_accumulation"):
            (of[n.name],) = by_module[path]
            continue
        fwd = [of[a.name] for a in n.all_input_nodes if a.name in of and not is_backward(a)]
        bwd = [of[a.name] for a in n.all_input_nodes if a.name in of and is_backward(a)]
        if fwd or bwd:
            of[n.name] = min(bwd) if bwd else max(fwd)
        else:
            pending.append(n)
    for n in reversed(pending):  # constants of the backward: where they are read
        users = [of[u.name] for u in n.users if u.name in of]
        of[n.name] = max(users) if users else len(starts)
    owner = _owners(gm, roles, of)
    if check:
        _check_edges(gm, of)
    names = tuple(module_path(next(x for x in gm.graph.nodes if x.name == s)) or s for s in starts)
    return Stages(len(starts) + 1, of, owner, tuple(starts), names)


def _owners(gm: fx.GraphModule, roles: list, of: dict) -> dict:
    owner = {}
    for node, role in zip(gm.graph.find_nodes(op="placeholder"), roles):
        if role.kind in (PARAM, BUFFER):
            users = [of[u.name] for u in node.users if u.name in of]
            owner[role.name] = min(users) if users else 0
            of[node.name] = owner[role.name]
    return owner


def _check_edges(gm: fx.GraphModule, of: dict) -> None:
    """Forward values flow to the same or later stages (by construction); backward values must
    flow to the same or earlier ones, as the backward pass runs from the last stage down."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not is_backward(n):
            continue
        for a in n.all_input_nodes:
            if a.op == "call_function" and is_backward(a) and of[a.name] < of[n.name]:
                raise ConfigError(
                    f"pipeline stages: backward node '{n.name}' (stage {of[n.name]}) reads '{a.name}' of stage "
                    f"{of[a.name]}, but the backward pass runs from the last stage down",
                    fix="choose split points at block boundaries (e.g. the start of a repeated layer), or "
                        "split_points=None to let the planner choose")


# -- the planner's cut ---------------------------------------------------------------------------
def balance(costs: list, state: list, act: list, inflight, n_stages: int, budget=None) -> list[int]:
    """The run indices where stages 1 .. n_stages - 1 begin: contiguous groups of the runs
    minimising the largest stage's ``costs`` sum (seconds), such that each stage ``s`` fits
    ``budget`` bytes: the sum of its runs' ``state`` (parameters, gradients, optimizer state)
    plus ``inflight(s)`` times the sum of their ``act`` (activations kept for backward, per
    microbatch). Ties keep earlier cuts. A MemoryBudgetError names the stage that cannot fit."""
    k = len(costs)
    if n_stages > k:
        raise ConfigError(f"the pipeline has {n_stages} stages but the forward pass has only {k} pieces to split at "
                          "(the runs of one layer each)",
                          fix="use fewer pipeline ranks or stages_per_rank, or a deeper model")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)

    def fits(s: int, a: int, b: int) -> bool:
        return budget is None or sum(state[a:b]) + inflight(s) * sum(act[a:b]) <= budget

    inf = float("inf")
    # best[s][j]: least max cost of stages 0..s-1 over runs [0, j); cut[s][j]: where stage s-1 began
    best = [[inf] * (k + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (k + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, k - (n_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not fits(s - 1, i, j):
                    continue
                v = max(best[s - 1][i], pre[j] - pre[i])
                if v < best[s][j] - 1e-15:
                    best[s][j], cut[s][j] = v, i
    if best[n_stages][k] == inf:
        raise MemoryBudgetError(f"no split of the forward pass into {n_stages} stages keeps every stage within "
                                f"memory_budget={budget:.4g} bytes (parameters, gradients, optimizer state and "
                                "in-flight activations per stage)",
                                fix="raise memory_budget, use more pipeline ranks, fewer microbatches in flight "
                                    "(schedule='1f1b'), or shard the stages on other mesh dims")
    bounds, j = [], k
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        if s > 1:
            bounds.append(i)
        j = i
    return sorted(bounds)
