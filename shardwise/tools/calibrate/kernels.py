"""What one rank measures of its device: matmul throughput by size and dtype, the fused attention
kernel, memory-bound kernels by size, the fixed cost of one kernel call.

Each figure is the median of repeated timings (``timed``), taken while every rank of the group
measures at once, as the ranks of a training step compute at once. Rates are of the kernel's own
work: the fixed per-call cost measured first (``overhead``) is taken out, and the cost model adds it
back once per node (core/cost.py ``compute_time``).
"""
from __future__ import annotations

import statistics
import time

import torch

aten = torch.ops.aten

# (M, K, N) per matmul: squares for the curve, then the tall products a transformer's tokens make
MATMULS = ((16, 16, 16), (32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
           (1024, 1024, 1024), (2048, 256, 256), (2048, 256, 1024), (2048, 1024, 256))
QUICK_MATMULS = ((32, 32, 32), (128, 128, 128), (512, 512, 512), (2048, 256, 1024))
LOW_PRECISION_MAX = 512  # bf16 on a CPU without its instructions is slow: smaller sizes only
# (batch, heads, sequence, head size), causal
ATTENTION = ((1, 4, 64, 32), (2, 8, 128, 32), (4, 8, 256, 32), (8, 8, 256, 64))
QUICK_ATTENTION = ((1, 4, 64, 32), (4, 8, 256, 32))
MEMORY_BYTES = tuple(2 ** p for p in range(12, 27, 2))  # 4 KiB .. 64 MiB read + written
QUICK_MEMORY_BYTES = tuple(2 ** p for p in (12, 16, 20, 24))


def timed(fn, min_time: float = 0.02, reps: int = 5) -> float:
    """Median seconds of one ``fn()`` call over ``reps`` samples, each of enough calls to last
    ``min_time`` (after one call that warms caches and allocations)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / one))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def overhead() -> float:
    """Seconds of one aten call on a one-element tensor: dispatch and launch, no work to speak of."""
    x = torch.ones(1)
    return timed(lambda: aten.add.Tensor(x, x), min_time=0.01, reps=7)


def matmul_points(dtype: torch.dtype, shapes, fixed: float, tick=lambda label: None) -> list:
    """[[flops, flop/s], ...] of ``aten.mm`` at each (M, K, N) in ``shapes``."""
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        t = timed(lambda: aten.mm.default(a, b))
        flops = 2.0 * m * k * n
        out.append([flops, flops / max(t - fixed, t * 0.05)])
        tick(f"matmul {str(dtype).removeprefix('torch.')} {m}x{k}x{n}")
    return out


def attention_points(shapes, fixed: float, tick=lambda label: None) -> list:
    """[[flops, flop/s], ...] of the fused CPU attention kernel, causal, forward and backward,
    with flops counted as search/flops.py counts them (4 L S E per batch and head, times the
    causal share; backward twice that)."""
    out = []
    for b, h, s, e in shapes:
        q, k, v = (torch.randn(b, h, s, e) for _ in range(3))
        fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
        o, lse = fwd(q, k, v, 0.0, True)
        g = torch.randn_like(o)
        t_f = timed(lambda: fwd(q, k, v, 0.0, True))
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        t_b = timed(lambda: bwd(g, q, k, v, o, lse, 0.0, True))
        share = (s * (s + 1) / 2) / (s * s)
        flops = 4.0 * b * h * s * s * e * share
        out += [[flops, flops / max(t_f - fixed, t_f * 0.05)], [2 * flops, 2 * flops / max(t_b - fixed, t_b * 0.05)]]
        tick(f"attention {b}x{h}x{s}x{e}")
    return out


def memory_points(sizes, fixed: float, tick=lambda label: None) -> list:
    """[[bytes, bytes/s], ...] of a streaming multiply (float32, read and written) of each size."""
    out = []
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 8))
        y = torch.empty_like(x)
        t = timed(lambda: torch.mul(x, 2.0, out=y))
        moved = 2.0 * x.numel() * 4
        out.append([moved, moved / max(t - fixed, t * 0.05)])
        tick(f"memory {nbytes // 1024} KiB")
    return out
