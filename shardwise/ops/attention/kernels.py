"""Local attention math on plain tensors: forward, backward and the online-softmax merge.

Layout is F.scaled_dot_product_attention's: q ``[..., Hq, L, E]``, k ``[..., Hk, S, E]``,
v ``[..., Hk, S, Ev]``, out ``[..., Hq, L, Ev]``, lse ``[..., Hq, L]`` (natural-log
logsumexp of the scaled, masked scores of each query row).

Conventions (each matches F.sdpa on CPU in torch 2.13):

- **Causal** is F.sdpa's ``is_causal``: the top-left aligned ``tril(ones(L, S))``, i.e.
  query ``i`` sees key ``j`` iff ``j <= i``. Here positions are global: query ``i`` of the
  local block sits at ``settings.q_offset + i``, key ``j`` at ``settings.k_offset + j``, and
  it sees the key iff ``k_offset + j <= q_offset + i``. A block of the global problem thus
  sees exactly the keys it would see on one device (with Sq != Sk too).
- **Masks**: bool (True = may attend) or additive float, broadcastable to
  ``[..., Hq, L, S]``, already sliced to the local block by the caller. Causal and a mask
  may be combined (both apply); F.sdpa refuses that combination, this op does not.
- **GQA** (``enable_gqa``): query head ``h`` uses kv head ``h // (Hq // Hk)``
  (repeat_interleave semantics, as F.sdpa).
- **Fully masked rows** (a query that sees no key, or an empty key block) give output 0
  and lse ``-inf``, never NaN, with zero gradients: that is what F.sdpa's default CPU
  kernel gives (its math fallback gives the mean of v instead; we do not match that).
- **Precision**: lse is float32 for float16/bfloat16 inputs. Whole calls on torch's fused
  kernel (``attention_forward`` / ``attention_backward``) compute low precision as aten's
  SDPA does (float32 accumulation, results rounded to the input dtype); blocks that are
  merged afterwards (``attention_block*``) and the math path compute from float32 copies
  and return the compute dtype.

Two paths compute the same thing: torch's fused SDPA kernels (fused.py: no L x S scores,
used wherever they apply, offsets and masks included) and the math path below
(``math_block`` / ``math_block_backward``: materialised scores, for what the kernels cannot
express, e.g. soft-capping, or a device without a wired kernel). A v head size unlike q's
(Multi-head Latent Attention) takes the fused kernels zero-padded to one head size (fused.py).

Score modifications (mods.py: soft-capping, an additive bias and its gradient, ALiBi slopes,
sliding windows, document ids) come as ``settings`` and a ``Mods`` of tensors. The fused
kernels take all but soft-capping folded into one additive mask (``mods.fold``); soft-capping
and a bias gradient take the math path. Backward functions return ``(dq, dk, dv, dbias)``,
dbias None unless ``grad_bias``.

The block functions (``attention_block``, ``attention_block_backward``, ``merge``) are what
ring and gathered-KV attention (ring.py) assemble a sharded computation from.
"""
from __future__ import annotations


import torch

from ...core.errors import AttentionError

from . import fused, mods as score_mods
from .mods import NO_MODS, Mods, block_is_empty  # noqa: F401 (block_is_empty: re-exported)
from .settings import AttentionSettings, default_scale  # noqa: F401 (default_scale: re-exported)
from .softmax import LOW_PRECISION, NEG_INF, compute_dtype, empty_block, merge  # noqa: F401 (re-exported)


# -- shape checks -----------------------------------------------------------------------

def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, settings: "AttentionSettings",
                 mods: Mods = NO_MODS) -> int:
    """Validate q/k/v/mask/mods against each other and ``settings``; return the GQA group size."""
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise AttentionError(f"attention: q, k, v need the same rank >= 2 ([..., heads, seq, head_dim]); got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}", fix="reshape them alike")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise AttentionError(f"attention: q, k, v need one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}",
                             fix="cast them to one float dtype, e.g. q.float()")
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise AttentionError(f"attention: q/k head_dim and k/v [..., seq] must agree; got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}", fix="give k and v one sequence length")
    g = 1
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        hq, hk = q.shape[-3], k.shape[-3]
        if not settings.enable_gqa or hk == 0 or hq % hk:
            raise AttentionError(f"attention: {hq} query heads vs {hk} key/value heads needs enable_gqa=True and "
                                 f"query heads a multiple of kv heads (q {tuple(q.shape)}, k {tuple(k.shape)})",
                                 fix="pass enable_gqa=True with query heads a multiple of key/value heads")
        g = hq // hk
    if q.shape[:-3] != k.shape[:-3]:
        raise AttentionError(f"attention: batch dims of q {tuple(q.shape)} and k {tuple(k.shape)} differ",
                             fix="give q, k and v the same leading (batch) dims")
    if mask is not None:
        _check_mask(mask, q, k)
    score_mods.check(mods, q, k, settings)
    settings.check_blocks(q.shape[-2], k.shape[-2])
    return g


