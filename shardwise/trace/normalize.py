"""Checks and the minimal clean-up applied to every traced graph.

- ``check_functional``: no op with a mutable schema may remain. A ``copy_`` into a
  placeholder (what functionalisation leaves for a mutated graph input) is reported by
  role: a mutated buffer (BatchNorm running stats), parameter or input.
- ``strip_asserts``: ``aten._assert_*`` and ``aten.sym_*`` nodes without users are removed.
  Everything else is kept (detach and alias included: they have rules).
- ``remove_dead``: nodes whose results nobody uses are dropped (fx's dead-code elimination;
  random ops count as impure and stay, so the RNG stream is unchanged).
- ``rename_placeholders``: placeholders get names from their roles (``p_fc1_weight``,
  ``b_inv_freq``, ``input_ids``, ``target_0``) so printed graphs read well.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..core.calls import OpCall, leaves
from ..core.errors import ShardingError
from .provenance import source_line
from .roles import BUFFER, PlaceholderRole, placeholder_name


def is_view_op(op) -> bool:
    """An op whose output is its input's data, not new bytes: torch's schema says it returns an
    alias (OpOverload.is_view: view, t, transpose, expand, split, detach, ...), or it is
    aten._unsafe_view, the alias decompositions make without saying so (matmul's reshape back)."""
    return isinstance(op, torch._ops.OpOverload) and (op.is_view or op is torch.ops.aten._unsafe_view.default)


_aten = torch.ops.aten
# Ops that keep their input's elements in order and restate only its shape.
RESHAPES = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.unsqueeze.default,
                      _aten.alias.default})
# Ops whose output is their input's data copied or cast.
COPIES = frozenset({_aten._to_copy.default, _aten.clone.default})


def is_view(n: fx.Node) -> bool:
    """A call_function node of a view op (``is_view_op``)."""
    return n.op == "call_function" and is_view_op(n.target)


def is_mutable(target) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


# Ops that write into inputs although their schema does not say so: op -> (training arg
# index, indices of the tensors written when training is True). aten.native_batch_norm
# updates running_mean/running_var in place in training mode.
HIDDEN_MUTATIONS = {torch.ops.aten.native_batch_norm.default: (5, (3, 4))}


def _hidden_mutations(n: fx.Node) -> list:
    spec = HIDDEN_MUTATIONS.get(n.target)
    if spec is None:
        return []
    training, written = spec
    if len(n.args) <= training or not n.args[training]:
        return []
    return [n.args[i] for i in written if i < len(n.args) and n.args[i] is not None]


def check_functional(gm: fx.GraphModule, roles: list[PlaceholderRole]) -> None:
    """Raise ShardingError if any op in the graph mutates its inputs."""
    phs = {n: r for n, r in zip(gm.graph.find_nodes(op="placeholder"), roles)}
    mutated, other = [], []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for dst in _hidden_mutations(n):
            if dst in phs:
                mutated.append(phs[dst])
            else:
                other.append(f"{n.name} = {n.target} writes into {dst} (from {source_line(n) or 'unknown source'})")
        if not is_mutable(n.target):
            continue
        dst = n.args[0] if n.args else None
        if n.target is torch.ops.aten.copy_.default and dst in phs:
            mutated.append(phs[dst])
        else:
            other.append(f"{n.name} = {n.target} (from {source_line(n) or 'unknown source'})")
    mutated = list(dict.fromkeys(mutated))
    if mutated:
        buffers = [r for r in mutated if r.kind == BUFFER]
        what = ", ".join(r.describe() for r in mutated)
        raise ShardingError(
            f"the traced step mutates {what} in place; shardwise plans functional steps only",
            fix=("BatchNorm-style running statistics: call model.eval() or build the norm with "
                 "track_running_stats=False (or use LayerNorm/GroupNorm)" if buffers else
                 "do not write into parameters or inputs inside forward; return new tensors instead"),
        )
    if other:
        raise ShardingError(
            "functionalisation left mutating ops in the traced graph:\n  " + "\n  ".join(other),
            fix="rewrite the in-place op out-of-place in the model, or report the op to shardwise",
        )


