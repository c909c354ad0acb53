"""Cost profiles: a machine's figures as JSON, measured (``shardwise calibrate``) or written from a
preset, and the curves the cost model reads them through.

    cost = CostModel.from_profile("profile.json")            # what calibrate measured
    profile = preset_profile("cpu")                          # a preset as a profile, its source said
    write(profile, "cpu.json"); read("cpu.json") -> dict     # checked on read (ProfileError)

A profile (``FORMAT``) is a JSON object:

- ``source``: where the numbers came from: ``kind`` ("measured" or "preset"), and for a measured one
  the machine, processor, torch version, date, nproc, threads per process, the command;
- ``compute`` per dtype name ("float32", "bfloat16", ...): ``peak_flops`` (the best matmul rate
  measured), ``matmul`` and ``attention``: curves ``[[flops of one kernel, achieved flop/s], ...]``;
- ``memory``: ``peak_bandwidth`` and ``curve`` ``[[bytes read + written by one kernel, bytes/s], ...]``;
- ``op_overhead_s``: the fixed cost of one kernel call (dispatch and launch), already taken out of
  the rates above;
- ``links``: per mesh-dim name (``"*"``: every dim; a dim a profile without "*" does not name gets
  its slowest measured dim's figures) per collective kind, the fit
  ``{"latency_s": per ring round, "bandwidth": bytes each rank sends per second, "points":
  [[bytes sent per rank, seconds], ...], "group_size": n}``: a collective takes ``latency_s *
  rounds(n) + sent / bandwidth`` (core/cost.py's alpha-beta, per kind);
- ``overlap``: whether the backend runs collectives beside compute (CostModel.overlap);
  ``device_memory``: bytes one rank can hold, or null.

Curves become efficiencies, shares of the peak, interpolated linearly in log(size) and held flat
beyond the measured sizes (``interpolate``): a small matmul runs at a smaller share than a large one.
"""
from __future__ import annotations

import bisect
import json
import math

from .errors import ConfigError

FORMAT = "shardwise-profile/1"
CURVE_KINDS = ("matmul", "attention", "memory")


class ProfileError(ConfigError):
    """A cost profile that cannot be read: the file, what is wrong, how to make a good one."""


def interpolate(points, x: float) -> float:
    """The curve ``points`` ((size, value) pairs, sizes ascending) at ``x``: linear in log(size)
    between measured sizes, the end value beyond them."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def _curve(points, peak: float, where: str) -> tuple:
    """Measured ``[[size, rate], ...]`` -> sorted ((size, share of ``peak``), ...), shares in (0, 1]."""
    try:
        pts = sorted((float(s), float(r)) for s, r in points)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where} is not a list of [size, rate] pairs: {points!r}",
                           fix="rerun shardwise calibrate to write a fresh profile") from e
    if not pts or any(s <= 0 or r <= 0 for s, r in pts):
        raise ProfileError(f"{where} needs positive [size, rate] pairs, got {points!r}",
                           fix="rerun shardwise calibrate to write a fresh profile")
    merged: dict = {}
    for s, r in pts:  # one share per size (the best of repeated sizes)
        merged[s] = max(merged.get(s, 0.0), min(1.0, r / peak))
    return tuple(sorted(merged.items()))


def _need(d, key, where, kind=dict):
    if not isinstance(d, dict) or key not in d or not isinstance(d[key], kind):
        raise ProfileError(f"cost profile: {where} lacks {key!r} ({kind.__name__})",
                           fix="write it with shardwise calibrate --out profile.json, or see profile.FORMAT")
    return d[key]


def read(path) -> dict:
    """The profile at ``path``, its format checked."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ProfileError(f"no cost profile at {str(path)!r}",
                           fix="write one with: shardwise calibrate --nproc 2 --out profile.json") from e
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path} is not JSON: {e}", fix="rerun shardwise calibrate --out profile.json") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ProfileError(f"{path} is not a shardwise cost profile (format {got!r}, expected {FORMAT!r})",
                           fix="give the file shardwise calibrate --out wrote")
    return data


def write(profile: dict, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1, sort_keys=False)
        f.write("\n")


def source_line(profile: dict) -> str:
    """One line saying where a profile's numbers came from."""
    src = profile.get("source", {})
    if src.get("kind") == "preset":
        return f"preset {src.get('name')}: {src.get('note', '')}".strip()
    parts = [src.get("machine"), src.get("processor"), f"torch {src.get('torch')}", src.get("date"),
             f"{src.get('nproc')} processes" if src.get("nproc") else None]
    return "measured: " + ", ".join(str(p) for p in parts if p)


