"""Score modifications of ``shardwise.attention`` as data (what FlexAttention's score_mod and
block_mask express as code), applied at GLOBAL positions so that a block of a sharded problem
computes exactly its part of the one-device scores.

For query i (global position ``q_offset + i``) and key j (``k_offset + j``), with ``s`` the
scaled scores q k^T * scale::

    s = softcap * tanh(s / softcap)                       # settings.softcap
    s = s + bias + alibi                                  # additive terms
    s = -inf where the key is not visible                 # mask, causal, window, documents

- ``bias``: a float tensor broadcastable to the scores ``[..., Hq, L, S]`` (T5's position
  bias, a model's ALiBi tensor), differentiable: its gradient is the score gradient summed
  over the dims it broadcasts over (``reduce_to``).
- ``alibi_slopes``: ``[Hq]``, one slope per query head: alibi = slope_h * (j - i), or
  slope_h * j with ``settings.alibi_key_only`` (Bloom; softmax makes the two equal).
- ``q_doc`` / ``k_doc``: integer document ids ``[*batch, L]`` / ``[*batch, S]``, one per
  token (batch dims may broadcast; no head dim): a query sees a key only within its own document (packed
  sequences). They travel with the tokens: sharded along the sequence like q and k.
- windows and causal come from the settings (``AttentionSettings.reach``).

``Mods`` bundles the tensors; ``fold`` turns everything but softcap into one additive mask
for torch's fused kernels, ``apply`` is the math path's version on materialised scores.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from ...core.errors import AttentionError
from .softmax import NEG_INF

Tensor = torch.Tensor


class Mods(NamedTuple):
    """The tensor score modifications of one call (see the module docstring); None = absent."""

    bias: Optional[Tensor] = None
    alibi_slopes: Optional[Tensor] = None
    q_doc: Optional[Tensor] = None
    k_doc: Optional[Tensor] = None

    @property
    def docs(self) -> bool:
        return self.q_doc is not None


NO_MODS = Mods()
MOD_NAMES = Mods._fields


def present(mods: Mods, settings) -> bool:
    """True when a mod beyond the plain mask and causal is in force (bias, ALiBi, documents, window)."""
    return any(t is not None for t in mods) or settings.windowed


# -- checks ---------------------------------------------------------------------------------

def check(mods: Mods, q: Tensor, k: Tensor, settings) -> None:
    """Fail loudly where a mod does not fit q and k."""
    scores = (*q.shape[:-1], k.shape[-2])
    if mods.bias is not None:
        b = mods.bias
        if not b.dtype.is_floating_point:
            raise AttentionError(f"attention: bias must be floating point, got {b.dtype}", fix="pass bias.float()")
        if not _broadcasts(b.shape, scores):
            raise AttentionError(f"attention: bias {tuple(b.shape)} does not broadcast to the scores {scores}",
                                 fix="give the bias the scores' [..., heads, L, S] shape (size-1 dims broadcast)")
    if mods.alibi_slopes is not None:
        a = mods.alibi_slopes
        if q.dim() < 3 or a.dim() != 1 or a.shape[0] != q.shape[-3] or not a.dtype.is_floating_point:
            heads = q.shape[-3] if q.dim() >= 3 else "?"
            raise AttentionError(f"attention: alibi_slopes must be float [query heads] = [{heads}], got "
                                 f"{tuple(a.shape)} {a.dtype} for q {tuple(q.shape)}",
                                 fix="one slope per query head, q laid out [..., heads, L, E]")
    if (mods.q_doc is None) != (mods.k_doc is None):
        raise AttentionError("attention: q_doc and k_doc go together", fix="pass both document-id tensors (or neither)")
    if mods.docs:
        batch = tuple(q.shape[:-3]) if q.dim() >= 3 else ()
        for what, d, n in (("q_doc", mods.q_doc, q.shape[-2]), ("k_doc", mods.k_doc, k.shape[-2])):
            if d.dtype.is_floating_point or d.dtype.is_complex or d.dtype == torch.bool or d.dim() == 0 \
                    or d.shape[-1] != n or not _broadcasts(d.shape, (*batch, n)):
                raise AttentionError(f"attention: {what} must be integer ids of shape [*batch, {n}] (one per "
                                     f"token, batch dims may broadcast, no head dim); got {tuple(d.shape)} {d.dtype}",
                                     fix="one document id per token, e.g. torch.long [batch, seq]")


def _broadcasts(shape, target) -> bool:
    return len(shape) <= len(target) and all(
        m in (1, s) for m, s in zip(reversed(shape), reversed(target), strict=False))


# -- positions, visibility, additive terms ----------------------------------------------------

def positions(settings, q_len: int, k_len: int, device) -> tuple[Tensor, Tensor]:
    """Global positions of the block's queries ``[L, 1]`` and keys ``[1, S]``."""
    qpos = torch.arange(q_len, device=device) + settings.q_offset
    kpos = torch.arange(k_len, device=device) + settings.k_offset
    return qpos[:, None], kpos[None, :]


