"""A failure inside the trace, explained: which aten op, which line of the user's code, what to do.

The trace runs the model on fake tensors (shapes and dtypes, no data). What fails there is
mostly one of: an op whose output shape depends on the data (``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``), a Python value read from data (``.item()``,
``.tolist()``, ``if tensor:``), or an op whose fake kernel refuses what its real kernel
takes. shardwise plans static global shapes, so these are refused, never guessed, with a
``TraceError`` naming the op (found in the failing dispatch's frames), the innermost frame
outside torch and shardwise (the user's line), and the known way out.
"""
from __future__ import annotations

import os
import traceback

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from ..core.errors import ShardingError

_TORCH = os.path.dirname(torch.__file__) + os.sep
_SHARDWISE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

DATA_SHAPE_FIX = (
    "keep shapes fixed: torch.where(mask, x, 0) or x * mask instead of x[mask] / masked_select / nonzero; "
    "for a Hugging Face Mixture-of-Experts model use experts_implementation='grouped_mm' (the default) or "
    "'batched_mm' rather than 'eager'")
DATA_VALUE_FIX = ("keep the value a tensor (no .item(), .tolist(), int(t) or `if t:` on tensor data inside forward); "
                  "branch with torch.where")
GENERIC_FIX = ("the op failed on fake tensors (shapes and dtypes only): check that the model runs eagerly on these "
               "inputs; if it does, report the op and this message to shardwise")


class TraceError(ShardingError):
    """Tracing the model failed at an aten op: ``op``, ``source`` (the user's line) and the cause."""

    def __init__(self, message: str, *, op=None, source: str | None = None, fix: str | None = None):
        self.op = op
        self.source = source
        super().__init__(message, fix=fix)


def _failing_op(tb):
    """The aten op being dispatched when the error was raised: innermost frame with an OpOverload ``func``."""
    op = None
    while tb is not None:
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, torch._ops.OpOverload):
            op = func
        tb = tb.tb_next
    return op


def _user_line(tb) -> str | None:
    """``file:line in fn: code`` of the innermost frame outside torch and shardwise."""
    line = None
    for fs in traceback.extract_tb(tb):
        f = os.path.abspath(fs.filename)
        if not (f.startswith(_TORCH) or f.startswith(_SHARDWISE)):
            line = f"{fs.filename}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"
    return line


def explain(exc: BaseException) -> TraceError | None:
    """A TraceError for a failure inside a traced op, or None (not an op failure: re-raise as is)."""
    if isinstance(exc, ShardingError):
        return None
    op = getattr(exc, "func", None) or _failing_op(exc.__traceback__)
    if not isinstance(op, torch._ops.OpOverload):
        return None
    line = _user_line(exc.__traceback__)
    where = f"\n  source: {line}" if line else ""
    if isinstance(exc, DynamicOutputShapeException):
        msg, fix = f"{op} has an output shape that depends on the data, which a plan cannot hold", DATA_SHAPE_FIX
    elif isinstance(exc, DataDependentOutputException):
        msg, fix = f"{op} reads a Python value from tensor data while tracing", DATA_VALUE_FIX
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg, fix = f"tracing failed in {op}: {type(exc).__name__}: {first}", GENERIC_FIX
    return TraceError(msg + where, op=op, source=line, fix=fix)
