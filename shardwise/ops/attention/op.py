"""``torch.ops.shardwise.attention``: scaled-dot-product attention as one custom op.

    python -m pytest tests/attention/test_op.py      # opcheck, compile, gradients vs aten

Schema (the settings travel as a few primitive args; ``AttentionSettings.to_op_args`` /
``from_op_args`` convert each way)::

    shardwise::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal,
        float? scale, bool enable_gqa, int q_offset, int k_offset, int? q_len_global,
        int? k_len_global) -> (Tensor out, Tensor lse)
    shardwise::attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k,
        Tensor v, Tensor? attn_mask, Tensor out, Tensor lse, <the same settings>)
        -> (Tensor dq, Tensor dk, Tensor dv)

``out`` has q's dtype and memory layout; ``lse`` is float32 for float16/bfloat16 inputs, else
q's dtype, contiguous. dq/dk/dv have the dtypes of q/k/v; 4-d ones are laid out as aten's CPU
flash backward lays them out ([batch, seq, heads, dim] in memory), others as their input.
The compute is torch's fused SDPA kernel where it applies, else the math path (kernels.py).
The backward is a custom op too, so a traced joint graph holds one forward and one
backward attention node rather than decomposed math. ``attn_mask`` is not
differentiable: a mask that requires grad raises when the forward records for autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...core.errors import AttentionError
from . import kernels
from .settings import SETTING_NAMES, AttentionSettings  # noqa: F401 (re-exported)
from .softmax import compute_dtype

Tensor = torch.Tensor


# -- forward op ---------------------------------------------------------------------------

@torch.library.custom_op("shardwise::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                 scale: Optional[float], enable_gqa: bool, q_offset: int, k_offset: int,
                 q_len_global: Optional[int], k_len_global: Optional[int]) -> tuple[Tensor, Tensor]:
    settings = AttentionSettings.from_op_args(is_causal, scale, enable_gqa, q_offset, k_offset,
                                              q_len_global, k_len_global)
    out, lse = kernels.attention_forward(q, k, v, attn_mask, settings)
    return _like(out, q), lse.contiguous()


@attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, *settings_args):
    kernels.check_shapes(q, k, v, attn_mask, AttentionSettings.from_op_args(*settings_args))
    out = _empty_in_layout_of((*q.shape[:-1], v.shape[-1]), q.dtype, q)
    return out, q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype))


# -- backward op --------------------------------------------------------------------------

@torch.library.custom_op("shardwise::attention_backward", mutates_args=())
def attention_backward_op(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                          attn_mask: Optional[Tensor], out: Tensor, lse: Tensor, is_causal: bool,
                          scale: Optional[float], enable_gqa: bool, q_offset: int, k_offset: int,
                          q_len_global: Optional[int], k_len_global: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    settings = AttentionSettings.from_op_args(is_causal, scale, enable_gqa, q_offset, k_offset,
                                              q_len_global, k_len_global)
    grads = kernels.attention_backward(grad_out, q, k, v, attn_mask, out, lse, settings, grad_lse=grad_lse)
    return tuple(_in_order(g, _grad_order(x)) for g, x in zip(grads, (q, k, v), strict=True))


def _memory_order(x: Tensor) -> list[int]:
    """``x``'s dims from outermost to innermost in memory."""
    return sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))


def _grad_order(x: Tensor) -> list[int]:
    """Memory order of the gradient of input ``x``: for 4-d inputs aten's CPU flash backward's
    [batch, seq, heads, dim] (as its meta function; no copy after the fused kernel, and the
    layout of q/k/v that are transposed views of [batch, seq, heads, dim] projections), else x's."""
    return [0, 2, 1, 3] if x.dim() == 4 else _memory_order(x)


def _empty_in_order(shape, dtype, x: Tensor, order: list[int]) -> Tensor:
    """An empty tensor of ``shape`` (on x's device) whose dims lie in memory in ``order``."""
    t = x.new_empty([shape[d] for d in order], dtype=dtype)
    return t.permute([order.index(d) for d in range(len(shape))])


def _empty_in_layout_of(shape, dtype, x: Tensor) -> Tensor:
    """An empty tensor of ``shape`` whose dims are ordered in memory as ``x``'s are."""
    return _empty_in_order(shape, dtype, x, _memory_order(x))


def _is_in_order(t: Tensor, order: list[int]) -> bool:
    """True when ``t`` is dense with its dims in memory in ``order`` (size-1 dims: any stride)."""
    stride = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != stride:
            return False
        stride *= t.shape[d]
    return True


