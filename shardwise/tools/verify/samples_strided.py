"""Hand samples (uneven sizes) for the diagonal, roll, strided-view and reduce-by-index rules
(rules/diagonal.py, shift.py, strided.py, indexing.py): the calls models make (HF Swin's shifted
windows and its pooler's as_strided pair, the backward's flat zeros scattered into) and the ops
OpInfo reaches only with 0-d or 1-element tensors (unfold_backward)."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def strided_samples() -> dict:
    diag = aten.diagonal.default(_r(5, 4, 7), 1, 1, 2)  # [5, 4]: the diagonal of dims (1, 2), offset 1
    return {
        aten.diagonal.default: [(_r(5, 4, 7), 1, 1, 2), (_r(3, 5, 7), -1, 2, 0)],
        aten.diagonal_backward.default: [(_r(*diag.shape), [5, 4, 7], 1, 1, 2)],
        aten.diagonal_scatter.default: [(_r(5, 4, 7), _r(*diag.shape), 1, 1, 2)],
        aten.diag_embed.default: [(_r(5, 3, 4), 1, 0, 2)],
        aten.roll.default: [(_r(5, 7, 7, 3), [-2, -2], [1, 2]), (_r(5, 7, 3), [7, 2], [1, 2])],
        # Swin's pooler (adaptive average pool of one) and its backward, on a batch of 5
        aten.as_strided.default: [(_r(5, 16, 1), [5, 16, 1, 1], [16, 1, 16, 16]), (_r(80), [5, 16], [16, 1], 0),
                                  (_r(5, 6, 7), [5, 3, 7], [42, 14, 1], 7)],
        aten.as_strided_scatter.default: [(_r(80), _r(5, 16), [5, 16], [16, 1], 0)],
        aten.unfold_backward.default: [(_r(5, 3, 3, 3), [5, 7, 3], 1, 3, 2), (_r(3, 5, 3, 2), [3, 5, 4], 2, 2, 1)],
    }
