"""Rules for ``shardwise.attention`` and its backward: one op, every way to split it.

Tags (``parallelize(attention=...)`` selects among them):
- "leading": batch- or head-sharded (any dim before [seq, head_dim]); no communication.
  With grouped-query attention the key/value heads must split like the query heads; one
  key/value head (multi-query) may instead stay whole on every rank while the query heads
  split (its dK/dV are then partial sums over the ranks' query heads).
  Ulysses is this strategy reached from a sequence-sharded input: the planner's
  Shard(seq) -> Shard(heads) redistribution is the all-to-all before attention.
- "seq_gather": queries sharded on the sequence, keys/values replicated (the planner
  gathers them: explicit all-gathers in the program); causal masks use the queries'
  global offset. In backward dK/dV come out as partial sums over the query blocks.
- "ring": queries, keys and values sharded on the sequence of ONE mesh dim; key/value
  blocks rotate around it with an online-softmax merge (ops/attention/ring.py), dK/dV too.
- "partial": linear in v (forward) and in the output gradient (backward).

Score modifications (ops/attention/mods.py) follow the scores: the mask and the bias split
where the scores split on a dim they have (query rows, batch, heads) and are replicated
where they broadcast or along the keys (a key block takes its slice at its global offset);
ALiBi slopes split with the query heads (Ulysses slices them by head); document ids split
with the tokens (q_doc with the queries, k_doc with the keys: in ring attention they rotate
with k and v). Windows and ALiBi positions are global: the local call's offsets say where
its block sits. The bias gradient (the backward's fourth output) is sharded like the bias
or a partial sum where the bias broadcasts over the split dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.attention import ring
from ..ops.attention.kernels import compute_dtype
from ..ops.attention.mods import MOD_NAMES, Mods
from ..ops.attention.op import SETTING_NAMES, AttentionSettings
from ..core.calls import bound_arguments
from ..core.collective_kinds import RedistStep
from ..core.layout import Partial, Replicate, Shard
from .common import replicate_all
from .registry import LocalCall, LocalCtx, Rule, Strategy1D, TensorMeta

FORWARD = torch.ops.shardwise.attention.default
BACKWARD = torch.ops.shardwise.attention_backward.default
R, P = Replicate(), Partial()


def _bound(call) -> dict:
    """Every schema argument of the call by name (given positionally, by keyword, or its default)."""
    return bound_arguments(call.op, call.args, call.kwargs)


def _names(call) -> list[str]:
    """Schema name of each tensor input, in call.ins order (q, k, v, attn_mask, bias, q_doc, ...)."""
    schema = call.op._schema.arguments
    named = [(schema[i].name, a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [n for n, x in named if isinstance(x, TensorMeta)]


def _settings(call) -> AttentionSettings:
    b = _bound(call)
    return AttentionSettings.from_op_args(*(b[n] for n in SETTING_NAMES))


def _grad_bias(call) -> bool:
    """True when the backward call returns the bias's gradient (its fourth output is not empty)."""
    return call.op == BACKWARD and call.outs[3] is not None and call.outs[3].shape != (0,)


def _with_settings(call, settings: AttentionSettings) -> tuple[tuple, dict]:
    """The call's (args, kwargs) with its settings replaced (tensors untouched, in place)."""
    args, kwargs = list(call.args), dict(call.kwargs)
    schema = [a.name for a in call.op._schema.arguments]
    for name, value in zip(SETTING_NAMES, settings.to_op_args(), strict=True):
        i = schema.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


# -- where each input follows a split of the scores -------------------------------------------

def _score_aligned(call, names, name: str, d: int):
    """The dim of a tensor broadcast to the scores ([*lead, Hq, L, S]: mask, bias) that score
    dim ``d`` splits; None if it broadcasts there."""
    q, t = call.ins[names.index("q")], call.ins[names.index(name)]
    md = d - (q.ndim - t.ndim)
    return md if md >= 0 and t.shape[md] != 1 else None


