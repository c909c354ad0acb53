"""``torch.ops.shardwise.attention``: scaled-dot-product attention as one custom op.

    python -m pytest tests/attention/test_op.py      # opcheck, compile, gradients vs aten

Schema (the settings travel as primitive args; ``AttentionSettings.to_op_args`` /
``from_op_args`` convert each way; the score-modification tensors (mods.py) come last and
default to None)::

    shardwise::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal,
        float? scale, bool enable_gqa, int q_offset, int k_offset, int? q_len_global,
        int? k_len_global, float? softcap=None, int? window_left=None, int? window_right=None,
        bool alibi_key_only=False, Tensor? bias=None, Tensor? alibi_slopes=None,
        Tensor? q_doc=None, Tensor? k_doc=None) -> (Tensor out, Tensor lse)
    shardwise::attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k,
        Tensor v, Tensor? attn_mask, Tensor out, Tensor lse, <the same settings and mods>,
        bool grad_bias=False) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)

``out`` has q's dtype and memory layout; ``lse`` is float32 for float16/bfloat16 inputs, else
q's dtype, contiguous. dq/dk/dv have the dtypes of q/k/v; 4-d ones are laid out as aten's CPU
flash backward lays them out ([batch, seq, heads, dim] in memory), others as their input.
``dbias`` is the bias's gradient (its shape and dtype) when ``grad_bias``, else an empty
``[0]`` tensor (a custom op cannot return None).
The compute is torch's fused SDPA kernel where it applies, else the math path (kernels.py).
The backward is a custom op too, so a traced joint graph holds one forward and one
backward attention node rather than decomposed math. ``bias`` is differentiable;
``attn_mask``, ``alibi_slopes`` and the document ids are not: one that requires grad raises
when the forward records for autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...core.errors import AttentionError
from . import fused, kernels
from .mods import MOD_NAMES, Mods
from .settings import SETTING_NAMES, AttentionSettings  # noqa: F401 (re-exported)
from .softmax import compute_dtype

Tensor = torch.Tensor


# -- forward op ---------------------------------------------------------------------------

def _attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               scale: Optional[float], enable_gqa: bool, q_offset: int, k_offset: int,
               q_len_global: Optional[int], k_len_global: Optional[int], softcap: Optional[float] = None,
               window_left: Optional[int] = None, window_right: Optional[int] = None,
               alibi_key_only: bool = False, bias: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
               q_doc: Optional[Tensor] = None, k_doc: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    if (got := _whole_forward(q, k, v, attn_mask, is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global,
                              k_len_global, softcap, window_left, window_right, alibi_key_only, bias, alibi_slopes,
                              q_doc, k_doc)) is not None:
        return got
    settings = AttentionSettings.from_op_args(is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global,
                                              k_len_global, softcap, window_left, window_right, alibi_key_only)
    out, lse = kernels.attention_forward(q, k, v, attn_mask, settings, Mods(bias, alibi_slopes, q_doc, k_doc))
    return _like(out, q), lse.contiguous()


attention_op = torch.library.custom_op("shardwise::attention", mutates_args=())(_attention)
_N_SETTINGS = len(SETTING_NAMES)


def _split_fake_args(rest: tuple) -> tuple[AttentionSettings, Mods, tuple]:
    """(settings, mods, what follows them) from the op's args after its leading tensors."""
    st = AttentionSettings.from_op_args(*rest[:_N_SETTINGS])
    tail = rest[_N_SETTINGS:]
    return st, Mods(*tail[:len(MOD_NAMES)]), tail[len(MOD_NAMES):]


@attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, *rest):
    st, mods, _ = _split_fake_args(_with_defaults(rest, _FWD_DEFAULTS))
    kernels.check_shapes(q, k, v, attn_mask, st, mods)
    out = _empty_in_layout_of((*q.shape[:-1], v.shape[-1]), q.dtype, q)
    return out, q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype))


