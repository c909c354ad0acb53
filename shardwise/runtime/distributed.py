"""The torch backend: collectives over torch.distributed process groups, one per mesh dim.

``TorchCollectives(mesh)`` uses the already-initialised default process group (gloo on
CPU, NCCL on GPU; buffers live on the input tensor's device). Every process creates the
same sub-groups in the same order, so the constructor is itself collective: call it on
every rank. ``activate(mesh)`` builds one and makes it current for the whole process.

Failures of the underlying collective (a peer died, a timeout) are re-raised as
:class:`~shardwise.errors.CollectiveError` naming this rank, the primitive and the group.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..mesh import Mesh
from .collectives import REDUCE_OPS, Collectives, using

_REDUCE_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# Dtypes gloo handles natively for every primitive used here (checked on torch 2.13:
# all_reduce / reduce_scatter sum,max,min; flat all_gather; all_to_all_single; complex
# also works except max/min, which torch.maximum refuses too).
_GLOO_OK = {
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
}
# Gloo rejects e.g. int16, uint16/32, float8: move their bits as a supported dtype of the
# same width (bit-exact), reduce them widened (int64 / float32) and cast back.
_SAME_WIDTH = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}

# Newer torch renamed the *_tensor collectives; use whichever exists (no deprecation noise).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_op(op: str) -> None:
    if op not in _REDUCE_OP:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {REDUCE_OPS}")


class TorchCollectives(Collectives):
    """Collectives of this process's rank over the groups of ``mesh`` (torch.distributed)."""

    def __init__(self, mesh: Mesh):
        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError(
                "torch.distributed is not initialised; call torch.distributed.init_process_group "
                "first (or launch with shardwise.runtime.launch.spawn / torchrun)"
            )
        mesh.check_world_size(dist.get_world_size())
        super().__init__(mesh, dist.get_rank())
        # Per mesh dim: (process group or None when the group has one member, its ranks).
        self._groups: list[tuple[object, tuple[int, ...]]] | None = []
        self._owned: list = []
        world = tuple(range(mesh.size))
        for m in range(mesh.ndim):
            mine = None
            for ranks in mesh.groups(m):
                if len(ranks) == 1:
                    # Same decision on every process, so skipping keeps new_group calls aligned.
                    continue
                if ranks == world:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(list(ranks))
                    if self.rank in ranks:
                        self._owned.append(pg)
                if self.rank in ranks:
                    mine = pg
            ranks = mesh.group(m, self.rank)
            if mine is not None and dist.get_group_rank(mine, self.rank) != ranks.index(self.rank):
                raise CollectiveError(
                    f"rank {self.rank}: process group for mesh dim {m} orders ranks differently "
                    f"from the mesh group {list(ranks)}",
                    rank=self.rank,
                )
            self._groups.append((mine, ranks))

    # -- helpers ---------------------------------------------------------------
    def _dim(self, mesh_dim) -> int:
        return self.mesh.dim_index(mesh_dim)

    def _group(self, mesh_dim):
        """(mesh dim index, process group or None for a one-member group, group ranks)."""
        if self._groups is None:
            raise CollectiveError(f"rank {self.rank}: these TorchCollectives were closed", rank=self.rank)
        m = self._dim(mesh_dim)
        pg, ranks = self._groups[m]
        return m, pg, ranks

    def group_size(self, mesh_dim) -> int:
        return self.mesh.shape[self._dim(mesh_dim)]

    def group_index(self, mesh_dim) -> int:
        return self.mesh.coord(self.rank)[self._dim(mesh_dim)]

    def _run(self, what: str, m: int, call):
        try:
            return call()
        except CollectiveError:
            raise
        except (RuntimeError, ValueError) as e:  # DistBackendError / DistError are RuntimeErrors
            ranks = list(self.mesh.group(m, self.rank))
            raise CollectiveError(
                f"rank {self.rank}: {what} on mesh dim {m} over ranks {ranks} failed: {e}",
                rank=self.rank,
            ) from e

    @staticmethod
    def _movable(t: torch.Tensor):
        """A contiguous buffer the backend moves byte-exactly, and the dtype to view it back as."""
        t = t.detach().contiguous()
        if t.device.type != "cpu" or t.dtype in _GLOO_OK or t.is_complex():
            return t, None
        return t.view(_SAME_WIDTH[t.element_size()]), t.dtype

    @staticmethod
    def _reducible(t: torch.Tensor):
        """A fresh contiguous buffer the backend can reduce, and the dtype to cast back to."""
        t = t.detach()
        if t.device.type != "cpu" or t.dtype in _GLOO_OK or t.is_complex():
            return t.clone(memory_format=torch.contiguous_format), None
        wide = torch.float32 if t.is_floating_point() else torch.int64
        return t.to(wide).contiguous(), t.dtype

    # -- primitives --------------------------------------------------------------
    def all_reduce(self, t, mesh_dim, op="sum"):
        _check_op(op)
        m, pg, _ = self._group(mesh_dim)
        buf, back = self._reducible(t)
        if pg is not None:
            self._run("all_reduce", m, lambda: dist.all_reduce(buf, op=_REDUCE_OP[op], group=pg))
        return buf if back is None else buf.to(back)

    def all_gather(self, t, mesh_dim):
        m, pg, ranks = self._group(mesh_dim)
        n = len(ranks)
        if pg is None:
            return t.detach().clone(memory_format=torch.contiguous_format).unsqueeze(0)
        buf, back = self._movable(t)
        flat = buf.reshape(-1)
        out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        self._run("all_gather", m, lambda: _all_gather_flat(out, flat, group=pg))
        out = out.view(n, *buf.shape)
        return out if back is None else out.view(back)

    def reduce_scatter(self, t, mesh_dim, op="sum"):
        _check_op(op)
        m, pg, ranks = self._group(mesh_dim)
        n = len(ranks)
        self.check_stacked(t, m, n, "reduce_scatter")
        if pg is None:
            return t[0].detach().clone(memory_format=torch.contiguous_format)
        buf, back = self._reducible(t)
        out = torch.empty(buf.shape[1:], dtype=buf.dtype, device=buf.device)
        self._run(
            "reduce_scatter", m,
            lambda: _reduce_scatter_flat(out.view(-1), buf.view(-1), op=_REDUCE_OP[op], group=pg),
        )
        return out if back is None else out.to(back)

    def all_to_all(self, t, mesh_dim):
        m, pg, ranks = self._group(mesh_dim)
        n = len(ranks)
        self.check_stacked(t, m, n, "all_to_all")
        if pg is None:
            return t.detach().clone(memory_format=torch.contiguous_format)
        buf, back = self._movable(t)
        flat = buf.reshape(-1)
        out = torch.empty_like(flat)
        self._run("all_to_all", m, lambda: dist.all_to_all_single(out, flat, group=pg))
        out = out.view(buf.shape)
        return out if back is None else out.view(back)

    def send_recv(self, t, mesh_dim, shift=1):
        m, pg, ranks = self._group(mesh_dim)
        n = len(ranks)
        if pg is None or shift % n == 0:
            return t.detach().clone(memory_format=torch.contiguous_format)
        i = ranks.index(self.rank)
        dst, src = (i + shift) % n, (i - shift) % n
        buf, back = self._movable(t)
        flat = buf.reshape(-1)
        k = flat.numel()
        out = torch.empty_like(flat)
        # One all_to_all with a single non-empty split each way: works on gloo and NCCL,
        # and cannot deadlock on send/recv ordering.
        in_splits = [k if j == dst else 0 for j in range(n)]
        out_splits = [k if j == src else 0 for j in range(n)]
        self._run(
            "send_recv", m,
            lambda: dist.all_to_all_single(out, flat, out_splits, in_splits, group=pg),
        )
        out = out.view(buf.shape)
        return out if back is None else out.view(back)

    def barrier(self):
        try:
            dist.barrier()
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"rank {self.rank}: barrier over all {self.mesh.size} ranks failed: {e}",
                                  rank=self.rank) from e

    def close(self) -> None:
        """Destroy the sub-groups this object created (the default group is left alone)."""
        owned, self._owned, self._groups = self._owned, [], None
        for pg in owned:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass


@contextmanager
def activate(mesh: Mesh):
    """Build :class:`TorchCollectives` for ``mesh`` and make it current process-wide.

    Collective: every rank of the default process group must enter it.
    """
    c = TorchCollectives(mesh)
    try:
        with using(c, process_wide=True):
            yield c
    finally:
        c.close()