def _doc_dim(call, names, name: str, d: int):
    """The dim of document ids ([*batch, seq], no head dim) that q's dim ``d`` splits: a batch
    dim, or (``d`` the sequence dim) their last; None at the heads or a batch dim they broadcast over."""
    q, t = call.ins[names.index("q")], call.ins[names.index(name)]
    seq, batch = q.ndim - 2, max(q.ndim - 3, 0)
    if d == seq:
        return t.ndim - 1
    j = d - batch + t.ndim - 1 if d < batch else -1
    return j if j >= 0 and t.shape[j] != 1 else None


def _follow(call, names, name: str, p):
    """Placement of input ``name`` when the placement ``p`` is asked of it in the scores' terms
    (a Shard(d) of q's dim d; keys and docs of keys: k's dim d)."""
    if not isinstance(p, Shard) or name not in ("attn_mask", "bias", "alibi_slopes", "q_doc", "k_doc"):
        return p
    if name == "alibi_slopes":  # [Hq]: split with the query heads only
        return Shard(0) if p.dim == call.ins[names.index("q")].ndim - 3 else R
    aligned = _score_aligned if name in ("attn_mask", "bias") else _doc_dim
    dim = aligned(call, names, name, p.dim)
    return R if dim is None else Shard(dim)


def _bias_grad(call, names, p):
    """Placement of the bias gradient when the scores split as ``p``: the bias's own dim, or a
    partial sum where the bias broadcasts over the split dim; R when there is no bias gradient."""
    if not _grad_bias(call):
        return R
    if isinstance(p, Shard):
        dim = _score_aligned(call, names, "bias", p.dim)
        return P if dim is None else Shard(dim)
    return p


def _strategy(call, names, place: dict, outs, tag) -> Strategy1D:
    ins = tuple(_follow(call, names, n, place.get(n, R)) for n in names)
    return Strategy1D(tuple(outs), ins, tag)


def attention_strategies(call) -> list[Strategy1D]:
    names = _names(call)
    q = call.ins[names.index("q")]
    seq = q.ndim - 2
    fwd = call.op == FORWARD
    out = [replicate_all(call)]
    for d in range(seq):  # batch / heads
        outs = [Shard(d)] * 2 if fwd else [Shard(d)] * 3 + [_bias_grad(call, names, Shard(d))]
        out.append(_strategy(call, names, {n: Shard(d) for n in names}, outs, "leading"))
    k = call.ins[names.index("k")]
    if q.ndim >= 3 and k.shape[-3] == 1 < q.shape[-3]:  # one kv head (multi-query): query heads split, k/v whole
        d, whole = q.ndim - 3, {"k": R, "v": R}
        outs = [Shard(d)] * 2 if fwd else [Shard(d), P, P, _bias_grad(call, names, Shard(d))]
        out.append(_strategy(call, names, {**{n: Shard(d) for n in names}, **whole}, outs, "leading"))
    s = Shard(seq)
    rows = {n: s for n in ("q", "attn_mask", "bias", "q_doc", "grad_out", "grad_lse", "out", "lse")}
    keys = {"k": s, "v": s, "k_doc": s}
    if fwd:
        out.append(_strategy(call, names, rows, [s, s], "seq_gather"))
        out.append(_strategy(call, names, {**rows, **keys}, [s, s], "ring"))
        out.append(_strategy(call, names, {"v": P}, [P, R], "partial"))
    else:
        db = _bias_grad(call, names, s)
        out.append(_strategy(call, names, rows, [s, P, P, db], "seq_gather"))
        out.append(_strategy(call, names, {**rows, **keys}, [s, s, s, db], "ring"))
        out.append(_strategy(call, names, {"grad_out": P, "grad_lse": P}, [P, P, P, _bias_grad(call, names, P)],
                             "partial"))
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
    if k.shape[hd] == 1:  # one key/value head, whole on every rank: any split of the query heads uses it
        return not any(isinstance(p, Shard) and p.dim == hd for p in st.ins[ki])
    for r in range(mesh.size):
        (qo, qn), (ko, kn) = ql.shard_bounds(mesh, r)[hd], kl.shard_bounds(mesh, r)[hd]
        if qn != g * kn or qo != g * ko:
            return False
    return True


# -- local calls ------------------------------------------------------------------------------

def _seq_mesh_dim(ctx: LocalCtx) -> int:
    return next(m for m, t in enumerate(ctx.strategy.tags) if t == "ring")


