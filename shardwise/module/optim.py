"""Optimizers over the local shards of a ParallelModule, addressable by parameter name and rank.

    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)   # still an AdamW: step, zero_grad, param_groups,
    opt.step(); opt.zero_grad()                        # LR schedulers, state_dict() all work
    opt.shard_state("fc1.weight", rank=2)              # {"step", "exp_avg", "exp_avg_sq"} of rank 2's shard

``pm.optimizer(cls, ...)`` builds an instance of a subclass of ``cls`` that mixes in
:class:`ShardedOptimizer`: torch runs the update unchanged (elementwise optimizers such as
AdamW then update every shard exactly as one device updates the full tensor), and the mixin
knows which (rank, parameter name) every local shard is, so checkpoints can save, reshard
and load the state like the parameters (shardwise.module.checkpoint).

``pm.optimizer(cls, ..., skip_nonfinite=True)``: a step whose gradients hold a NaN or an
infinity anywhere on the mesh is skipped on every rank alike (one all-reduce of a flag decides),
counted in ``opt.skipped_steps`` (saved in checkpoints) and logged as a warning
(logger ``shardwise.optim``); parameters and optimizer state stay as they were.
"""
from __future__ import annotations

import logging

import torch

from ..core.errors import ShardingError

__all__ = ["ShardedOptimizer", "make_optimizer"]

log = logging.getLogger("shardwise.optim")


class ShardedOptimizer:
    """Mixin over a torch optimizer whose parameters are the local shards of a ParallelModule.

    ``shard_names``: ``{(rank, name): local shard}`` for every shard the optimizer updates.
    Addressing by name is what lets a checkpoint move the state to another mesh: the torch
    state is keyed by tensor, which means nothing once the mesh changes.
    """

    shard_names: dict
    _sw_mesh = None
    _sw_specs: dict
    skipped_steps: int = 0      # steps skipped for non-finite gradients (skip_nonfinite=True)
    _sw_skip_nonfinite = False

    def _sw_bind(self, pm) -> None:
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        self.shard_names = {(r, n): p for r in sorted(pm.shards) for n, p in pm.shards[r].items()
                            if id(p) in owned}
        self._sw_mesh, self._sw_specs = pm.mesh, pm.specs
        self._sw_ranks = sorted(pm.shards)
        self._sw_backend = pm.backend

    def step(self, closure=None):
        """The optimizer's own step; with ``skip_nonfinite``, none (on every rank) when a gradient
        anywhere on the mesh is not finite: counted in ``skipped_steps`` and logged."""
        if self._sw_skip_nonfinite and not self.grads_finite():
            self.skipped_steps += 1
            log.warning("optimizer step skipped: a gradient holds NaN or inf (%d step(s) skipped so far)",
                        self.skipped_steps)
            return None
        return _base_step(self, closure)

    def grads_finite(self) -> bool:
        """Whether every gradient of every rank is finite (collective on the torch backend: every
        rank gets the same answer)."""
        flags = {}
        for rank in self._sw_ranks:
            grads = [p.grad for (r, _), p in self.shard_names.items() if r == rank and p.grad is not None]
            ok = all(bool(torch.isfinite(g).all()) for g in grads)
            device = next((p.device for (r, _), p in self.shard_names.items() if r == rank), torch.device("cpu"))
            flags[rank] = torch.tensor(1.0 if ok else 0.0, device=device)
        return bool(self._sw_backend.reduce(flags, "min") > 0)

    @property
    def names(self) -> list[str]:
        """Parameter names this optimizer updates, in the order of its param groups (each once)."""
        out: dict = {}
        for _, name in self.shard_names:
            out.setdefault(name, None)
        return list(out)

    @property
    def ranks(self) -> list[int]:
        """The ranks whose shards this process holds (every rank on the threads backend)."""
        return list(self._sw_ranks)

    def shard(self, name: str, rank: int | None = None) -> torch.nn.Parameter:
        """The local shard of ``name`` on ``rank`` (default: the only rank held, on the torch backend)."""
        rank = self._sw_rank(rank)
        try:
            return self.shard_names[(rank, name)]
        except KeyError:
            raise ShardingError(f"the optimizer has no shard of parameter {name!r} on rank {rank}",
                                fix=f"use one of {self.names[:5]}... on ranks {self.ranks}") from None

    def shard_state(self, name: str, rank: int | None = None) -> dict:
        """The live torch state (``{"step", "exp_avg", ...}`` for AdamW) of one local shard."""
        return self.state[self.shard(name, rank)]

    def named_state(self) -> dict:
        """``{name: {rank: state}}`` for every shard held here (empty states before the first step)."""
        out: dict = {}
        for (rank, name), p in self.shard_names.items():
            out.setdefault(name, {})[rank] = self.state.get(p, {})
        return out

    def _sw_rank(self, rank: int | None) -> int:
        if rank is None:
            if len(self._sw_ranks) != 1:
                raise ShardingError(f"this process holds ranks {self._sw_ranks}; say which one",
                                    fix="pass rank=<int>")
            return self._sw_ranks[0]
        return rank


def _base_step(opt, closure):
    """The wrapped optimizer class's step, without torch's step-hook wrapper: torch wraps the
    step it finds on the class (ours) in one that runs the step hooks, and may have wrapped the
    base class's step too (when a plain instance was made): calling that would run them twice."""
    mro = type(opt).__mro__
    fn = next(vars(c)["step"] for c in mro[mro.index(ShardedOptimizer) + 1:] if "step" in vars(c))
    if getattr(fn, "hooked", False):
        fn = fn.__wrapped__
    return fn(opt, closure)


_CLASSES: dict = {}


def _sharded_class(cls: type) -> type:
    """``Sharded<cls>``: cls with the ShardedOptimizer mixin, made once per cls and registered in
    this module under a unique name so instances pickle and deep-copy."""
    if cls not in _CLASSES:
        name = f"Sharded{cls.__name__}"
        while name in globals() and globals()[name] is not _CLASSES.get(cls):
            name += "_"
        sub = type(name, (ShardedOptimizer, cls), {"__module__": __name__, "__doc__": cls.__doc__})
        sub.__qualname__ = name
        globals()[name] = _CLASSES[cls] = sub
    return _CLASSES[cls]


def make_optimizer(pm, cls, skip_nonfinite: bool = False, **kwargs):
    """``cls(local shards of every rank held here, **kwargs)``, addressable by name (ShardedOptimizer).

    ``cls`` must be a torch.optim.Optimizer subclass; elementwise ones (SGD, Adam, AdamW, ...)
    update each shard exactly as on one device. ``skip_nonfinite``: see the module docstring.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ShardingError(f"pm.optimizer needs a torch.optim.Optimizer subclass, got {cls!r}",
                            fix="e.g. pm.optimizer(torch.optim.AdamW, lr=1e-3)")
    opt = _sharded_class(cls)(pm.parameters(), **kwargs)
    opt._sw_bind(pm)
    opt._sw_skip_nonfinite = bool(skip_nonfinite)
    return opt
