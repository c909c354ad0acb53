"""Backends that run per-rank programs: ``threads`` (every rank in this process) and
``torch`` (this process's rank under torch.distributed). Both run the same programs.

Random ops draw from a per-rank generator that starts from the state a single-device
run would have, so dropout masks match one device for the same seed.
"""
from __future__ import annotations

import torch

from ..errors import ShardingError
from ..layout import Layout, Replicate
from ..mesh import Mesh
from .collectives import mark_failure, reduce_list, using, using_generator
from .inputs import gather_infos, leaf_infos
from .threads import run_threads


def _local_state(model, specs: dict, mesh: Mesh, rank: int) -> dict:
    """This rank's shards of the model's parameters (as Parameters) and buffers."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        lay = Layout(t.shape, t.dtype, specs[name])
        local = lay.local_view(t.detach(), mesh, rank).clone()
        out[name] = torch.nn.Parameter(local, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else local
    return out


def _flat_locals(plan, shards: dict, rank: int, inputs: tuple, targets: tuple, local: bool = False) -> list:
    """The program's arguments on ``rank``: local state, and this rank's chunk of each input/target
    (``local``: the inputs and targets are this rank's pieces already, checked by runtime/inputs.py).
    Plain tensor arguments, as traced, take the fast path (_ArgPlan): no pytree work per step."""
    fast = _ArgPlan.of(plan, rank)
    if fast is not None and not local and fast.fits(inputs, targets):
        return fast.args(shards[rank], inputs, targets)
    traced, mesh = plan.traced, plan.mesh
    state = shards[rank]
    params = {n: state[n] for n in traced.args.param_names}
    buffers = {n: state[n] for n in traced.args.buffer_names}
    flat = traced.args.flat(params, buffers, tuple(inputs), {}, tuple(targets))
    out = []
    for node, role, x in zip(traced.placeholder_nodes(), traced.placeholders, flat):
        if role.kind in ("input", "target") and not local:
            x = plan.prop.layouts[node.name][0].local_view(x, mesh, rank)
        out.append(x)
    return out


class _ArgPlan:
    """How rank ``rank``'s program arguments come from the local state and the step's
    positional tensors when the plan was traced with exactly those (no constants, no nesting):
    each input's local slice as ``narrow`` calls worked out once (None: the whole tensor).
    ``of`` returns None for other plans (nested inputs, dims split in groups): the pytree path."""

    def __init__(self, state_names: list, slices: list):
        self.state_names, self.slices = state_names, slices

    @classmethod
    def of(cls, plan, rank: int):
        cache = plan.__dict__.setdefault("_arg_plans", {})
        if rank not in cache:
            cache[rank] = cls._build(plan, rank)
        return cache[rank]

    @classmethod
    def _build(cls, plan, rank: int):
        traced = getattr(plan, "traced", None)
        if traced is None:
            return None
        a = traced.args
        for tree in (a.inputs, a.targets):
            if tree.tensor_idx != list(range(len(tree.leaves))):  # a constant leaf: checked per step
                return None
        if a.inputs.spec != _plain_spec(len(a.inputs.leaves)) or a.targets.spec != _plain_spec(len(a.targets.leaves),
                                                                                                  kwargs=False):
            return None
        slices = []
        for node, role in zip(traced.placeholder_nodes(), traced.placeholders):
            if role.kind not in ("input", "target"):
                continue
            lay = plan.prop.layouts[node.name][0]
            ext = lay.extents(plan.mesh, rank)
            if any(g != 1 for g, _, _ in ext):
                return None
            cuts = tuple((d, off, n) for d, (_, off, n) in enumerate(ext) if (off, n) != (0, lay.shape[d]))
            slices.append(cuts or None)
        return cls(list(a.param_names) + list(a.buffer_names), slices)

    def fits(self, inputs: tuple, targets: tuple) -> bool:
        return len(inputs) + len(targets) == len(self.slices) and all(
            type(x) is torch.Tensor for x in (*inputs, *targets))

    def args(self, state: dict, inputs: tuple, targets: tuple) -> list:
        out = [state[n] for n in self.state_names]
        for x, cuts in zip((*inputs, *targets), self.slices):
            if cuts is not None:
                for d, off, n in cuts:
                    x = x.narrow(d, off, n)
            out.append(x)
        return out


def _plain_spec(n: int, kwargs: bool = True):
    """The pytree spec of ``n`` positional tensors (and no keyword arguments), as traced."""
    import torch.utils._pytree as pytree

    leaves = tuple(torch.empty(0) for _ in range(n))
    return pytree.tree_flatten((leaves, {}) if kwargs else leaves)[1]


def _program(plan, rank: int):
    """Rank ``rank``'s program for this run: with the debug shape guards until one run of the
    plan on this rank has passed them (a plan's local shapes are fixed, so later runs would
    check the same shapes again), the plain program after that, or always without debug."""
    if plan.debug and rank not in plan.__dict__.get("_checked_ranks", ()):
        return plan.program_module(rank)
    return plan._unguarded(rank)


def _checked(plan, rank: int) -> None:
    """A run of ``plan`` on ``rank`` passed the shape guards: later runs skip them."""
    plan.__dict__.setdefault("_checked_ranks", set()).add(rank)


class ThreadsBackend:
    name = "threads"

    def __init__(self, mesh: Mesh, timeout: float = 120.0):
        self.mesh, self.timeout = mesh, timeout
        self.ranks = list(range(mesh.size))

    def shard_state(self, model, specs) -> dict:
        return {r: _local_state(model, specs, self.mesh, r) for r in self.ranks}

    def run(self, plan, shards, inputs, targets, local: dict | None = None) -> dict:
        """Run ``plan`` on every rank: {rank: program outputs}. ``local``: {rank: (inputs, targets)},
        each rank's own pieces (inputs="local"); else every rank slices the full ``inputs``/``targets``."""
        state = torch.random.get_rng_state()
        finals: dict = {}

        def body(rank):
            program = _program(plan, rank)
            args = (_flat_locals(plan, shards, rank, *local[rank], local=True) if local is not None
                    else _flat_locals(plan, shards, rank, inputs, targets))
            gen = torch.Generator()
            gen.set_state(state)
            with using_generator(gen), torch.no_grad():
                try:
                    out = program(*args)
                except BaseException as e:  # name this rank and node; run_threads stops the others
                    mark_failure(e, program, rank, "threads")
                    raise
            finals[rank] = gen.get_state()
            return list(out) if isinstance(out, (tuple, list)) else [out]

        for r in self.ranks:  # build programs up front, outside the timed collectives
            _program(plan, r)
        outs = run_threads(body, self.mesh, timeout=self.timeout)
        for r in self.ranks:
            _checked(plan, r)
        torch.random.set_rng_state(finals[0])
        return dict(enumerate(outs))

    def gather_infos(self, leaves_by_rank: dict, with_sums=True) -> dict:
        """{rank: [LeafInfo]} of every rank's input leaves: all ranks are here, no collective."""
        return {r: leaf_infos(leaves, with_sums) for r, leaves in leaves_by_rank.items()}

    def reduce(self, values: dict, op: str = "sum") -> torch.Tensor:
        """Reduce one tensor per rank over the whole mesh (rank order: deterministic)."""
        return reduce_list([values[r] for r in self.ranks], op)

    def broadcast_state(self, model) -> None:
        """One model serves every rank here: nothing to synchronise."""

    def gather(self, shards, name, placements, grad=False) -> torch.Tensor:
        from ..api_layout import collect

        locals_ = [shards[r][name].grad if grad else shards[r][name] for r in self.ranks]
        if grad and any(g is None for g in locals_):
            return None
        return collect([t.detach() for t in locals_], self.mesh, placements)


class TorchBackend:
    """This process's rank; the default process group must be initialised (torchrun, or
    ``shardwise.runtime.launch.spawn``). ``timeout``: seconds a collective waits for the other
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

    def shard_state(self, model, specs) -> dict:
        self.shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self._state = _local_state(model, specs, self.mesh, self.rank)
        return {self.rank: self._state}

    def run(self, plan, shards, inputs, targets, local: dict | None = None) -> dict:
        """Run this rank's program: {rank: outputs}. ``local``: {rank: (inputs, targets)}, this
        rank's own pieces (inputs="local"); else the full ``inputs``/``targets``, sliced here."""
        args = (_flat_locals(plan, shards, self.rank, *local[self.rank], local=True) if local is not None
                else _flat_locals(plan, shards, self.rank, inputs, targets))
        gen = torch.Generator()
        gen.set_state(torch.random.get_rng_state())
        program = _program(plan, self.rank)
        with using(self.comm, process_wide=True), using_generator(gen, process_wide=True), torch.no_grad():
            try:
                out = program(*args)
            except BaseException as e:  # the other ranks' collectives stop, naming this rank and node
                self.comm.report_failure(e, mark_failure(e, program, self.rank, "torch"))
                raise
        _checked(plan, self.rank)
        torch.random.set_rng_state(gen.get_state())
        return {self.rank: list(out) if isinstance(out, (tuple, list)) else [out]}

    def gather_infos(self, leaves_by_rank: dict, with_sums=True) -> dict:
        """{rank: [LeafInfo]} over the whole mesh: one small all-gather (collective)."""
        leaves = leaves_by_rank[self.rank]
        state = list(getattr(self, "_state", {}).values())
        device = next((t.device for t in [*state, *leaves]), torch.device("cpu"))  # NCCL gathers on the GPU
        return gather_infos(self.comm, leaf_infos(leaves, with_sums), device)

    def reduce(self, values: dict, op: str = "sum") -> torch.Tensor:
        """All-reduce this rank's tensor over the whole mesh (collective: every rank calls it)."""
        t = values[self.rank]
        for m in range(self.mesh.ndim):
            t = self.comm.all_reduce(t, m, op)
        return t

    def broadcast_state(self, model) -> None:
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

    def gather(self, shards, name, placements, grad=False) -> torch.Tensor:
        from ..lower.redistribute import redistribute_local

        t = shards[self.rank][name]
        t = t.grad if grad else t
        if t is None:
            return None
        lay = Layout(self.shapes[name], t.dtype, placements)
        return redistribute_local(t.detach(), lay, (Replicate(),) * self.mesh.ndim, self.mesh, self.comm, self.rank)


def make_backend(name, mesh: Mesh):
    if not isinstance(name, str):
        return name
    if name == "threads":
        return ThreadsBackend(mesh)
    if name == "torch":
        return TorchBackend(mesh)
    raise ShardingError(f"unknown backend {name!r}", fix="use backend='threads' or backend='torch'")
