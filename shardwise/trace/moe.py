"""Grouped matmuls (Mixture-of-Experts) as fixed-shape aten ops while tracing.

Hugging Face's default experts implementation sorts the (token, expert) pairs by expert and
calls ``torch.nn.functional.grouped_mm(x, w, offs=offsets)``: rows ``offs[e-1]:offs[e]`` of
``x`` are multiplied by expert ``e``'s weight. torch 2.13's fake kernel for ``_grouped_mm``
accepts only bfloat16 while the CPU kernel takes float32 too, so a float32 model cannot be
traced as is; and the group boundaries are data (``offs``), so no static slicing exists.

While tracing, ``dense_grouped_mm`` replaces the call by an exactly equal fixed-shape form:
every row is multiplied by every expert, and ``torch.where`` keeps the product of the
expert that owns the row (exact zeros elsewhere, so the sum over experts adds exact zeros
to one value: bit-for-bit the owning expert's product row, whatever the summation order).
Its ops (matmul, comparisons, where, sum) have rules, so the planner shards it like any
other graph: rows (data parallel), the output features (tensor parallel), the reduction
features (Partial), and the experts dim of the weights (expert parallel: each rank
multiplies by its own experts and the sum over experts becomes a partial sum across ranks).

Cost: ``E`` times the multiply-adds of a true grouped matmul (``E / n`` per rank when the
experts are sharded ``n`` ways).

That dense form is the fallback. Hugging Face experts modules of the common kind (gated,
concatenated ``gate_up_proj``, no bias, no post-expert norm, a known activation) are traced as
one ``shardwise.moe_experts`` op instead, whatever their ``experts_implementation`` (eager,
batched_mm, grouped_mm: the same function; the eager loop's ``nonzero`` never reaches the
tracer): ``experts_as_op`` routes Hugging Face's experts dispatcher (``ExpertsInterface.
get_interface``) to it while tracing, on the tracing thread only. The op's rule
(rules/moe_experts.py) offers data, tensor and expert parallelism, and token dispatch by
all-to-all (ops/moe/dispatch.py).
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ..core.errors import ShardingError
from .patching import TracingPatch

GROUPED = tuple(f for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
                if f is not None)


def dense_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(x[S, K], w[E, K, N], offs[E])`` with fixed shapes: row ``s`` times ``w[e]``
    for the ``e`` with ``offs[e-1] <= s < offs[e]`` (``offs[-1] = 0``); rows past ``offs[E-1]``
    are zero (the kernel leaves them unwritten)."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(x.shape[0], device=x.device)
    owner = (rows.unsqueeze(0) >= starts.unsqueeze(1)) & (rows.unsqueeze(0) < ends.unsqueeze(1))  # [E, S]
    every = torch.matmul(x.unsqueeze(0), w)  # [E, S, N]: each row by each expert
    return torch.where(owner.unsqueeze(-1), every, every.new_zeros(())).sum(0)


def _unpack(args: tuple, kwargs: dict):
    a, b = args[:2]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    bias = kwargs.get("bias", args[3] if len(args) > 3 else None)
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    return a, b, offs, bias, out_dtype


def dense_in_place(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """A ``F.grouped_mm`` / ``torch._grouped_mm`` call (2-d input, 3-d weights, ``offs``) as
    ``dense_grouped_mm``; any other form is refused with the op named, never traced wrongly.
    Called by the tracing pass's one TorchFunctionMode (trace/eager_attention.py): each mode
    costs every torch call of the trace."""
    a, b, offs, bias, out_dtype = _unpack(args, kwargs)
    if a.dim() != 2 or b.dim() != 3 or offs is None or bias is not None or out_dtype not in (None, a.dtype):
        raise ShardingError(
            f"{getattr(func, '__name__', func)} with a {a.dim()}-d and a {b.dim()}-d operand"
            f"{'' if offs is not None else ', no offs'}{', a bias' if bias is not None else ''}"
            f"{', out_dtype' if out_dtype not in (None, a.dtype) else ''} is not supported while tracing; "
            "shardwise traces the Mixture-of-Experts form (2-d tokens sorted by expert, 3-d expert weights, "
            "offs, no bias or out_dtype)",
            fix="compute the grouped product with fixed shapes (per-expert masks and matmul), or for a Hugging "
                "Face model pass experts_implementation='batched_mm'")
    return dense_grouped_mm(a, b, offs)


# -- Hugging Face experts modules as shardwise.moe_experts --------------------------------------
_PATCH = TracingPatch()  # experts_as_op: the dispatcher wrapped while any thread traces
_IMPLEMENTATIONS = (None, "eager", "batched_mm", "grouped_mm")  # the same function, computed three ways


def experts_act(module) -> str | None:
    """The activation name ``shardwise.moe_experts`` computes for ``module``, or None when the
    module is not of the kind the op computes exactly (then it is traced as written)."""
    from ..ops.moe.kernels import ACTIVATIONS

    moe = sys.modules.get("transformers.integrations.moe")
    config = getattr(module, "config", None)
    name = getattr(config, "hidden_act", None)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if moe is None or name not in ACTIVATIONS or not isinstance(gate_up, torch.Tensor) \
            or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return None
    plain = (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
             and not getattr(module, "has_bias", True) and not getattr(module, "has_post_expert_norm", True)
             and not getattr(module, "_is_expert_parallel", True)
             and getattr(type(module), "_apply_gate", None) is getattr(moe, "_default_apply_gate", object())
             and getattr(config, "_experts_implementation", None) in _IMPLEMENTATIONS)
    act_cls = type(_act_module(name))
    return name if plain and type(getattr(module, "act_fn", None)) is act_cls else None


def _act_module(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def experts_op_forward(module, hidden_states, top_k_index, top_k_weights):
    """What a qualifying experts module computes, as one op (its weights in [E, 2I, H] /
    [E, H, I] order: transposed modules pass transposed views)."""
    from ..ops.moe.op import moe_experts

    gate_up, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, experts_act(module), 0)


def _routed(chosen):
    def forward(module, *args, **kwargs):
        if _PATCH.active and not kwargs and len(args) == 3 and experts_act(module) is not None:
            return experts_op_forward(module, *args)
        return chosen(module, *args, **kwargs)

    return forward


@contextlib.contextmanager
def experts_as_op():
    """While tracing on this thread, Hugging Face's experts dispatcher returns the op's form for
    qualifying modules (experts_act) and the module's own implementation otherwise. The
    dispatcher is wrapped while any thread has this context open (a count under a lock), and
    the wrapper substitutes only on threads that have it open."""
    moe = sys.modules.get("transformers.integrations.moe")
    cls = getattr(moe, "ExpertsInterface", None)
    if cls is None:
        yield
        return

    def install():
        original = cls.get_interface

        def get_interface(self, experts_implementation, default):
            return _routed(original(self, experts_implementation, default))

        cls.get_interface = get_interface

        def undo():
            cls.get_interface = original
        return undo

    with _PATCH.opened(install):
        yield
