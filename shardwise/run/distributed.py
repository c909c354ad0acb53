"""The torch backend: collectives over torch.distributed process groups, one per mesh dim.

``TorchCollectives(mesh)`` uses the already-initialised default process group (gloo on
CPU, NCCL on GPU; buffers live on the input tensor's device). Every process creates the
same sub-groups in the same order, so the constructor is itself collective: call it on
every rank. ``activate(mesh)`` builds one and makes it current for the whole process.

Nothing waits forever. Each collective is issued asynchronously and waited for in slices:
one that completes within ``FIRST_WAIT_S`` (the usual case) costs nothing more. A rank that
waits longer writes where it waits into the process group's store and, every ``POLL_S``,
looks there for a failure record; a rank whose program raised writes one (rank, node,
error) before raising, so the waiting ranks stop with a
:class:`~shardwise.core.errors.RankFailedError` naming it. After ``timeout`` seconds a waiting
rank raises :class:`~shardwise.core.errors.CollectiveError` naming the ranks that did not arrive
(from their arrival records) and records its own failure, so ranks that arrive later stop
too. A failure of the underlying collective (a peer's process died) is re-raised the same
way. On CUDA tensors (NCCL) the wait enqueues on the stream and returns at once, so these
checks do not apply there; NCCL's own watchdog and the process group's timeout do.

After a collective failed, the process group is out of step (gloo may still hold the
operation): end the job. At interpreter exit every process group this module saw is
destroyed, sub-groups first, while Python is still whole (see ``_teardown``).
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import itertools
import json
import sys
import time
import types
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..core.errors import CollectiveError, ConfigError, RankFailedError
from ..core.mesh import Mesh
from .collectives import REDUCE_OPS, Collectives, Handle, default_timeout, summary, using

# A collective that completes within this many seconds costs no store traffic.
FIRST_WAIT_S = 0.05
# How often a waiting rank looks in the store for another rank's failure.
POLL_S = 0.25
_FAILED_KEY = "shardwise/failed"
_AT_KEY = "shardwise/at/{rank}"
_instances = itertools.count()

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


def movable(t: torch.Tensor):
    """A contiguous buffer gloo moves byte-exactly, and the dtype to view it back as (or None)."""
    t = t.contiguous()
    if t.device.type != "cpu" or t.dtype in _GLOO_OK or t.is_complex():
        return t, None
    return t.view(_SAME_WIDTH[t.element_size()]), t.dtype


def _check_op(op: str) -> None:
    if op not in _REDUCE_OP:
        raise ConfigError(f"unknown reduce op {op!r}", fix=f"use one of {REDUCE_OPS}")


def _seconds(t: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(t, 0.001))


def _abandon(work, pg) -> None:
    """Give up on a collective that has not completed: keep its Work and process group alive
    for good (one extra reference each), so neither is destroyed while gloo still runs the
    operation. Destroying them would wait for it (the process could not exit until every
    peer had), and a Work freed by its worker thread during interpreter finalisation aborts
    the process (see _teardown)."""
    for obj in (work, pg):
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _cpu_capable() -> bool:
    """Whether the default process group moves CPU tensors (gloo, or "cpu:gloo,cuda:nccl")."""
    return "gloo" in str(dist.get_backend())


def _timed(t: torch.Tensor) -> bool:
    """Whether a collective on ``t`` is waited for in timed slices (CPU: gloo; not CUDA: NCCL)."""
    return t.device.type == "cpu"


def _finished(work, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``work``: True once it completed (raising its own error if it
    failed), False if it is still running."""
    try:
        work.wait(timeout=_seconds(seconds))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False  # "Operation timed out!": the operation itself is still under way
    work.wait()  # it completed (perhaps just after the timed wait gave up): its own outcome
    return True