def _check_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        raise AttentionError(f"attention: attn_mask must be bool or q's dtype {q.dtype}; got {mask.dtype}",
                             fix="pass a bool mask, or an additive one of q's dtype")
    ok = mask.dim() <= len(scores) and all(
        m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores), strict=False))
    if not ok:
        raise AttentionError(f"attention: attn_mask {tuple(mask.shape)} does not broadcast to the scores {scores}",
                             fix="slice the mask to the local query/key block (the caller's job)")


# -- scores -------------------------------------------------------------------------------

def _expand_kv(t: torch.Tensor, g: int) -> torch.Tensor:
    """GQA: kv heads repeated ``g`` times in repeat_interleave order (a view when g == 1)."""
    if g == 1:
        return t
    return t.unsqueeze(-3).expand(*t.shape[:-2], g, *t.shape[-2:]).flatten(-4, -3)


def _reduce_kv_grad(t: torch.Tensor, g: int) -> torch.Tensor:
    """Adjoint of ``_expand_kv``: sum the gradients of the ``g`` query heads of each kv head."""
    if g == 1:
        return t
    return t.unflatten(-3, (t.shape[-3] // g, g)).sum(-3)


def _scores(q, k, mask, settings: "AttentionSettings", g: int, mods: Mods = NO_MODS):
    """(scores, tanh): the scaled, soft-capped, biased and masked scores ``[..., Hq, L, S]`` in the
    compute dtype (-inf where not seen), and tanh(scaled / softcap) for the backward (None
    without soft-capping)."""
    ct = compute_dtype(q.dtype)
    scale = settings.resolve_scale(q.shape[-1])
    s = torch.matmul(q.to(ct), _expand_kv(k.to(ct), g).transpose(-1, -2)) * scale
    t = None
    if settings.softcap is not None:
        t = torch.tanh(s / settings.softcap)
        s = t * settings.softcap
    return score_mods.apply(s, settings, mods, mask, q, k), t


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse); rows with lse = -inf (saw no key) give 0 instead of NaN."""
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe.unsqueeze(-1))


# -- forward ------------------------------------------------------------------------------

def math_block(q, k, v, mask, settings: "AttentionSettings", mods: Mods = NO_MODS) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one query block against one key block, both in the compute dtype, from the
    materialised scores (the path for what the fused kernels cannot express)."""
    g = check_shapes(q, k, v, mask, settings, mods)
    ct = compute_dtype(q.dtype)
    s, _ = _scores(q, k, mask, settings, g, mods)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(_probs(s, lse), _expand_kv(v.to(ct), g))
    return out, lse


def _fused_forward(q, k, v, mask, settings, mods: Mods, native: bool):
    """The fused kernel's (out, lse), or None where it cannot compute this call (soft-capping)."""
    if settings.softcap is not None or not fused.applies(q, k, v, settings):
        return None
    mask, settings = score_mods.fold(mask, settings, mods, q, k, compute_dtype(q.dtype))
    return fused.forward(q, k, v, mask, settings, native=native)


def attention_block(q, k, v, mask, settings: "AttentionSettings", mods: Mods = NO_MODS):
    """(out, lse) of one query block against one key block, both in the compute dtype (blocks
    that are merged afterwards keep full precision): torch's fused kernel where it applies."""
    check_shapes(q, k, v, mask, settings, mods)
    got = _fused_forward(q, k, v, mask, settings, mods, native=False)
    return math_block(q, k, v, mask, settings, mods) if got is None else got


def attention_forward(q, k, v, mask, settings: "AttentionSettings", mods: Mods = NO_MODS):
    """(out in q's dtype, lse in the compute dtype) of a whole call: the fused kernel where it
    applies (low precision as aten's SDPA computes it), else the math path."""
    check_shapes(q, k, v, mask, settings, mods)
    got = _fused_forward(q, k, v, mask, settings, mods, native=True)
    if got is None:
        got = math_block(q, k, v, mask, settings, mods)
    out, lse = got
    return out.to(q.dtype), lse


# -- backward -----------------------------------------------------------------------------

def row_dot(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) in the compute dtype: the softmax backward's correction term."""
    ct = compute_dtype(out.dtype)
    return (grad_out.to(ct) * out.to(ct)).sum(-1)


def math_block_backward(grad_out, grad_lse, q, k, v, mask, delta, lse, settings: "AttentionSettings",
                        mods: Mods = NO_MODS, grad_bias: bool = False):
    """(dq, dk, dv, dbias) in the compute dtype for one query block against one key block.

    ``lse`` is the row logsumexp over ALL keys the rows see (not just this block's) and
    ``delta`` = ``row_dot(grad_out, out)`` of the final output, so block gradients add up
    to the full gradient. dS = P * (dP - delta + grad_lse) is the gradient of the modified
    scores: the bias's (summed over what it broadcasts over; None unless ``grad_bias``), and
    through soft-capping's tanh' and the scale, q's and k's.
    """
    g = check_shapes(q, k, v, mask, settings, mods)
    ct = compute_dtype(q.dtype)
    if g == 0:  # no query heads here (a rank's empty share of them): nothing reaches k or v
        zero = lambda t: torch.zeros(t.shape, dtype=ct, device=t.device)  # noqa: E731
        return zero(q), zero(k), zero(v), zero(mods.bias) if grad_bias and mods.bias is not None else None
    scale = settings.resolve_scale(q.shape[-1])
    kc, vc, do = _expand_kv(k.to(ct), g), _expand_kv(v.to(ct), g), grad_out.to(ct)
    s, t = _scores(q, k, mask, settings, g, mods)
    p = _probs(s, lse)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vc.transpose(-1, -2))
    corr = -delta if grad_lse is None else grad_lse.to(ct) - delta
    ds = p * (dp + corr.unsqueeze(-1))
    dbias = score_mods.reduce_to(ds, mods.bias.shape) if grad_bias and mods.bias is not None else None
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, kc) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(ct)) * scale
    return dq, _reduce_kv_grad(dk, g), _reduce_kv_grad(dv, g), dbias


