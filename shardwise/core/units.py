"""Bytes and seconds as people read them: every figure the plan, the reports and the tools print."""
from __future__ import annotations


def fmt_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``: the plan's, the report's and a step's byte figures."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def fmt_seconds(s: float) -> str:
    """``0.00006`` -> ``60 us``: three significant digits in the largest unit below the value."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"
