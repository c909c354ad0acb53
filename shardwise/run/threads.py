"""The threads backend: one thread per rank in one process, in-memory collectives.

Every collective is an exchange: each member of the group deposits its tensor, waits at
a barrier, reads the others, and waits again before the slots are reused. Barriers time
out; the error names the ranks that did not arrive. A rank that raises aborts every
barrier so the other ranks stop at once with a RankFailedError naming it and the program
node it was at (``exc.shardwise_node``, set by the backend that ran the program), instead
of hanging.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback

import torch

from ..core.errors import CollectiveError, RankFailedError
from ..core.mesh import Mesh
from .collectives import Collectives, Handle, reduce_list, summary, using

DEFAULT_TIMEOUT_S = 60.0


class _Exchange:
    """Slots + barrier for one group of ranks."""

    def __init__(self, ranks: tuple[int, ...], world: "ThreadWorld"):
        self.ranks = ranks
        self.world = world
        self.slots: list = [None] * len(ranks)
        self.arrived: set[int] = set()
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(len(ranks))

    def _wait(self, rank: int, what: str):
        with self.lock:
            self.arrived.add(rank)
        try:
            self.barrier.wait(timeout=self.world.timeout)
        except threading.BrokenBarrierError:
            failed = self.world.failed_rank
            if failed is not None and failed != rank:
                raise RankFailedError(
                    f"rank {rank}: stopped in {what} because {self.world.failure}", rank=failed,
                    node=self.world.failed_node,
                ) from None
            with self.lock:
                missing = tuple(r for r in self.ranks if r not in self.arrived)
            raise CollectiveError(
                f"rank {rank}: {what} over ranks {list(self.ranks)} timed out after "
                f"{self.world.timeout:.1f}s; rank(s) {list(missing)} did not arrive",
                rank=rank,
                missing=missing,
            ) from None
        with self.lock:
            self.arrived.discard(rank)

    def exchange(self, rank: int, t: torch.Tensor, what: str, compute):
        """Deposit ``t``, then ``compute(all deposits)`` before anyone may reuse the slots."""
        i = self.ranks.index(rank)
        self.slots[i] = (what, t)
        self._wait(rank, what)
        kinds = {(w, x.dtype) for w, x in self.slots}
        try:
            if len(kinds) != 1:
                raise CollectiveError(
                    f"rank {rank}: mismatched collectives over ranks {list(self.ranks)}: "
                    f"{[(w, str(x.dtype), tuple(x.shape)) for w, x in self.slots]}",
                    rank=rank,
                )
            result = compute([x for _, x in self.slots])
        finally:
            self._wait(rank, what)
        return result


class ThreadWorld:
    """Shared state of all ranks of one threads-backend run."""

    def __init__(self, mesh: Mesh, timeout: float = DEFAULT_TIMEOUT_S):
        self.mesh = mesh
        self.timeout = timeout
        self.failed_rank: int | None = None
        self.failed_node: str | None = None
        self.failure = ""  # "rank R failed at node 'n' (Type: message)", said by the stopped ranks
        self.exchanges: dict[tuple[int, ...], _Exchange] = {}
        for m in range(mesh.ndim):
            for g in mesh.groups(m):
                self.exchanges[g] = _Exchange(g, self)
        everyone = tuple(range(mesh.size))
        self.exchanges.setdefault(everyone, _Exchange(everyone, self))
        self._mailboxes: dict = {}  # (src rank, dst rank, tag) -> queue of point-to-point messages
        self._mail_lock = threading.Lock()

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue:
        """The queue of messages ``src`` sends ``dst`` under ``tag`` (made on first use, by either side)."""
        key = (src, dst, tag)
        with self._mail_lock:
            if key not in self._mailboxes:
                self._mailboxes[key] = queue.Queue()
            return self._mailboxes[key]

    def abort(self, rank: int, exc: BaseException | None = None):
        """Rank ``rank`` failed with ``exc``: break every barrier so the others stop at once."""
        if self.failed_rank is None:
            self.failed_node = getattr(exc, "shardwise_node", None)
            where = f" at node '{self.failed_node}'" if self.failed_node else ""
            self.failure = f"rank {rank} failed{where}" + (f" ({summary(exc)})" if exc is not None else "")
            self.failed_rank = rank
        for ex in self.exchanges.values():
            ex.barrier.abort()


class ThreadCollectives(Collectives):
    def __init__(self, world: ThreadWorld, rank: int):
        super().__init__(world.mesh, rank)
        self.world = world

    def _exchange(self, t: torch.Tensor, mesh_dim: int | None, what: str, compute, stacked: bool = False):
        """``compute`` over the group's deposits (``mesh_dim=None``: every rank of the mesh)."""
        g = tuple(range(self.mesh.size)) if mesh_dim is None else self.mesh.group(mesh_dim, self.rank)
        if stacked:
            self.check_stacked(t, mesh_dim, len(g), what)

        def checked(got):
            shapes = {tuple(x.shape) for x in got}
            if len(shapes) != 1:
                raise CollectiveError(f"rank {self.rank}: {what} on mesh dim {mesh_dim} got shapes {sorted(shapes)}")
            return compute(got)

        return self.world.exchanges[g].exchange(self.rank, t, what, checked)

    def all_reduce(self, t, mesh_dim, op="sum"):
        return self._exchange(t, mesh_dim, "all_reduce", lambda got: reduce_list(got, op))

    def all_gather(self, t, mesh_dim):
        return self._exchange(t, mesh_dim, "all_gather", lambda got: torch.stack([x.clone() for x in got]))

    def reduce_scatter(self, t, mesh_dim, op="sum"):
        i = self.group_index(mesh_dim)
        return self._exchange(t, mesh_dim, "reduce_scatter", lambda got: reduce_list([x[i] for x in got], op), True)

    def all_to_all(self, t, mesh_dim):
        i = self.group_index(mesh_dim)
        return self._exchange(t, mesh_dim, "all_to_all", lambda got: torch.stack([x[i].clone() for x in got]), True)

    def all_to_all_uneven(self, t, mesh_dim, send_splits, recv_splits):
        i = self.group_index(mesh_dim)
        rows = t.detach().view(t.shape)  # a fresh alias carrying this member's splits to the others
        rows.shardwise_splits = tuple(int(s) for s in send_splits)

        def compute(got):
            parts = [x.split(list(x.shardwise_splits))[i] for x in got]
            if [p.shape[0] for p in parts] != [int(r) for r in recv_splits]:
                raise CollectiveError(f"rank {self.rank}: all_to_all_uneven on mesh dim {mesh_dim} expected rows "
                                      f"{list(recv_splits)}, members sent {[p.shape[0] for p in parts]}")
            return torch.cat([p.clone() for p in parts])

        g = self.mesh.group(mesh_dim, self.rank)
        return self.world.exchanges[g].exchange(self.rank, rows, "all_to_all_uneven", compute)

    def send_recv(self, t, mesh_dim, shift=1):
        n, i = self.group_size(mesh_dim), self.group_index(mesh_dim)
        return self._exchange(t, mesh_dim, "send_recv", lambda got: got[(i - shift) % n].clone())

    def broadcast(self, t, mesh_dim=None, src=0):
        return self._exchange(t, mesh_dim, "broadcast", lambda got: got[src].clone())

    def send(self, t, mesh_dim, peer, tag=0):
        """Point-to-point: a copy of ``t`` into the peer's mailbox; never blocks (queues are unbounded)."""
        dst = self.mesh.group(mesh_dim, self.rank)[peer]
        self.world.mailbox(self.rank, dst, tag).put(t.detach().clone())
        return Handle(value=None)

    def recv(self, shape, dtype, mesh_dim, peer, tag=0, device=None):
        """Point-to-point: a Handle whose ``wait()`` takes the next message ``peer`` sent under ``tag``,
        stopping with RankFailedError when another rank failed, CollectiveError after the timeout."""
        src = self.mesh.group(mesh_dim, self.rank)[peer]
        box = self.world.mailbox(src, self.rank, tag)
        what = f"recv from rank {src} (tag {tag})"

        def finish():
            deadline = time.monotonic() + self.world.timeout
            while True:
                try:
                    got = box.get(timeout=0.05)
                    break
                except queue.Empty:
                    pass
                failed = self.world.failed_rank
                if failed is not None and failed != self.rank:
                    raise RankFailedError(f"rank {self.rank}: stopped in {what} because {self.world.failure}",
                                          rank=failed, node=self.world.failed_node)
                if time.monotonic() > deadline:
                    raise CollectiveError(f"rank {self.rank}: {what} timed out after {self.world.timeout:.1f}s; "
                                          f"rank {src} sent nothing", rank=self.rank, missing=(src,))
            if tuple(got.shape) != tuple(shape) or got.dtype != dtype:
                raise CollectiveError(f"rank {self.rank}: {what} expected {tuple(shape)} {dtype}, got "
                                      f"{tuple(got.shape)} {got.dtype}", rank=self.rank)
            return got

        return Handle(finish)

    def barrier(self):
        self._exchange(torch.empty(0), None, "barrier", lambda got: None)


