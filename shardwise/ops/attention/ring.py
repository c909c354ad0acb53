"""Sequence-parallel attention on one rank: ring attention and gathered-KV attention.

    python -m pytest tests/attention/test_ring.py    # every rank vs single-device sdpa

These run inside a per-rank program (threads or torch backend) and talk through
``shardwise.run.collectives.current()`` (or the ``collectives`` passed in). Each rank
holds one block of the sequence of q, k and v along ``seq_dim`` on mesh dim ``mesh_dim``;
the block sizes of all members are given explicitly (``seq_sizes`` for queries,
``kv_seq_sizes`` for keys/values, default the same), in member order, e.g. torch.chunk
sizes from ``chunk_sizes``. Blocks may be uneven or empty; tensors are padded to the
largest block for every exchange and unpadded by the known sizes.

Causal masks, windows and ALiBi use global offsets (prefix sums of the sizes), so a rank's
queries see exactly the keys they see on one device. ``attn_mask`` and the ``bias`` of
``mods`` (mods.py) are in score layout ``[..., Hq, L_local, S_global]`` (this rank's query
rows, all keys; either may broadcast as 1): each key block takes its slice. Document ids are
this rank's: ``q_doc`` of its queries, ``k_doc`` of its keys, which travel with k and v.

- ring: k/v blocks rotate with ``send_recv`` (P-1 exchanges), merged by online softmax;
  the backward rotates k/v again with the dk/dv accumulators travelling alongside, and
  one last shift brings each accumulator home (P exchanges; k/v and dk/dv go in one
  message when they share a dtype). dq accumulates locally.
- gathered KV: one ``all_gather`` of k/v, local queries against all keys; the backward
  gathers again and ``reduce_scatter``s dk/dv back to their owners.

Outputs: ``(out, lse)`` with out in q's layout and dtype, lse in q's layout without its
last dim, in the compute dtype; backward ``(dq, dk, dv, dbias)`` in the dtypes of q, k, v
and the bias (dbias: this rank's rows, every key; None unless ``grad_bias``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...core.errors import AttentionError
from ...core.layout import chunk_bounds
from ...core.collectives import Collectives
from ...core.scope import current
from . import kernels
from .mods import NO_MODS, Mods, block_is_empty, key_block
from .op import AttentionSettings


def chunk_sizes(total: int, n: int) -> tuple[int, ...]:
    """Block sizes of a dim of ``total`` split over ``n`` members (torch.chunk semantics)."""
    return tuple(chunk_bounds(total, n, i)[1] for i in range(n))


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


# -- layout and packing helpers --------------------------------------------------------------

class _Blocks:
    """Sizes and offsets of the query and key blocks of every member, checked against the tensors."""

    def __init__(self, c: Collectives, mesh_dim: int, q, k, seq_sizes, kv_seq_sizes, settings: AttentionSettings):
        self.n, self.me = c.group_size(mesh_dim), c.group_index(mesh_dim)
        self.q_sizes = _sizes(seq_sizes, self.n, "seq_sizes")
        self.k_sizes = self.q_sizes if kv_seq_sizes is None else _sizes(kv_seq_sizes, self.n, "kv_seq_sizes")
        self.q_offsets, self.k_offsets = offsets(self.q_sizes), offsets(self.k_sizes)
        self.q_total, self.k_total = sum(self.q_sizes), sum(self.k_sizes)
        if q.shape[-2] != self.q_sizes[self.me] or k.shape[-2] != self.k_sizes[self.me]:
            raise AttentionError(f"sequence-parallel attention on member {self.me}: local q/k blocks have "
                                 f"{q.shape[-2]}/{k.shape[-2]} positions, sizes say {self.q_sizes[self.me]}/"
                                 f"{self.k_sizes[self.me]}", fix="give seq_sizes (kv_seq_sizes) as laid out")
        if settings.q_offset or settings.k_offset or settings.q_len_global not in (None, self.q_total) \
                or settings.k_len_global not in (None, self.k_total):
            raise AttentionError(f"sequence-parallel attention computes offsets and global lengths from the block "
                                 f"sizes (got {settings})", fix="pass settings without offsets and global lengths")
        self.k_max = max(self.k_sizes)
        self.settings = settings

    def block(self, j: int) -> AttentionSettings:
        """Settings for my queries against member ``j``'s keys."""
        return self.settings.block(self.q_offsets[self.me], self.k_offsets[j], self.q_total, self.k_total)


