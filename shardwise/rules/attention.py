"""Rules for ``shardwise.attention`` and its backward: one op, every way to split it.

Tags (``parallelize(attention=...)`` selects among them):
- "leading": batch- or head-sharded (any dim before [seq, head_dim]); no communication.
  With grouped-query attention the key/value heads must split like the query heads.
  Ulysses is this strategy reached from a sequence-sharded input: the planner's
  Shard(seq) -> Shard(heads) redistribution is the all-to-all before attention.
- "seq_gather": queries sharded on the sequence, keys/values replicated (the planner
  gathers them: explicit all-gathers in the program); causal masks use the queries'
  global offset. In backward dK/dV come out as partial sums over the query blocks.
- "ring": queries, keys and values sharded on the sequence of ONE mesh dim; key/value
  blocks rotate around it with an online-softmax merge (ops/attention/ring.py), dK/dV too.
- "partial": linear in v (forward) and in the output gradient (backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.attention import ring
from ..ops.attention.kernels import compute_dtype
from ..ops.attention.op import AttentionSettings
from ..core.collective_kinds import RedistStep
from ..core.layout import Partial, Replicate, Shard
from .common import replicate_all
from .registry import LocalCall, LocalCtx, Rule, Strategy1D, TensorMeta

FORWARD = torch.ops.shardwise.attention.default
BACKWARD = torch.ops.shardwise.attention_backward.default
R, P = Replicate(), Partial()
_FWD_SETTINGS = 4  # index of is_causal in the forward args
_BWD_SETTINGS = 8


def _names(call) -> list[str]:
    """Role of each tensor input, in call.ins order."""
    a = call.args
    if call.op == FORWARD:
        slots = ["q", "k", "v", "mask"]
    else:
        slots = ["grad_out", "grad_lse", "q", "k", "v", "mask", "out", "lse"]
    return [n for n, x in zip(slots, a) if isinstance(x, TensorMeta)]


def _mask_dim(call, names, d: int):
    """The mask dim aligned with score dim ``d`` (scores: [*lead, Sq, Sk]); None if broadcast."""
    q = call.ins[names.index("q")]
    mask = call.ins[names.index("mask")]
    md = d - (q.ndim - mask.ndim)
    return md if md >= 0 and mask.shape[md] != 1 else None


def _strategy(call, names, place: dict, outs, tag) -> Strategy1D:
    ins = []
    for n in names:
        p = place.get(n, R)
        if n == "mask" and isinstance(p, Shard):
            md = _mask_dim(call, names, p.dim)
            p = R if md is None else Shard(md)
        ins.append(p)
    return Strategy1D(tuple(outs), tuple(ins), tag)


def attention_strategies(call) -> list[Strategy1D]:
    names = _names(call)
    q = call.ins[names.index("q")]
    seq = q.ndim - 2
    fwd = call.op == FORWARD
    n_out = len(call.outs)
    out = [replicate_all(call)]
    for d in range(seq):  # batch / heads
        outs = [Shard(d)] * n_out
        out.append(_strategy(call, names, {n: Shard(d) for n in names}, outs, "leading"))
    s = Shard(seq)
    if fwd:
        out.append(_strategy(call, names, {"q": s, "mask": s}, [s, s], "seq_gather"))
        out.append(_strategy(call, names, {"q": s, "k": s, "v": s, "mask": s}, [s, s], "ring"))
        out.append(_strategy(call, names, {"v": P}, [P, R], "partial"))
    else:
        rows = {"grad_out": s, "grad_lse": s, "q": s, "mask": s, "out": s, "lse": s}
        out.append(_strategy(call, names, rows, [s, P, P], "seq_gather"))
        out.append(_strategy(call, names, {**rows, "k": s, "v": s}, [s, s, s], "ring"))
        out.append(_strategy(call, names, {"grad_out": P, "grad_lse": P}, [P, P, P], "partial"))
    return out


# -- validity on the n-d mesh -----------------------------------------------------------------

def _valid(call, st, mesh) -> bool:
    names = _names(call)
    qi, ki = names.index("q"), names.index("k")
    q, k = call.ins[qi], call.ins[ki]
    seq = q.ndim - 2
    if "ring" in st.tags:
        dims = [m for m, t in enumerate(st.tags) if t == "ring"]
        if len(dims) != 1 or any(isinstance(p, Shard) and p.dim == seq for m, p in enumerate(st.ins[qi]) if m != dims[0]):
            return False  # the ring runs on one mesh dim that alone splits the sequence
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        return _gqa_aligned(call, st, mesh, qi, ki)
    return True


def _gqa_aligned(call, st, mesh, qi, ki) -> bool:
    """Grouped-query heads: every rank's query heads are exactly the groups of its kv heads."""
    from ..core.layout import Layout

    q, k = call.ins[qi], call.ins[ki]
    hd = q.ndim - 3
    ql, kl = Layout(q.shape, q.dtype, st.ins[qi]), Layout(k.shape, k.dtype, st.ins[ki])
    g = q.shape[hd] // k.shape[hd]
    for r in range(mesh.size):
        (qo, qn), (ko, kn) = ql.shard_bounds(mesh, r)[hd], kl.shard_bounds(mesh, r)[hd]
        if qn != g * kn or qo != g * ko:
            return False
    return True


# -- local calls ------------------------------------------------------------------------------

def _settings(call, first: int) -> AttentionSettings:
    return AttentionSettings.from_op_args(*call.args[first:first + 7])