def run_threads(fn, mesh: Mesh, *, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(rank)`` on one thread per rank (rank 0 on the calling thread) with that rank's
    collectives current.

    Returns the results in rank order. If any rank raises, the others are stopped (their
    collectives raise RankFailedError naming it) and the first failure is re-raised with a
    note naming its rank, the node it was at (``exc.shardwise_node``, set by the backend that
    ran the program) and where every other rank stopped.
    """
    world = ThreadWorld(mesh, timeout)
    results: list = [None] * mesh.size
    errors: dict[int, BaseException] = {}

    def body(rank: int):
        try:
            with using(ThreadCollectives(world, rank)):
                results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below, naming the rank
            errors[rank] = e
            e.__shardwise_tb__ = traceback.format_exc()
            # A timeout is reported by every waiting rank itself; only real failures abort the others.
            if not isinstance(e, CollectiveError) or e.missing == ():
                if not isinstance(e, RankFailedError):
                    world.abort(rank, e)

    # rank 0 runs on the calling thread: one thread fewer to start per run (a 1-rank mesh starts
    # none), and a profiler or debugger on the caller sees rank 0's work
    threads = [threading.Thread(target=body, args=(r,), name=f"shardwise-rank{r}") for r in range(1, mesh.size)]
    for t in threads:
        t.start()
    body(0)
    for t in threads:
        t.join()
    if errors:
        raise _primary(errors, mesh.size)
    return results


def _primary(errors: dict, size: int) -> BaseException:
    """The first real failure (not a rank stopped by it), with notes naming its rank and node
    and where each stopped rank was."""
    primary = {r: e for r, e in errors.items() if not isinstance(e, RankFailedError)} or errors
    rank = min(primary)
    err = primary[rank]
    if hasattr(err, "add_note"):
        if getattr(err, "shardwise_rank", None) is None:
            node = getattr(err, "shardwise_node", None)
            where = f" at node '{node}'" if node else ""
            err.add_note(f"shardwise: raised on rank {rank} of {size}{where} (threads backend)")
        stopped = [f"rank {r}" + (f" at node '{e.shardwise_node}'" if getattr(e, "shardwise_node", None) else "")
                   for r, e in sorted(errors.items()) if r != rank and isinstance(e, RankFailedError)]
        if stopped:
            err.add_note("shardwise: the other ranks stopped: " + ", ".join(stopped))
    return err
