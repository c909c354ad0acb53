"""Rules for ``shardwise.moe_experts`` and its backward (ops/moe/op.py): every way to split a
Mixture-of-Experts layer's experts.

Tags (one mesh dim each; ins are x, top_k_index, top_k_weights, gate_up, down, the backward
takes grad_out first):
- "tokens": tokens sharded (dim 0 of x, index, weights and out), experts whole: data
  parallel; the experts' gradients are partial sums.
- "tp": every expert's intermediate features split (gate_up ``Shard(1, groups=2)``: each
  rank holds its chunk of the gate rows and of the up rows; down ``Shard(2)``): Megatron
  inside each expert, the output (backward: x's and the weights' gradients) partial.
- "experts": tokens whole, experts sharded (dim 0 of gate_up and down): each rank computes
  its experts' share for every token (``first_expert`` = its first expert), so the output
  is a partial sum over ranks. Cheap when tokens are replicated anyway.
- "dispatch": tokens AND experts sharded on the same mesh dim (EP = DP x EP): each rank sends
  its tokens to the ranks holding their experts and gets the results back (ops/moe/dispatch.py,
  all_to_alls inside the local call, stated to the plan by ``dispatch_comm`` so stats count
  and the planner prices them). On one mesh dim per strategy, which alone shards the experts.
- "grad_partial" (backward): linear in the output gradient, so a Partial one gives Partial
  gradients.
"""
from __future__ import annotations

import math

from ..core.cost import CostModel
from ..core.collective_kinds import RedistStep
from ..core.layout import Shard
from ..ops.moe.op import BACKWARD, FORWARD
from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

S0 = Shard(0)
GATE_UP_TP, DOWN_TP = Shard(1, groups=2), Shard(2)
DISPATCH = "dispatch"


def _fwd(call: OpCall) -> bool:
    return call.op is FORWARD


def _weights(call: OpCall) -> tuple[int, int]:
    """Indices in call.ins of gate_up and down."""
    return (3, 4) if _fwd(call) else (4, 5)


MAX_UNITS = 6  # unit variants of the token shards offered (token_shards): batch sizes up to the 6th divisor


