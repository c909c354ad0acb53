"""A staged copy of a sharded state dict: what an asynchronous save writes while training goes on.

DCP's own async_save stages with a copier that runs torch ops on every tensor, which a
ShardChunks (shards known only as chunks) refuses; staging here copies just the chunks this
process writes (replicas held here are not copied) into CPU memory, so the next step may change
the live shards at once. The copy is of the state at the step that asked for the save.
"""
from __future__ import annotations

import copy

import torch

from .chunks import ShardChunks


def _chunks(t: ShardChunks) -> ShardChunks:
    written = [(off, c.detach().to("cpu", copy=True)) for off, c in t._chunks[: t._n_write]]
    return ShardChunks(t.shape, t.dtype, written, len(written), device="cpu")


def stage(value):
    """A CPU copy of ``value`` (nested dicts and lists of ShardChunks, tensors and plain values)."""
    if isinstance(value, ShardChunks):
        return _chunks(value)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: stage(v) for k, v in value.items()}
    if isinstance(value, list):
        return [stage(v) for v in value]
    return copy.deepcopy(value)


def nbytes(value) -> int:
    """Bytes of tensor data in a (staged) state dict."""
    if isinstance(value, ShardChunks):
        return sum(c.numel() * c.element_size() for _, c in value._chunks[: value._n_write])
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(nbytes(v) for v in value)
    return 0