def _sizes(sizes, n: int, what: str) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if len(sizes) != n or any(not isinstance(s, int) or s < 0 for s in sizes):
        raise AttentionError(f"{what} must give one non-negative int per member of the mesh dim ({n}); got {sizes}",
                             fix="one local sequence length per member, in member order")
    return sizes


def _seq_last(t: torch.Tensor | None, seq_dim: int, ndim: int) -> torch.Tensor | None:
    """Move the sequence dim to -2 (kernel layout [..., heads, seq, head_dim])."""
    if t is None:
        return None
    d = seq_dim % ndim
    if d >= ndim - 1:
        raise AttentionError(f"seq_dim {seq_dim} is the head_dim of a {ndim}-d tensor", fix="pick the sequence dim")
    return t.movedim(d, -2)


def _seq_back(out: torch.Tensor, lse: torch.Tensor, seq_dim: int, ndim: int):
    d = seq_dim % ndim
    return out.movedim(-2, d), lse.movedim(-1, d)


def _lse_seq_last(lse: torch.Tensor | None, seq_dim: int, ndim: int):
    return None if lse is None else lse.movedim(seq_dim % ndim, -1)


def _pad_seq(t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape[-2] == n:
        return t
    out = t.new_zeros(*t.shape[:-2], n, t.shape[-1])
    out[..., : t.shape[-2], :] = t
    return out


def _pad_last(t: torch.Tensor, n: int) -> torch.Tensor:
    """Document ids [..., S] padded to ``n`` positions (padding never read: blocks are cut to size)."""
    if t.shape[-1] == n:
        return t
    out = t.new_zeros(*t.shape[:-1], n)
    out[..., : t.shape[-1]] = t
    return out


def _moving_docs(mods: Mods, n: int) -> list[torch.Tensor]:
    """This rank's key document ids (one per key) as a block that rotates with k and v ([] if none)."""
    return [] if mods.k_doc is None else [_pad_last(mods.k_doc, n)]


def _block_mods(mods: Mods, moving: list, start: int, length: int) -> Mods:
    """The mods of my rows against the key block at ``start`` whose rotating ids are ``moving``."""
    return key_block(mods, start, length, moving[0][..., :length] if moving else None)


def _mask_block(mask, start: int, length: int):
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., start:start + length]


