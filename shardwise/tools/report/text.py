"""The plan in a screenful: parameters grouped by layer pattern, communication per kind and
the busiest layers, memory per rank. ``shardwise plan`` and ``shardwise demo`` print it;
``Plan.summary()`` is the full per-node table.
"""
from __future__ import annotations

import re
from collections import Counter, OrderedDict

from ...core.units import fmt_bytes
from ...core.units import fmt_seconds
from ...lower.allocator import ALLOCATOR_NAMES, ALLOCATORS


def _pattern(name: str) -> str:
    """``blocks.3.attn.qkv.weight`` -> ``blocks.*.attn.qkv.weight`` (layers that repeat, once)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def _indices(name: str) -> tuple:
    """The layer numbers ``_pattern`` replaces: ``blocks.3.attn.qkv.weight`` -> (3,)."""
    return tuple(int(i) for i in re.findall(r"\.(\d+)(?=\.)", name))


def param_groups(data: dict) -> list[tuple[str, str, list, int, str]]:
    """(pattern, placements, shape, count, why), parameters of repeated layers folded into one
    line; ``why``: given, planner or default (lower/explain.param_reasons). Where the layers of a
    pattern are placed differently, each line names its layers (``blocks.{0,2-5}.attn.qkv.weight``)
    instead of folding them into rows that read alike."""
    groups: OrderedDict = OrderedDict()
    for p in data["params"]:
        key = (_pattern(p["name"]), p["placements"], tuple(p["shape"]), p.get("why", "").split(" ")[0])
        groups.setdefault(key, []).append(_indices(p["name"]))
    per_pattern = Counter(pat for pat, *_ in groups)
    return [(pat if per_pattern[pat] == 1 else _named(pat, members), pl, list(shape), len(members), why)
            for (pat, pl, shape, why), members in groups.items()]


def _named(pattern: str, members: list) -> str:
    """``pattern`` with each ``*`` replaced by the numbers its members have there, as ranges."""
    out = pattern
    for k in range(pattern.count(".*.")):
        out = out.replace(".*.", "." + _ranges(sorted({m[k] for m in members if len(m) > k})) + ".", 1)
    return out


def _ranges(nums: list) -> str:
    """[0, 2, 3, 4] -> '{0,2-4}'; [3] -> '3'."""
    if len(nums) == 1:
        return str(nums[0])
    spans, start = [], nums[0]
    for a, b in zip(nums, nums[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return "{" + ",".join(spans) + "}"


def brief(data: dict, top: int = 5) -> str:
    mesh = data["mesh"]
    dims = "x".join(map(str, mesh["shape"]))
    lines = [f"plan ({data['stage']}) on mesh {dims} ({', '.join(mesh['names'])}): {mesh['size']} ranks, "
             f"{len(data['nodes'])} nodes"]
    if data.get("planner"):
        lines.append(f"planner: {data['planner']}")
    sharded = sum(1 for n in data["nodes"] if "S(" in n["placement"])
    lines.append(f"work split: {sharded} of {len(data['nodes'])} nodes run on shards (the rest on whole or "
                 f"partial values)")
    groups = param_groups(data)
    lines.append(f"parameters ({len(data['params'])}), placement per mesh dim ({', '.join(mesh['names'])}):")
    width = max((len(g[0]) for g in groups), default=0)
    for pat, pl, shape, n, why in groups:
        times = f" x{n}" if n > 1 else ""
        lines.append(f"  {pat:<{width}}  {pl:<24} {str(shape) + times:<16} {why}".rstrip())
    st = data["stats"]
    kinds = data["by_kind"]
    total = sum(k["count"] for k in kinds.values())
    lines.append(f"communication per {data['stage']}, per rank: {total} collectives, "
                 f"{fmt_bytes(int(st.get('comm_bytes', 0)))}, est. {float(st.get('comm_time_s', 0)) * 1e6:.1f} us")
    if "est_step_time_s" in st:
        lines.append(f"est. {data['stage']} time (busiest rank): {fmt_seconds(st['est_step_time_s'])} = communication "
                     f"{fmt_seconds(st['comm_time_s'])} + compute {fmt_seconds(st['compute_time_s'])}"
                     + (f" + optimizer {fmt_seconds(st['optimizer_time_s'])}" if st.get("optimizer_time_s") else ""))
    for kind, k in sorted(kinds.items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"  {kind:<15} {k['count']:>4} x  {fmt_bytes(k['bytes']):>10}")
    busy = sorted((m for m in data["by_module"] if m["comm_bytes"]), key=lambda m: -m["comm_bytes"])[:top]
    if busy:
        lines.append("  busiest layers: " + ", ".join(f"{m['module']} {fmt_bytes(m['comm_bytes'])}" for m in busy))
    mem = data["memory_per_rank"]
    peak = max(m["parameters"] + m["gradients"] + m.get("optimizer_state", 0) + m["activations"] for m in mem)
    lines.append(f"memory per rank (largest), at the peak: parameters {fmt_bytes(max(m['parameters'] for m in mem))}, "
                 f"gradients {fmt_bytes(max(m['gradients'] for m in mem))}, optimizer state "
                 f"{fmt_bytes(max(m.get('optimizer_state', 0) for m in mem))}, peak activations "
                 f"{fmt_bytes(max(m['activations'] for m in mem))}; total {fmt_bytes(peak)}")
    reserved = data.get("reserved_memory_bytes")
    if reserved:
        lines.append("on CUDA, PyTorch's caching allocator would reserve "
                     + " or ".join(f"{fmt_bytes(reserved[m])} ({ALLOCATOR_NAMES[m]})" for m in ALLOCATORS))
    return "\n".join(lines)
