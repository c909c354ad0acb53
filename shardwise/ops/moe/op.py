"""``torch.ops.shardwise.moe_experts``: a Mixture-of-Experts layer's experts as one custom op.

    python -m pytest tests/parallel/test_moe_dispatch.py -q   # opcheck, gradients, sharded runs

Schema::

    shardwise::moe_experts(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up,
        Tensor down, str act, int first_expert) -> Tensor out
    shardwise::moe_experts_backward(Tensor grad_out, Tensor x, Tensor top_k_index,
        Tensor top_k_weights, Tensor gate_up, Tensor down, str act, int first_expert)
        -> (Tensor dx, Tensor d_weights, Tensor d_gate_up, Tensor d_down)

``x`` [T, H] tokens, ``top_k_index`` [T, K] expert ids, ``top_k_weights`` [T, K] routing
weights, ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] the stacked experts (Hugging Face's
layout), ``act`` a ``hidden_act`` name (kernels.ACTIVATIONS). ``first_expert``: the global id
of ``gate_up[0]`` (0 for the whole model; a rank holding experts [f, f + E_local) passes f
and computes their share only). The op hides the data-dependent grouping from the tracer
(fixed shapes in, fixed shapes out), so the joint graph holds one forward and one backward
node per MoE layer, and its rule (rules/moe_experts.py) can send tokens to the ranks holding
their experts (dispatch.py).
"""
from __future__ import annotations

import torch

from ...core.errors import ShardingError
from . import kernels

Tensor = torch.Tensor


@torch.library.custom_op("shardwise::moe_experts", mutates_args=())
def moe_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                act: str, first_expert: int) -> Tensor:
    return kernels.experts_forward(x, top_k_index, top_k_weights, gate_up, down, act, first_expert)


def _check(x, top_k_index, top_k_weights, gate_up, down, act):
    kernels.check_act(act)
    ok = (x.dim() == 2 and top_k_index.dim() == 2 and top_k_weights.shape == top_k_index.shape
          and top_k_index.shape[0] == x.shape[0] and gate_up.dim() == 3 and down.dim() == 3
          and gate_up.shape[0] == down.shape[0] and gate_up.shape[2] == x.shape[1]
          and gate_up.shape[1] == 2 * down.shape[2] and down.shape[1] == x.shape[1])
    if not ok:
        raise ShardingError(f"shardwise.moe_experts: shapes x {tuple(x.shape)}, top_k_index "
                            f"{tuple(top_k_index.shape)}, top_k_weights {tuple(top_k_weights.shape)}, gate_up "
                            f"{tuple(gate_up.shape)}, down {tuple(down.shape)} do not fit [T, H], [T, K], [T, K], "
                            "[E, 2I, H], [E, H, I]", fix="pass tokens flattened to [T, H] and Hugging Face's stacked "
                            "expert weights (gate rows then up rows)")


@moe_experts.register_fake
def _moe_experts_fake(x, top_k_index, top_k_weights, gate_up, down, act, first_expert):
    _check(x, top_k_index, top_k_weights, gate_up, down, act)
    return x.new_empty(x.shape)


@torch.library.custom_op("shardwise::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad_out: Tensor, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                         down: Tensor, act: str, first_expert: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return kernels.experts_backward(grad_out, x, top_k_index, top_k_weights, gate_up, down, act, first_expert)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad_out, x, top_k_index, top_k_weights, gate_up, down, act, first_expert):
    _check(x, top_k_index, top_k_weights, gate_up, down, act)
    return torch.empty_like(x), torch.empty_like(top_k_weights), torch.empty_like(gate_up), torch.empty_like(down)


def _setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, down, act, first_expert = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, down)
    ctx.act, ctx.first_expert = act, first_expert


def _backward(ctx, grad_out):
    x, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    dx, dw, dgu, dd = moe_experts_backward(grad_out.contiguous(), x, top_k_index, top_k_weights, gate_up, down,
                                           ctx.act, ctx.first_expert)
    return dx, None, dw, dgu, dd, None, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)

FORWARD = torch.ops.shardwise.moe_experts.default
BACKWARD = torch.ops.shardwise.moe_experts_backward.default
