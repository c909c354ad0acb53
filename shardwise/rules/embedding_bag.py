"""embedding_bag: ``_embedding_bag(weight [V, D], indices [L], offsets [B or B+1], ...)`` -> (output
[B, D], offset2bag, bag_size, max_indices) and its backwards (``_embedding_bag_backward``,
``_embedding_bag_dense_backward``: the weight's gradient [V, D]; ``_embedding_bag_per_sample_weights
_backward``: [L]).

Indices and offsets are 1-D (nn.functional.embedding_bag flattens a 2-D input): where a bag starts
in ``indices`` is data, so indices and offsets stay replicated. Strategies (one mesh dim):

- the weight's columns (D) sharded: every mode is per column -> output (and max mode's
  max_indices [B, D]) sharded on D; the backward's grad likewise; the per-sample-weights gradient
  (a dot over D) Partial.
- the weight's rows (V) sharded, modes sum and mean: each rank looks up only the ids of its row
  range (the others weighted 0, as padding is) -> a Partial sum, divided for 'mean' by the
  global bag sizes. The backward keeps each rank's rows of the gradient (other ids sent to an
  extra row that is cut off). Max mode needs every row's value: not offered.
- the bags (B) sharded, the weight whole: the local call takes its bags' run of ``indices`` from
  the replicated offsets (values, read at run time), so each rank computes only its bags; the
  backwards take a bags-sharded grad and give a Partial gradient.
- Partial weight (sum, mean: linear in the table) -> Partial output; Partial grad -> Partial.

offset2bag, bag_size and (for sum and mean) max_indices depend on the indices, offsets, mode and
padding alone: where a strategy changes the local call, they are the op's own, run on a table of
zero columns (every rank the same: Replicate).
"""
from __future__ import annotations

import torch

from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D, TensorMeta
from ..core.layout import Shard

aten = torch.ops.aten
FORWARD = aten._embedding_bag.default
BACKWARD, DENSE = aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default
PSW = aten._embedding_bag_per_sample_weights_backward.default
SUM, MEAN, MAX = 0, 1, 2
ROWS_TAG, BAGS_TAG = "offsets", "bags"  # strategies whose local call needs this rank's offsets

_FWD_NAMES = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
              "include_last_offset", "padding_idx")
_FWD_DEFAULTS = (None, None, None, False, SUM, False, None, False, -1)
_BWD_NAMES = {BACKWARD: ("grad", "indices", "offsets", "offset2bag", "bag_size", "maximum_indices", "num_weights",
                         "scale_grad_by_freq", "mode", "sparse", "per_sample_weights", "padding_idx"),
              DENSE: ("grad", "indices", "offset2bag", "bag_size", "maximum_indices", "num_weights",
                      "scale_grad_by_freq", "mode", "per_sample_weights", "padding_idx")}


def _args(call: OpCall) -> dict:
    if call.op is FORWARD:
        return {n: call.arg(i, n, d) for i, (n, d) in enumerate(zip(_FWD_NAMES, _FWD_DEFAULTS))}
    if call.op is PSW:
        names = ("grad", "weight", "indices", "offsets", "offset2bag", "mode", "padding_idx")
        return {n: call.arg(i, n, -1 if n == "padding_idx" else None) for i, n in enumerate(names)}
    defaults = {"padding_idx": -1, "sparse": False}
    return {n: call.arg(i, n, defaults.get(n)) for i, n in enumerate(_BWD_NAMES[call.op])}


def forward_strategies(call: OpCall) -> list[Strategy1D]:
    a = _args(call)
    n_rest = len(call.ins) - 1  # indices, offsets, [per_sample_weights]
    out = [replicate_all(call)]
    out.append(Strategy1D((Shard(1), R, R, Shard(1) if a["mode"] == MAX else R), (Shard(1),) + (R,) * n_rest))
    out.append(Strategy1D((Shard(0), R, R, Shard(0)), (R,) * (n_rest + 1), BAGS_TAG))
    if a["mode"] != MAX:
        out.append(Strategy1D((P, R, R, R), (P,) + (R,) * n_rest))
        # with include_last_offset the CPU kernel sums the last bag to its last offset or to the end
        # of indices depending on mode and padding_idx (torch 2.13): the rows' masked sum is not offered
        if not a["sparse"] and not a["include_last_offset"]:
            out.append(Strategy1D((P, R, R, R), (Shard(0),) + (R,) * n_rest, ROWS_TAG))
    return out


