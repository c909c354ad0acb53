"""Which path an attention call takes, in words, for the plan's summary: torch's fused kernel of
the device (fused.py; on CUDA the one cuda.py picks) or the math path with its L x S scores."""
from __future__ import annotations

from . import cuda, fused


def describe_call(q, k, v, mask, settings, device_type: str, device: "cuda.Device | None" = None) -> str:
    """The path of one whole (unsplit) call of these local shapes on ``device_type``; q, k, v and
    mask may be meta tensors. ``device``: the GPU assumed for CUDA (default: an sm90 with cuDNN 9.15)."""
    if device_type != "cuda":
        fits = (q.dtype in fused.DTYPES and q.numel() > 0 and k.numel() > 0 and q.shape[-1] > 0 and v.shape[-1] > 0
                and not (settings.is_causal and settings.resolve_scale(q.shape[-1]) <= 0))  # fused.applies' rule
        if fits and device_type in fused.KERNELS:
            return f"fused ({device_type}: {fused.KERNEL_NAMES.get(device_type, device_type)})"
        return "math (scores materialised)"
    q4, k4, v4 = (fused._as_4d(t) for t in (q, k, v))
    return cuda.choose(q4, k4, v4, fused._mask_4d(mask, q), settings.is_causal, device=device or cuda.Device()).describe()
