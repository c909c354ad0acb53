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

DATA_SHAPE_FIX = "keep shapes fixed: torch.where(mask, x, 0) or x * mask instead of x[mask] / masked_select / nonzero"
MOE_FIX = ("for a Hugging Face Mixture-of-Experts model use experts_implementation='grouped_mm' (the default) or "
           "'batched_mm' rather than 'eager'")
CTC_FIX = ("for a CTC loss pass F.ctc_loss batched log_probs [T, N, C], targets padded to [N, S] and input_lengths / "
           "target_lengths as tensors (shardwise traces that form at fixed shapes); concatenated 1-D targets "
           "(labels.masked_select(mask)) have a length that is the data's")
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


# A composite torch function whose C++ reads a tensor argument's data without dispatching an aten op
# (tensor_split with a tensor of indices): on the trace's fake tensors it meets no data at all.
_NO_DATA = "data is not allocated yet"
NO_DATA_FIX = ("pass the values as Python numbers (e.g. torch.tensor_split(x, [1, 3]) rather than a tensor of "
               "indices), so the shapes do not depend on tensor data")


def _failing_function(tb):
    """The torch function being run when no aten op was: the innermost ``__torch_function__`` frame's ``func``."""
    fn = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "__torch_function__" and callable(tb.tb_frame.f_locals.get("func")):
            fn = tb.tb_frame.f_locals["func"]
        tb = tb.tb_next
    return fn


def _user_line(tb) -> str | None:
    """``file:line in fn: code`` of the innermost frame outside torch and shardwise."""
    return user_line(traceback.extract_tb(tb))


def user_line(frames: traceback.StackSummary) -> str | None:
    """``file:line in fn: code`` of the innermost of ``frames`` outside torch and shardwise."""
    line = None
    for fs in frames:
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
        return _no_data(exc)
    line = _user_line(exc.__traceback__)
    where = f"\n  source: {line}" if line else ""
    if isinstance(exc, DynamicOutputShapeException):
        msg, fix = f"{op} has an output shape that depends on the data, which a plan cannot hold", _shape_fix(op, line)
    elif isinstance(exc, DataDependentOutputException):
        msg, fix = f"{op} reads a Python value from tensor data while tracing", DATA_VALUE_FIX
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg, fix = f"tracing failed in {op}: {type(exc).__name__}: {first}", GENERIC_FIX
    return TraceError(msg + where, op=op, source=line, fix=fix)


def _shape_fix(op, line: str | None) -> str:
    """The way out of a data-dependent shape, by what the op and the user's line are about."""
    about = f"{op} {line or ''}".lower()
    if "ctc" in about:
        return f"{CTC_FIX}; else {DATA_SHAPE_FIX}"
    if "expert" in about or "moe" in about:
        return f"{DATA_SHAPE_FIX}; {MOE_FIX}"
    return DATA_SHAPE_FIX


def _no_data(exc: BaseException) -> TraceError | None:
    """A torch function that read a fake tensor's data in C++ (no aten op to name): named itself."""
    fn = _failing_function(exc.__traceback__)
    if fn is None or _NO_DATA not in str(exc):
        return None
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    # torch.tensor_split is _VariableFunctionsClass.tensor_split; Tensor.tensor_split is TensorBase's
    name = "torch." + qual.split(".")[-1] if qual.startswith("_VariableFunctions") else qual.replace("TensorBase", "Tensor")
    line = _user_line(exc.__traceback__)
    where = f"\n  source: {line}" if line else ""
    fix = CTC_FIX if "ctc" in name.lower() else NO_DATA_FIX
    return TraceError(f"{name} reads tensor data while tracing (the trace's fake tensors hold none){where}",
                      op=name, source=line, fix=fix)