def backward_strategies(call: OpCall) -> list[Strategy1D]:
    a, n = _args(call), len(call.ins)
    names = [k for k in _BWD_NAMES[call.op] if isinstance(a[k], TensorMeta)]  # the tensor args, in order
    out = [replicate_all(call)]
    cols = tuple(Shard(1) if k == "grad" or (k == "maximum_indices" and a["mode"] == MAX) else R for k in names)
    out.append(Strategy1D((Shard(1),), cols))
    bags = tuple(Shard(0) if k == "grad" or (k == "maximum_indices" and a["mode"] == MAX) else R for k in names)
    out.append(Strategy1D((P,), bags, BAGS_TAG))
    if a["mode"] != MAX and not a["scale_grad_by_freq"]:  # (the kernel's frequency scaling on remapped
        out.append(Strategy1D((Shard(0),), (R,) * n, ROWS_TAG))  # ids was measured off: not offered)
    out.append(Strategy1D((P,), (P,) + (R,) * (n - 1)))  # linear in grad
    return out


def psw_strategies(call: OpCall) -> list[Strategy1D]:
    """ins: grad [B, D], weight [V, D], indices, offsets, offset2bag; out: [L]."""
    n_rest = len(call.ins) - 2
    return [replicate_all(call),
            Strategy1D((P,), (Shard(1), Shard(1)) + (R,) * n_rest),
            Strategy1D((P,), (Shard(0), R) + (R,) * n_rest, BAGS_TAG),
            Strategy1D((P,), (P, R) + (R,) * n_rest),
            Strategy1D((P,), (R, P) + (R,) * n_rest)]


# -- local calls ------------------------------------------------------------------------------------
def _aux(weight, indices, offsets, a: dict):
    """(offset2bag, bag_size, max_indices) of the whole call: the op on a table of no columns."""
    table = weight.new_zeros((a["num_rows"], 1))  # (no columns at all trips the mean kernel)
    return FORWARD(table, indices, offsets, False, a["mode"], False, a["per_sample_weights"],
                   a["include_last_offset"], a["padding_idx"])[1:]


def _bag_run(indices, offsets, first: int, count: int, include_last: bool) -> tuple[int, int]:
    """[start, end) of ``indices`` that bags [first, first + count) cover (offsets are values). The
    last bag's run goes to the end of ``indices`` even with include_last_offset (the kernels count
    its bag size so), its last offset passed on as it is."""
    n_bags = offsets.shape[0] - (1 if include_last else 0)
    start = int(offsets[first]) if first < n_bags else indices.shape[0]
    end = int(offsets[first + count]) if first + count < n_bags else indices.shape[0]
    return start, end


def bag_rows_forward(weight, indices, offsets, a: dict, row_offset: int):
    """Sum/mean over this rank's rows of the table: ids elsewhere (and padding) weighted 0 -> a Partial part."""
    rows = weight.shape[0]
    keep = (indices >= row_offset) & (indices < row_offset + rows)
    if a["padding_idx"] >= 0:
        keep &= indices != a["padding_idx"]
    w = keep.to(weight.dtype) if a["per_sample_weights"] is None else a["per_sample_weights"] * keep
    local = torch.where(keep, indices - row_offset, torch.zeros_like(indices))
    table = weight if rows else weight.new_zeros((1, weight.shape[1]))
    out = FORWARD(table, local, offsets, False, SUM, False, w, a["include_last_offset"], -1)[0]
    aux = _aux(weight, indices, offsets, a)
    if a["mode"] == MEAN:
        out = out / aux[1].clamp(min=1).unsqueeze(1).to(out.dtype)
    return (out, *aux)


