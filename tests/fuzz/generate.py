"""Random program = inputs, a chain/DAG of ops from ops.py, and a scalar loss over every sink.

The loss sees every value nothing else consumed (so no computation is dead): each sink is
weighted by a fixed random buffer and summed. When the program ends in a value used as
logits (or a regression output), the model returns it and ``loss_fn`` applies
``F.cross_entropy`` with an ``ignore_index`` (or ``F.mse_loss``) against a target, adding
the weighted sum of the other sinks, which the model returns beside it.
"""
from __future__ import annotations

import math

from . import ops
from .program import Builder, Val

MESHES = {1: ((2,), (3,), (4,), (8,)), 2: ((2, 2), (2, 3), (3, 2), (2, 4), (4, 2)), 3: ((2, 2, 2),)}


def mesh_shape(c, max_mesh_ndim: int) -> tuple:
    return c.choice([m for n in range(1, max_mesh_ndim + 1) for m in MESHES[n]])


def generate(c, mesh: tuple, seed: int, max_ops: int = 6, op_set=ops.OPS) -> Builder:
    b = Builder(c, mesh, seed)
    b.input(ops.shape(b, 1, 3))
    if c.coin(0.25):
        b.input(ops.shape(b, 1, 3))
    for _ in range(c.int(1, max_ops)):
        c.choice(op_set)(b)
    if not b.params:  # something to train
        ops.binary(b, with_param=True)
    finish(b)
    return b


def finish(b: Builder) -> None:
    """Write the loss: in the model (weighted sum of sinks), or cross_entropy / mse in loss_fn."""
    mode = b.c.choice(("sum", "cross_entropy", "mse"))
    sinks = b.sinks()
    if mode == "sum":
        b.returns = _weighted(b, sinks)
        return
    last = sinks[-1]
    head, logit_shape = _logits(b, last) if mode == "cross_entropy" else (last.name, None)
    rest = _weighted(b, sinks[:-1]) if len(sinks) > 1 else ""
    b.returns = f"{head}, {rest}" if rest else head
    out = "out[0]" if rest else "out"
    if mode == "cross_entropy":
        y, ignore = _labels(b, logit_shape)
        extra = ""
        if b.c.coin(0.3):  # class weights: a constant of the loss (weighted mean with ignored rows: invariant 4)
            extra += f", weight=torch.tensor({[0.5 + b.c.int(0, 20) / 10 for _ in range(logit_shape[1])]})"
        if b.c.coin(0.2):
            extra += ", label_smoothing=0.1"
        call = (f"F.cross_entropy({out}, {y}, ignore_index={ignore}, reduction={b.c.choice(('mean', 'sum'))!r}"
                f"{extra})")
    else:
        y = b.target(last.shape, f"torch.randn({ops._sizes(last.shape, tuple_=True)}, generator=g)")
        call = f"F.mse_loss({out}, {y})"
    b.loss_src = "\n".join([f"def loss_fn(out, {y}):", f"    return {call}" + (" + out[1]" if rest else "")])


def _weighted(b: Builder, vals: list[Val]) -> str:
    return " + ".join(f"({v.name} * {b.buffer(v.shape)}).sum()" for v in vals)


def _logits(b: Builder, v: Val) -> tuple[str, tuple]:
    """[N, C] logits from ``v`` (or [N, C, S], torch's class-dim-1 convention, for rank 3)."""
    if v.rank == 2 or (v.rank == 3 and b.c.coin(0.5)):
        return v.name, v.shape
    c_ = v.shape[-1]
    shape = (math.prod(v.shape) // c_, c_)
    return (f"{v.name}.unsqueeze(0)" if v.rank == 1 else f"{v.name}.reshape(-1, {c_})"), shape


def _labels(b: Builder, logit_shape: tuple) -> tuple[str, int]:
    """A label tensor literal (class dim removed) with some entries ignored, at least one not."""
    classes = logit_shape[1]
    shape = logit_shape[:1] + logit_shape[2:]
    ignore = b.c.choice((-100, 0))
    flat = [ignore if b.c.coin(0.3) else b.c.int(0, classes - 1) for _ in range(math.prod(shape))]
    if all(x == ignore for x in flat):
        if ignore == 0 and classes == 1:
            ignore = -100
        flat[0] = classes - 1 if ignore == 0 else 0
    return b.target(shape, f"torch.tensor({_nest(flat, shape)})"), ignore


def _nest(flat: list, shape: tuple):
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nest(flat[i:i + step], shape[1:]) for i in range(0, len(flat), step)]