def _seq_mesh_dim(ctx: LocalCtx) -> int:
    return next(m for m, t in enumerate(ctx.strategy.tags) if t == "ring")


def ring_attention_local(q, k, v, mask, mesh_dim, is_causal, scale, enable_gqa, seq_sizes, kv_seq_sizes):
    """One rank's ring attention (the program calls this by name)."""
    st = AttentionSettings(is_causal, scale, enable_gqa)
    return ring.ring_attention_forward(q, k, v, mesh_dim, st, seq_sizes, kv_seq_sizes, attn_mask=mask,
                                       seq_dim=q.dim() - 2)


def ring_attention_backward_local(grad_out, grad_lse, q, k, v, mask, out, lse, mesh_dim, is_causal, scale,
                                  enable_gqa, seq_sizes, kv_seq_sizes):
    st = AttentionSettings(is_causal, scale, enable_gqa)
    return ring.ring_attention_backward(grad_out, q, k, v, out, lse, mesh_dim, st, seq_sizes, kv_seq_sizes,
                                        attn_mask=mask, grad_lse=grad_lse, seq_dim=q.dim() - 2)


def _member_sizes(ctx: LocalCtx, i: int, mesh_dim: int, dim: int) -> tuple:
    lay = ctx.in_layout(i)
    return tuple(lay.local_shape(ctx.mesh, r)[dim] for r in ctx.mesh.group(mesh_dim, ctx.rank))


def attention_local(ctx: LocalCtx) -> LocalCall:
    call, names = ctx.call, _names(ctx.call)
    fwd = call.op == FORWARD
    first = _FWD_SETTINGS if fwd else _BWD_SETTINGS
    st = _settings(call, first)
    qi, ki = names.index("q"), names.index("k")
    seq = call.ins[qi].ndim - 2
    if "ring" in ctx.strategy.tags:
        m = _seq_mesh_dim(ctx)
        sizes = (_member_sizes(ctx, qi, m, seq), _member_sizes(ctx, ki, m, seq))
        fn = ring_attention_local if fwd else ring_attention_backward_local
        return LocalCall(fn, (*call.args[:first], m, st.is_causal, st.scale, st.enable_gqa, *sizes), {})
    if Shard(seq) in ctx.strategy.ins[qi]:  # seq_gather: global positions of the local queries
        q_len, k_len = call.ins[qi].shape[seq], call.ins[ki].shape[seq]
        local = AttentionSettings(st.is_causal, st.scale, st.enable_gqa, ctx.in_offset(qi)[seq], 0, q_len, k_len)
        return LocalCall(call.op, (*call.args[:first], *local.to_op_args()), {})
    return LocalCall(call.op, call.args, call.kwargs)


# -- the ring's own collectives (Rule.comm) ---------------------------------------------------

@dataclass(frozen=True)
class RingStep(RedistStep):
    """One ring shift inside ring attention's local call: the layouts stay, blocks move on."""

    def __repr__(self) -> str:
        return f"ring send_recv(mesh_dim={self.mesh_dim}, {self.bytes} B/rank)"


def attention_comm(call, st, mesh) -> list:
    """Ring attention's send/recvs (ops/attention/ring.py), one step per shift and dtype: forward
    n - 1 shifts of the k and v blocks; backward n - 1 shifts of k, v and their gradient
    accumulators (in the compute dtype), then one more of the accumulators. A block is sent
    padded to the group's largest (per dim, the largest local extent)."""
    if "ring" not in st.tags or mesh.shape[st.tags.index("ring")] == 1:
        return []
    m, n, names = st.tags.index("ring"), mesh.shape[st.tags.index("ring")], _names(call)
    k, v = (st.in_layouts(call)[names.index(x)] for x in ("k", "v"))
    numel = [math.prod(max(col) for col in zip(*(t.local_shape(mesh, r) for r in range(mesh.size)))) for t in (k, v)]
    acc = compute_dtype(k.dtype)
    moving = [(k.dtype, numel[0]), (v.dtype, numel[1])]
    if call.op != FORWARD:
        moving += [(acc, numel[0]), (acc, numel[1])]
    shift = _per_dtype(moving)
    shifts = [shift] * (n - 1) + ([_per_dtype(moving[2:])] if call.op != FORWARD else [])
    return [RingStep("send_recv", m, k, k, bytes=b) for s in shifts for b in s]


def _per_dtype(moving: list) -> list:
    """Bytes of each send_recv of one shift: one per dtype among ``moving`` ((dtype, numel))."""
    out: dict = {}
    for dtype, numel in moving:
        out[dtype] = out.get(dtype, 0) + numel * torch.empty((), dtype=dtype).element_size()
    return list(out.values())


ROWS = (Rule([FORWARD, BACKWARD], attention_strategies, attention_local, valid=_valid, blockwise=False,
             comm=attention_comm),)


# -- choosing among strategies (parallelize(attention=...)) ------------------------------------
MODES = {"auto": (), "ulysses": ("seq_gather", "ring"), "ring": ("seq_gather",), "gather": ("ring",)}


def strategy_filter(mode: str):
    """A planner filter keeping the attention strategies ``mode`` allows (other ops untouched)."""
    from ..core.errors import ShardingError

    if mode not in MODES:
        raise ShardingError(f"unknown attention mode {mode!r}", fix=f"use one of {sorted(MODES)}")
    excluded = set(MODES[mode])

    def keep(call, strategy) -> bool:
        return call.op not in (FORWARD, BACKWARD) or not excluded.intersection(strategy.tags)

    return keep
