"""shardwise.attention against aten's SDPA on one device: forward+backward time and peak memory.

    python bench/bench_attention.py [--seqs 512 1024 2048] [--runs 5]    # or: shardwise bench

Both sides run in this process on the same inputs (batch 2, 8 heads, head dim 64 by default):
``F.scaled_dot_product_attention`` (on CPU aten's flash kernel
``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``) and ``shardwise.attention``
(the ``shardwise::attention`` custom op and its backward op), with no sequence split. Time is
process CPU time of ``runs`` forward+backward passes after one warmup, the two sides interleaved
run by run; the ratio is the median over back-to-back pairs, with its quartiles (CPU time and
pairs keep a shared machine's load out of the ratio; wall times are printed too). Peak memory is
the highest total of bytes allocated and not yet freed during one forward+backward
(torch.profiler memory events; inputs made beforehand do not count). Each case also checks that output and gradients agree (rtol 1e-4 float32).
Targets (issue 13): time <= 1.1x, peak memory <= 1.2x aten's.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

TIME_TARGET, MEMORY_TARGET = 1.1, 1.2
DEFAULT_SEQS = (512, 1024, 2048)


def _inputs(batch: int, heads: int, seq: int, head_dim: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seq)
    mk = lambda: torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(), mk(), mk()
    return q, k, v, torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype)


def _step(attn, q, k, v, go, causal: bool):
    """One forward+backward; returns (out, dq, dk, dv)."""
    out = attn(q, k, v, is_causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


def peak_bytes(fn) -> int:
    """Highest total of live bytes allocated during ``fn()`` (CPU profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _times(fns: dict, runs: int, clock=time.process_time) -> dict:
    """Seconds per call of each fn by ``clock``, run by run, interleaved (order alternates).

    The default clock is this process's CPU time: on a machine shared with other work it
    counts the attention's own work, where wall time also counts waiting for a core."""
    names = list(fns)
    for n in names:  # warmup
        fns[n]()
    out = {n: [] for n in names}
    for i in range(runs):
        for n in (names if i % 2 == 0 else names[::-1]):
            t = clock()
            fns[n]()
            out[n].append(clock() - t)
    return out


def _quartiles(xs) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile); the extremes for fewer than 4 values."""
    xs = sorted(xs)
    if len(xs) < 4:
        return xs[0], statistics.median(xs), xs[-1]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[1], q[2]


def run_case(seq: int, causal: bool, batch: int = 2, heads: int = 8, head_dim: int = 64, runs: int = 5) -> dict:
    """One shape: times, peak memory, ratios, and whether the results agree."""
    from .op import attention

    q, k, v, go = _inputs(batch, heads, seq, head_dim)
    fns = {"aten": lambda: _step(F.scaled_dot_product_attention, q, k, v, go, causal),
           "shardwise": lambda: _step(attention, q, k, v, go, causal)}
    want, got = fns["aten"](), fns["shardwise"]()
    match = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, want, strict=True))
    del want, got
    times = _times(fns, runs)
    wall = {n: statistics.median(ts) for n, ts in _times(fns, max(1, runs // 3), time.perf_counter).items()}
    mem = {n: peak_bytes(fn) for n, fn in fns.items()}
    # the ratio of each back-to-back pair: load that drifts between runs hits both sides of a pair
    lo, ratio, hi = _quartiles([s / a for s, a in zip(times["shardwise"], times["aten"], strict=True)])
    return {"seq": seq, "causal": causal, "shape": (batch, heads, seq, head_dim), "runs": runs,
            "aten_s": statistics.median(times["aten"]), "shardwise_s": statistics.median(times["shardwise"]),
            "time_ratio": ratio, "time_ratio_spread": (lo, hi),
            "aten_wall_s": wall["aten"], "shardwise_wall_s": wall["shardwise"],
            "aten_peak": mem["aten"], "shardwise_peak": mem["shardwise"],
            "memory_ratio": mem["shardwise"] / max(mem["aten"], 1), "match": match}


def run_benchmark(seqs=DEFAULT_SEQS, causal=(False, True), runs: int = 5, **shape) -> list[dict]:
    return [run_case(s, c, runs=runs, **shape) for s in seqs for c in causal]


def ok(rows) -> bool:
    """Every case agreed with aten (targets are reported, not enforced)."""
    return all(r["match"] for r in rows)


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def format_report(rows) -> str:
    head = ("seq", "causal", "aten cpu ms", "sw cpu ms", "time sw/aten [quartiles]", "wall ms aten / sw",
            "aten peak MiB", "sw peak MiB", "mem sw/aten", "match")
    body = []
    for r in rows:
        t_flag = "" if r["time_ratio"] <= TIME_TARGET else " (target <= 1.1x missed)"
        m_flag = "" if r["memory_ratio"] <= MEMORY_TARGET else " (target <= 1.2x missed)"
        lo, hi = r["time_ratio_spread"]
        body.append((r["seq"], "yes" if r["causal"] else "no", f"{r['aten_s'] * 1e3:.1f}",
                     f"{r['shardwise_s'] * 1e3:.1f}", f"{r['time_ratio']:.2f}x [{lo:.2f}-{hi:.2f}]{t_flag}",
                     f"{r['aten_wall_s'] * 1e3:.1f} / {r['shardwise_wall_s'] * 1e3:.1f}",
                     f"{r['aten_peak'] / 2**20:.1f}", f"{r['shardwise_peak'] / 2**20:.1f}",
                     f"{r['memory_ratio']:.2f}x{m_flag}", "yes" if r["match"] else "MISMATCH"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths]), *map(line, body)]
    if rows:
        r = rows[0]
        out.append(f"forward+backward, float32, [batch, heads, seq, head_dim] = {r['shape'][:2]} x seq x "
                   f"{r['shape'][3]}, no sequence split; {r['runs']} runs each, interleaved: cpu ms = median process "
                   "CPU time, time ratio = median [quartiles] of back-to-back pairs of it, wall ms = median of "
                   f"{max(1, r['runs'] // 3)} more runs; peak = bytes allocated during one step")
        out.append(f"{torch.get_num_threads()} intra-op threads; {os.cpu_count()} CPUs, load average "
                   f"{_load()} (1/5/15 min) when the report was written")
    return "\n".join(out)


def main(seqs=DEFAULT_SEQS, runs: int = 5) -> int:
    """Print the report; 0 when every case matched aten, 1 otherwise."""
    print("shardwise.attention vs aten SDPA (one device) ...", flush=True)
    rows = run_benchmark(seqs=seqs, runs=runs)
    print(format_report(rows))
    return 0 if ok(rows) else 1