def _in_order(t: Tensor, order: list[int]) -> Tensor:
    """``t`` laid out in ``order``: itself when it already is (the fused kernels' results
    usually are), else a copy. Aten's attention kernels fix their results' layouts and graphs
    traced through them may ``view`` the results in ways only that layout allows."""
    return t if _is_in_order(t, order) else _empty_in_order(t.shape, t.dtype, t, order).copy_(t)


def _like(t: Tensor, x: Tensor) -> Tensor:
    """``t`` in ``x``'s memory layout."""
    return _in_order(t, _memory_order(x))


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, grad_lse, q, k, v, attn_mask, out, lse, *settings_args):
    kernels.check_shapes(q, k, v, attn_mask, AttentionSettings.from_op_args(*settings_args))
    return tuple(_empty_in_order(x.shape, x.dtype, x, _grad_order(x)) for x in (q, k, v))


# -- autograd -----------------------------------------------------------------------------

INPUT_NAMES = ("q", "k", "v", "attn_mask") + SETTING_NAMES
SAVED_NAMES = ("q", "k", "v", "attn_mask", "out", "lse")


def _storage_ptr(t: Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper without a storage
        return None


def _known_equal(a, b) -> bool:
    """a == b, decided without adding guards on symbolic sizes (unknown counts as different)."""
    return bool(statically_known_true(a == b))


def same_memory_view(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` view the same storage the same way (not Python identity)."""
    if a is b:
        return True
    pa = _storage_ptr(a)
    if pa is None or pa != _storage_ptr(b) or a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    return _known_equal(a.storage_offset(), b.storage_offset()) and all(
        _known_equal(x, y) for x, y in zip((*a.shape, *a.stride()), (*b.shape, *b.stride()), strict=True))


def save_deduplicated(ctx, named: dict) -> None:
    """``ctx.save_for_backward`` each distinct tensor once (by storage and view); remember
    which saved slot each name maps to."""
    unique: list[Tensor] = []
    index: dict[str, int | None] = {}
    for name, t in named.items():
        if t is None:
            index[name] = None
            continue
        hit = next((i for i, u in enumerate(unique) if same_memory_view(t, u)), None)
        if hit is None:
            hit = len(unique)
            unique.append(t)
        index[name] = hit
    ctx.save_for_backward(*unique)
    ctx.saved_index = index


def load_deduplicated(ctx) -> dict:
    saved = ctx.saved_tensors
    return {name: None if i is None else saved[i] for name, i in ctx.saved_index.items()}


def _setup_context(ctx, inputs, output):
    named = dict(zip(INPUT_NAMES, inputs, strict=True))
    mask = named["attn_mask"]
    if mask is not None and mask.requires_grad:
        raise AttentionError(
            "shardwise.attention: attn_mask is not differentiable but requires grad here",
            fix="detach it (a learned additive bias needs F.scaled_dot_product_attention or an op of its own)")
    out, lse = output
    ctx.settings = AttentionSettings.from_op_args(*(named[n] for n in SETTING_NAMES))
    ctx.set_materialize_grads(False)  # an unused lse stays None: no zeros in the backward graph
    tensors = (named["q"], named["k"], named["v"], mask, out, lse)
    save_deduplicated(ctx, dict(zip(SAVED_NAMES, tensors, strict=True)))


def _backward(ctx, grad_out, grad_lse):
    t = load_deduplicated(ctx)
    if grad_out is None:
        grad_out = torch.zeros_like(t["out"])
    dq, dk, dv = torch.ops.shardwise.attention_backward.default(
        grad_out, grad_lse, t["q"], t["k"], t["v"], t["attn_mask"], t["out"], t["lse"],
        *ctx.settings.to_op_args())
    grads = {"q": dq, "k": dk, "v": dv}
    return tuple(grads.get(name) for name in INPUT_NAMES)


attention_op.register_autograd(_backward, setup_context=_setup_context)


# -- Python entry ---------------------------------------------------------------------------

def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       settings: AttentionSettings = AttentionSettings()) -> tuple[Tensor, Tensor]:
    """(out, lse) through the custom op, settings given as the dataclass."""
    return torch.ops.shardwise.attention.default(q, k, v, attn_mask, *settings.to_op_args())


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` (no dropout): one ``shardwise::attention`` node.

    q ``[..., Hq, L, E]``, k ``[..., Hk, S, E]``, v ``[..., Hk, S, Ev]`` -> ``[..., Hq, L, Ev]``.
    """
    settings = AttentionSettings(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return attention_with_lse(q, k, v, attn_mask, settings)[0]