def _fused_backward(grad_out, grad_lse, q, k, v, mask, out, lse, settings, mods: Mods, grad_bias: bool,
                    native: bool):
    if grad_bias or settings.softcap is not None or not fused.applies(q, k, v, settings):
        return None
    mask, settings = score_mods.fold(mask, settings, mods, q, k, compute_dtype(q.dtype))
    got = fused.backward(grad_out, grad_lse, q, k, v, mask, out, lse, settings, native=native)
    return None if got is None else (*got, None)


def attention_block_backward(grad_out, grad_lse, q, k, v, mask, out, lse, settings: "AttentionSettings",
                             mods: Mods = NO_MODS, grad_bias: bool = False):
    """(dq, dk, dv, dbias) in the compute dtype for one query block against one key block.

    ``out`` and ``lse`` are the FINAL output and row logsumexp over all keys the rows see, so
    block gradients add up to the full gradient. Fused kernel where it applies."""
    check_shapes(q, k, v, mask, settings, mods)
    got = _fused_backward(grad_out, grad_lse, q, k, v, mask, out, lse, settings, mods, grad_bias, native=False)
    if got is None:
        got = math_block_backward(grad_out, grad_lse, q, k, v, mask, row_dot(grad_out, out), lse, settings, mods,
                                  grad_bias)
    return got


def attention_backward(grad_out, q, k, v, mask, out, lse, settings: "AttentionSettings", grad_lse=None,
                       mods: Mods = NO_MODS, grad_bias: bool = False):
    """(dq, dk, dv, dbias) in the dtypes of q, k, v (and the bias), from the saved ``out`` and ``lse``."""
    check_shapes(q, k, v, mask, settings, mods)
    got = _fused_backward(grad_out, grad_lse, q, k, v, mask, out, lse, settings, mods, grad_bias, native=True)
    if got is None:
        got = math_block_backward(grad_out, grad_lse, q, k, v, mask, row_dot(grad_out, out), lse, settings, mods,
                                  grad_bias)
    dq, dk, dv, db = got
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if db is None else db.to(mods.bias.dtype)
