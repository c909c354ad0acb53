"""Core ATen coverage: every op torch tags ``core`` has a rule that passes the rule sweep, or a
documented refusal saying why not and what to do instead.

    shardwise verify-rules --coverage            # the table; exit 1 if an op is missing or failing
    shardwise verify-rules --coverage --op sin   # only core ops whose name contains 'sin'

An op with a rule is checked by the sweep (tools/verify/sweep.py: every strategy on meshes (2,),
(3,), (2, 2), uneven sizes) and shows as ``verified`` or ``FAILED``; an op in ``REFUSALS``
shows as ``refused`` with its reason; anything else is ``MISSING``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

_SYM = ("a symbolic-shape query: shardwise traces static shapes, so it never reaches a plan "
        "(unused ones are stripped after tracing)")
_NO_RULE = "no rule yet: {why}; way out: parallelize(..., replicate_fallback={{'{op}'}}) runs it replicated"
# op name -> why it has no rule (what the user sees, and the way out)
REFUSALS = {
    "aten._local_scalar_dense.default": "reads a Python number from tensor data (.item()): the trace refuses it "
                                        "with TraceError naming the user's line; keep values as tensors",
    "aten.nonzero.default": "its output shape depends on the data: the trace refuses it with TraceError naming the "
                            "user's line; use fixed-shape masks (torch.where)",
    "aten.masked_scatter.default": "takes source elements in the order of the mask's true entries, so a shard's "
                                   "share of the source depends on the other shards' masks; use torch.where",
    "aten.sym_numel.default": _SYM, "aten.sym_size.int": _SYM, "aten.sym_storage_offset.default": _SYM,
    "aten.sym_stride.int": _SYM, "aten.sym_is_contiguous.default": _SYM,
    "aten.resize_.default": "resizes its input in place: functionalised graphs never hold it (a traced "
                            "step is checked to be functional)",
    "aten.atan2.out": "an out= variant: functional graphs never hold it (aten.atan2.default has a rule)",
    **{op: _NO_RULE.format(why=why, op=op) for op, why in {
        "aten.rand.default": "a random factory with no input to shard alongside; the *_like draws (rand_like, "
                             "randn_like, bernoulli) have rules",
        "aten.randn.default": "a random factory with no input to shard alongside; the *_like draws have rules",
        "aten.randperm.default": "a random permutation: every element depends on the whole draw",
        "aten.col2im.default": "overlapping windows summed (a halo, as spatial convolutions)",
        "aten._native_batch_norm_legit.default": "the overload that writes running statistics into its inputs",
    }.items()},
}


def core_aten_ops() -> list:
    """Every aten overload tagged ``torch.Tag.core`` in this torch, sorted by name. Read from the
    dispatcher's table (``dir(torch.ops.aten)`` lists only the ops looked up so far)."""
    ops = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, name = qualified.partition("::")
        if ns != "aten":
            continue
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if isinstance(op, torch._ops.OpOverload) and torch.Tag.core in op.tags:
            ops.add(op)
    return sorted(ops, key=str)


@dataclass
class CoverageRow:
    op: object
    status: str  # verified | FAILED | refused | MISSING
    note: str


def coverage(op_filter: str | None = None, full: bool = False, progress=None) -> list[CoverageRow]:
    """One row per core ATen op (matching ``op_filter``): its rule swept, or its refusal."""
    from ...rules import DEFAULT, load_all
    from .sweep import sweep

    registry = load_all(DEFAULT)
    core = [op for op in core_aten_ops() if not op_filter or op_filter in str(op)]
    ruled = [op for op in core if op in registry]
    report = sweep(registry, ops=ruled, full=full, progress=progress) if ruled else None
    rows = []
    for op in core:
        if op in registry:
            st = report.rows[op]
            if st.failures:
                rows.append(CoverageRow(op, "FAILED", f"{len(st.failures)} failing strategies (shardwise verify-rules "
                                                      f"--op {op})"))
            elif not st.samples:
                rows.append(CoverageRow(op, "FAILED", "a rule but no sample to verify it on"))
            else:
                rows.append(CoverageRow(op, "verified", f"{st.samples} samples, {st.strategies} strategies"
                                        + (f" ({st.note})" if st.note else "")))
        elif str(op) in REFUSALS:
            rows.append(CoverageRow(op, "refused", REFUSALS[str(op)]))
        else:
            rows.append(CoverageRow(op, "MISSING", "no rule and no documented refusal"))
    return rows


def table(rows: list[CoverageRow]) -> str:
    width = max([len(str(r.op)) for r in rows] + [2])
    lines = [f"{'core ATen op':<{width}}  {'status':<8}  note", "-" * (width + 40)]
    lines += [f"{str(r.op):<{width}}  {r.status:<8}  {r.note}" for r in rows]
    counts = {s: sum(r.status == s for r in rows) for s in ("verified", "refused", "FAILED", "MISSING")}
    lines.append(f"CORE ATEN: {len(rows)} ops, " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def run_cli(op: str | None = None, full: bool = False, out=None) -> int:
    """``shardwise verify-rules --coverage``: prints the table; 1 if any op is MISSING or FAILED."""
    from ..progress import sweep_progress

    out = out or sys.stdout
    with sweep_progress(op) as progress:
        rows = coverage(op, full, progress)
    if not rows:
        print(f"no core ATen op matches {op!r}", file=out)
        return 2
    print(table(rows), file=out)
    return 0 if all(r.status in ("verified", "refused") for r in rows) else 1
