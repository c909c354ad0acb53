"""The online softmax that blocks of attention are merged with: compute dtypes, the empty
block (merge's identity) and ``merge``, shared by the fused path (fused.py), the math path
(kernels.py) and ring attention (ring.py)."""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention is computed (and lse kept) in for inputs of ``dtype``."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def empty_block(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The identity of ``merge``: out 0 and lse -inf for every query row of ``q``."""
    ct = compute_dtype(q.dtype)
    rows = q.shape[:-1]
    return q.new_zeros(*rows, v.shape[-1], dtype=ct), q.new_full(rows, NEG_INF, dtype=ct)


def merge(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets.

    ``out_*`` are softmax-normalised within their own keys; the result is the attention
    over the union. Rows where both lse are -inf stay (0, -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse
