"""Linear algebra on the last two dims: the batch dims shard, the matrix dims stay whole.

Every op here treats each matrix of a batch on its own (solves, factorisations, decompositions,
inverses, determinants). Each tensor, input or output, is a batch shape followed by its core dims:
two for a matrix (A, LU, Q, U, a right-hand side B), one for a vector (pivots, S, eigenvalues,
``tau``, a vector right-hand side), none for a scalar per matrix (info, det, sign, pinv's tensor
tolerances). The inputs' batch shapes broadcast to one batch shape B; each dim of B shards alike on
every input and output that holds it, and an input broadcast along it (size 1 or missing) stays
Replicate, as does an output made from such inputs only (``_linalg_solve_ex``'s LU when A is
broadcast). The core dims are never sharded: every entry of a factor depends on the whole matrix.
Local calls are the op on contiguous inputs (no arg carries a batch size; ``_linalg_det`` and
``_linalg_slogdet`` return a wrong LU for a strided batch, such as a local chunk of a batch dim that
is not the first).

Solves (and ormqr's product Q C, from geqrf's factors) are linear in their right-hand side: a
Partial(sum) B with the factors Replicate gives a Partial(sum) solution (the other outputs, made
from the factors alone, Replicate).
``_linalg_check_errors(info)`` has no output: each rank checks its own infos (a failure on any
rank stops the step with that rank's error).
"""
from __future__ import annotations

import torch

from ..core.calls import pure
from ..core.layout import Shard
from .common import P, R, replicate_all
from .registry import LocalCall, LocalCtx, OpCall, Rule, Strategy1D

aten = torch.ops.aten

# op -> (core dims of each tensor input, of each output (None: no tensor), the input a solve is
#        linear in or None). _linalg_solve_ex's B and result: see _cores (a vector B has one).
CORES = {
    aten.linalg_solve_triangular.default: ((2, 2), (2,), 1),
    aten._linalg_solve_ex.default: ((2, 2), (2, 2, 1, 0), 1),
    aten.linalg_lu_solve.default: ((2, 1, 2), (2,), 2),
    aten.cholesky_solve.default: ((2, 2), (2,), 0),
    aten.triangular_solve.default: ((2, 2), (2, 2), 0),
    aten._linalg_svd.default: ((2,), (2, 1, 2), None),
    aten.linalg_qr.default: ((2,), (2, 2), None),
    aten._linalg_eigh.default: ((2,), (1, 2), None),
    aten.linalg_inv_ex.default: ((2,), (2, 0), None),
    aten.linalg_cholesky_ex.default: ((2,), (2, 0), None),
    aten._linalg_det.default: ((2,), (0, 2, 1), None),
    aten._linalg_slogdet.default: ((2,), (0, 0, 2, 1), None),
    aten.linalg_lu_factor_ex.default: ((2,), (2, 1, 0), None),
    aten.linalg_lu.default: ((2,), (2, 2, 2), None),
    aten.lu_unpack.default: ((2, 1), (2, 2, 2), None),
    aten.cholesky.default: ((2,), (2,), None),
    aten.cholesky_inverse.default: ((2,), (2,), None),
    aten.linalg_matrix_exp.default: ((2,), (2,), None),
    aten._linalg_check_errors.default: ((0,), (None,), None),
    aten.linalg_ldl_factor_ex.default: ((2,), (2, 1, 0), None),
    aten.linalg_ldl_solve.default: ((2, 1, 2), (2,), 2),
    aten.geqrf.default: ((2,), (2, 1), None),
    aten.ormqr.default: ((2, 1, 2), (2,), 2),  # (A and tau from geqrf, C): Q C, linear in C
    aten.linalg_householder_product.default: ((2, 1), (2,), None),
}
# pinv: the matrix, then its tolerances as tensors (atol, rtol or rcond, one number per matrix) where given
PINV = (aten.linalg_pinv.default, aten.linalg_pinv.atol_rtol_float, aten.linalg_pinv.atol_rtol_tensor,
        aten.linalg_pinv.rcond_tensor)
CORES.update(dict.fromkeys(PINV, ((2,), (2,), None)))


def _cores(call: OpCall) -> tuple[tuple, tuple]:
    ins, outs, _ = CORES[call.op]
    if call.op in PINV:
        ins = (2,) + (0,) * (len(call.ins) - 1)
    if call.op == aten._linalg_solve_ex.default:
        a, b = call.ins
        vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])  # torch's vector case
        if vector:
            ins, outs = (2, 1), (1,) + outs[1:]
    return ins, outs


def _batch_shape(tensors, cores) -> tuple:
    """The inputs' batch shapes broadcast together."""
    return tuple(torch.broadcast_shapes(*(t.shape[:max(t.ndim - c, 0)] for t, c in zip(tensors, cores))))


def _holder(t, core: int, d: int, batch: tuple):
    """Shard(j) where ``t`` holds batch dim ``d`` whole at its dim j, else Replicate."""
    if t is None:
        return None
    j = d - (len(batch) - (t.ndim - core))
    return Shard(j) if 0 <= j < t.ndim - core and t.shape[j] == batch[d] else R


def batch_strategies(call: OpCall) -> list[Strategy1D]:
    in_cores, out_cores = _cores(call)
    batch = _batch_shape(call.ins, in_cores)
    out = [replicate_all(call)]
    for d in range(len(batch)):
        ins = tuple(_holder(t, c, d, batch) for t, c in zip(call.ins, in_cores))
        outs = tuple(_holder(t, c, d, batch) for t, c in zip(call.outs, out_cores))
        if any(isinstance(p, Shard) for p in ins):
            out.append(Strategy1D(outs, ins))
    linear = CORES[call.op][2]
    if linear is not None:  # Partial right-hand side, factors Replicate: Partial solution
        outs = tuple(None if o is None else (P if i == 0 else R) for i, o in enumerate(call.outs))
        out.append(Strategy1D(outs, tuple(P if i == linear else R for i in range(len(call.ins)))))
    return out


@pure
def on_contiguous(op, *args, **kwargs):
    """``op`` with contiguous tensor args (a no-op for the contiguous locals most programs pass)."""
    return op(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)


def contiguous_local(ctx: LocalCtx) -> LocalCall:
    return LocalCall(on_contiguous, (ctx.call.op, *ctx.call.args), dict(ctx.call.kwargs))


def pinv_strategies(call: OpCall) -> list[Strategy1D]:
    """As batch_strategies, where the tolerances do not widen the batch: torch's pinv returns an empty
    matrix batch as it is, without broadcasting it against them (a rank's empty chunk would give the
    wrong shape), so tolerances that broadcast the batch beyond the matrices' keep it whole."""
    if call.out.shape[:-2] != call.ins[0].shape[:-2]:
        return [replicate_all(call)]
    return batch_strategies(call)


CHECKS = [aten._linalg_check_errors.default]  # reads its infos as they are; raises or returns nothing
ROWS = (Rule([op for op in CORES if op not in CHECKS and op not in PINV], batch_strategies, contiguous_local,
             blockwise=True),
        Rule(list(PINV), pinv_strategies, contiguous_local, blockwise=True),
        Rule(CHECKS, batch_strategies, blockwise=True))
