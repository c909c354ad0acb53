"""Expert parallelism by token dispatch, on one rank (the per-rank program calls these by name).

Tokens and experts are both sharded on mesh dim ``mesh_dim``: member j of the group holds
experts [off_j, off_j + counts[j]) (``expert_counts``, torch.chunk sizes; a member may hold
none) and its own tokens. Each rank

1. sorts its (token, choice) pairs by expert id (stable): experts of one member are
   contiguous and members are in expert order, so the sort also groups pairs by destination;
2. exchanges counts: one all_to_all of a [n, max experts per member] table (row j: how many
   pairs go to each of member j's experts), so every rank knows how many rows it receives
   from each member and which local expert each one is for;
3. sends each pair's token row to the member holding its expert (all_to_all with uneven
   splits), applies its local expert MLPs (kernels.py), and sends the results back the same
   way (splits reversed);
4. puts the results back in pair order and combines them with the routing weights.

The backward routes again (same counts), sends token rows, output gradients and routing
weights (one message per dtype), computes the experts' gradients locally (they stay on the
member that holds the expert: its weights' gradient is complete there) and returns each
pair's input gradient and routing-weight gradient. Forward: 3 all_to_alls, backward: 3 (one
more per extra dtype among the rows). Pairs whose expert receives no tokens cost nothing;
an expert that receives none gets a zero gradient, as on one device.
"""
from __future__ import annotations

import torch

from ...core.errors import ShardingError
from ...core.collectives import Collectives
from ...core.scope import current
from . import kernels


class Route:
    """Where this rank's pairs go and what it receives (step 1 and 2 of the module docstring)."""

    def __init__(self, c: Collectives, mesh_dim: int, top_k_index: torch.Tensor, expert_counts):
        self.n, self.me = c.group_size(mesh_dim), c.group_index(mesh_dim)
        counts = [int(e) for e in expert_counts]
        if len(counts) != self.n:
            raise ShardingError(f"moe dispatch: {len(counts)} expert counts for a group of {self.n} members",
                                fix="pass one expert count per member of the mesh dim's group")
        offs = [sum(counts[:j]) for j in range(self.n)]
        total, widest = sum(counts), max(counts)
        flat = top_k_index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= total):
            raise ShardingError(f"moe dispatch: expert ids must lie in [0, {total}); got "
                                f"[{int(flat.min())}, {int(flat.max())}]",
                                fix="route to existing experts (a router's top-k over num_experts)")
        self.order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=total)
        table = per_expert.new_zeros(self.n, widest)
        for j in range(self.n):
            table[j, :counts[j]] = per_expert[offs[j]:offs[j] + counts[j]]
        self.send = table.sum(1).tolist()
        got = c.all_to_all(table, mesh_dim)[:, :counts[self.me]]  # [n, my experts]: from each member
        self.recv = got.sum(1).tolist()
        mine = torch.arange(offs[self.me], offs[self.me] + counts[self.me], device=flat.device)
        self.experts = torch.repeat_interleave(mine.repeat(self.n), got.reshape(-1))  # expert of each row received
        self.first = offs[self.me]

    def unsort(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows in sorted pair order -> pair order (t * K + k)."""
        return torch.empty_like(rows).index_copy_(0, self.order, rows)


def exchange(c: Collectives, mesh_dim: int, tensors: list, send, recv) -> list:
    """all_to_all_uneven of several [rows, width] tensors with the same rows: one call per dtype."""
    out: list = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        got = c.all_to_all_uneven(torch.cat([tensors[i] for i in idx], dim=1), mesh_dim, send, recv)
        for i, part in zip(idx, got.split([tensors[i].shape[1] for i in idx], dim=1), strict=True):
            out[i] = part
    return out


def _fake(t: torch.Tensor) -> bool:
    """Fake or meta tensors (the planner's memory estimate runs programs on them): no data to route."""
    return isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta"


def _fake_rows(x: torch.Tensor, k: int, width: int) -> list:
    """The row buffers a balanced route allocates (sorted, received, results, returned)."""
    return [x.new_empty(x.shape[0] * k, width) for _ in range(4)]


def dispatch_forward(x, top_k_index, top_k_weights, gate_up, down, act: str, mesh_dim: int, expert_counts,
                     collectives: Collectives | None = None):
    """This rank's tokens' expert outputs [T_local, H], computed by the members holding the experts."""
    if _fake(x):
        _fake_rows(x, top_k_index.shape[1], x.shape[1])
        return torch.empty_like(x)
    c = collectives or current()
    k = top_k_index.shape[1]
    r = Route(c, mesh_dim, top_k_index, expert_counts)
    rows = x.index_select(0, r.order // k)
    (got,) = exchange(c, mesh_dim, [rows], r.send, r.recv)
    y = kernels.expert_rows_forward(got, r.experts, gate_up, down, act, r.first)
    (back,) = exchange(c, mesh_dim, [y], r.recv, r.send)
    return kernels.combine(r.unsort(back), top_k_weights, x.dtype)


def dispatch_backward(grad_out, x, top_k_index, top_k_weights, gate_up, down, act: str, mesh_dim: int,
                      expert_counts, collectives: Collectives | None = None):
    """(dx, d_weights) of this rank's tokens, (d_gate_up, d_down) of its experts."""
    if _fake(x):
        _fake_rows(x, top_k_index.shape[1], 2 * x.shape[1] + 1)
        return tuple(torch.empty_like(t) for t in (x, top_k_weights, gate_up, down))
    c = collectives or current()
    t, k = top_k_index.shape
    r = Route(c, mesh_dim, top_k_index, expert_counts)
    token = r.order // k
    sent = [x.index_select(0, token), grad_out.index_select(0, token),
            top_k_weights.reshape(-1).index_select(0, r.order).unsqueeze(1)]
    xs, gs, ws = exchange(c, mesh_dim, sent, r.send, r.recv)
    dx, dw, d_gate_up, d_down = kernels.expert_rows_backward(xs, r.experts, gs, ws.squeeze(1), gate_up, down, act,
                                                             r.first)
    dx_back, dw_back = exchange(c, mesh_dim, [dx, dw.unsqueeze(1)], r.recv, r.send)
    dx_pairs, dw_pairs = r.unsort(dx_back), r.unsort(dw_back).squeeze(1)
    dx = dx_pairs.view(t, k, dx_pairs.shape[-1]).sum(1)
    return dx, dw_pairs.view(t, k).to(top_k_weights.dtype), d_gate_up, d_down
