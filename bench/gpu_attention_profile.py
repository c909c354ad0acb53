"""Where shardwise.attention's time goes on a GPU, kernel by kernel, beside aten's SDPA.

    python bench/gpu_attention_profile.py [--seqs 2048 8192] [--top 8]

For each dtype (bfloat16, float32), causal or not, and sequence length (batch 2, 8 heads, head dim
64, q/k/v laid out [batch, seq, heads, dim] in memory as a model's projections give them): the
median wall time of one forward+backward of each side (CUDA events), and the CUDA kernels of one
profiled step of each (torch.profiler), heaviest first. The gap between the two sides' kernel lists
is the work shardwise adds (copies, pads, extra reductions); the gap between wall and kernel time is
launch and Python overhead. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.ops.attention.benchmark import _step  # noqa: E402 (one forward+backward)


def _wall_ms(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _kernels(fn) -> list:
    """[(kernel name, calls, device ms)] of one ``fn()``, heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = rows.get(e.name, (0, 0.0))
            rows[e.name] = (n + 1, t + e.device_time_total / 1e3)
    return sorted(((k, n, t) for k, (n, t) in rows.items()), key=lambda r: -r[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--runs", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_attention_profile: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for causal in (False, True):
            for seq in a.seqs:
                g = torch.Generator(device=dev).manual_seed(seq)
                q, k, v = (torch.randn(2, seq, 8, 64, generator=g, device=dev).to(dtype).transpose(1, 2).requires_grad_()
                           for _ in range(3))
                go = torch.randn(2, 8, seq, 64, generator=g, device=dev).to(dtype)
                sides = {"aten": lambda: _step(F.scaled_dot_product_attention, q, k, v, go, causal),
                         "shardwise": lambda: _step(sw.attention, q, k, v, go, causal)}
                wall = {n: _wall_ms(fn, a.runs) for n, fn in sides.items()}
                print(f"\n== {str(dtype)[6:]} seq {seq}{' causal' if causal else ''}: wall ms aten {wall['aten']:.3f}, "
                      f"shardwise {wall['shardwise']:.3f} ({wall['shardwise'] / wall['aten']:.2f}x)")
                for n, fn in sides.items():
                    ks = _kernels(fn)
                    total = sum(t for _, _, t in ks)
                    print(f"  {n}: {len(ks)} kernel kinds, {sum(c for _, c, _ in ks)} launches, {total:.3f} ms on device")
                    for name, calls, t in ks[:a.top]:
                        print(f"    {t:8.3f} ms  x{calls:<3d} {name[:110]}")
    host_profile(dev, a.top * 3)
    return 0


def _host_ms(fn, gc_off: bool) -> float:
    import gc
    import time

    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        if gc_off:
            gc.disable()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / 200 * 1e3)
        gc.enable()
    return statistics.median(runs)


def host_profile(dev, top: int) -> None:
    """The host side of shardwise.attention's step (bfloat16, seq 2048): the Python functions that
    take its time (cProfile, by own time), and any op that waits for the device
    (torch.cuda.set_sync_debug_mode)."""
    import cProfile
    import io
    import pstats
    import warnings

    q, k, v = (torch.randn(2, 2048, 8, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    go = torch.randn(2, 8, 2048, 64, device=dev, dtype=torch.bfloat16)
    step = lambda: _step(sw.attention, q, k, v, go, True)  # noqa: E731
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"\n== host: {len(syncs)} synchronizing call(s) in one step" + "".join(f"\n  {m[:150]}" for m in syncs))
    print("== host: ms per step (wall, 200 steps, median of 3)")
    def fwd():
        with torch.no_grad():
            return torch.ops.shardwise.attention.default(q, k, v, None, True, None, False, 0, 0, None, None)
    aten = lambda: _step(F.scaled_dot_product_attention, q, k, v, go, True)  # noqa: E731
    for name, fn, gc_off in (("aten step", aten, False), ("shardwise step", step, False),
                             ("shardwise step, gc disabled", step, True),
                             ("shardwise.attention op alone (no autograd, as a program calls it)", fwd, False)):
        print(f"  {name}: {_host_ms(fn, gc_off):.3f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print("== host: 50 steps, by own time\n" + "\n".join(
        line[:170] for line in out.getvalue().splitlines() if line.strip())[-6000:])


if __name__ == "__main__":
    sys.exit(main())