def _ring_inputs(roles, tensors) -> tuple[dict, Mods]:
    t = dict(zip(roles, tensors, strict=True))
    return t, Mods(*(t.get(n) for n in MOD_NAMES))


def ring_attention_local(mesh_dim, settings_args, seq_sizes, kv_seq_sizes, roles, *tensors):
    """One rank's ring attention (the program calls this by name): ``tensors`` are the call's
    tensor inputs, ``roles`` their schema names."""
    t, mods = _ring_inputs(roles, tensors)
    st = AttentionSettings.from_op_args(*settings_args)
    return ring.ring_attention_forward(t["q"], t["k"], t["v"], mesh_dim, st, seq_sizes, kv_seq_sizes,
                                       attn_mask=t.get("attn_mask"), seq_dim=t["q"].dim() - 2, mods=mods)


def ring_attention_backward_local(mesh_dim, settings_args, seq_sizes, kv_seq_sizes, grad_bias, roles, *tensors):
    t, mods = _ring_inputs(roles, tensors)
    st = AttentionSettings.from_op_args(*settings_args)
    dq, dk, dv, db = ring.ring_attention_backward(
        t["grad_out"], t["q"], t["k"], t["v"], t["out"], t["lse"], mesh_dim, st, seq_sizes, kv_seq_sizes,
        attn_mask=t.get("attn_mask"), grad_lse=t.get("grad_lse"), seq_dim=t["q"].dim() - 2, mods=mods,
        grad_bias=grad_bias)
    return dq, dk, dv, t["q"].new_empty(0) if db is None else db


def _member_sizes(ctx: LocalCtx, i: int, mesh_dim: int, dim: int) -> tuple:
    lay = ctx.in_layout(i)
    return tuple(lay.local_shape(ctx.mesh, r)[dim] for r in ctx.mesh.group(mesh_dim, ctx.rank))


def attention_local(ctx: LocalCtx) -> LocalCall:
    call, names = ctx.call, _names(ctx.call)
    st = _settings(call)
    qi, ki = names.index("q"), names.index("k")
    seq = call.ins[qi].ndim - 2
    if "ring" in ctx.strategy.tags:
        m = _seq_mesh_dim(ctx)
        sizes = (_member_sizes(ctx, qi, m, seq), _member_sizes(ctx, ki, m, seq))
        if call.op == FORWARD:
            return LocalCall(ring_attention_local, (m, st.to_op_args(), *sizes, tuple(names), *call.ins), {})
        return LocalCall(ring_attention_backward_local,
                         (m, st.to_op_args(), *sizes, _grad_bias(call), tuple(names), *call.ins), {})
    if Shard(seq) in ctx.strategy.ins[qi]:  # seq_gather: global positions of the local queries
        q_len, k_len = call.ins[qi].shape[seq], call.ins[ki].shape[seq]
        args, kwargs = _with_settings(call, st.block(ctx.in_offset(qi)[seq], 0, q_len, k_len))
        return LocalCall(call.op, args, kwargs)
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
    lays = st.in_layouts(call)
    k, v = (lays[names.index(x)] for x in ("k", "v"))
    numel = [_largest_block(t, mesh) for t in (k, v)]
    acc = compute_dtype(k.dtype)
    moving = [(k.dtype, numel[0]), (v.dtype, numel[1])]
    docs = [lays[names.index("k_doc")]] if "k_doc" in names else []
    docs = [(d.dtype, _largest_block(d, mesh)) for d in docs]  # the ids rotate with k and v
    if call.op != FORWARD:
        moving += [(acc, numel[0]), (acc, numel[1])]
    shift = _per_dtype(moving + docs)
    shifts = [shift] * (n - 1) + ([_per_dtype(moving[2:])] if call.op != FORWARD else [])
    return [RingStep("send_recv", m, k, k, bytes=b) for s in shifts for b in s]


def _largest_block(t, mesh) -> int:
    """Elements of ``t``'s largest local block (per dim, the largest local extent): what a padded send carries."""
    return math.prod(max(col) for col in zip(*(t.local_shape(mesh, r) for r in range(mesh.size))))


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
