"""The plan summary's words on attention: which path each attention node's local call takes on
rank 0 (torch's fused kernel of the device, on CUDA the one torch's SDPA would pick, or the math
path with its L x S scores), from the local shapes and dtype the plan gives it (ops/attention/paths.py)."""
from __future__ import annotations

import torch

from ..core.calls import TensorMeta
from ..core.layout import Layout
from ..ops.attention import cuda
from ..ops.attention.paths import describe_call
from ..ops.attention.settings import AttentionSettings

# op -> positions of (q, the mask, the first setting) in its args
_OPS = {"shardwise.attention.default": (0, 3, 4), "shardwise.attention_backward.default": (2, 5, 8)}


def _device(node) -> torch.device:
    first = next(iter(node.all_input_nodes), None) if node is not None else None
    val = first.meta.get("val") if first is not None else None
    return getattr(val, "device", torch.device("cpu"))


def _gpu(device: torch.device) -> "cuda.Device | None":
    return cuda.Device.of(device) if device.type == "cuda" and torch.cuda.is_available() else None


def attention_lines(plan) -> list[str]:
    """One line per attention node: ``attention path (rank 0): <node>: <path>``."""
    graph = {n.name: n for n in plan.prop.gm.graph.nodes}
    lines = []
    for name, np_ in plan.prop.nodes.items():
        where = _OPS.get(str(np_.call.op))
        if where is None:
            continue
        qi, mi, si = where
        args = np_.call.args
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, TensorMeta)]  # in_layouts' order
        q, k, v = (_local(np_, tensor_pos.index(i), plan.mesh) for i in range(qi, qi + 3))
        mask = args[mi]
        m = None if mask is None else torch.empty(mask.shape, dtype=mask.dtype, device="meta")
        settings = AttentionSettings.from_op_args(*args[si:si + 7])
        device = _device(graph.get(name))
        lines.append(f"attention path (rank 0): {name}: {describe_call(q, k, v, m, settings, device.type, _gpu(device))}")
    return lines


def _local(np_, j: int, mesh) -> torch.Tensor:
    """Tensor input ``j`` of the node as rank 0 holds it: a meta tensor of its local shape."""
    lay = np_.in_layouts[j]
    shape = Layout(lay.shape, lay.dtype, np_.strategy.ins[j]).local_shape(mesh, 0)
    return torch.empty(shape, dtype=lay.dtype, device="meta")