# -- backward op --------------------------------------------------------------------------

def _attention_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                        attn_mask: Optional[Tensor], out: Tensor, lse: Tensor, is_causal: bool,
                        scale: Optional[float], enable_gqa: bool, q_offset: int, k_offset: int,
                        q_len_global: Optional[int], k_len_global: Optional[int], softcap: Optional[float] = None,
                        window_left: Optional[int] = None, window_right: Optional[int] = None,
                        alibi_key_only: bool = False, bias: Optional[Tensor] = None,
                        alibi_slopes: Optional[Tensor] = None, q_doc: Optional[Tensor] = None,
                        k_doc: Optional[Tensor] = None, grad_bias: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if (got := _whole_backward(grad_out, grad_lse, q, k, v, attn_mask, out, lse, is_causal, scale, enable_gqa,
                               q_offset, k_offset, q_len_global, k_len_global, softcap, window_left, window_right,
                               alibi_key_only, bias, alibi_slopes, q_doc, k_doc, grad_bias)) is not None:
        return got
    settings = AttentionSettings.from_op_args(is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global,
                                              k_len_global, softcap, window_left, window_right, alibi_key_only)
    mods = Mods(bias, alibi_slopes, q_doc, k_doc)
    *grads, db = kernels.attention_backward(grad_out, q, k, v, attn_mask, out, lse, settings, grad_lse=grad_lse,
                                            mods=mods, grad_bias=grad_bias and bias is not None)
    grads = tuple(_in_order(g, _grad_order(x)) for g, x in zip(grads, (q, k, v), strict=True))
    return (*grads, q.new_empty(0) if db is None else db.contiguous())


attention_backward_op = torch.library.custom_op("shardwise::attention_backward", mutates_args=())(_attention_backward)


# -- the whole-call fast path as plain functions ------------------------------------------------
# What the ops compute for a call fused.whole_call_scale accepts (``scale``: its answer), as plain
# calls: compile=True (run/compiled.py) puts them in the program in place of those calls, so dynamo
# traces them into aten's kernel and inductor runs it without the custom op's Python frames.

def whole_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                    scale: float) -> tuple[Tensor, Tensor]:
    out, lse = fused.whole_forward(q, k, v, attn_mask, is_causal, scale)
    return _like(out, q), lse.contiguous()


def whole_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                             out: Tensor, lse: Tensor, is_causal: bool, scale: float) -> tuple:
    """Also needs fused.whole_backward_fits(grad_out, q, out, lse)."""
    grads = fused.whole_backward(grad_out, q, k, v, attn_mask, out, lse, is_causal, scale)
    return (*(_in_order(g, _grad_order(x)) for g, x in zip(grads, (q, k, v), strict=True)), q.new_empty(0))


def _whole_forward(q, k, v, attn_mask, is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global, k_len_global,
                   softcap=None, window_left=None, window_right=None, alibi_key_only=False, bias=None,
                   alibi_slopes=None, q_doc=None, k_doc=None):
    """shardwise::attention's result where the whole-call fast path applies (the op's arguments), else None."""
    fast = fused.whole_call_scale(q, k, v, attn_mask, is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global,
                                  k_len_global, softcap, window_left, window_right, alibi_key_only, bias,
                                  alibi_slopes, q_doc, k_doc)
    return None if fast is None else whole_attention(q, k, v, attn_mask, is_causal, fast)


def _whole_backward(grad_out, grad_lse, q, k, v, attn_mask, out, lse, is_causal, scale, enable_gqa, q_offset,
                    k_offset, q_len_global, k_len_global, softcap=None, window_left=None, window_right=None,
                    alibi_key_only=False, bias=None, alibi_slopes=None, q_doc=None, k_doc=None, grad_bias=False):
    """shardwise::attention_backward's result where the whole-call fast path applies (the op's
    arguments), else None."""
    if grad_lse is not None or not fused.whole_backward_fits(grad_out, q, out, lse):
        return None
    fast = fused.whole_call_scale(q, k, v, attn_mask, is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global,
                                  k_len_global, softcap, window_left, window_right, alibi_key_only, bias,
                                  alibi_slopes, q_doc, k_doc)
    return None if fast is None else whole_attention_backward(grad_out, q, k, v, attn_mask, out, lse, is_causal, fast)


