"""Floating-point work of one node under one strategy, on the busiest rank.

Estimates, not counts: matmul-like ops take ``2 * M * N * K`` from the LOCAL shapes (so a
strategy that splits the contraction dim does half the work per rank), attention takes
``4 * L * S * E`` per (batch, head) (``Q K^T`` and ``P V``; backward twice that), a
convolution ``2 * output * (C_in / groups) * kernel``; every other op one flop per local
output element. The planner turns flops into time with ``CostModel.compute_time``.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..layout import Layout
from ..mesh import Mesh
from ..rules.registry import OpCall, Strategy, TensorMeta

aten = torch.ops.aten

# op -> index (in OpCall.ins) of the operand whose last dim is contracted.
_CONTRACT_LAST = {aten.mm.default: 0, aten.bmm.default: 0, aten.mv.default: 0, aten.dot.default: 0,
                  aten.addmm.default: 1, aten.baddbmm.default: 1, aten.addmv.default: 1, aten.linear.default: 0}


@lru_cache(maxsize=1)
def _attention_ops() -> dict:
    """op -> (arg position of q, arg position of k, work relative to a forward)."""
    ops = {aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1, 1.0),
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 2, 2.0)}
    shardwise_ops = getattr(torch.ops, "shardwise", None)
    if shardwise_ops is not None and hasattr(shardwise_ops, "attention"):
        ops[shardwise_ops.attention.default] = (0, 1, 1.0)
        ops[shardwise_ops.attention_backward.default] = (2, 3, 2.0)
    return ops


def local_shapes(layout: Layout, mesh: Mesh) -> tuple:
    """Per rank, the local shape of ``layout`` (the planner asks for the same layouts often)."""
    return _local_shapes(layout, mesh.shape)


@lru_cache(maxsize=1 << 16)
def _local_shapes(layout: Layout, mesh_shape: tuple) -> tuple:
    """Keyed on the mesh's shape (plain values), never on a Mesh object."""
    mesh = Mesh(mesh_shape)
    return tuple(layout.local_shape(mesh, r) for r in range(mesh.size))


def _in_index(call: OpCall, argpos: int) -> int:
    """Index in ``call.ins`` of the tensor at positional arg ``argpos``."""
    return sum(isinstance(a, TensorMeta) for a in call.args[:argpos])


def flops(call: OpCall, st: Strategy, mesh: Mesh) -> float:
    """Estimated flops of ``call`` under ``st`` on the busiest rank."""
    ins = st.in_layouts(call)
    outs = [o for o in st.out_layouts(call) if o is not None]
    out_numel = [sum(math.prod(local_shapes(o, mesh)[r]) for o in outs) for r in range(mesh.size)]
    if call.op in _CONTRACT_LAST and ins:
        k = local_shapes(ins[_CONTRACT_LAST[call.op]], mesh)
        return max(2.0 * n * (k[r][-1] if k[r] else 1) for r, n in enumerate(out_numel))
    attn = _attention_ops().get(call.op)
    if attn is not None and len(call.args) > attn[1] and isinstance(call.args[attn[0]], TensorMeta):
        q = local_shapes(ins[_in_index(call, attn[0])], mesh)
        seq_k = call.args[attn[1]].shape[-2]  # every strategy sees all keys (gathered or rotated)
        return max(4.0 * attn[2] * math.prod(s) * seq_k for s in q)
    if call.op == aten.convolution.default and not call.arg(6, "transposed", False):
        w = local_shapes(ins[1], mesh)
        return max(2.0 * n * math.prod(w[r][1:]) for r, n in enumerate(out_numel))
    return float(max(out_numel, default=0))