def token_shards(tokens: int) -> list[Shard]:
    """Placements of the tokens dim: ``Shard(0)`` and ``Shard(0, unit=T // b)`` for the smallest
    divisors ``b >= 2`` of T. Tokens reach the op flattened (``[B, S, H] -> [B * S, H]``), so a
    batch shard arrives as ``Shard(0, unit=S)``; the planner restates blockwise rules for such
    units by cutting every shard of the strategy alike (registry.with_block), which would cut
    the experts too, so this rule states its token units itself. Any whole rows work: tokens
    are independent and dispatch reads no offsets."""
    units = [tokens // b for b in range(2, tokens + 1) if tokens % b == 0 and tokens // b > 1][:MAX_UNITS]
    return [S0] + [Shard(0, unit=u) for u in units]


def experts_strategies(call: OpCall) -> list[Strategy1D]:
    fwd = _fwd(call)
    lead = () if fwd else (R,)  # grad_out's placement, when it is not the tokens' one
    out = [replicate_all(call)]
    if fwd:
        out.append(Strategy1D((P,), (R, R, R, GATE_UP_TP, DOWN_TP), "tp"))
        out.append(Strategy1D((P,), (R, R, R, S0, S0), "experts"))
        for t in token_shards(call.ins[0].shape[0]):
            out.append(Strategy1D((t,), (t, t, t, R, R), "tokens"))
            out.append(Strategy1D((t,), (t, t, t, S0, S0), DISPATCH))
        return out
    out.append(Strategy1D((P, P, GATE_UP_TP, DOWN_TP), lead + (R, R, R, GATE_UP_TP, DOWN_TP), "tp"))
    out.append(Strategy1D((P, P, S0, S0), lead + (R, R, R, S0, S0), "experts"))
    out.append(Strategy1D((P, P, P, P), (P, R, R, R, R, R), "grad_partial"))
    for t in token_shards(call.ins[1].shape[0]):
        out.append(Strategy1D((t, t, P, P), (t,) * 4 + (R, R), "tokens"))
        out.append(Strategy1D((t, t, S0, S0), (t,) * 4 + (S0, S0), DISPATCH))
    return out


def experts_valid(call: OpCall, st, mesh) -> bool:
    """Token shards on several mesh dims share one unit (they come from one flatten); dispatch
    runs on one mesh dim, and that dim alone splits the experts (every member of its group must
    together hold all of them)."""
    if len({p.unit for p in st.ins[0 if _fwd(call) else 1] if isinstance(p, Shard)}) > 1:
        return False
    dims = [m for m, t in enumerate(st.tags) if t == DISPATCH]
    if not dims:
        return True
    if len(dims) > 1:
        return False
    m = dims[0]
    return not any(isinstance(p, Shard) and p.dim == 0 and k != m
                   for i in _weights(call) for k, p in enumerate(st.ins[i]))


def experts_local(ctx: LocalCtx) -> LocalCall:
    from ..ops.moe import dispatch

    call = ctx.call
    fwd = _fwd(call)
    gate_up = _weights(call)[0]
    tensors, (act, first) = call.args[:-2], call.args[-2:]
    if DISPATCH in ctx.strategy.tags:
        m = ctx.strategy.tags.index(DISPATCH)
        counts = tuple(ctx.in_layout(gate_up).local_shape(ctx.mesh, r)[0] for r in ctx.mesh.group(m, ctx.rank))
        fn = dispatch.dispatch_forward if fwd else dispatch.dispatch_backward
        return LocalCall(fn, (*tensors, act, m, counts), {})
    return LocalCall(call.op, (*tensors, act, first + ctx.in_offset(gate_up, 0)), {})


def dispatch_comm(call: OpCall, st, mesh) -> list:
    """The all_to_alls a dispatch strategy runs (counts, rows out, results back; the backward's
    rows and results in one message per dtype), with bytes for routing spread evenly over the
    experts: each rank sends (n-1)/n of its pairs away."""
    if DISPATCH not in st.tags:
        return []
    m = st.tags.index(DISPATCH)
    n = mesh.shape[m]
    fwd = _fwd(call)
    xi = 0 if fwd else 1
    x = st.in_layouts(call)[xi]
    k, h = call.ins[xi + 1].shape[1], call.ins[xi].shape[1]
    tokens = max(x.local_shape(mesh, r)[0] for r in range(mesh.size))
    away = math.ceil(tokens * k * (n - 1) / n)
    widest = math.ceil(call.ins[_weights(call)[0]].shape[0] / n)
    x_item, w_item = x.itemsize, call.ins[xi + 2].dtype.itemsize
    sizes = [widest * (n - 1) * 8]
    if fwd:
        sizes += [away * h * x_item] * 2
    elif call.ins[xi + 2].dtype == x.dtype:  # rows and routing weights travel together
        sizes += [away * (2 * h * x_item + w_item), away * (h * x_item + w_item)]
    else:  # one message per dtype each way (dispatch.exchange)
        sizes += [away * 2 * h * x_item, away * w_item, away * h * x_item, away * w_item]
    cost = CostModel()
    return [RedistStep("all_to_all", m, x, x, bytes=b, time=cost.collective_time("all_to_all", b, n, m, mesh))
            for b in sizes]


def experts_flops(call: OpCall, st, mesh) -> tuple:
    """Per rank: ``6 * H * I_local`` flops per (token, expert) pair it computes (gate_up and
    down products; the backward twice that). Its pairs: its tokens (with dispatch, those of its
    whole group) times K, times the share of the experts it holds: data parallel, dispatch and
    the experts' partial sums each compute 1/n of the pairs, tensor parallel all of them with
    1/n of the features, replicated all of them."""
    fwd = _fwd(call)
    xi, gi = (0 if fwd else 1), _weights(call)[0]
    lays = st.in_layouts(call)
    k, h, experts = call.ins[xi + 1].shape[1], call.ins[xi].shape[1], call.ins[gi].shape[0]
    group = mesh.shape[st.tags.index(DISPATCH)] if DISPATCH in st.tags else 1
    out = []
    for r in range(mesh.size):
        tokens, (held, gate_up_rows) = lays[xi].local_shape(mesh, r)[0], lays[gi].local_shape(mesh, r)[:2]
        pairs = tokens * group * k * held / experts
        out.append((1.0 if fwd else 2.0) * 3.0 * h * gate_up_rows * pairs)
    return tuple(out)


ROWS = (Rule([FORWARD, BACKWARD], experts_strategies, experts_local, valid=experts_valid, blockwise=False,
             comm=dispatch_comm),)