def attention_or_op(*args, **kwargs):
    """shardwise::attention's call: its fast path as plain calls where it applies, else the op."""
    got = _whole_forward(*args, **kwargs)
    return got if got is not None else attention_op(*args, **kwargs)


def attention_backward_or_op(*args, **kwargs):
    """shardwise::attention_backward's call: its fast path as plain calls where it applies, else the op."""
    got = _whole_backward(*args, **kwargs)
    return got if got is not None else attention_backward_op(*args, **kwargs)


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
    shape, strides = t.shape, t.stride()
    stride = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != stride:
            return False
        stride *= shape[d]
    return True


def _in_order(t: Tensor, order: list[int]) -> Tensor:
    """``t`` laid out in ``order``: itself when it already is (the fused kernels' results
    usually are), else a copy. Aten's attention kernels fix their results' layouts and graphs
    traced through them may ``view`` the results in ways only that layout allows."""
    return t if _is_in_order(t, order) else _empty_in_order(t.shape, t.dtype, t, order).copy_(t)


def _like(t: Tensor, x: Tensor) -> Tensor:
    """``t`` in ``x``'s memory layout."""
    return _in_order(t, _memory_order(x))


_FWD_DEFAULTS = (None, None, None, False, None, None, None, None)  # softcap ... k_doc
_BWD_DEFAULTS = _FWD_DEFAULTS + (False,)  # ... grad_bias


_N_REQUIRED = 7  # is_causal ... k_len_global: the settings without defaults


def _with_defaults(rest: tuple, defaults: tuple) -> tuple:
    """The op's args after its leading tensors, the defaulted trailing ones filled in."""
    return tuple(rest) + defaults[len(rest) - _N_REQUIRED:]


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, grad_lse, q, k, v, attn_mask, out, lse, *rest):
    st, mods, tail = _split_fake_args(_with_defaults(rest, _BWD_DEFAULTS))
    kernels.check_shapes(q, k, v, attn_mask, st, mods)
    grads = tuple(_empty_in_order(x.shape, x.dtype, x, _grad_order(x)) for x in (q, k, v))
    b = mods.bias
    return (*grads, b.new_empty(b.shape) if tail[0] and b is not None else q.new_empty(0))


# -- autograd -----------------------------------------------------------------------------

INPUT_NAMES = ("q", "k", "v", "attn_mask") + SETTING_NAMES + MOD_NAMES
SAVED_NAMES = ("q", "k", "v", "attn_mask", "out", "lse") + MOD_NAMES
_NO_GRAD = ("attn_mask", "alibi_slopes", "q_doc", "k_doc")


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
    named = dict(zip(INPUT_NAMES, (*inputs, *(None,) * (len(INPUT_NAMES) - len(inputs)))))
    for name in _NO_GRAD:
        t = named[name]
        if t is not None and t.requires_grad:
            raise AttentionError(
                f"shardwise.attention: {name} is not differentiable but requires grad here",
                fix="detach it (a learned additive bias goes in as bias=, whose gradient the op computes)")
    out, lse = output
    ctx.settings = AttentionSettings.from_op_args(*(named[n] for n in SETTING_NAMES))
    ctx.set_materialize_grads(False)  # an unused lse stays None: no zeros in the backward graph
    tensors = (named["q"], named["k"], named["v"], named["attn_mask"], out, lse, *(named[n] for n in MOD_NAMES))
    save_deduplicated(ctx, dict(zip(SAVED_NAMES, tensors, strict=True)))


