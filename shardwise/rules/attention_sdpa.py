"""aten scaled-dot-product attention ops: batch- and head-sharded strategies.

q ``[..., Hq, L, E]``, k/v ``[..., Hk, S, E]``. Every leading dim of q (batch, heads) can be
sharded on all tensors at once: attention is independent per batch and head. The mask /
bias (and math's attention weights) broadcast to ``[..., Hq, L, S]`` and follow where they
have the dim. Grouped-query attention (Hq = g * Hk): query head chunk i must use exactly kv
head chunk i, which holds when each rank's q heads are g times its kv heads and start at g
times their offset; other splits are dropped at expansion (``shape_sensitive``).
Linear strategies: v Partial -> out Partial (logsumexp does not depend on v); in the
backward, grad_out Partial -> every grad Partial (out and logsumexp are inputs).
With dropout_p > 0 only Replicate is offered (the ops draw from the default generator).
Sequence sharding is another family's job.

Empty local heads or batch crash the CPU kernels (SIGFPE from Hq / Hk), so the local fn
returns the (empty) planned outputs itself there.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .common import P, R, aligned_dim, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D, TensorMeta
from ..core.layout import Shard

aten = torch.ops.aten

# Role of each tensor argument / output: "q" (query-like [..., Hq, L, *]), "kv", "lse"
# ([..., Hq, L']), "mask" (broadcasts to [..., Hq, L, S]), "rng" (philox scalars: Replicate).
ARG_ROLES = {
    "query": "q", "grad_out": "q", "grad_out_": "q", "out": "q", "key": "kv", "value": "kv",
    "logsumexp": "lse", "log_sumexp": "lse", "attn_mask": "mask", "attn_bias": "mask",
    "dropout_mask": "mask", "philox_seed": "rng", "philox_offset": "rng",
}
# op -> (output roles, is a backward (linear in grad_out) rather than a forward (linear in v))
OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (("q", "lse"), False),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (("q", "kv", "kv"), True),
    aten._scaled_dot_product_efficient_attention.default: (("q", "lse", "rng", "rng"), False),
    aten._scaled_dot_product_efficient_attention_backward.default: (("q", "kv", "kv", "mask"), True),
    aten.scaled_dot_product_attention.default: (("q",), False),
    aten._scaled_dot_product_attention_math.default: (("q", "mask"), False),
}


def _arg_names(call: OpCall) -> list[str]:
    """Schema name of every tensor input, in call.ins order (args, then kwargs; no tensor lists here)."""
    schema = call.op._schema.arguments
    named = [(schema[i].name, a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [n for n, x in named if isinstance(x, TensorMeta)]


def _roles(call: OpCall):
    names = _arg_names(call)
    ins = [ARG_ROLES[n] for n in names]
    q, k = call.ins[names.index("query")], call.ins[names.index("key")]
    return ins, OPS[call.op][0], q, k


def _place(role: str, t: TensorMeta | None, d: int, q: TensorMeta, k: TensorMeta):
    if t is None:
        return None
    if role in ("q", "kv", "lse"):
        return Shard(d)
    if role == "mask":
        scores = q.shape[:-1] + (k.shape[-2],)
        j = aligned_dim(len(scores), t.shape, scores, d)
        return R if j is None else Shard(j)
    return R


def _shardable(d: int, q: TensorMeta, k: TensorMeta) -> bool:
    if q.ndim != k.ndim:  # q broadcast against k/v: leading dims do not line up index by index
        return False
    if q.shape[d] == k.shape[d]:
        return True
    return d == q.ndim - 3 and k.shape[d] > 0 and q.shape[d] % k.shape[d] == 0  # GQA heads


def sdpa_strategies(call: OpCall) -> list[Strategy1D]:
    ins, outs, q, k = _roles(call)
    out = [replicate_all(call)]
    if _dropout_p(call):
        return out
    for d in range(q.ndim - 2):
        if _shardable(d, q, k):
            out.append(Strategy1D(tuple(_place(r, t, d, q, k) for r, t in zip(outs, call.outs)),
                                  tuple(_place(r, t, d, q, k) for r, t in zip(ins, call.ins))))
    backward = OPS[call.op][1]
    linear_in = "q" if backward else "kv"  # grad_out (first q-role input) / value (second kv input)
    pos = [i for i, r in enumerate(ins) if r == linear_in][0 if backward else 1]
    o = tuple(None if t is None else (P if backward or r == "q" else R) for r, t in zip(outs, call.outs))
    out.append(Strategy1D(o, tuple(P if i == pos else R for i in range(len(ins)))))
    return out


def _dropout_p(call: OpCall) -> float:
    names = [a.name for a in call.op._schema.arguments]
    return call.arg(names.index("dropout_p"), "dropout_p", 0.0)


def sdpa_or_empty(op, out_specs, *args, **kwargs):
    """``op(*args, **kwargs)``, or its planned outputs when a batch/head dim is empty locally
    (the CPU kernels divide by the local head count)."""
    ts = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if any(0 in t.shape[:-2] for t in ts[:3]):
        outs = tuple(None if s is None else torch.zeros(s[0], dtype=s[1], device=ts[0].device) for s in out_specs)
        return outs if len(outs) > 1 else outs[0]
    return op(*args, **kwargs)


def _check_gqa(ctx: LocalCtx, iq: int, ik: int) -> None:
    """Query head chunk must map onto this rank's kv head chunk (raises: strategy dropped)."""
    q, k = ctx.call.ins[iq], ctx.call.ins[ik]
    h = q.ndim - 3
    if h < 0 or q.shape[h] == k.shape[h]:
        return
    g = q.shape[h] // k.shape[h]
    a, lq = ctx.in_layout(iq).shard_bounds(ctx.mesh, ctx.rank)[h]
    b, lk = ctx.in_layout(ik).shard_bounds(ctx.mesh, ctx.rank)[h]
    if lq != g * lk or (lq and a != g * b):
        raise ValueError(f"GQA: query heads [{a}, {a + lq}) do not map onto kv heads [{b}, {b + lk}) (group {g})")


def sdpa_local(ctx: LocalCtx) -> LocalCall:
    names = _arg_names(ctx.call)
    iq = names.index("query")
    _check_gqa(ctx, iq, names.index("key"))
    specs = tuple(None if t is None else (tuple(ctx.local_out_shape(i)), t.dtype) for i, t in enumerate(ctx.call.outs))
    return LocalCall(sdpa_or_empty, (ctx.call.op, specs) + tuple(ctx.call.args), dict(ctx.call.kwargs))


ROWS = (Rule(list(OPS), sdpa_strategies, sdpa_local, shape_sensitive=True, blockwise=False),)
