"""Values against a set of bins or test values: searchsorted, bucketize, isin, histogram, histogramdd.

Each value is placed on its own: ``searchsorted`` / ``bucketize`` find a value's slot in a sorted
sequence, ``isin`` tests it against every test element. So the values (and the output, which has
their shape) shard on every dim, with the bins whole. searchsorted's n-d ``sorted_sequence`` holds
one sorted row per row of values: its leading (batch) dims shard with the values' (and the
sorter's), its last dim (the sorted row) stays whole. isin is an OR over the test elements (AND with
``invert``), so test elements sharded with the elements whole give a Partial(max) (Partial(min))
result.

A histogram counts values into bins: a count is a sum over the values, so sharded values (with
their weights) give Partial(sum) counts, and so do Partial(sum) weights with the values whole (a
count is linear in the weights). That holds only where the bin edges do not depend on which values a
rank holds: bins given as tensors, or ``range=`` given. Without ``range`` the edges come from the
data's min and max, which a shard would take over its own values only: the values stay whole (the
min/max are not computed across ranks here). ``density=True`` divides by the total count, which
no part knows: whole. The edges (``bin_edges``, ``_histogramdd_bin_edges``) are the same on every
rank, Replicate. histogramdd's values are (..., D) with weights (...): the leading dims shard, the
last (which coordinate) stays whole.
"""
from __future__ import annotations

import torch

from ..core.layout import Partial, R, Shard
from .common import P, replicate_all
from .linalg import contiguous_local
from .registry import KW_ONLY, OpCall, Rule, Strategy1D

aten = torch.ops.aten
ANY, EVERY = Partial("max"), Partial("min")  # isin's OR over test elements (AND when inverted)


def _shard_outs(call: OpCall, p) -> tuple:
    return tuple(None if o is None else p for o in call.outs)


def searchsorted_strategies(call: OpCall) -> list[Strategy1D]:
    """searchsorted.Tensor: ins (sorted_sequence, self[, sorter]); .Scalar: (sorted_sequence[, sorter])."""
    seq, n = call.ins[0], len(call.ins)
    st = [replicate_all(call)]
    values = call.ins[1] if call.op is aten.searchsorted.Tensor else None
    batch = seq.ndim - 1  # n-d sequence: its leading dims match the values'
    for d in range(call.out.ndim):
        if d < batch:  # a batch dim: the sequence's (and sorter's) rows with the values'
            st.append(Strategy1D((Shard(d),), (Shard(d),) * n))
        elif values is not None:  # the values' last dim (or any, against a 1-d sequence): the rows whole
            st.append(Strategy1D((Shard(d),), tuple(Shard(d) if i == 1 else R for i in range(n))))
    return st


def bucketize_strategies(call: OpCall) -> list[Strategy1D]:
    """bucketize.Tensor: ins (self, boundaries [1-d]); .Scalar: (boundaries) and a 0-d result."""
    st = [replicate_all(call)]
    if call.op is aten.bucketize.Tensor:
        st += [Strategy1D((Shard(d),), (Shard(d), R)) for d in range(call.out.ndim)]
    return st


def isin_strategies(call: OpCall) -> list[Strategy1D]:
    """Tensor_Tensor: ins (elements, test_elements); Tensor_Scalar: (elements); Scalar_Tensor: (test_elements)."""
    st = [replicate_all(call)]
    found = EVERY if call.arg(KW_ONLY, "invert", False) else ANY
    if call.op is not aten.isin.Scalar_Tensor:
        rest = (R,) * (len(call.ins) - 1)
        st += [Strategy1D((Shard(d),), (Shard(d),) + rest) for d in range(call.ins[0].ndim)]
    if call.op is not aten.isin.Tensor_Scalar:
        tests = call.ins[-1]
        first = (R,) * (len(call.ins) - 1)
        st += [Strategy1D((found,), first + (Shard(d),)) for d in range(tests.ndim)]
    return st


# -- histograms ------------------------------------------------------------------------------------
def _counts(call: OpCall, dims, edges_fixed: bool) -> list[Strategy1D]:
    """Partial(sum) counts from the values (ins[0]) sharded on each of ``dims`` with the weight (the
    last input, when given, shaped as the values' leading dims), or from a Partial weight; the other
    inputs (bin tensors) whole and the edges (outs after the first) Replicate."""
    st = [replicate_all(call)]
    if not edges_fixed or call.arg(KW_ONLY, "density", False):
        return st
    n, weighted = len(call.ins), call.arg(KW_ONLY, "weight") is not None
    outs = tuple(None if o is None else (P if i == 0 else R) for i, o in enumerate(call.outs))
    for d in dims:
        st.append(Strategy1D(outs, tuple(Shard(d) if i == 0 or (weighted and i == n - 1) else R for i in range(n))))
    if weighted:
        st.append(Strategy1D(outs, (R,) * (n - 1) + (P,)))
    return st


def histogram_strategies(call: OpCall) -> list[Strategy1D]:
    """histogram.bins_tensor (self, bins[, weight]) / .bin_ct (self[, weight]) -> (hist, bin_edges)."""
    fixed = call.op is aten.histogram.bins_tensor or call.arg(KW_ONLY, "range") is not None
    return _counts(call, range(call.ins[0].ndim), fixed)


def histogramdd_strategies(call: OpCall) -> list[Strategy1D]:
    """_histogramdd_from_bin_cts (self[, weight]) and _from_bin_tensors (self, *bins[, weight]) -> hist."""
    fixed = call.op is aten._histogramdd_from_bin_tensors.default or call.arg(KW_ONLY, "range") is not None
    return _counts(call, range(call.ins[0].ndim - 1), fixed)


def histogramdd_edges_strategies(call: OpCall) -> list[Strategy1D]:
    """_histogramdd_bin_edges (self[, weight]) -> D edge tensors: with ``range`` they are made from it
    alone, so any leading-dim shard of the values (and weight) gives the same edges on every rank."""
    st = [replicate_all(call)]
    if call.arg(KW_ONLY, "range") is None:
        return st
    n, outs = len(call.ins), tuple(None if o is None else R for o in call.outs)
    return st + [Strategy1D(outs, (Shard(d),) + (Shard(d),) * (n - 1)) for d in range(call.ins[0].ndim - 1)]


ROWS = (
    Rule([aten.searchsorted.Tensor, aten.searchsorted.Scalar], searchsorted_strategies, blockwise=True),
    Rule([aten.bucketize.Tensor, aten.bucketize.Scalar], bucketize_strategies, blockwise=True),
    # isin's CPU kernel views test_elements flat (.view(-1)), which a strided local chunk refuses
    Rule([aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor], isin_strategies,
         contiguous_local, blockwise=True),
    Rule([aten.histogram.bins_tensor, aten.histogram.bin_ct], histogram_strategies, blockwise=True),
    Rule([aten._histogramdd_from_bin_cts.default, aten._histogramdd_from_bin_tensors.default],
         histogramdd_strategies, blockwise=True),
    Rule(aten._histogramdd_bin_edges.default, histogramdd_edges_strategies, blockwise=True),
)