def cost_fields(profile: dict, dtype: str = "float32", where: str = "profile") -> dict:
    """CostModel keyword arguments from ``profile`` for matmuls in ``dtype`` (a dtype name)."""
    compute = _need(profile, "compute", where)
    if dtype not in compute:
        raise ProfileError(f"{where} has no compute figures for {dtype} (it has {sorted(compute)})",
                           fix=f"use dtype= one of {sorted(compute)}, or calibrate with that dtype")
    comp = compute[dtype]
    peak = float(_need(comp, "peak_flops", f"{where} compute.{dtype}", (int, float)))
    mem = _need(profile, "memory", where)
    mem_peak = float(_need(mem, "peak_bandwidth", f"{where} memory", (int, float)))
    curves = []
    for kind in ("matmul", "attention"):
        if comp.get(kind):
            curves.append((kind, _curve(comp[kind], peak, f"{where} compute.{dtype}.{kind}")))
    if mem.get("curve"):
        curves.append(("memory", _curve(mem["curve"], mem_peak, f"{where} memory.curve")))
    fields = dict(flops=peak, memory_bandwidth=mem_peak, op_overhead=float(profile.get("op_overhead_s", 0.0)),
                  curves=tuple(curves), overlap=bool(profile.get("overlap", False)),
                  device_memory=profile.get("device_memory"), source=source_line(profile))
    fields.update(_link_fields(_need(profile, "links", where), where))
    return fields


def _link_fields(links: dict, where: str) -> dict:
    """Per-kind fits as CostModel.collectives, and a dim's bandwidth / latency (its all_reduce fit,
    else any kind's) for the scalar path (kinds no fit names)."""
    fits, bw, lat = [], {}, {}
    for dim, kinds in sorted(links.items()):
        for kind, fit in sorted(kinds.items()):
            b = float(_need(fit, "bandwidth", f"{where} links.{dim}.{kind}", (int, float)))
            a = float(_need(fit, "latency_s", f"{where} links.{dim}.{kind}", (int, float)))
            if b <= 0 or a < 0:
                raise ProfileError(f"{where} links.{dim}.{kind}: bandwidth {b} and latency {a} must be positive",
                                   fix="rerun shardwise calibrate")
            fits.append((dim, kind, a, b))
            if kind == "all_reduce" or dim not in bw:
                bw[dim], lat[dim] = b, a
    out: dict = {"collectives": tuple(fits)}
    if "*" in bw:
        out.update(default_bandwidth=bw["*"], default_latency=lat["*"])
    named = {d: v for d, v in bw.items() if d != "*"}
    if named:
        out.update(bandwidth=named, latency={d: lat[d] for d in named})
        if "*" not in bw:  # a mesh dim the profile does not name: its slowest measured link, not a guess
            slow = min(named, key=named.get)
            out.update(default_bandwidth=named[slow], default_latency=lat[slow])
    elif "*" in bw:
        out.update(bandwidth=bw["*"], latency=lat["*"])
    return out


# where each preset's figures came from (core/cost.py's docstring has the measurements in full)
PRESET_SOURCES = {
    "cpu": "set by hand from one-off measurements on the development machine (Intel Xeon, 2 shared cores, torch "
           "2.13, one thread): fp32 matmul 1024^3 at 78 GFLOP/s, a streaming multiply at 4.7 GB/s, the threads "
           "backend's all_reduce on 2 ranks (50 us, 1 GB/s); no curves. Measure yours: shardwise calibrate",
    "a100": "datasheet (A100 SXM 80GB): 312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e, NVLink 3 300 GB/s sent per GPU, "
            "HDR InfiniBand 25 GB/s per GPU; peaks, not measured",
    "h100": "datasheet (H100 SXM): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 450 GB/s sent per GPU, "
            "NDR InfiniBand 50 GB/s per GPU; peaks, not measured",
}


def preset_profile(name: str, figures: tuple, dtype: str = "float32") -> dict:
    """The preset ``name`` (its PRESETS ``figures``: flops, memory bandwidth, fast link bandwidth and
    latency, slow link bandwidth and latency) as a profile whose source names where they came from."""
    fl, mem, bw, lat, _slow_bw, _slow_lat = figures
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return {"format": FORMAT, "source": {"kind": "preset", "name": name, "note": PRESET_SOURCES[name]},
            "compute": {dtype: {"peak_flops": fl, "matmul": [], "attention": []}},
            "memory": {"peak_bandwidth": mem, "curve": []}, "op_overhead_s": 0.0,
            "links": {"*": {k: {"latency_s": lat, "bandwidth": bw, "points": []} for k in kinds}},
            "overlap": False, "device_memory": None}