def _backward(ctx, grad_out, grad_lse, backward_call=None):
    """The op's gradients (``backward_call``: what computes them, shardwise::attention_backward
    unless given)."""
    t = load_deduplicated(ctx)
    if grad_out is None:
        grad_out = torch.zeros_like(t["out"])
    grad_bias = t["bias"] is not None and ctx.needs_input_grad[INPUT_NAMES.index("bias")]
    dq, dk, dv, db = (backward_call or torch.ops.shardwise.attention_backward.default)(
        grad_out, grad_lse, t["q"], t["k"], t["v"], t["attn_mask"], t["out"], t["lse"],
        *ctx.settings.to_op_args(), *(t[n] for n in MOD_NAMES), grad_bias)
    grads = {"q": dq, "k": dk, "v": dv, "bias": db if grad_bias else None}
    return tuple(grads.get(name) for name in INPUT_NAMES)


attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """shardwise::attention's forward and backward for a plain eager call (``_plain_eager``): the
    op's implementations called as functions, with its own setup_context and backward. What the
    custom op's dispatch adds there is only cost: torch.library's autograd wrapper (its
    ``fill_defaults`` reads the 19-argument schema once per argument) and two trips through the
    dispatcher, ~0.3 ms per forward + backward on CPU and ~1.5 ms measured on an H200, more than
    the kernels of a small call. Traced, compiled, fake, subclass or autocast calls keep the op."""

    @staticmethod
    def forward(ctx, *args):  # (ctx in forward: apply then skips binding the arguments by signature)
        output = _attention(*args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward(ctx, grad_out, grad_lse, _attention_backward)


def _plain_eager(tensors) -> bool:
    """A call nothing intercepts: plain (or no) tensors, no torch.compile, no dispatch or
    function mode (make_fx, fake tensors, profilers of ops), no functorch transform, no autocast."""
    return (all(t is None or type(t) is Tensor for t in tensors) and not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack() and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None and not torch._C._is_any_autocast_enabled())


# -- Python entry ---------------------------------------------------------------------------

def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       settings: AttentionSettings = AttentionSettings(),
                       mods: Mods = Mods()) -> tuple[Tensor, Tensor]:
    """(out, lse) through the custom op, settings given as the dataclass, mods as a ``Mods``
    (a plain eager call: its implementation under autograd, _EagerAttention)."""
    args = (q, k, v, attn_mask, *settings.to_op_args(), *mods)
    if not _plain_eager((q, k, v, attn_mask, *mods)):
        return torch.ops.shardwise.attention.default(*args)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask, *mods)):
        return _EagerAttention.apply(*args)  # (its setup_context refuses a mask that requires grad, as the op's)
    return _attention(*args)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None, enable_gqa: bool = False, *, bias: Optional[Tensor] = None,
              softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None, alibi_key_only: bool = False,
              window_left: Optional[int] = None, window_right: Optional[int] = None,
              q_doc: Optional[Tensor] = None, k_doc: Optional[Tensor] = None) -> Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` (no dropout): one ``shardwise::attention`` node.

    q ``[..., Hq, L, E]``, k ``[..., Hk, S, E]``, v ``[..., Hk, S, Ev]`` -> ``[..., Hq, L, Ev]``.
    Score modifications (see ops/attention/mods.py): ``bias`` (differentiable, broadcastable to
    the scores), ``softcap``, ``alibi_slopes`` ``[Hq]`` (``alibi_key_only``: Bloom's form), a
    sliding window ``window_left`` / ``window_right`` (keys i - left .. i + right; None:
    unbounded), document ids ``q_doc`` ``[*batch, L]`` / ``k_doc`` ``[*batch, S]``.
    """
    settings = AttentionSettings(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
                                 window_left=window_left, window_right=window_right, alibi_key_only=alibi_key_only)
    return attention_with_lse(q, k, v, attn_mask, settings, Mods(bias, alibi_slopes, q_doc, k_doc))[0]
