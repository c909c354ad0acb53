"""torch's fused attention kernels as the local compute of ``shardwise::attention``.

The math path in kernels.py materialises the ``[..., Hq, L, S]`` scores in forward and
again in backward; aten's fused kernels never do. Here one block (queries at global
``q_offset`` against keys at ``k_offset``) becomes at most two fused calls, each either
unmasked-causal-free or top-left causal (the only causal the kernels know):

- not causal, or every key at or before the first query: one call, no causal;
- no key at or before the last query: nothing (rows give out 0, lse -inf);
- aligned (``q_offset == k_offset``): one call with the kernel's ``is_causal``;
- keys start before the queries (shift > 0): the keys before the first query are seen by
  every row (one call, no causal), the rest are aligned (one causal call); the two are
  merged through their logsumexp (online softmax, ``softmax.merge``);
- keys start after the queries (shift < 0): the first ``-shift`` rows see no key, the
  others are aligned (one causal call on them).

The backward kernel takes the final ``out`` and the row logsumexp over ALL keys, so each
call's gradients are exactly its share and the shares add up (dq over key pieces, dk/dv
over query pieces). It folds ``grad_lse`` in through one extra head-dim column (see
``_kernel_backward``).

Conventions kept (kernels.py): a bool mask becomes additive (0 / -inf) in the kernel's
dtype; rows that see no key give out 0 and lse -inf (the kernel itself reports lse 0
there, so ``_dead_rows`` finds them from the mask), and their gradients are 0.
Precision: ``native=True`` runs float16/bfloat16 in the kernel as aten's SDPA does
(float32 accumulation, results rounded to the input dtype, lse float32); block results
that are merged afterwards (``native=False``, or two pieces) are computed from float32
copies of the inputs.

Which kernel: ``KERNELS`` maps a device type to its forward/backward pair: CPU
(``_scaled_dot_product_flash_attention_for_cpu``) and CUDA (cuda.py: flash, memory-efficient
or cuDNN, as torch's SDPA would pick); other devices, empty blocks and dtypes the kernel lacks
take the math path (``applies`` says which).

A value head size Ev unlike the query/key one E (Multi-head Latent Attention: E 192, Ev 128),
which the CPU kernel does not take, is zero-padded to one head size (``_one_head_size``): zero
columns of q and k add nothing to the scores (the scale stays E's), zero columns of v give zero
output columns, sliced off; in the backward grad_out and out take zero columns too (delta and
dP unchanged) and the gradients are sliced back. No L x S scores, at the price of the padding.
"""
from __future__ import annotations

import torch

from . import cuda, softmax

ATEN = torch.ops.aten
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _cpu_forward(q, k, v, mask, causal: bool, scale: float):
    return ATEN._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, attn_mask=mask,
                                                                    scale=scale)


def _cpu_backward(grad_out, q, k, v, out, lse, mask, causal: bool, scale: float):
    return ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


# device type -> (forward(q, k, v, additive mask | None, causal, scale) -> (out, lse),
#                 backward(grad_out, q, k, v, out, lse, mask, causal, scale) -> (dq, dk, dv)), all 4-d
KERNELS = {"cpu": (_cpu_forward, _cpu_backward), "cuda": (cuda.kernel_forward, cuda.kernel_backward)}
KERNEL_NAMES = {"cpu": "aten._scaled_dot_product_flash_attention_for_cpu", "cuda": "flash / efficient / cuDNN"}


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings=None, mask=None) -> bool:
    """True when a fused kernel computes this call (else the math path does).

    Causal with a scale <= 0 stays on the math path: the CPU kernel scales its causal -inf
    along with the scores (torch 2.13: NaN for scale 0, keys unmasked for a negative scale).
    On CUDA the kernel torch's SDPA would pick decides (cuda.py)."""
    if q.device.type == "cuda":
        return cuda.applies(_as_4d(q), _as_4d(k), _as_4d(v), _mask_4d(mask, q), settings)
    return (q.device.type in KERNELS and q.dtype in DTYPES and q.numel() > 0 and k.numel() > 0 and q.shape[-1] > 0
            and v.shape[-1] > 0
            and not (settings is not None and settings.is_causal and settings.resolve_scale(q.shape[-1]) <= 0))


