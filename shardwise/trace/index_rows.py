"""``x[arange(B)[:, None, ...], j]``: an index that is an arange over the dim it indexes.

Hugging Face builds padding masks per batch row this way (``padding_mask[batch_idx, kv_idx]``
with ``batch_idx = arange(B)`` broadcast). As plain ``aten.index`` the planner cannot know
that row ``r`` of the result reads row ``r`` of ``x``, so a batch-sharded mask was gathered.
This pass retargets such a call to ``shardwise.index_aligned(x, indices, dim, offset)``: the
same lookup with ``indices[dim] - offset``. Its rule (rules/indexing.py) adds the strategy
with ``x`` and ``indices[dim]`` sharded alike on ``dim`` (both have ``x.shape[dim]`` entries
there, so their chunks coincide and each rank's indices fall in its own rows), where the
local call gets its rows' start as ``offset``. The pass matches only an ``aten.arange`` with
start 0, step 1 and end ``x.shape[dim]``, reached through unsqueezes, views that keep one
non-1 dim, ``+ 0`` and casts: values known from the graph, not assumed.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .normalize import COPIES, RESHAPES

aten = torch.ops.aten


def index_rows(x: torch.Tensor, indices: list, dim: int, offset: int) -> torch.Tensor:
    """What ``shardwise.index_aligned`` computes, as plain calls (compile=True traces this instead
    of the op: run/compiled.py)."""
    idx = list(indices)
    idx[dim] = idx[dim] - offset
    return aten.index.Tensor(x, idx)


@torch.library.custom_op("shardwise::index_aligned", mutates_args=())
def index_aligned(x: torch.Tensor, indices: list[torch.Tensor | None], dim: int, offset: int) -> torch.Tensor:
    return index_rows(x, indices, dim, offset)


@index_aligned.register_fake
def _index_aligned_fake(x, indices, dim, offset):
    return aten.index.Tensor(x, list(indices))


INDEX_ALIGNED = torch.ops.shardwise.index_aligned.default
_PASS = RESHAPES | COPIES  # arange's values seen through them unchanged


def _is_arange_to(node, n: int) -> bool:
    """Is ``node`` arange(0, n, 1) seen through shape-only ops (one non-1 dim) and ``+ 0``?"""
    while isinstance(node, fx.Node) and node.op == "call_function":
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32) \
                or sorted(s for s in val.shape if s != 1) != [n]:
            return False
        if node.target in _PASS:
            node = node.args[0]
        elif node.target in (aten.add.Tensor, aten.add.Scalar) and node.args[1] == 0 and len(node.args) == 2:
            node = node.args[0]
        elif node.target is aten.arange.default:
            return len(node.args) == 1 and node.args[0] == n
        elif node.target is aten.arange.start_step:
            return tuple(node.args[:3]) == (0, n, 1)
        elif node.target is aten.arange.start:
            return tuple(node.args[:2]) == (0, n)
        else:
            return False
    return False


def map_aligned_index(gm: fx.GraphModule) -> list[str]:
    """Retarget ``aten.index.Tensor`` calls with an arange index (see the module doc)."""
    notes = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor or node.kwargs:
            continue
        x, indices = node.args
        shape = x.meta["val"].shape
        for k, i in enumerate(indices):
            if i is not None and k < len(shape) and _is_arange_to(i, shape[k]):
                node.target = INDEX_ALIGNED
                node.args = (x, list(indices), k, 0)
                notes.append(f"index: {node.name} reads row r of dim {k} at position r -> shardwise.index_aligned")
                break
    return notes
