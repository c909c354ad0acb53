"""Backends that run per-rank programs: ``threads`` (every rank in this process) and
``torch`` (this process's rank under torch.distributed). Both run the same programs, handed
to ``run`` ready with their arguments by the plan runner (shardwise/run/execute.py).

Random ops draw from a per-rank generator that starts from the state a single-device
run would have, so dropout masks match one device for the same seed.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.errors import ShardingError
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.scope import set_process_collectives
from .collectives import mark_failure, reduce_list, using_generator
from .inputs import gather_infos, leaf_infos
from .threads import run_threads


def _local_state(model, specs: dict, mesh: Mesh, rank: int, keep=None) -> dict:
    """This rank's shards of the model's parameters (as Parameters) and buffers (``keep(rank,
    name)``: only those it is true for; a pipeline stage's ranks hold that stage's)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if keep is not None and not keep(rank, name):
            continue
        lay = Layout(t.shape, t.dtype, specs[name])
        local = lay.local_view(t.detach(), mesh, rank).clone()
        out[name] = torch.nn.Parameter(local, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else local
    return out


class ThreadsBackend:
    name = "threads"

    def __init__(self, mesh: Mesh, timeout: float = 120.0):
        self.mesh, self.timeout = mesh, timeout
        self.ranks = list(range(mesh.size))

    def shard_state(self, model: torch.nn.Module, specs: dict, keep=None) -> dict:
        return {r: _local_state(model, specs, self.mesh, r, keep) for r in self.ranks}

    def run(self, programs: dict, args_of: Callable[[int], list], draws: bool = True) -> dict:
        """Run ``programs[rank](*args_of(rank))`` on every rank, one thread each: {rank: outputs}.
        ``draws=False``: the programs draw no random numbers (Plan.draws_random), so no rank needs a
        generator of its own and the default one's state is neither copied nor set back."""
        state = torch.random.get_rng_state() if draws else None
        finals: dict = {}

        def body(rank):
            program, args = programs[rank], args_of(rank)
            gen = None
            if draws:
                gen = torch.Generator()
                gen.set_state(state)
            with using_generator(gen), torch.no_grad():
                try:
                    out = program(*args)
                except BaseException as e:  # name this rank and node; run_threads stops the others
                    mark_failure(e, program, rank, "threads")
                    raise
            if draws:
                finals[rank] = gen.get_state()
            return list(out) if isinstance(out, (tuple, list)) else [out]

        outs = run_threads(body, self.mesh, timeout=self.timeout)
        if draws:
            torch.random.set_rng_state(finals[0])
        return dict(enumerate(outs))

    def gather_infos(self, leaves_by_rank: dict, with_sums: bool = True) -> dict:
        """{rank: [LeafInfo]} of every rank's input leaves: all ranks are here, no collective."""
        return {r: leaf_infos(leaves, with_sums) for r, leaves in leaves_by_rank.items()}

    def gather_rows(self, rows: dict) -> torch.Tensor:
        """Every rank's row (an int64 vector, one length on every rank) as [world size, len], rank order."""
        return torch.stack([rows[r] for r in self.ranks])

    def reduce(self, values: dict, op: str = "sum") -> torch.Tensor:
        """Reduce one tensor per rank over the whole mesh (rank order: deterministic)."""
        return reduce_list([values[r] for r in self.ranks], op)

    def broadcast_state(self, model: torch.nn.Module) -> None:
        """One model serves every rank here: nothing to synchronise."""


class TorchBackend:
    """This process's rank; the default process group must be initialised (torchrun, or
    ``shardwise.run.launch.spawn``). ``timeout``: seconds a collective waits for the other
    ranks before raising CollectiveError naming them (default 300, or
    ``$SHARDWISE_COLLECTIVE_TIMEOUT``); pass ``backend=TorchBackend(mesh, timeout=...)``."""

    name = "torch"

    def __init__(self, mesh: Mesh, timeout: float | None = None):
        import torch.distributed as dist

        from .distributed import TorchCollectives

        if not dist.is_available() or not dist.is_initialized():
            raise ShardingError("backend='torch' needs an initialised torch.distributed process group",
                                fix="launch with torchrun / `shardwise run --nproc N`, or use backend='threads'")
        mesh.check_world_size(dist.get_world_size())
        self.mesh = mesh
        self.comm = TorchCollectives(mesh, timeout)
        self.rank = dist.get_rank()
        self.ranks = [self.rank]

    def shard_state(self, model: torch.nn.Module, specs: dict, keep=None) -> dict:
        self.shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self._state = _local_state(model, specs, self.mesh, self.rank, keep)
        return {self.rank: self._state}

    def run(self, programs: dict, args_of: Callable[[int], list], draws: bool = True) -> dict:
        """Run this rank's ``programs[rank](*args_of(rank))``: {rank: outputs}. The program draws from
        a copy of the default generator, whose state the default one takes back after a run that
        completed; ``draws=False`` (Plan.draws_random: nothing draws, so that would leave the state
        as it was) skips the copies."""
        args = args_of(self.rank)
        program = programs[self.rank]
        if not draws:
            return {self.rank: self._call(program, args)}
        gen = torch.Generator()
        gen.set_state(torch.random.get_rng_state())
        with using_generator(gen, process_wide=True):
            out = self._call(program, args)
        torch.random.set_rng_state(gen.get_state())
        return {self.rank: out}

    def _call(self, program, args: list) -> list:
        """``program(*args)`` on this rank's collectives with grad mode off (what torch.no_grad()
        does, without its frames), as a list."""
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        outer = set_process_collectives(self.comm)  # (``using`` without a context manager's three calls)
        try:
            out = program(*args)
        except BaseException as e:  # the other ranks' collectives stop, naming this rank and node
            self.comm.report_failure(e, mark_failure(e, program, self.rank, "torch"))
            raise
        finally:
            set_process_collectives(outer)
            torch._C._set_grad_enabled(grad)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def gather_infos(self, leaves_by_rank: dict, with_sums: bool = True) -> dict:
        """{rank: [LeafInfo]} over the whole mesh: one small all-gather (collective)."""
        leaves = leaves_by_rank[self.rank]
        return gather_infos(self.comm, leaf_infos(leaves, with_sums), self.comm.facts_device)

    def gather_rows(self, rows: dict) -> torch.Tensor:
        """Every rank's row (an int64 vector, one length on every rank) as [world size, len], rank
        order, on the CPU: one small all-gather over every rank (collective: every rank calls it)."""
        return self.comm.world_gather(rows[self.rank].to(self.comm.facts_device)).cpu()

    def reduce(self, values: dict, op: str = "sum") -> torch.Tensor:
        """All-reduce this rank's tensor over the whole mesh (collective: every rank calls it)."""
        t = values[self.rank]
        for m in range(self.mesh.ndim):
            t = self.comm.all_reduce(t, m, op)
        return t

    def broadcast_state(self, model: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers into ``model`` on every rank (DDP's convention), one
        broadcast per dtype (collective: every rank calls it). Meta tensors (a model built for
        planning only) have no values to send and are skipped on every rank alike."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: dict = {}
        for _, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device.type != "meta":
                by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, _), ts in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            flat = _flatten_dense_tensors([t.detach() for t in ts])
            # waited for like every collective of the mesh: a rank that never builds its
            # ParallelModule is named after the backend timeout instead of hanging the others
            flat = self.comm.broadcast(flat, None, 0)
            with torch.no_grad():
                for t, v in zip(ts, _unflatten_dense_tensors(flat, ts)):
                    t.copy_(v)


Backend = ThreadsBackend | TorchBackend  # what run/execute.py and the ParallelModule hand programs to


def make_backend(name: str | Backend, mesh: Mesh) -> Backend:
    if not isinstance(name, str):
        return name
    if name == "threads":
        return ThreadsBackend(mesh)
    if name == "torch":
        return TorchBackend(mesh)
    raise ShardingError(f"unknown backend {name!r}", fix="use backend='threads' or backend='torch'")
