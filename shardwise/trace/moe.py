"""Grouped matmuls (Mixture-of-Experts) as fixed-shape aten ops while tracing.

Hugging Face's default experts implementation sorts the (token, expert) pairs by expert and
calls ``torch.nn.functional.grouped_mm(x, w, offs=offsets)``: rows ``offs[e-1]:offs[e]`` of
``x`` are multiplied by expert ``e``'s weight. torch 2.13's fake kernel for ``_grouped_mm``
accepts only bfloat16 while the CPU kernel takes float32 too, so a float32 model cannot be
traced as is; and the group boundaries are data (``offs``), so no static slicing exists.

While tracing, ``dense_grouped_mm`` replaces the call by an exactly equal fixed-shape form:
every row is multiplied by every expert, and ``torch.where`` keeps the product of the
expert that owns the row (exact zeros elsewhere, so the sum over experts adds exact zeros
to one value: bit-for-bit the owning expert's product row, whatever the summation order).
Its ops (matmul, comparisons, where, sum) have rules, so the planner shards it like any
other graph: rows (data parallel), the output features (tensor parallel), the reduction
features (Partial), and the experts dim of the weights (expert parallel: each rank
multiplies by its own experts and the sum over experts becomes a partial sum across ranks).

Cost: ``E`` times the multiply-adds of a true grouped matmul (``E / n`` per rank when the
experts are sharded ``n`` ways); token dispatch by all-to-all, which needs data-dependent
shapes, is not done.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ShardingError

_GROUPED = tuple(f for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
                 if f is not None)


def dense_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(x[S, K], w[E, K, N], offs[E])`` with fixed shapes: row ``s`` times ``w[e]``
    for the ``e`` with ``offs[e-1] <= s < offs[e]`` (``offs[-1] = 0``); rows past ``offs[E-1]``
    are zero (the kernel leaves them unwritten)."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(x.shape[0], device=x.device)
    owner = (rows.unsqueeze(0) >= starts.unsqueeze(1)) & (rows.unsqueeze(0) < ends.unsqueeze(1))  # [E, S]
    every = torch.matmul(x.unsqueeze(0), w)  # [E, S, N]: each row by each expert
    return torch.where(owner.unsqueeze(-1), every, every.new_zeros(())).sum(0)


def _unpack(args: tuple, kwargs: dict):
    a, b = args[:2]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    bias = kwargs.get("bias", args[3] if len(args) > 3 else None)
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    return a, b, offs, bias, out_dtype


class DenseGroupedMM(TorchFunctionMode):
    """Routes ``F.grouped_mm`` / ``torch._grouped_mm`` (2-d input, 3-d weights, ``offs``) through
    ``dense_grouped_mm``; any other form is refused with the op named, never traced wrongly."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _GROUPED:
            return func(*args, **kwargs)
        a, b, offs, bias, out_dtype = _unpack(args, kwargs)
        if a.dim() != 2 or b.dim() != 3 or offs is None or bias is not None or out_dtype not in (None, a.dtype):
            raise ShardingError(
                f"{getattr(func, '__name__', func)} with a {a.dim()}-d and a {b.dim()}-d operand"
                f"{'' if offs is not None else ', no offs'}{', a bias' if bias is not None else ''}"
                f"{', out_dtype' if out_dtype not in (None, a.dtype) else ''} is not supported while tracing; "
                "shardwise traces the Mixture-of-Experts form (2-d tokens sorted by expert, 3-d expert weights, "
                "offs, no bias or out_dtype)",
                fix="compute the grouped product with fixed shapes (per-expert masks and matmul), or for a Hugging "
                    "Face model pass experts_implementation='batched_mm'")
        return dense_grouped_mm(a, b, offs)


@contextlib.contextmanager
def grouped_mm_as_dense():
    """Around the first tracing pass (capture.py)."""
    if not _GROUPED:
        yield
        return
    with DenseGroupedMM():
        yield
