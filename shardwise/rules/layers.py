"""Activation and layer ops outside the pointwise table: glu, PReLU's kernel, bilinear's _trilinear.

- ``glu(x, dim)``: the first half of ``dim`` times the sigmoid of the second. Any other dim
  shards; ``dim`` itself shards as two groups (``Shard(dim, groups=2)``: each rank holds its chunk
  of both halves), which gives the output's plain shard of ``dim``. ``glu_backward(grad, x, dim)``
  likewise, and it is linear in grad (Partial in, Partial out).
- ``_prelu_kernel(x, w)``: the weight arrives viewed to broadcast against x ([1, C, 1, ...] or
  one value), so the op is pointwise: any dim shards, the weight following on the channel dim
  (sharded with it) or replicated where it broadcasts. Its backward returns both gradients at
  x's shape (the weight's is summed over the other dims by the graph's own sum, a Partial sum where
  those dims are sharded); it is linear in grad.
- ``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` (nn.functional.bilinear and its
  backward): each input is unsqueezed at its ``expand`` dims, the three multiplied and summed over
  ``sumdim``: an einsum, restated as one (``einsum_strategies``). A dim where an input holds size 1
  against a larger one (broadcast) is not sharded on that input.
"""
from __future__ import annotations

import string

import torch

from .common import P, R, einsum_strategies, pointwise_strategies, replicate_all
from .registry import OpCall, Rule, Strategy1D
from ..core.layout import Shard

aten = torch.ops.aten
GLU, GLU_BWD = aten.glu.default, aten.glu_backward.default
PRELU, PRELU_BWD = aten._prelu_kernel.default, aten._prelu_kernel_backward.default
TRILINEAR = aten._trilinear.default


def glu_strategies(call: OpCall) -> list[Strategy1D]:
    bwd = call.op is GLU_BWD
    x = call.ins[1 if bwd else 0]
    dim = call.arg(2 if bwd else 1, "dim", -1) % x.ndim
    out = [replicate_all(call)]
    for d in range(x.ndim):
        halves = Shard(d, groups=2) if d == dim else Shard(d)  # x (and grad_input) split in halves
        half = Shard(d)  # the output (and grad) hold one half
        out.append(Strategy1D((halves,), (half, halves)) if bwd else Strategy1D((half,), (halves,)))
    if bwd:
        out.append(Strategy1D((P,), (P, R)))
    return out


def prelu_strategies(call: OpCall) -> list[Strategy1D]:
    if call.op is PRELU:
        return pointwise_strategies(call)
    return pointwise_strategies(call, linear="first")  # linear in grad (x and the weight replicated)


def _trilinear_spec(call: OpCall) -> tuple[str, dict]:
    """The einsum string of a _trilinear call, and per letter the operands where it broadcasts
    (size 1 against a larger size)."""
    expands = [list(call.arg(3 + k, f"expand{k + 1}")) for k in range(3)]
    sumdim = set(call.arg(6, "sumdim"))
    full = call.ins[0].ndim + len(expands[0])
    letters = string.ascii_lowercase[:full]
    operands, sizes = [], [[] for _ in range(full)]
    for t, expand in zip(call.ins, expands):
        kept = [d for d in range(full) if d not in expand]
        operands.append("".join(letters[d] for d in kept))
        for d, n in zip(kept, t.shape):
            sizes[d].append((len(operands) - 1, n))
    broadcast = {letters[d]: {k for k, n in got if n == 1 and any(m > 1 for _, m in got)}
                 for d, got in enumerate(sizes)}
    rhs = "".join(letters[d] for d in range(full) if d not in sumdim)
    return ",".join(operands) + "->" + rhs, broadcast


def trilinear_strategies(call: OpCall) -> list[Strategy1D]:
    spec, broadcast = _trilinear_spec(call)
    operands = spec.split("->")[0].split(",")

    def ok(s: Strategy1D) -> bool:  # no shard of a dim an operand broadcasts (size 1)
        return not any(isinstance(p, Shard) and k in broadcast[operands[k][p.dim]] for k, p in enumerate(s.ins))
    return [s for s in einsum_strategies(spec, call) if ok(s)]


ROWS = (Rule([GLU, GLU_BWD], glu_strategies, blockwise=True),
        Rule([PRELU, PRELU_BWD], prelu_strategies, blockwise=True),
        Rule(TRILINEAR, trilinear_strategies, blockwise=True))