def _one_head_size(ts: list, q: torch.Tensor, v: torch.Tensor) -> list:
    """4-d ``ts`` (q, k, v first; then grad_out and out, of v's head size) zero-padded to one head
    size where the values' differs from the queries' on a device whose kernel needs one (CPU)."""
    e, ev = q.shape[-1], v.shape[-1]
    if e == ev or q.device.type != "cpu":
        return ts
    d = max(e, ev)
    return [t if t is None or t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in ts]


# -- shapes ---------------------------------------------------------------------------------

def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """[..., heads, seq, dim] as the kernels' [batch, heads, seq, dim] (a view where possible)."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.flatten(0, t.dim() - 4)


def _mask_4d(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The mask broadcastable to the 4-d scores of ``_as_4d(q)``."""
    if mask is None:
        return None
    if mask.dim() <= 3 or q.dim() <= 4:
        return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    lead = q.dim() - 3  # batch dims of q flattened into one: the mask's must follow
    full = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
    return full.expand(*q.shape[:lead], *full.shape[lead:]).flatten(0, lead - 1)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = may attend) as 0 / -inf; a float mask in ``dtype``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, softmax.NEG_INF)
    return mask.to(dtype)


def _slice_mask(mask, q0: int, k0: int, k1: int):
    """The mask of rows [q0, L) and keys [k0, k1) (broadcast dims stay as they are)."""
    if mask is None:
        return None
    if mask.shape[-2] != 1 and q0:
        mask = mask[..., q0:, :]
    if mask.shape[-1] != 1 and (k0, k1) != (0, mask.shape[-1]):
        mask = mask[..., k0:k1]
    return mask


def _dead_rows(mask: torch.Tensor, causal: bool, rows: int) -> torch.Tensor:
    """Rows that see no key under the additive ``mask`` (and top-left causal): mask-shaped minus
    its key dim, broadcastable to lse."""
    seen = ~torch.isneginf(mask)
    any_seen = seen.any(-1)
    if not causal:
        return ~any_seen
    first = seen.to(torch.uint8).argmax(-1)  # first visible key of each row
    row = torch.arange(rows, device=mask.device)
    return ~any_seen | (first > row)


# -- pieces of a block ----------------------------------------------------------------------

def pieces(settings, q_len: int, k_len: int) -> list[tuple[int, int, int, bool]]:
    """Kernel calls ``(q0, k0, k1, causal)`` covering one block: rows [q0, L) against keys [k0, k1)."""
    if q_len == 0 or k_len == 0:
        return []
    if not settings.is_causal:
        return [(0, 0, k_len, False)]
    shift = settings.q_offset - settings.k_offset  # query i sees key j iff j <= i + shift
    if shift >= k_len - 1:
        return [(0, 0, k_len, False)]
    if shift + q_len - 1 < 0:
        return []
    if shift == 0:
        return [(0, 0, k_len, True)]
    if shift > 0:
        return [(0, 0, shift, False), (0, shift, k_len, True)]
    return [(-shift, 0, k_len, True)]


def _kernel_forward(q, k, v, mask, causal: bool, scale: float):
    """(out, lse) of one 4-d kernel call; lse -inf on rows that see no key."""
    fwd = KERNELS[q.device.type][0]
    out, lse = fwd(q, k, v, mask, causal, scale)
    if mask is not None:
        lse = lse.masked_fill(_dead_rows(mask, causal, q.shape[-2]), softmax.NEG_INF)
    return out, lse


def _kernel_backward(grad_out, grad_lse, q, k, v, out, lse, mask, causal: bool, scale: float):
    """(dq, dk, dv) of one 4-d kernel call from the final out and lse.

    The kernel computes delta = rowsum(grad_out * out) itself. A gradient of lse enters as
    dS = P * (dP - delta + grad_lse): one extra head-dim column (q, k, v: 0; grad_out: 1;
    out: -grad_lse) leaves the scores and dP alone and turns delta into delta - grad_lse.
    """
    bwd = KERNELS[q.device.type][1]
    if mask is not None:  # only a mask makes rows that see no key (lse -inf): P = 0 with lse 0 too
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
    if grad_lse is None:
        return bwd(grad_out, q, k, v, out, lse, mask, causal, scale)
    col = lambda t, x: torch.cat([t, torch.full_like(t[..., :1], x)], -1)  # noqa: E731
    out = torch.cat([out, -grad_lse.unsqueeze(-1).to(out.dtype)], -1)
    dq, dk, dv = bwd(col(grad_out, 1.0), col(q, 0.0), col(k, 0.0), col(v, 0.0), out, lse, mask, causal, scale)
    return dq[..., :-1], dk[..., :-1], dv[..., :-1]