def bag_shard_forward(weight, indices, offsets, a: dict, first: int, count: int):
    """The op on bags [first, first + count) alone (their run of indices), offset2bag and bag_size
    of the whole call; max_indices of the local bags (ids of the whole table)."""
    o2b, bag_size, max_idx = _aux(weight, indices, offsets, a)
    if count == 0:
        return weight.new_zeros((0, weight.shape[1])), o2b, bag_size, max_idx.new_zeros((0,) + max_idx.shape[1:])
    start, end = _bag_run(indices, offsets, first, count, a["include_last_offset"])
    local_off = offsets[first:first + count + (1 if a["include_last_offset"] else 0)] - start
    psw = a["per_sample_weights"]
    psw = None if psw is None else psw[start:end]
    out, _, _, local_max = FORWARD(weight, indices[start:end], local_off, False, a["mode"], False, psw,
                                   a["include_last_offset"], a["padding_idx"])
    return out, o2b, bag_size, local_max


def forward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    tag = next((t for t in ctx.strategy.tags if t in (ROWS_TAG, BAGS_TAG)), "")
    if not tag:
        return LocalCall(call.op, call.args, call.kwargs)
    a = _args(call)
    a["num_rows"] = call.ins[0].shape[0]
    fixed = {k: a[k] for k in ("mode", "per_sample_weights", "include_last_offset", "padding_idx", "num_rows")}
    if tag == ROWS_TAG:
        return LocalCall(bag_rows_forward, (a["weight"], a["indices"], a["offsets"], fixed, ctx.in_offset(0, 0)), {})
    first, count = ctx.out_offset(0, 0), ctx.local_out_shape(0)[0]
    return LocalCall(bag_shard_forward, (a["weight"], a["indices"], a["offsets"], fixed, first, count), {})


def bag_rows_backward(op, args: dict, row_offset: int, rows: int):
    """Gradient rows [row_offset, row_offset + rows): ids elsewhere (and padding) go to an extra
    row, marked as padding so nothing accumulates there, then cut off."""
    indices = args["indices"]
    keep = (indices >= row_offset) & (indices < row_offset + rows)
    if args["padding_idx"] >= 0:
        keep &= indices != args["padding_idx"]
    args = dict(args, indices=torch.where(keep, indices - row_offset, torch.full_like(indices, rows)),
                num_weights=rows + 1, padding_idx=rows)
    return op(**args)[:rows]


def bag_shard_backward(op, args: dict, first: int, total: int, padded: tuple):
    """The backward of this rank's bags: grad (and max_indices) rows placed among zeros for the
    others (whose gradient they give is 0), so the result is a Partial part."""
    args = dict(args)
    for k in padded:
        t = args[k]
        full = t.new_zeros((total,) + tuple(t.shape[1:]))
        full[first:first + t.shape[0]] = t
        args[k] = full
    return op(**args)


def backward_local(ctx: LocalCtx) -> LocalCall:
    call = ctx.call
    tag = next((t for t in ctx.strategy.tags if t in (ROWS_TAG, BAGS_TAG)), "")
    if not tag:
        return LocalCall(call.op, call.args, call.kwargs)
    a = _args(call)
    if tag == ROWS_TAG:
        return LocalCall(bag_rows_backward, (call.op, a, ctx.out_offset(0, 0), ctx.local_out_shape(0)[0]), {})
    padded = ("grad",) + (("maximum_indices",) if call.op is not PSW and a["mode"] == MAX else ())
    return LocalCall(bag_shard_backward, (call.op, a, ctx.in_offset(0, 0), call.ins[0].shape[0], padded), {})


def one_kind(call: OpCall, st, mesh) -> bool:
    """A local call reads one kind of offsets: this rank's rows or its bags, not both."""
    return not {ROWS_TAG, BAGS_TAG} <= set(st.tags)


ROWS = (Rule(FORWARD, forward_strategies, forward_local, valid=one_kind, blockwise=False),
        Rule([BACKWARD, DENSE], backward_strategies, backward_local, valid=one_kind, blockwise=False),
        Rule(PSW, psw_strategies, backward_local, blockwise=False))