class _Watch:
    """Arrival and failure records in the process group's store (see the module docstring).

    Keys are shared by every TorchCollectives of the job: one failure record (the first
    failure wins) and, per rank, where it last waited longer than FIRST_WAIT_S."""

    def __init__(self, rank: int):
        self.rank = rank
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
        except Exception:  # noqa: BLE001 - no store: waits still time out, without names
            self.store = None

    def _get(self, key: str):
        """The JSON record under ``key``, or None (absent, or the store is gone)."""
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key).decode())
        except Exception:  # noqa: BLE001 - the store's host may have exited
            return None

    def arrived(self, where: dict) -> None:
        if self.store is not None:
            try:
                self.store.set(_AT_KEY.format(rank=self.rank), json.dumps(where))
            except Exception:  # noqa: BLE001
                pass

    def failed(self, rank: int, node: str | None, error: str) -> None:
        """Record a failure unless one is recorded already (the first one is the cause)."""
        if self.store is not None:
            try:
                self.store.compare_set(_FAILED_KEY, "", json.dumps({"rank": rank, "node": node, "error": error}))
            except Exception:  # noqa: BLE001
                pass

    def peer_failure(self) -> dict | None:
        got = self._get(_FAILED_KEY)
        return got if got is not None and got.get("rank") != self.rank else None

    def absent(self, where: dict, ranks) -> tuple[tuple[int, ...], list[str]]:
        """Members of ``ranks`` with no arrival record at ``where``, and where each was seen last."""
        missing, seen = [], []
        for r in ranks:
            if r == self.rank:
                continue
            at = self._get(_AT_KEY.format(rank=r))
            if at is not None and all(at.get(k) == where[k] for k in ("id", "dim", "seq")):
                continue
            missing.append(r)
            if at is not None:
                seen.append(f"rank {r} last waited in {at['what']} #{at['seq']} on mesh dim {at['dim']}")
        return tuple(missing), seen