# -- block forward / backward ---------------------------------------------------------------

def _to(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _rows(t, q0: int):
    return t[..., q0:, :] if q0 else t


def _keys(t, k0: int, k1: int):
    return t if (k0, k1) == (0, t.shape[-2]) else t[..., k0:k1, :]


def _row_vec_4d(t, q):
    """A per-row tensor [..., heads, L] (lse, grad_lse) in the 4-d layout of ``_as_4d(q)``."""
    if t is None or q.dim() == 4:
        return t
    return _as_4d(t.unsqueeze(-1)).squeeze(-1)


def _prepared(ts, mask, q, upcast: bool):
    """4-d tensors (float32 copies if ``upcast``) and the 4-d additive mask in their dtype."""
    dt = softmax.compute_dtype(q.dtype) if upcast else q.dtype
    out = [None if t is None else _head_dim_dense(_as_4d(_to(t, dt))) for t in ts]
    return out, _additive(_mask_4d(mask, q), dt)


def _head_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """aten's CPU flash kernels read the head dim as if its stride were 1 and do not check (F.sdpa's
    dispatcher sends other inputs to its math path): a q, k, v or out whose last dim is not innermost
    (a transposed view; q expanded over the sequence, laid out like q) gave wrong gradients. Copy those."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _upcast(q, n_pieces: int, native: bool) -> bool:
    return q.dtype in softmax.LOW_PRECISION and (not native or n_pieces > 1)


def forward(q, k, v, mask, settings, native: bool):
    """(out, lse) of one block through the fused kernel, or None when ``applies`` is False.

    out is in q's dtype if ``native`` else the compute dtype; lse in the compute dtype."""
    if not applies(q, k, v, settings, mask):
        return None
    parts = pieces(settings, q.shape[-2], k.shape[-2])
    ct = softmax.compute_dtype(q.dtype)
    rows = (*q.shape[:-1],)
    if not parts:
        return (q.new_zeros(*rows, v.shape[-1], dtype=q.dtype if native else ct),
                q.new_full(rows, softmax.NEG_INF, dtype=ct))
    (q4, k4, v4), m4 = _prepared((q, k, v), mask, q, _upcast(q, len(parts), native))
    q4, k4, v4 = _one_head_size([q4, k4, v4], q, v)
    scale = settings.resolve_scale(q.shape[-1])
    acc = None
    for q0, k0, k1, causal in parts:
        o, lse = _kernel_forward(_rows(q4, q0), _keys(k4, k0, k1), _keys(v4, k0, k1),
                                 _slice_mask(m4, q0, k0, k1), causal, scale)
        if q0:  # rows before q0 see no key of this block
            o = torch.cat([o.new_zeros(*o.shape[:-2], q0, o.shape[-1]), o], -2)
            lse = torch.cat([lse.new_full((*lse.shape[:-1], q0), softmax.NEG_INF), lse], -1)
        acc = (o, lse) if acc is None else softmax.merge(*acc, o, lse)
    out, lse = _to(acc[0][..., :v.shape[-1]], q.dtype if native else ct), acc[1]
    return (out, lse) if q.dim() == 4 else (out.reshape(*rows, v.shape[-1]), lse.reshape(rows))


def backward(grad_out, grad_lse, q, k, v, mask, out, lse, settings, native: bool):
    """(dq, dk, dv) of one block through the fused kernel, or None when ``applies`` is False.

    ``out``/``lse`` are the final output and row logsumexp over all keys (not just this
    block's). Grads are in the dtypes of q, k, v if ``native``, else the compute dtype."""
    if not applies(q, k, v, settings, mask):
        return None
    parts = pieces(settings, q.shape[-2], k.shape[-2])
    ct = softmax.compute_dtype(q.dtype)
    upcast = _upcast(q, len(parts), native) or (grad_lse is not None and q.dtype in softmax.LOW_PRECISION)
    dtypes = (q.dtype, k.dtype, v.dtype) if native and not upcast else (ct, ct, ct)
    if not parts:
        return tuple(torch.zeros(t.shape, dtype=d, device=t.device) for t, d in zip((q, k, v), dtypes, strict=True))
    (go4, q4, k4, v4, o4), m4 = _prepared((grad_out, q, k, v, out), mask, q, upcast)
    q4, k4, v4, go4, o4 = _one_head_size([q4, k4, v4, go4, o4], q, v)
    lse4, gl4 = _to(_row_vec_4d(lse, q), ct), _to(_row_vec_4d(grad_lse, q), ct)
    scale = settings.resolve_scale(q.shape[-1])
    grads = None
    for q0, k0, k1, causal in parts:
        g = _kernel_backward(_rows(go4, q0), None if gl4 is None else gl4[..., q0:], _rows(q4, q0),
                             _keys(k4, k0, k1), _keys(v4, k0, k1), _rows(o4, q0), lse4[..., q0:],
                             _slice_mask(m4, q0, k0, k1), causal, scale)
        if (q0, k0, k1) == (0, 0, k.shape[-2]):  # the whole block in one call
            grads = g
            break
        if grads is None:
            grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q4, k4, v4)]
        grads[0][..., q0:, :] += g[0]
        grads[1][..., k0:k1, :] += g[1]
        grads[2][..., k0:k1, :] += g[2]
    grads = [gr[..., :t.shape[-1]] for gr, t in zip(grads, (q, k, v), strict=True)]  # padding's columns off
    return tuple(_to(gr, d) if gr.dim() == t.dim() else _to(gr, d).reshape(t.shape)
                 for gr, d, t in zip(grads, dtypes, (q, k, v), strict=True))


