"""Halo exchange for windowed ops (convolution) with a spatial dim sharded on one mesh dim.

A window op's output row ``o`` reads input rows ``o*s - p .. o*s - p + d*(k-1)`` (stride s,
padding p, dilation d, kernel k). A rank holding output rows ``[o0, o1)`` therefore needs
input rows ``[o0*s - p, (o1-1)*s + d*(k-1) + 1 - p)``: its own chunk plus rows its
neighbours hold (the halo), and zeros where the range leaves the tensor (the padding, now
explicit). Every chunk comes from ``Layout`` (invariant 1), so uneven and empty chunks,
strides that do not line input and output chunks up, and halos wider than a neighbour's
chunk are all exact: ``HaloPlan`` lists, per ring shift, the rows each member sends.

The exchange runs on ``send_recv`` (a ring shift of the mesh dim's group: shift t sends to
member i + t); pieces are zero-padded to the group's widest piece for that shift, as every
collective here pads uneven chunks. ``gather`` builds the halo'd block; ``scatter_add``
is its adjoint for the backward: each rank sends the gradient of rows it borrowed back to
their owner, who adds it. ``steps`` states the exchanges as plan steps, so ``plan.stats()``
counts them and the planners price them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.cost import CostModel
from ..core.collective_kinds import RedistStep
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.scope import current


@dataclass(frozen=True)
class Window:
    """One spatial dim of a window op: input length, kernel, stride, padding, dilation."""

    length: int
    kernel: int
    stride: int
    padding: int
    dilation: int

    def need(self, o0: int, o1: int) -> tuple[int, int]:
        """Input rows ``[a, b)`` (unpadded coordinates, may leave [0, length)) for outputs [o0, o1)."""
        if o1 <= o0:
            return 0, 0
        span = self.dilation * (self.kernel - 1) + 1  # rows one window covers
        return o0 * self.stride - self.padding, (o1 - 1) * self.stride + span - self.padding


def _overlap(a: int, b: int, c: int, d: int) -> tuple[int, int]:
    lo, hi = max(a, c), min(b, d)
    return (lo, hi) if hi > lo else (lo, lo)


@dataclass(frozen=True)
class HaloPlan:
    """The static exchange for one rank: printable args of the program's halo calls.

    ``own``: (start, length) of this rank's input chunk; ``need``: [a, b) it reads;
    ``shifts``: per ring shift t with any traffic, (t, width, (send start, send length)
    relative to the own chunk, (recv global start, recv length)).
    """

    dim: int
    mesh_dim: int
    own: tuple
    need: tuple
    shifts: tuple

    def args(self) -> tuple:
        """(dim, mesh_dim, own, need, shifts): ``HaloPlan(*args)`` rebuilds it."""
        return (self.dim, self.mesh_dim, self.own, self.need, self.shifts)

    @staticmethod
    def of(x: Layout, out: Layout, dim: int, mesh_dim: int, win: Window, mesh: Mesh, rank: int) -> "HaloPlan":
        group = mesh.group(mesh_dim, rank)
        n, i = len(group), group.index(rank)
        own = [(x.local_offset(mesh, r, dim), x.local_shape(mesh, r)[dim]) for r in group]
        outs = [(out.local_offset(mesh, r, dim), out.local_shape(mesh, r)[dim]) for r in group]
        need = [win.need(o, o + ln) for o, ln in outs]
        shifts = []
        for t in range(1, n):
            # member j sends to (j + t) the rows it owns that (j + t) needs
            sends = [_overlap(*need[(j + t) % n], own[j][0], own[j][0] + own[j][1]) for j in range(n)]
            width = max(hi - lo for lo, hi in sends)
            if width == 0:
                continue
            s_lo, s_hi = sends[i]
            r_lo, r_hi = sends[(i - t) % n]
            send = (s_lo - own[i][0], s_hi - s_lo) if s_hi > s_lo else (0, 0)
            recv = (r_lo, r_hi - r_lo) if r_hi > r_lo else (need[i][0], 0)
            shifts.append((t, width, send, recv))
        return HaloPlan(dim, mesh_dim, own[i], need[i], tuple(shifts))


def _pad_to(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    if t.shape[dim] == width:
        return t.contiguous()
    out = t.new_zeros(t.shape[:dim] + (width,) + t.shape[dim + 1:])
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def halo_gather(x: torch.Tensor, plan: HaloPlan, fill: float = 0.0) -> torch.Tensor:
    """This rank's chunk -> the block of input rows ``plan.need`` it reads: own rows, rows
    received from the members that hold them, ``fill`` outside the tensor (explicit padding:
    zeros for convolutions and average pools, -inf for max pools)."""
    dim, (start, length), (a, b) = plan.dim, plan.own, plan.need
    block = x.new_full(x.shape[:dim] + (b - a,) + x.shape[dim + 1:], fill)
    lo, hi = _overlap(a, b, start, start + length)
    if hi > lo:
        block.narrow(dim, lo - a, hi - lo).copy_(x.narrow(dim, lo - start, hi - lo))
    comm = current()
    for t, width, (s_off, s_len), (r_start, r_len) in plan.shifts:
        got = comm.send_recv(_pad_to(x.narrow(dim, s_off, s_len), dim, width), plan.mesh_dim, t)
        if r_len:
            block.narrow(dim, r_start - a, r_len).copy_(got.narrow(dim, 0, r_len))
    return block


def halo_scatter_add(g: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """Adjoint of ``halo_gather``: the gradient of the block -> the gradient of this rank's
    chunk, with the rows other ranks borrowed sent back and added by their owner."""
    dim, (start, length), (a, b) = plan.dim, plan.own, plan.need
    out = g.new_zeros(g.shape[:dim] + (length,) + g.shape[dim + 1:])
    lo, hi = _overlap(a, b, start, start + length)
    if hi > lo:
        out.narrow(dim, lo - start, hi - lo).add_(g.narrow(dim, lo - a, hi - lo))
    comm = current()
    for t, width, (s_off, s_len), (r_start, r_len) in plan.shifts:
        piece = g.narrow(dim, r_start - a, r_len)
        got = comm.send_recv(_pad_to(piece, dim, width), plan.mesh_dim, -t)
        if s_len:
            out.narrow(dim, s_off, s_len).add_(got.narrow(dim, 0, s_len))
    return out


def steps(x: Layout, out: Layout, dim: int, mesh_dim: int, win: Window, mesh: Mesh,
          cost: CostModel | None = None) -> list:
    """The exchanges as plan steps (kind ``send_recv``, one per ring shift with traffic; bytes
    each rank sends, the widest piece times the largest local cross-section)."""
    cost = cost or CostModel()
    plans = [HaloPlan.of(x, out, dim, mesh_dim, win, mesh, r) for r in range(mesh.size)]
    cross = max(math.prod(s for k, s in enumerate(x.local_shape(mesh, r)) if k != dim) for r in range(mesh.size))
    widths: dict = {}
    for p in plans:
        for t, width, _, _ in p.shifts:
            widths[t] = max(widths.get(t, 0), width)
    n = mesh.shape[mesh_dim]
    out_steps = []
    for t, width in sorted(widths.items()):
        nbytes = width * cross * x.itemsize
        out_steps.append(HaloStep("send_recv", mesh_dim, x, x, src_dim=dim, dst_dim=dim, bytes=nbytes,
                                  time=cost.collective_time("send_recv", nbytes, n, mesh_dim, mesh)))
    return out_steps


@dataclass(frozen=True)
class HaloStep(RedistStep):
    """A halo exchange inside a window op's local call: the layout stays; rows move to neighbours."""

    def __repr__(self) -> str:
        return f"halo send_recv(mesh_dim={self.mesh_dim}, dim={self.src_dim}, {self.bytes} B/rank)"