class TorchCollectives(Collectives):
    """Collectives of this process's rank over the groups of ``mesh`` (torch.distributed).

    ``timeout``: seconds one collective waits for the other ranks before raising
    CollectiveError (default: ``shardwise.run.collectives.default_timeout()``, 300 s or
    ``$SHARDWISE_COLLECTIVE_TIMEOUT``)."""

    def __init__(self, mesh: Mesh, timeout: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError(
                "torch.distributed is not initialised; call torch.distributed.init_process_group "
                "first (or launch with shardwise.run.launch.spawn / torchrun)"
            )
        timeout = default_timeout() if timeout is None else timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}", fix="e.g. 300")
        mesh.check_world_size(dist.get_world_size())
        super().__init__(mesh, dist.get_rank())
        self.timeout = float(timeout)
        self._id = next(_instances)  # the constructor is collective: the same number on every rank
        self._seq = [0] * (mesh.ndim + 1)  # per mesh dim, and the world barrier last
        self._watch = _Watch(self.rank)
        # Per mesh dim: (process group or None when the group has one member, its ranks).
        self._groups: list[tuple[object, tuple[int, ...]]] | None = []
        self._owned: list = []
        self._pending: dict = {}  # started, not yet waited collectives: key -> (Work, process group)
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
        # Facts the host reads at once (the ranks' input shapes and checksums, a plan's
        # fingerprint) travel as CPU tensors: gathered on a GPU and read back, they would wait for
        # every kernel queued before them (a device sync a step with inputs="local"). A default
        # group that cannot move CPU tensors (NCCL alone) gets a gloo group beside it for them.
        # (only a group of its own is held here: a reference to the default group would keep its
        # worker threads alive past teardown, see _teardown)
        self._facts_pg, self._facts_cpu = None, _cpu_capable()
        if not self._facts_cpu and dist.is_gloo_available():
            self._facts_pg, self._facts_cpu = dist.new_group(backend="gloo"), True
            self._owned.append(self._facts_pg)
        _watch_exit(self)

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

    @property
    def facts_device(self) -> torch.device:
        """Where ``world_gather``'s facts travel: the CPU, unless no group here moves CPU tensors
        (NCCL without gloo: then the device, read back with a sync)."""
        return torch.device("cpu") if self._facts_cpu else torch.device("cuda", torch.cuda.current_device())

    def world_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every rank as [world size, *t.shape] in rank order: one all_gather over every
        rank, whatever the mesh's number of dims (CPU tensors over the facts group)."""
        pg = None
        if self.mesh.size > 1:
            pg = self._facts_pg if t.device.type == "cpu" and self._facts_pg is not None else dist.group.WORLD
        return self._start_gather(t, self.mesh.ndim, pg, tuple(range(self.mesh.size))).wait()

    def group_size(self, mesh_dim) -> int:
        return self.mesh.shape[self._dim(mesh_dim)]

    def group_index(self, mesh_dim) -> int:
        return self.mesh.coord(self.rank)[self._dim(mesh_dim)]

    def _run(self, what: str, m: int, issue, ranks=None, pg=None, timed: bool | None = None) -> None:
        """Issue one collective (``issue()`` returns its async Work) on mesh dim ``m`` over
        ``ranks`` (process group ``pg``; the world barrier: ``m == mesh.ndim``) and wait for
        it without ever hanging: RankFailedError once another rank recorded a failure,
        CollectiveError naming the ranks that did not arrive after ``timeout`` seconds.
        ``timed=False`` (CUDA buffers: NCCL) waits plainly: a timed wait there blocks the CPU
        and a timeout aborts the communicator; None: timed when ``pg`` is a gloo group."""
        ranks = tuple(range(self.mesh.size)) if ranks is None else tuple(ranks)
        self._seq[m] += 1
        where = {"id": self._id, "dim": m, "seq": self._seq[m], "what": what}
        on = "over the whole mesh" if m == self.mesh.ndim else f"on mesh dim {m} over ranks {list(ranks)}"
        if timed is None:
            timed = dist.get_backend(pg) == "gloo"
        work = None
        try:
            work = issue()
            if work is None:
                return
            if not timed:
                work.wait()
                return
            if _finished(work, FIRST_WAIT_S) or self._wait(work, where, on, ranks):
                return
        except CollectiveError:
            if work is not None and not work.is_completed():
                _abandon(work, pg)
            raise
        except (RuntimeError, ValueError) as e:  # DistBackendError / DistError are RuntimeErrors
            self._stop_if_peer_failed(what, on)
            missing, seen = self._absent(where, ranks)
            lost = f"; rank(s) {list(missing)} did not arrive" if missing else ""
            raise self._failure(CollectiveError(
                f"rank {self.rank}: {what} {on} failed{lost}: {e}" + "".join(f"; {x}" for x in seen),
                rank=self.rank, missing=missing)) from e
        _abandon(work, pg)
        missing, seen = self._absent(where, ranks)
        raise self._failure(CollectiveError(
            f"rank {self.rank}: {what} {on} timed out after {self.timeout:.1f}s; rank(s) {list(missing)} did "
            "not arrive" + "".join(f"; {x}" for x in seen)
            + " (is a collective that every rank must call called on some ranks only?)",
            rank=self.rank, missing=missing))

    def _wait(self, work, where: dict, on: str, ranks) -> bool:
        """The slow path: say where this rank waits, then wait in slices, looking for another
        rank's failure between them. True once the work completed, False at the timeout."""
        self._watch.arrived(where)
        deadline = time.monotonic() + self.timeout - FIRST_WAIT_S
        while True:
            self._stop_if_peer_failed(where["what"], on)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if _finished(work, min(POLL_S, left)):
                return True

    def _absent(self, where, ranks):
        missing, seen = self._watch.absent(where, ranks)
        if missing:  # a rank that arrived just now may not have written its record yet
            time.sleep(2 * FIRST_WAIT_S)
            missing, seen = self._watch.absent(where, ranks)
        return missing, seen

    def _stop_if_peer_failed(self, what: str, on: str) -> None:
        got = self._watch.peer_failure()
        if got is None:
            return
        where = f" at node '{got['node']}'" if got.get("node") else ""
        raise RankFailedError(
            f"rank {self.rank}: stopped in {what} {on} because rank {got['rank']} failed{where} ({got['error']})",
            rank=got["rank"], node=got.get("node"))

    def _failure(self, err: CollectiveError) -> CollectiveError:
        """Record this rank's own collective failure so ranks that arrive later stop too."""
        self.report_failure(err)
        return err

    def report_failure(self, exc: BaseException, node: str | None = None) -> None:
        """Tell the other ranks that this rank failed (at ``node``), so their waiting
        collectives raise RankFailedError naming it. A rank that was itself stopped by
        another's failure records nothing (the first failure is the cause)."""
        pending, self._pending = self._pending, {}  # started collectives this rank will not wait for
        for work, pg in pending.values():
            if not work.is_completed():
                _abandon(work, pg)
        if isinstance(exc, RankFailedError) or getattr(exc, "_shardwise_reported", False):
            return
        self._watch.failed(self.rank, node if node is not None else getattr(exc, "shardwise_node", None),
                           summary(exc))
        try:
            exc._shardwise_reported = True
        except AttributeError:
            pass

    @staticmethod
    def _reducible(t: torch.Tensor):
        """A contiguous buffer the backend can reduce (``t`` itself where it is one), and the dtype
        to cast back to."""
        t = t.detach()
        if t.device.type != "cpu" or t.dtype in _GLOO_OK or t.is_complex():
            return t.contiguous(), None
        wide = torch.float32 if t.is_floating_point() else torch.int64
        return t.to(wide).contiguous(), t.dtype

    # -- primitives --------------------------------------------------------------
    def all_reduce(self, t, mesh_dim, op="sum"):  # on a copy: the caller's ``t`` stays as it was
        return self.start_all_reduce(t.detach().clone(memory_format=torch.contiguous_format), mesh_dim, op).wait()

    def start_all_reduce(self, t, mesh_dim, op="sum"):
        """Launch an all_reduce now (async Work) and return a Handle whose ``wait()`` waits for
        it through ``_run`` (timed waits, a failed peer named, a launch error raised there);
        ``t`` is the caller's own buffer: reduced in place when gloo can reduce its dtype."""
        _check_op(op)
        m, pg, ranks = self._group(mesh_dim)
        if pg is None:
            return Handle(value=t)
        buf, back = self._reducible(t)
        return self._start("all_reduce", m, lambda: dist.all_reduce(buf, op=_REDUCE_OP[op], group=pg, async_op=True),
                           ranks, pg, _timed(buf), lambda: buf if back is None else buf.to(back))

    def _start(self, what: str, m: int, launch, ranks, pg, timed: bool, result) -> Handle:
        """Launch one collective now (``launch()`` returns its async Work) and return a Handle
        whose ``wait()`` waits for it through ``_run`` (timed waits, a failed peer named; an
        error raised by the launch is raised there) and returns ``result()``. Until waited, the
        Work is kept in ``_pending``: a rank that fails abandons it (report_failure), so no
        teardown waits for an operation a stopped peer will never join."""
        try:
            work, err = launch(), None
        except (RuntimeError, ValueError) as e:
            work, err = None, e
        key = object()
        if work is not None:
            self._pending[key] = (work, pg)

        def issue():
            if err is not None:
                raise err
            return work

        def finish():
            self._pending.pop(key, None)
            self._run(what, m, issue, ranks, pg, timed)
            return result()

        return Handle(finish)

    def start_reduce_scatter(self, t, mesh_dim, op="sum"):
        """Launch a reduce_scatter now (async Work); a Handle as start_all_reduce's."""
        _check_op(op)
        m, pg, ranks = self._group(mesh_dim)
        self.check_stacked(t, m, len(ranks), "reduce_scatter")
        if pg is None:
            return Handle(value=t[0])
        buf, back = self._reducible(t)
        out = torch.empty(buf.shape[1:], dtype=buf.dtype, device=buf.device)
        return self._start(
            "reduce_scatter", m,
            lambda: _reduce_scatter_flat(out.view(-1), buf.view(-1), op=_REDUCE_OP[op], group=pg, async_op=True),
            ranks, pg, _timed(buf), lambda: out if back is None else out.to(back))

    def start_all_gather(self, t, mesh_dim):
        """Launch an all_gather now (async Work); a Handle as start_all_reduce's."""
        return self._start_gather(t, *self._group(mesh_dim))

    def _start_gather(self, t, m: int, pg, ranks) -> Handle:
        """An all_gather of ``t`` over ``ranks`` (process group ``pg``, None: this rank alone)
        on mesh dim ``m`` (the whole mesh: ``mesh.ndim``), launched."""
        if pg is None:
            return Handle(value=t.detach().clone(memory_format=torch.contiguous_format).unsqueeze(0))
        buf, back = movable(t.detach())
        flat = buf.reshape(-1)
        out = torch.empty(len(ranks) * flat.numel(), dtype=flat.dtype, device=flat.device)
        got = out.view(len(ranks), *buf.shape)
        return self._start("all_gather", m, lambda: _all_gather_flat(out, flat, group=pg, async_op=True), ranks, pg,
                           _timed(flat), lambda: got if back is None else got.view(back))

    def all_gather(self, t, mesh_dim):
        return self.start_all_gather(t, mesh_dim).wait()  # launched and waited at once: the same result

    def reduce_scatter(self, t, mesh_dim, op="sum"):  # on a copy (gloo may use its input as scratch)
        mine = t.detach().clone(memory_format=torch.contiguous_format)
        return self.start_reduce_scatter(mine, mesh_dim, op).wait()

    def all_to_all(self, t, mesh_dim):
        _, _, ranks = self._group(mesh_dim)
        self.check_stacked(t, self._dim(mesh_dim), len(ranks), "all_to_all")
        return self._rows_to_all("all_to_all", mesh_dim, t, [1] * len(ranks), [1] * len(ranks))

    def all_to_all_uneven(self, t, mesh_dim, send_splits, recv_splits):
        return self._rows_to_all("all_to_all_uneven", mesh_dim, t, send_splits, recv_splits)

    def send_recv(self, t, mesh_dim, shift=1):
        _, _, ranks = self._group(mesh_dim)
        n, i = len(ranks), ranks.index(self.rank)
        if shift % n == 0:
            return t.detach().clone(memory_format=torch.contiguous_format)
        # ``t`` as one row, in one all_to_all with a single non-empty split each way: works on
        # gloo and NCCL, and cannot deadlock on send/recv ordering.
        to, frm = [int(j == (i + shift) % n) for j in range(n)], [int(j == (i - shift) % n) for j in range(n)]
        return self._rows_to_all("send_recv", mesh_dim, t.detach().reshape(1, t.numel()), to, frm).view(t.shape)

    def _rows_to_all(self, what: str, mesh_dim, t, send_splits, recv_splits):
        """One all_to_all_single of the rows (dim 0) of ``t``: the next ``send_splits[j]`` rows to
        member j; returns [sum(recv_splits), *s], member j's rows at position j."""
        m, pg, ranks = self._group(mesh_dim)
        if pg is None:
            return t.detach().clone(memory_format=torch.contiguous_format)
        buf, back = movable(t.detach())
        width = buf.shape[1:].numel()
        flat = buf.reshape(buf.shape[0], width)
        out = torch.empty(sum(recv_splits), width, dtype=flat.dtype, device=flat.device)
        ins, outs = [int(s) for s in send_splits], [int(r) for r in recv_splits]
        self._run(what, m, lambda: dist.all_to_all_single(out, flat, outs, ins, group=pg, async_op=True),
                  ranks, pg, _timed(flat))
        out = out.view(out.shape[0], *buf.shape[1:])
        return out if back is None else out.view(back)

    def broadcast(self, t, mesh_dim=None, src=0):
        m, pg, ranks = (self.mesh.ndim, dist.group.WORLD, None) if mesh_dim is None else self._group(mesh_dim)
        if pg is None:
            return t.detach().clone(memory_format=torch.contiguous_format)
        buf, back = movable(t.detach().clone(memory_format=torch.contiguous_format))
        self._run("broadcast", m, lambda: dist.broadcast(buf, src=src if ranks is None else ranks[src], group=pg,
                                                         async_op=True), ranks, pg, _timed(buf))
        return buf if back is None else buf.view(back)

    def barrier(self):
        self._run("barrier", self.mesh.ndim, lambda: dist.barrier(async_op=True), None, dist.group.WORLD)

    # -- point to point (a pipeline's stages) ---------------------------------------------
    def send(self, t, mesh_dim, peer, tag=0):
        """Launch ``t`` to group member ``peer`` (torch.distributed.batch_isend_irecv over the mesh
        dim's group); the Handle waits for the send like a collective (never forever)."""
        (handle,) = self.p2p(mesh_dim, sends=[(t, peer, tag)])
        return handle

    def recv(self, shape, dtype, mesh_dim, peer, tag=0, device=None):
        (handle,) = self.p2p(mesh_dim, recvs=[(shape, dtype, peer, tag, device)])
        return handle

    def p2p(self, mesh_dim, sends=(), recvs=()) -> list:
        """Launch point-to-point ``sends`` ([(tensor, peer, tag)]) and ``recvs`` ([(shape, dtype, peer,
        tag, device)]) along ``mesh_dim`` in one batch_isend_irecv; one Handle each, sends first (a
        recv's ``wait()`` returns its tensor). Waits are timed in slices and stop when another rank
        recorded a failure, as every collective's; they keep no sequence number of the mesh dim
        (ranks send different numbers of messages)."""
        m, pg, ranks = self._group(mesh_dim)
        if pg is None:
            raise CollectiveError(f"rank {self.rank}: point-to-point on mesh dim {m}, which has one member",
                                  rank=self.rank)
        ops, done = [], []
        for t, peer, tag in sends:
            buf, _ = movable(t.detach())
            ops.append(dist.P2POp(dist.isend, buf, ranks[peer], pg, tag))
            done.append((f"send to rank {ranks[peer]} (tag {tag})", ranks[peer], buf, None))
        for shape, dtype, peer, tag, device in recvs:
            want = torch.empty(tuple(shape), dtype=dtype, device=device or "cpu")
            buf, back = movable(want)
            ops.append(dist.P2POp(dist.irecv, buf, ranks[peer], pg, tag))
            done.append((f"recv from rank {ranks[peer]} (tag {tag})", ranks[peer], buf, back))
        works = dist.batch_isend_irecv(ops) if ops else []
        return [self._p2p_handle(w, what, peer, buf, back, pg, send=i < len(sends))
                for i, (w, (what, peer, buf, back)) in enumerate(zip(works, done))]

    def _p2p_handle(self, work, what: str, peer: int, buf, back, pg, send: bool) -> Handle:
        key = object()
        self._pending[key] = (work, pg)

        def finish():
            self._pending.pop(key, None)
            try:
                self._wait_p2p(work, what, peer, pg, _timed(buf))
            except (RuntimeError, ValueError) as e:  # the peer's process died (DistBackendError)
                self._stop_if_peer_failed(what, "point to point")
                raise self._failure(CollectiveError(f"rank {self.rank}: {what} failed: {e}", rank=self.rank,
                                                    missing=(peer,))) from e
            if send:
                return None
            return buf if back is None else buf.view(back)

        return Handle(finish)

    def _wait_p2p(self, work, what: str, peer: int, pg, timed: bool) -> None:
        """Wait for a point-to-point Work, at most ``timeout`` seconds. One wait: gloo runs a send or
        recv inside ``wait`` (``is_completed`` stays False until then) and a timed wait that expires
        closes the pair ("Application timeout caused pair closure"), so no slices; a peer that died
        closes the pair and the wait raises (the caller names a recorded failure)."""
        if not timed:
            work.wait()
            return
        try:
            work.wait(timeout=_seconds(self.timeout))
        except RuntimeError:
            self._stop_if_peer_failed(what, "point to point")
            if work.is_completed():
                raise
            _abandon(work, pg)
            raise self._failure(CollectiveError(f"rank {self.rank}: {what} timed out after {self.timeout:.1f}s",
                                                rank=self.rank, missing=(peer,))) from None

    def close(self) -> None:
        """Destroy the sub-groups this object created (the default group is left alone)."""
        owned, self._owned, self._groups, self._facts_pg = self._owned, [], None, None
        for pg in owned:
            _destroy(pg)


# -- teardown at exit ---------------------------------------------------------------------
# The cause of "terminate called without an active exception" (SIGABRT) after correct output:
# a process that ends without destroy_process_group() leaves gloo's worker threads alive into
# interpreter finalisation. A worker that drops its last finished Work only then releases the
# Work's tensors; a tensor whose Python object Python already let go of must take the GIL to
# free it, and a thread taking the GIL during finalisation is ended with pthread_exit, whose
# unwinding through the Work's noexcept destructor calls std::terminate (backtrace: take_gil
# -> PyThread_exit_thread -> ~AsyncAllgatherWork -> ProcessGroupGloo::runLoop). It is a race
# with the worker thread, so it shows under load, about one run in twenty. Destroying the
# process groups while Python is still whole (atexit runs before finalisation) joins those
# threads first: shardwise's sub-groups, then the default group. A collective given up on
# after a failure keeps its Work and group alive for good (_abandon), so this never waits
# for an operation a peer will not finish.
# destroy_process_group only unregisters a group: its worker threads stop when the group's
# last Python reference goes. torch modules imported after init_process_group hold such
# references in their functions' default arguments (``group=group.WORLD`` in
# torch.distributed.nn.functional, imported by the first FakeTensorMode through torch._dynamo),
# which would otherwise outlive teardown into finalisation: _release_default_groups drops them.
_live: "weakref.WeakSet[TorchCollectives]" = weakref.WeakSet()
_state = {"registered": False}


def _watch_exit(c: "TorchCollectives") -> None:
    _live.add(c)
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(_teardown)


def _destroy(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - already destroyed (e.g. by destroy_process_group())
        pass


def _teardown() -> None:
    """atexit: destroy every process group in order (sub-groups, then the default group) and drop
    the references that keep their worker threads alive, also after a script's own
    destroy_process_group() (which only unregisters the groups: examples/torchrun_train.py)."""
    if not dist.is_available():
        return
    for c in list(_live):
        c.close()
    if dist.is_initialized():
        _destroy(None)
    _release_default_groups()


def _release_default_groups() -> None:
    """Replace process groups held as default arguments of torch.distributed's functions by None."""
    pg_type = dist.ProcessGroup
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for fn in list(vars(module).values()):
            defaults = fn.__defaults__ if type(fn) is types.FunctionType else None
            if defaults and any(isinstance(d, pg_type) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, pg_type) else d for d in defaults)


@contextmanager
def activate(mesh: Mesh, timeout: float | None = None):
    """Build :class:`TorchCollectives` for ``mesh`` and make it current process-wide.

    Collective: every rank of the default process group must enter it.
    """
    c = TorchCollectives(mesh, timeout)
    try:
        with using(c, process_wide=True):
            yield c
    finally:
        c.close()
