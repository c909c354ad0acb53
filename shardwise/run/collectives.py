"""The collectives interface every backend implements (the backends set the running rank's
collectives and generator in shardwise/core/scope.py, which the programs and rules read).

Primitives work on equal-sized buffers stacked on a new leading dim of the group size
(the way torch's *_into_tensor / *_single collectives do). Padding for uneven shards is
done by the caller (lower/redistribute.py), as explicit local ops in the program.
"""
from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod

import torch

from ..core.errors import CollectiveError, ConfigError
from ..core.mesh import Mesh
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
    and ``x`` both read as ``x``."""
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


class Handle:
    """A launched collective: ``wait()`` returns its result (once finished; later calls return
    it again). ``finish``: a function that completes it; ``value``: an already-finished result."""

    def __init__(self, finish=None, value=None):
        self._finish, self._value = finish, value

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._value, self._finish = self._finish(), None
        return self._value


class Collectives(ABC):
    """Collectives of one rank over the groups of a mesh (one group per mesh dim per rank)."""

    def __init__(self, mesh: Mesh, rank: int):
        self.mesh = mesh
        self.rank = rank

    def group_size(self, mesh_dim: int) -> int:
        return self.mesh.shape[mesh_dim]

    def group_index(self, mesh_dim: int) -> int:
        return self.mesh.coord(self.rank)[mesh_dim]

    def check_stacked(self, t: torch.Tensor, mesh_dim: int, n: int, what: str) -> None:
        """reduce_scatter / all_to_all take one slot per group member on a leading dim."""
        if t.dim() == 0 or t.shape[0] != n:
            raise CollectiveError(
                f"rank {self.rank}: {what} on mesh dim {mesh_dim} needs a leading dim of the group size {n}, "
                f"got shape {tuple(t.shape)}",
                rank=self.rank,
            )

    @abstractmethod
    def all_reduce(self, t: torch.Tensor, mesh_dim: int, op: str = "sum") -> torch.Tensor:
        """Elementwise reduction over the group; every member gets the result."""

    def start_all_reduce(self, t: torch.Tensor, mesh_dim: int, op: str = "sum") -> Handle:
        """Launch an all_reduce of ``t`` (a buffer the caller owns and does not read until the
        wait; a backend may reduce it in place) and return its Handle. This default runs it at
        once (the threads backend: the program keeps the same launch/wait structure)."""
        return Handle(value=self.all_reduce(t, mesh_dim, op))

    def start_reduce_scatter(self, t: torch.Tensor, mesh_dim: int, op: str = "sum") -> Handle:
        """Launch a reduce_scatter of ``t`` ([n, *s], owned by the caller) and return its Handle
        (default: run at once, as start_all_reduce)."""
        return Handle(value=self.reduce_scatter(t, mesh_dim, op))

    def start_all_gather(self, t: torch.Tensor, mesh_dim: int) -> Handle:
        """Launch an all_gather of ``t`` and return its Handle (default: run at once)."""
        return Handle(value=self.all_gather(t, mesh_dim))

    @abstractmethod
    def all_gather(self, t: torch.Tensor, mesh_dim: int) -> torch.Tensor:
        """[*s] -> [n, *s]: member i's tensor at index i (all members pass the same shape)."""

    @abstractmethod
    def reduce_scatter(self, t: torch.Tensor, mesh_dim: int, op: str = "sum") -> torch.Tensor:
        """[n, *s] -> [*s]: member i gets the reduction over members of their slot i."""

    @abstractmethod
    def all_to_all(self, t: torch.Tensor, mesh_dim: int) -> torch.Tensor:
        """[n, *s] -> [n, *s]: out[j] on member i is member j's t[i]."""

    def all_to_all_uneven(self, t: torch.Tensor, mesh_dim: int, send_splits, recv_splits) -> torch.Tensor:
        """Rows of ``t`` ([sum(send_splits), *s]) to each member: the next ``send_splits[j]`` rows go
        to member j; returns [sum(recv_splits), *s], member j's rows at position j (``recv_splits``:
        what each member sends here, known to the caller, e.g. from an exchange of counts)."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all_uneven")

    def broadcast(self, t: torch.Tensor, mesh_dim: int | None = None, src: int = 0) -> torch.Tensor:
        """Group member ``src``'s ``t`` to every member (``mesh_dim=None``: the whole mesh, rank ``src``)."""
        raise NotImplementedError(f"{type(self).__name__} has no broadcast")

    @abstractmethod
    def send_recv(self, t: torch.Tensor, mesh_dim: int, shift: int = 1) -> torch.Tensor:
        """Ring shift: send ``t`` to member (i + shift) % n, return what member (i - shift) % n sent."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every rank of the mesh."""
