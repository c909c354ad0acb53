"""The collectives interface every backend implements (run/threads.py, run/distributed.py) and
the programs, ops and memory model call: primitives on equal-sized buffers stacked on a new
leading dim of the group size (as torch's *_into_tensor / *_single collectives); padding for
uneven shards is the caller's (lower/comm.py), as explicit local ops in the program."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .errors import CollectiveError
from .mesh import Mesh


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

    def send(self, t: torch.Tensor, mesh_dim: int, peer: int, tag: int = 0) -> Handle:
        """Point-to-point: send ``t`` to group member ``peer`` along ``mesh_dim`` under ``tag`` (a
        pipeline's activations and their gradients). Returns at once; the Handle's ``wait()``
        returns once ``t`` may be reused. Messages between two members are told apart by tag."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point send")

    def recv(self, shape, dtype: torch.dtype, mesh_dim: int, peer: int, tag: int = 0,
             device=None) -> Handle:
        """Point-to-point: receive the tensor group member ``peer`` along ``mesh_dim`` sent under
        ``tag`` (of ``shape`` and ``dtype``). Returns at once; ``wait()`` returns the tensor."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point recv")

    @abstractmethod
    def send_recv(self, t: torch.Tensor, mesh_dim: int, shift: int = 1) -> torch.Tensor:
        """Ring shift: send ``t`` to member (i + shift) % n, return what member (i - shift) % n sent."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every rank of the mesh."""