# -- the whole-call fast path ---------------------------------------------------------------
# A call that is one CPU kernel call on dense 4-d inputs, with at most a mask of 4 dims or fewer
# and an aligned causal flag: what kernels.attention_forward / attention_backward compute for it
# (the same aten calls on the same tensors, so the same bits), without their general checks and
# reshaping: ~40 us of Python per forward and ~80 us per backward at a tiny GPT-2's shapes, more
# than the kernels themselves.

def _dense(t) -> bool:
    return t.dim() == 4 and t.device.type == "cpu" and (t.stride(-1) == 1 or t.shape[-1] <= 1)


def _broadcasts(mask, scores: tuple) -> bool:
    return mask.dim() <= 4 and all(m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores)))


def whole_call_scale(q, k, v, mask, causal: bool, scale, enable_gqa: bool, q_offset: int, k_offset: int,
                     q_len_global, k_len_global, *rest) -> float | None:
    """The kernel's scale when the call (the op's leading arguments) is one whole fused CPU kernel
    call; None when the general path must decide. ``rest``: the soft-cap, window and ALiBi
    settings and the mods, all unset on the fast path."""
    if enable_gqa or q_offset or k_offset or any(x is not None and x is not False for x in rest):
        return None
    if not (_dense(q) and _dense(k) and _dense(v)) or not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return None
    b, h, length, d = q.shape
    s = k.shape[2]
    if (k.shape[:2] != (b, h) or v.shape[:3] != (b, h, s) or k.shape[3] != d or v.shape[3] != d
            or q.numel() == 0 or k.numel() == 0 or d == 0 or q_len_global not in (None, length)
            or k_len_global not in (None, s) or (causal and s == 1)):  # pieces(): one key is not causal
        return None
    if mask is not None and not ((mask.dtype == torch.bool or mask.dtype.is_floating_point)
                                 and mask.device.type == "cpu" and _broadcasts(mask, (b, h, length, s))):
        return None
    scale = (1.0 / d ** 0.5) if scale is None else scale
    return None if causal and scale <= 0 else scale


def whole_forward(q, k, v, mask, causal: bool, scale: float):
    """(out, lse) of a call whole_call_scale accepted (lse -inf on rows the mask hides wholly)."""
    m = _additive(_mask_4d(mask, q), q.dtype)
    return _kernel_forward(q, k, v, m, causal, scale)


def whole_backward_fits(grad_out, q, out, lse) -> bool:
    """Whether grad_out / out / lse of a call whole_call_scale accepted fit the kernel as they are
    (else the general path converts them)."""
    return (_dense(grad_out) and _dense(out) and grad_out.dtype == out.dtype == q.dtype
            and lse.dtype == softmax.compute_dtype(q.dtype) and lse.dim() == 3)


def whole_backward(grad_out, q, k, v, mask, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of a call whole_call_scale accepted, or None where grad_out / out / lse do not
    fit the kernel as they are (whole_backward_fits)."""
    if not whole_backward_fits(grad_out, q, out, lse):
        return None
    m = _additive(_mask_4d(mask, q), q.dtype)
    return _kernel_backward(grad_out, None, q, k, v, out, lse, m, causal, scale)