def visible(settings, mods: Mods, q: Tensor, k: Tensor, causal: bool = True) -> Optional[Tensor]:
    """Bool, True where query i may see key j under causal (if ``causal``), the window and the
    documents, broadcastable to the scores; None when nothing restricts."""
    s = settings if causal else dataclasses.replace(settings, is_causal=False)
    left, right = s.reach()
    vis = None
    if left is not None or right is not None:
        qpos, kpos = positions(settings, q.shape[-2], k.shape[-2], q.device)
        d = kpos - qpos
        vis = (d >= -left) if left is not None else None
        if right is not None:
            vis = (d <= right) if vis is None else vis & (d <= right)
    if mods.docs:
        same = mods.q_doc.unsqueeze(-1) == mods.k_doc.unsqueeze(-2)  # [*batch, L, S]
        if q.dim() >= 3:
            same = same.unsqueeze(-3)  # the head dim
        vis = same if vis is None else vis & same
    return vis


def alibi(settings, slopes: Tensor, q: Tensor, k: Tensor, dtype) -> Tensor:
    """slope_h * (j - i) (or slope_h * j), ``[Hq, L, S]`` in ``dtype``, at global positions."""
    qpos, kpos = positions(settings, q.shape[-2], k.shape[-2], q.device)
    dist = kpos.expand(q.shape[-2], -1) if settings.alibi_key_only else kpos - qpos
    return slopes.to(dtype)[:, None, None] * dist.to(dtype)


def additive(settings, mods: Mods, q: Tensor, k: Tensor, dtype) -> Optional[Tensor]:
    """bias + alibi in ``dtype``, broadcastable to the scores; None when neither is given."""
    out = None if mods.bias is None else mods.bias.to(dtype)
    if mods.alibi_slopes is not None:
        a = alibi(settings, mods.alibi_slopes, q, k, dtype)
        out = a if out is None else out + a
    return out


def apply(s: Tensor, settings, mods: Mods, mask: Optional[Tensor], q: Tensor, k: Tensor) -> Tensor:
    """The scaled (and soft-capped) scores ``s`` with the additive terms and every mask applied."""
    add = additive(settings, mods, q, k, s.dtype)
    if add is not None:
        s = s + add
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    vis = visible(settings, mods, q, k)
    return s if vis is None else s.masked_fill(~vis, NEG_INF)


def fold(mask: Optional[Tensor], settings, mods: Mods, q: Tensor, k: Tensor, dtype):
    """(one additive mask, settings) for torch's fused kernels: the mask, bias, ALiBi, window and
    documents in one float tensor (causal folded in too, so the settings come back without it);
    the inputs unchanged when no such mod is in force."""
    if not present(mods, settings):
        return mask, settings
    vis = visible(settings, mods, q, k)
    out = additive(settings, mods, q, k, dtype)
    if mask is not None:
        m = mask.to(dtype) if mask.dtype != torch.bool else _neg_inf_where_not(mask, dtype)
        out = m if out is None else out + m
    if vis is not None:
        neg = _neg_inf_where_not(vis, dtype)
        out = neg if out is None else out + neg
    return out, dataclasses.replace(settings, is_causal=False)


def _neg_inf_where_not(seen: Tensor, dtype) -> Tensor:
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, NEG_INF)


def reduce_to(grad: Tensor, shape) -> Tensor:
    """``grad`` summed over the dims a tensor of ``shape`` broadcasts over (the adjoint of broadcasting)."""
    lead = grad.dim() - len(shape)
    if lead:
        grad = grad.sum(tuple(range(lead)))
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


# -- blocks -----------------------------------------------------------------------------------

def block_is_empty(settings, q_len: int, k_len: int) -> bool:
    """True when no query of the block may see any of its keys by position alone (causal and
    window at global offsets), or either side is empty. Documents are data: never decided here."""
    if q_len == 0 or k_len == 0:
        return True
    left, right = settings.reach()
    first_q, last_q = settings.q_offset, settings.q_offset + q_len - 1
    first_k, last_k = settings.k_offset, settings.k_offset + k_len - 1
    if right is not None and first_k > last_q + right:
        return True
    return left is not None and last_k < first_q - left


def key_block(mods: Mods, start: int, length: int, k_doc: Optional[Tensor] = None) -> Mods:
    """The mods of this rank's query rows against keys [start, start + length) of the global
    sequence: the bias sliced on its key dim (it holds every key); ``k_doc`` the block's own ids
    (they travel with the keys in ring attention)."""
    bias = mods.bias
    if bias is not None and bias.shape[-1] != 1:
        bias = bias[..., start:start + length]
    return mods._replace(bias=bias, k_doc=mods.k_doc if k_doc is None else k_doc)