def _pack(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    parts = torch.split(flat, [t.numel() for t in like])
    return [p.view(t.shape) for p, t in zip(parts, like, strict=True)]


def _shift(ts: list[torch.Tensor], c: Collectives, mesh_dim: int) -> list[torch.Tensor]:
    """Ring-shift every tensor by one member: one ``send_recv`` per dtype among ``ts``."""
    out: list = [None] * len(ts)
    for dtype in dict.fromkeys(t.dtype for t in ts):
        idx = [i for i, t in enumerate(ts) if t.dtype == dtype]
        got = c.send_recv(_pack([ts[i] for i in idx]), mesh_dim, 1)
        for i, t in zip(idx, _unpack(got, [ts[i] for i in idx]), strict=True):
            out[i] = t
    return out


# -- ring attention ---------------------------------------------------------------------------

def ring_attention_forward(q, k, v, mesh_dim: int, settings: AttentionSettings, seq_sizes: Sequence[int],
                           kv_seq_sizes: Sequence[int] | None = None, attn_mask=None, seq_dim: int = 2,
                           collectives: Collectives | None = None, mods: Mods = NO_MODS):
    """(out, lse) of this rank's queries against every rank's keys, k/v rotating around the ring."""
    c, nd = collectives or current(), q.dim()
    q, k, v = (_seq_last(t, seq_dim, nd) for t in (q, k, v))
    b = _Blocks(c, mesh_dim, q, k, seq_sizes, kv_seq_sizes, settings)
    out, lse = kernels.empty_block(q, v)
    kv = [_pad_seq(k, b.k_max), _pad_seq(v, b.k_max), *_moving_docs(mods, b.k_max)]
    for step in range(b.n):
        j = (b.me - step) % b.n  # whose block we hold after `step` shifts
        if step:
            kv = _shift(kv, c, mesh_dim)
        n_j, s_j = b.k_sizes[j], b.block(j)
        if block_is_empty(s_j, q.shape[-2], n_j):
            continue
        o_b, l_b = kernels.attention_block(q, kv[0][..., :n_j, :], kv[1][..., :n_j, :],
                                           _mask_block(attn_mask, b.k_offsets[j], n_j), s_j,
                                           _block_mods(mods, kv[2:], b.k_offsets[j], n_j))
        out, lse = kernels.merge(out, lse, o_b, l_b)
    return _seq_back(out.to(q.dtype), lse, seq_dim, nd)


def ring_attention_backward(grad_out, q, k, v, out, lse, mesh_dim: int, settings: AttentionSettings,
                            seq_sizes: Sequence[int], kv_seq_sizes: Sequence[int] | None = None, attn_mask=None,
                            grad_lse=None, seq_dim: int = 2, collectives: Collectives | None = None,
                            mods: Mods = NO_MODS, grad_bias: bool = False):
    """(dq, dk, dv, dbias) of this rank's blocks; k/v and their gradient accumulators travel the ring."""
    c, nd = collectives or current(), q.dim()
    grad_out, q, k, v, out = (_seq_last(t, seq_dim, nd) for t in (grad_out, q, k, v, out))
    lse, grad_lse = _lse_seq_last(lse, seq_dim, nd), _lse_seq_last(grad_lse, seq_dim, nd)
    b = _Blocks(c, mesh_dim, q, k, seq_sizes, kv_seq_sizes, settings)
    ct = kernels.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    kv = [_pad_seq(k, b.k_max), _pad_seq(v, b.k_max)]
    docs = _moving_docs(mods, b.k_max)
    dkv = [torch.zeros(t.shape, dtype=ct, device=t.device) for t in kv]
    db = _BiasGrad(mods.bias, ct) if grad_bias and mods.bias is not None else None
    for step in range(b.n):
        j = (b.me - step) % b.n
        if step:
            moved = _shift(kv + dkv + docs, c, mesh_dim)
            kv, dkv, docs = moved[:2], moved[2:4], moved[4:]
        n_j, s_j = b.k_sizes[j], b.block(j)
        if block_is_empty(s_j, q.shape[-2], n_j):
            continue
        dq_b, dk_b, dv_b, db_b = kernels.attention_block_backward(
            grad_out, grad_lse, q, kv[0][..., :n_j, :], kv[1][..., :n_j, :],
            _mask_block(attn_mask, b.k_offsets[j], n_j), out, lse, s_j,
            _block_mods(mods, docs, b.k_offsets[j], n_j), db is not None)
        dq = dq + dq_b
        dkv = [_add_rows(dkv[0], dk_b), _add_rows(dkv[1], dv_b)]
        if db is not None:
            db.add(db_b, b.k_offsets[j], n_j)
    if b.n > 1:  # we hold member (me + 1)'s accumulators: one more shift brings each home
        dkv = _shift(dkv, c, mesh_dim)
    n_me = b.k_sizes[b.me]
    dk, dv = (t[..., :n_me, :] for t in dkv)
    d = seq_dim % nd
    return (dq.to(q.dtype).movedim(-2, d), dk.to(k.dtype).movedim(-2, d), dv.to(v.dtype).movedim(-2, d),
            None if db is None else db.result())


class _BiasGrad:
    """The bias gradient of this rank's rows against every key, summed block by block."""

    def __init__(self, bias: torch.Tensor, dtype):
        self.bias, self.acc = bias, torch.zeros(bias.shape, dtype=dtype, device=bias.device)

    def add(self, block: torch.Tensor, start: int, length: int) -> None:
        if self.acc.shape[-1] == 1:
            self.acc += block
        else:
            self.acc[..., start:start + length] += block

    def result(self) -> torch.Tensor:
        return self.acc.to(self.bias.dtype)


def _add_rows(acc: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """acc with ``block`` added to its first rows (acc is padded to the largest block)."""
    n = block.shape[-2]
    if n == acc.shape[-2]:
        return acc + block
    return torch.cat([acc[..., :n, :] + block, acc[..., n:, :]], dim=-2)


# -- gathered-KV attention --------------------------------------------------------------------

def _gather_seq(ts: list[torch.Tensor], b: _Blocks, c: Collectives, mesh_dim: int) -> list[torch.Tensor]:
    """All members' blocks of each tensor, concatenated along the sequence (one all_gather)."""
    padded = [_pad_seq(t, b.k_max) for t in ts]
    got = c.all_gather(_pack(padded), mesh_dim)  # [n, numel]
    per_member = [_unpack(got[m], padded) for m in range(b.n)]
    return [torch.cat([per_member[m][i][..., : b.k_sizes[m], :] for m in range(b.n)], dim=-2)
            for i in range(len(ts))]


def _scatter_seq(ts: list[torch.Tensor], b: _Blocks, c: Collectives, mesh_dim: int) -> list[torch.Tensor]:
    """Sum each full-sequence tensor over members and keep my block (one reduce_scatter)."""
    rows = []
    for m in range(b.n):
        blocks = [_pad_seq(t.narrow(-2, b.k_offsets[m], b.k_sizes[m]), b.k_max) for t in ts]
        rows.append(_pack(blocks))
    mine = c.reduce_scatter(torch.stack(rows), mesh_dim, "sum")
    like = [t.new_empty(*t.shape[:-2], b.k_max, t.shape[-1]) for t in ts]
    return [t[..., : b.k_sizes[b.me], :] for t in _unpack(mine, like)]


def _gathered_mods(mods: Mods, b: _Blocks, c: Collectives, mesh_dim: int) -> Mods:
    """``mods`` with every member's key document ids (one all_gather of their own, when sharded)."""
    if mods.k_doc is None:
        return mods
    (docs,) = _gather_seq([mods.k_doc.unsqueeze(-1)], b, c, mesh_dim)
    return mods._replace(k_doc=docs.squeeze(-1))


def gathered_kv_attention_forward(q, k, v, mesh_dim: int, settings: AttentionSettings, seq_sizes: Sequence[int],
                                  kv_seq_sizes: Sequence[int] | None = None, attn_mask=None, seq_dim: int = 2,
                                  collectives: Collectives | None = None, mods: Mods = NO_MODS):
    """(out, lse) of this rank's queries against all keys, gathered with one all_gather."""
    c, nd = collectives or current(), q.dim()
    q, k, v = (_seq_last(t, seq_dim, nd) for t in (q, k, v))
    b = _Blocks(c, mesh_dim, q, k, seq_sizes, kv_seq_sizes, settings)
    k_all, v_all = _gather_seq([k, v], b, c, mesh_dim)
    s = settings.block(b.q_offsets[b.me], 0, b.q_total, b.k_total)
    out, lse = kernels.attention_forward(q, k_all, v_all, attn_mask, s, _gathered_mods(mods, b, c, mesh_dim))
    return _seq_back(out, lse, seq_dim, nd)


def gathered_kv_attention_backward(grad_out, q, k, v, out, lse, mesh_dim: int, settings: AttentionSettings,
                                   seq_sizes: Sequence[int], kv_seq_sizes: Sequence[int] | None = None,
                                   attn_mask=None, grad_lse=None, seq_dim: int = 2,
                                   collectives: Collectives | None = None, mods: Mods = NO_MODS,
                                   grad_bias: bool = False):
    """(dq, dk, dv, dbias) of this rank's blocks: k/v gathered again, dk/dv reduce-scattered home."""
    c, nd = collectives or current(), q.dim()
    grad_out, q, k, v, out = (_seq_last(t, seq_dim, nd) for t in (grad_out, q, k, v, out))
    lse, grad_lse = _lse_seq_last(lse, seq_dim, nd), _lse_seq_last(grad_lse, seq_dim, nd)
    b = _Blocks(c, mesh_dim, q, k, seq_sizes, kv_seq_sizes, settings)
    k_all, v_all = _gather_seq([k, v], b, c, mesh_dim)
    s = settings.block(b.q_offsets[b.me], 0, b.q_total, b.k_total)
    dq, dk_all, dv_all, db = kernels.attention_block_backward(
        grad_out, grad_lse, q, k_all, v_all, attn_mask, out, lse, s, _gathered_mods(mods, b, c, mesh_dim),
        grad_bias and mods.bias is not None)
    dk, dv = _scatter_seq([dk_all, dv_all], b, c, mesh_dim)
    d = seq_dim % nd
    return (dq.to(q.dtype).movedim(-2, d), dk.to(k.dtype).movedim(-2, d), dv.to(v.dtype).movedim(-2, d),
            None if db is None else db.to(mods.bias.dtype))
