"""Hand samples (uneven sizes) for the *_copy ops, the rearranging ops and the small math ops
(rules/copies.py, rearrange.py, small_math.py): overloads no OpInfo of their name reaches (split_copy,
select_copy, slice_copy, detach_copy, squeeze_copy.dims, unsafe_split_with_sizes, the functional zero and
resize_as), and larger calls than OpInfo's 1-d or 0-step ones (count_nonzero, hash_tensor, dist with its
exact Partial ords, linspace / logspace with tensor endpoints)."""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _sparse(*shape):
    """Some entries exactly zero (count_nonzero has something to count)."""
    return _r(*shape) * (_r(*shape, seed=1) > 0)


def small_ops_samples() -> dict:
    t = torch.tensor
    return {
        aten.split_copy.Tensor: [(_r(7, 5), 3), (_r(5, 6), 2, 1)],
        aten.squeeze_copy.dims: [(_r(5, 1, 7), [1]), (_r(1, 5, 1), [0, 2])],
        aten.detach_copy.default: [(_r(5, 7),)],
        aten.select_copy.int: [(_r(5, 3, 7), 1, 2), (_r(5, 7), 0, -1)],
        aten.slice_copy.Tensor: [(_r(5, 7), 1, 2, 6), (_r(6, 5), 0, 0, 5, 2)],
        aten.unsafe_split_with_sizes.default: [(_r(6, 5), [2, 2, 2]), (_r(5, 7), [3, 4], 1)],
        aten.zero.default: [(_r(5, 7),)],
        aten.resize_as.default: [(_r(5, 7), _r(5, 7, seed=1)), (_r(3, 5, 2), _r(3, 5, 2, seed=1))],
        aten.count_nonzero.default: [(_sparse(5, 7),), (_sparse(5, 7), 1)],
        aten.count_nonzero.dim_IntList: [(_sparse(3, 5, 7), [0, 2])],
        aten.hash_tensor.default: [(_r(5, 7), [1]), ((_r(3, 5, 7), [0, 2]), {"keepdim": True})],
        aten.vdot.default: [(_r(7), _r(7, seed=1))],
        aten.dist.default: [(_r(5, 7), _r(7), math.inf), (_r(5, 7), _r(5, 7, seed=1), 1)],
        aten.linspace.Tensor_Tensor: [(t(-1.5), t(3.25), 7)],
        aten.linspace.Tensor_Scalar: [(t(0.3), 2.0, 5)],
        aten.linspace.Scalar_Tensor: [(1, t(-4.0), 9)],
        aten.logspace.Tensor_Tensor: [(t(-1.0), t(2.0), 7, 2.0)],
        aten.logspace.Tensor_Scalar: [(t(0.5), 1.5, 5)],
        aten.logspace.Scalar_Tensor: [(0, t(1.0), 6)],
    }
