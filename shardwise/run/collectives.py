"""What both backends share around the collectives interface (core/collectives.py): the
timeout a rank waits in one collective, where a failing rank's program stopped (failed_node,
mark_failure), and the deterministic reduction of a list of buffers (reduce_list). The backends
set the running rank's collectives and generator in core/scope.py."""
from __future__ import annotations

import os
import re

import torch

from ..core.errors import ConfigError
from ..core.collectives import Collectives, Handle  # noqa: F401 (the interface the backends implement)
from ..core.scope import current, rank_generator, using, using_generator  # noqa: F401 - the runtime fills the scope

REDUCE_OPS = ("sum", "max", "min")

# How long a rank waits in one collective for the others before raising CollectiveError (the
# torch backend; the threads backend takes its own). Long enough for a slow peer (a rank saving
# a checkpoint while the others wait), short next to torch's 30-minute process-group default.
TIMEOUT_ENV = "SHARDWISE_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def default_timeout() -> float:
    """Seconds a collective waits: ``$SHARDWISE_COLLECTIVE_TIMEOUT`` if set, else 300."""
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"${TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}", fix="e.g. 300")
    return value


_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:,|=)")


def failed_node(exc: BaseException, program) -> str | None:
    """The node of ``program`` (a per-rank fx.GraphModule) that was running when ``exc`` was
    raised, from the traceback's frame in the program's generated code; None if the exception
    did not come through it. Debug shape guards name the node they check, so ``x_unchecked``
    and ``x`` both read as ``x``. A program run another way (run/replay.py) says itself (``node_of``)."""
    if hasattr(program, "node_of"):
        return program.node_of(exc)
    code = getattr(type(program), "forward", None)
    code = getattr(code, "__code__", None)
    lineno = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            lineno = tb.tb_lineno  # the innermost program frame: keep walking
        tb = tb.tb_next
    if lineno is None:
        return None
    lines = program.code.splitlines()
    m = _ASSIGN.match(lines[lineno - 1]) if 0 < lineno <= len(lines) else None
    if m is None:
        return None
    name = m.group(1)
    return name[: -len("_unchecked")] if name.endswith("_unchecked") else name


def summary(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (for messages to other ranks)."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def mark_failure(exc: BaseException, program, rank: int, backend: str) -> str | None:
    """Record on ``exc`` where this rank failed (``exc.shardwise_node``) and add a note saying
    so; returns the node. Called once per failure, by the backend that ran ``program``."""
    if getattr(exc, "shardwise_rank", None) is not None:
        return getattr(exc, "shardwise_node", None)
    node = failed_node(exc, program)
    try:
        exc.shardwise_rank, exc.shardwise_node = rank, node
    except AttributeError:  # an exception type with __slots__: nothing to record on it
        return node
    where = f" at node '{node}'" if node else ""
    if hasattr(exc, "add_note"):
        exc.add_note(f"shardwise: raised on rank {rank}{where} ({backend} backend)")
    return node


def reduce_list(ts, op: str) -> torch.Tensor:
    """Reduce tensors elementwise with ``op`` in list order (deterministic)."""
    out = ts[0].clone()
    for t in ts[1:]:
        if op == "sum":
            out = out + t
        elif op == "max":
            out = torch.maximum(out, t)
        elif op == "min":
            out = torch.minimum(out, t)
        else:
            raise ConfigError(f"unknown reduce op {op!r}", fix=f"use one of {REDUCE_OPS}")
    return out
