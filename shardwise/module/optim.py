"""Optimizers over the local shards of a ParallelModule, addressable by parameter name and rank.

    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)   # still an AdamW: step, zero_grad, param_groups,
    opt.step(); opt.zero_grad()                        # LR schedulers, state_dict() all work
    opt.shard_state("fc1.weight", rank=2)              # {"step", "exp_avg", "exp_avg_sq"} of rank 2's shard

``pm.optimizer(cls, ...)`` builds an instance of a subclass of ``cls`` that mixes in
:class:`ShardedOptimizer`: torch runs the update unchanged (elementwise optimizers such as
AdamW then update every shard exactly as one device updates the full tensor), and the mixin
knows which (rank, parameter name) every local shard is, so checkpoints can save, reshard
and load the state like the parameters (shardwise.module.checkpoint).
"""
from __future__ import annotations

import torch

from ..core.errors import ShardingError

__all__ = ["ShardedOptimizer", "make_optimizer"]


class ShardedOptimizer:
    """Mixin over a torch optimizer whose parameters are the local shards of a ParallelModule.

    ``shard_names``: ``{(rank, name): local shard}`` for every shard the optimizer updates.
    Addressing by name is what lets a checkpoint move the state to another mesh: the torch
    state is keyed by tensor, which means nothing once the mesh changes.
    """

    shard_names: dict
    _sw_mesh = None
    _sw_specs: dict

    def _sw_bind(self, pm) -> None:
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        self.shard_names = {(r, n): p for r in sorted(pm.shards) for n, p in pm.shards[r].items()
                            if id(p) in owned}
        self._sw_mesh, self._sw_specs = pm.mesh, pm.specs
        self._sw_ranks = sorted(pm.shards)

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


def make_optimizer(pm, cls, **kwargs):
    """``cls(local shards of every rank held here, **kwargs)``, addressable by name (ShardedOptimizer).

    ``cls`` must be a torch.optim.Optimizer subclass; elementwise ones (SGD, Adam, AdamW, ...)
    update each shard exactly as on one device.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ShardingError(f"pm.optimizer needs a torch.optim.Optimizer subclass, got {cls!r}",
                            fix="e.g. pm.optimizer(torch.optim.AdamW, lr=1e-3)")
    opt = _sharded_class(cls)(pm.parameters(), **kwargs)
    opt._sw_bind(pm)
    return opt
