"""One rank's expert MLPs on rows of (token, expert) pairs: the math of Hugging Face's gated
experts (``gate, up = (h @ gate_up[e].T).chunk(2); y = (act(gate) * up) @ down[e].T``) and its
backward, written out so the sharded local calls (op.py, dispatch.py) share one formula.

Rows are grouped by expert with a stable sort and each expert multiplies its rows once
(the data-dependent sizes are fine here: these functions run eagerly on real tensors inside
a per-rank program, never under the tracer). ``first`` is the global id of the first expert
whose weights are passed; rows of other experts are left at zero, which is what makes the
experts-sharded strategy a partial sum over ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.errors import ShardingError

aten = torch.ops.aten


def _gelu_bwd(approximate: str):
    return lambda grad, x: aten.gelu_backward(grad, x, approximate=approximate)


# Hugging Face ``hidden_act`` names -> (activation, its backward(grad, input)).
ACTIVATIONS = {
    "silu": (F.silu, aten.silu_backward),
    "swish": (F.silu, aten.silu_backward),
    "gelu": (F.gelu, _gelu_bwd("none")),
    "gelu_pytorch_tanh": (lambda x: F.gelu(x, approximate="tanh"), _gelu_bwd("tanh")),
    "relu": (F.relu, lambda grad, x: grad * (x > 0).to(grad.dtype)),
}


def check_act(act: str) -> None:
    if act not in ACTIVATIONS:
        raise ShardingError(f"shardwise.moe_experts: unknown activation {act!r}",
                            fix=f"use one of {sorted(ACTIVATIONS)}, or trace the experts as written")


def groups(experts: torch.Tensor, first: int, count: int):
    """(order, [(local expert, start, end)]) : rows sorted by expert (stable), each local
    expert's slice of ``order``; rows of experts outside [first, first + count) come last."""
    local = experts - first
    outside = (local < 0) | (local >= count)
    key = torch.where(outside, torch.full_like(local, count), local)
    order = torch.argsort(key, stable=True)
    sizes = torch.bincount(key, minlength=count + 1)[:count].tolist()
    spans, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            spans.append((e, start, start + n))
        start += n
    return order, spans


def expert_rows_forward(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        act: str, first: int = 0) -> torch.Tensor:
    """y[s] = expert ``experts[s]``'s MLP of row ``x[s]`` (unweighted); zero for experts not held."""
    check_act(act)
    fn = ACTIVATIONS[act][0]
    y = x.new_zeros(x.shape[0], down.shape[1])
    order, spans = groups(experts, first, gate_up.shape[0])
    for e, a, b in spans:
        rows = order[a:b]
        gate, up = F.linear(x.index_select(0, rows), gate_up[e]).chunk(2, dim=-1)
        y.index_copy_(0, rows, F.linear(fn(gate) * up, down[e]))
    return y


def expert_rows_backward(x, experts, g, w, gate_up, down, act: str, first: int = 0):
    """Gradients of ``sum_s w[s] * <g[s], y[s]>`` with y = expert_rows_forward(x, ...):
    (dx [S, H], dw [S], d_gate_up, d_down). ``g``: the output's gradient at each row's token
    (unweighted), ``w``: each row's routing weight."""
    check_act(act)
    fn, fn_bwd = ACTIVATIONS[act]
    dx = torch.zeros_like(x)
    dw = w.new_zeros(w.shape[0])
    d_gate_up, d_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    order, spans = groups(experts, first, gate_up.shape[0])
    for e, a, b in spans:
        rows = order[a:b]
        h, g_e, w_e = x.index_select(0, rows), g.index_select(0, rows), w.index_select(0, rows)
        gate, up = F.linear(h, gate_up[e]).chunk(2, dim=-1)
        s = fn(gate)
        hidden = s * up
        y = F.linear(hidden, down[e])
        dw.index_copy_(0, rows, (g_e.to(dw.dtype) * y.to(dw.dtype)).sum(-1))  # in the weights' dtype, as HF
        gy = (g_e * w_e.unsqueeze(-1)).to(y.dtype)
        d_down[e] = gy.t() @ hidden
        d_hidden = gy @ down[e]
        d_gu = torch.cat([fn_bwd(d_hidden * up, gate), d_hidden * s], dim=-1)
        d_gate_up[e] = d_gu.t() @ h
        dx.index_copy_(0, rows, d_gu @ gate_up[e])
    return dx, dw, d_gate_up, d_down


def token_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H] -> [T * k, H]: row t * k + j is token t (one row per (token, choice) pair)."""
    return x.unsqueeze(1).expand(x.shape[0], k, *x.shape[1:]).reshape(x.shape[0] * k, *x.shape[1:])


def combine(y_pairs: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_k w[t, k] * y[t, k] in the order Hugging Face sums (weight, then sum over k)."""
    t, k = w.shape
    return (y_pairs.view(t, k, y_pairs.shape[-1]) * w.unsqueeze(-1)).sum(1).to(dtype)


def experts_forward(x, top_k_index, top_k_weights, gate_up, down, act: str, first: int = 0) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t]), over the experts held (first, ...)."""
    k = top_k_index.shape[1]
    y = expert_rows_forward(token_rows(x, k), top_k_index.reshape(-1), gate_up, down, act, first)
    return combine(y, top_k_weights, x.dtype)


def experts_backward(grad_out, x, top_k_index, top_k_weights, gate_up, down, act: str, first: int = 0):
    """(dx, d_weights, d_gate_up, d_down) of experts_forward for the experts held."""
    t, k = top_k_index.shape
    dx, dw, d_gate_up, d_down = expert_rows_backward(
        token_rows(x, k), top_k_index.reshape(-1), token_rows(grad_out, k), top_k_weights.reshape(-1),
        gate_up, down, act, first)
    return dx.view(t, k, dx.shape[-1]).sum(1), dw.view(t, k).to(top_k_weights.dtype), d_gate_up, d_down