def _is_assert_or_sym(target) -> bool:
    name = getattr(target, "__name__", "") or ""
    overload = getattr(target, "_overloadpacket", None)
    base = getattr(overload, "__name__", name)
    ns = getattr(target, "namespace", None)
    return ns == "aten" and (base.startswith("_assert") or base.startswith("sym_"))


def strip_asserts(gm: fx.GraphModule) -> list[str]:
    """Remove user-less ``aten._assert_*`` / ``aten.sym_*`` nodes; return what was done."""
    removed: dict[str, int] = {}
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and _is_assert_or_sym(n.target) and not n.users:
            removed[str(n.target)] = removed.get(str(n.target), 0) + 1
            gm.graph.erase_node(n)
    kept = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and _is_assert_or_sym(n.target)})
    notes = [f"removed {c} x {op}" for op, c in sorted(removed.items())]
    if kept:
        notes.append("kept (have users): " + ", ".join(kept))
    return notes


def remove_dead(gm: fx.GraphModule) -> list[str]:
    before = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    gm.graph.eliminate_dead_code()
    after = {n.name for n in gm.graph.nodes}
    gone = sorted(f"{name} ({op})" for name, op in before.items() if name not in after)
    return [f"removed {len(gone)} unused node(s): " + ", ".join(gone)] if gone else []


def _key(a):
    """A hashable form of an argument in which values that compare equal but act differently stay
    apart (``1``, ``1.0`` and ``True``; ``0.0`` and ``-0.0``): type and repr for scalars."""
    if isinstance(a, fx.Node):
        return a
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_key(x) for x in a))
    if isinstance(a, dict):
        return tuple(sorted((k, _key(v)) for k, v in a.items()))
    return (type(a).__name__, repr(a))


def merge_duplicates(gm: fx.GraphModule) -> list[str]:
    """One node for each pure aten computation repeated with the same arguments in the same phase
    (a causal mask rebuilt in every layer, ``scalar_tensor(-inf)`` per layer): one value to lay out and
    move instead of one per copy. Random ops (seeded), mutating ops and custom ops stay as they are;
    a forward node is not merged with a backward one, so no value lives longer than it did."""
    seen: dict = {}
    merged = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        t = n.target
        aten_op = isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"
        if not (aten_op or t is operator.getitem):
            continue
        if aten_op and (torch.Tag.nondeterministic_seeded in t.tags or is_mutable(t) or n.is_impure()):
            continue
        key = (t, bool(n.meta.get("autograd_backward")), _key(n.args), _key(n.kwargs))
        first = seen.setdefault(key, n)
        if first is not n:
            n.replace_all_uses_with(first)
            gm.graph.erase_node(n)
            merged += 1
    return [f"merged {merged} repeated pure node(s)"] if merged else []


def rename_placeholders(gm: fx.GraphModule, roles: list[PlaceholderRole]) -> None:
    for n, role in zip(gm.graph.find_nodes(op="placeholder"), roles):
        n._rename(placeholder_name(role))
        n.target = n.name


def aten_ops(gm: fx.GraphModule) -> set:
    """The op overloads called in the graph (operator.getitem excluded: it only unpacks tuples)."""
    return {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}


def _val(n: fx.Node):
    if "val" in n.meta:
        return n.meta["val"]
    if n.op == "get_attr":
        obj = n.graph.owning_module
        for part in n.target.split("."):
            obj = getattr(obj, part)
        return obj
    raise KeyError(f"node {n.name} has no meta['val']")


def node_call(node: fx.Node) -> OpCall:
    """The rule-facing view of a call_function node: tensors as TensorMeta (global shapes)."""
    args = fx.node.map_arg(node.args, _val)
    kwargs = fx.node.map_arg(node.kwargs, _val)
    # an op that returns nothing (aten._linalg_check_errors) has no "val": no outputs
    return OpCall.from_values(node.target, args, kwargs, node.meta.get("val", ()))


def tensor_arg_nodes(node: fx.Node) -> list:
    """The fx nodes that feed the op's tensor inputs, in OpCall.ins order (pytree of args, kwargs)."""
    return [a for a in leaves((node.args, node.kwargs))
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
