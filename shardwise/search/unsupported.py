"""Checks before planning: every op of the graph has a rule or is allowed the replicate
fallback (all missing ops named in one error, not one per run), and the fallback's op names
exist (a misspelled name would otherwise be ignored silently)."""
from __future__ import annotations

import difflib
import operator

import torch
import torch.fx as fx

from ..core.errors import ShardingError, UnsupportedOpError, UnsupportedOpsError
from ..rules.registry import Registry
from ..trace.provenance import source_line


def _allowed(op, fallback_ops) -> bool:
    return op in fallback_ops or str(op) in fallback_ops


def check_rules(gm: fx.GraphModule, registry: Registry, fallback_ops=()) -> None:
    """Raise UnsupportedOpError (one op) or UnsupportedOpsError (several) naming every op of
    ``gm`` that has no rule and is not in ``fallback_ops``, each at its first node."""
    missing: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or n.target in registry:
            continue
        if not _allowed(n.target, fallback_ops) and n.target not in missing:
            missing[n.target] = (n.target, n.name, source_line(n))
    if len(missing) == 1:
        op, node, source = next(iter(missing.values()))
        raise UnsupportedOpError(op, node=node, source=source)
    if missing:
        raise UnsupportedOpsError(list(missing.values()))


def _resolve(name: str):
    """``"aten.add.Tensor"`` -> the OpOverload; ShardingError naming what is wrong otherwise."""
    parts = name.split(".")
    if len(parts) != 3:
        raise ShardingError(f"replicate_fallback names {name!r}, which is not an op overload name "
                            "'namespace.op.overload'", fix="e.g. replicate_fallback={'aten.histc.default'} "
                                                           "(the name the UnsupportedOpError printed)")
    ns, op, overload = parts
    packet = getattr(getattr(torch.ops, ns), op, None) if hasattr(torch.ops, ns) else None
    if packet is None:
        known = dir(getattr(torch.ops, ns)) if ns == "aten" else []
        close = difflib.get_close_matches(op, known, n=3)
        hint = f"; did you mean {', '.join(f'{ns}.{c}' for c in close)}?" if close else ""
        raise ShardingError(f"replicate_fallback names {name!r}, but there is no op {ns}.{op}{hint}",
                            fix="use the op name the UnsupportedOpError printed, e.g. 'aten.histc.default'")
    if overload not in packet.overloads():
        raise ShardingError(f"replicate_fallback names {name!r}, but {ns}.{op} has no overload {overload!r}; "
                            f"it has {', '.join(packet.overloads())}", fix=f"e.g. '{ns}.{op}.{packet.overloads()[0]}'")
    return getattr(packet, overload)


def check_fallback(fallback_ops) -> None:
    """Every entry of ``replicate_fallback`` is an op overload or a name that resolves to one."""
    if isinstance(fallback_ops, str):
        raise ShardingError(f"replicate_fallback must be a collection of op names, got the string {fallback_ops!r}",
                            fix=f"replicate_fallback={{{fallback_ops!r}}}")
    for op in fallback_ops:
        if isinstance(op, torch._ops.OpOverload):
            continue
        if isinstance(op, torch._ops.OpOverloadPacket):
            raise ShardingError(f"replicate_fallback names the op packet {op}, not one overload",
                                fix=f"e.g. {op}.{op.overloads()[0]}")
        if not isinstance(op, str):
            raise ShardingError(f"replicate_fallback holds {op!r} ({type(op).__name__}), not an op or op name",
                                fix="give op overloads (torch.ops.aten.histc.default) or their names")
        _resolve(op)
