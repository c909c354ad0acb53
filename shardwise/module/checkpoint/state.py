"""Sharded state dicts of a ParallelModule and its optimizer, in the layout DCP jobs use.

    {"model": {state-dict key: ShardChunks},
     "optim": {"state": {param name: {"step": tensor, "exp_avg": ShardChunks, ...}},
               "param_groups": [{"lr": ..., ..., "params": [param names]}]}}

This is the layout of ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)``
saved as ``{"model": ..., "optim": ...}`` (FSDP2 / DTensor jobs), so checkpoints move between
them and shardwise. Optimizer state tensors shaped like their parameter's local shard are
laid out like it; 0-d ones (AdamW's ``step``) are one value per parameter.
"""
from __future__ import annotations

import functools

import torch

from ...core.errors import ShardingError
from ...core.layout import R, Layout
from .chunks import shard_chunks

MODEL, OPTIM = "model", "optim"


def full_shapes(pm) -> dict:
    """{parameter or buffer name: global shape} (the model's tensors keep the global shapes)."""
    return {n: tuple(t.shape) for n, t in [*pm.model.named_parameters(), *pm.model.named_buffers()]}


def held(pm, name: str) -> bool:
    """Whether a rank of this process holds ``name`` (under a pipeline, its stage's ranks only)."""
    return any(name in s for s in pm.shards.values())


def layout_of(pm, name: str, shapes: dict, dtype=None) -> Layout:
    """The global layout of parameter or buffer ``name`` (dtype: its shards', unless given)."""
    rank = next(r for r, s in pm.shards.items() if name in s)
    return Layout(shapes[name], dtype or pm.shards[rank][name].dtype, pm.specs[name])


def param_chunks(pm, name: str, shapes: dict):
    """ShardChunks over the live local shards of parameter or buffer ``name`` (a load writes into them)."""
    return shard_chunks(layout_of(pm, name, shapes), pm.mesh,
                        {r: s[name].detach() for r, s in pm.shards.items() if name in s}, pm.owner_dims)


def model_chunks(pm) -> dict:
    """{key of model.state_dict(): ShardChunks}; tied aliases share one object. Under a pipeline a
    process lists only the tensors its ranks hold (every one is listed by some process)."""
    shapes = full_shapes(pm)
    by_name = {n: param_chunks(pm, n, shapes) for n in set(pm.aliases.values()) if held(pm, n)}
    return {k: by_name[n] for k, n in pm.aliases.items() if n in by_name}


def state_kind(pm, name: str, key: str, per_rank: dict) -> str:
    """"shard" (laid out like the parameter), "scalar" (0-d, one per parameter) or "value" (not a
    tensor); any other tensor raises: how it is sharded is unknown."""
    first = next(iter(per_rank.values()))
    if not isinstance(first, torch.Tensor):
        return "value"
    if first.dim() == 0:
        return "scalar"
    local = {r: pm.shards[r][name] for r in per_rank}
    if all(isinstance(v, torch.Tensor) and v.shape == local[r].shape for r, v in per_rank.items()):
        return "shard"
    raise ShardingError(f"optimizer state {key!r} of parameter {name!r} has shape {tuple(first.shape)}, neither the "
                        f"parameter's local shard {tuple(local[next(iter(local))].shape)} nor a scalar, so how it is "
                        "sharded is unknown", fix="use an elementwise optimizer (SGD, Adam, AdamW, ...)")


def state_value(pm, shapes: dict, name: str, key: str, per_rank: dict):
    """One optimizer state entry over the ranks held: ShardChunks (a scalar is one 0-d chunk, written
    once, loaded into every rank's copy) or a plain value."""
    kind = state_kind(pm, name, key, per_rank)
    if kind == "value":
        return next(iter(per_rank.values()))
    first = next(iter(per_rank.values()))
    lay = layout_of(pm, name, shapes, first.dtype) if kind == "shard" else Layout((), first.dtype, (R,) * pm.mesh.ndim)
    return shard_chunks(lay, pm.mesh, {r: v.detach() for r, v in per_rank.items()}, pm.owner_dims)


def optim_state(pm, opt) -> dict:
    """{"state": {name: {key: value}}, "param_groups": [...]} of a ShardedOptimizer, sharded."""
    check_optimizer(pm, opt)
    return {"state": state_entries(opt, functools.partial(state_value, pm, full_shapes(pm))),
            "param_groups": param_groups(opt)}


def state_entries(opt, value) -> dict:
    """{name: {key: value(name, key, {rank: state})}} of the shards held; a parameter with no state
    yet (no step taken) has none."""
    out = {}
    for name, per_rank in opt.named_state().items():
        if any(per_rank.values()):
            keys = next(s for s in per_rank.values() if s).keys()
            out[name] = {k: value(name, k, {r: s[k] for r, s in per_rank.items()}) for k in keys}
    return out


def param_groups(opt) -> list[dict]:
    """The optimizer's hyperparameters, with parameters named (as torch's distributed state dicts do)."""
    names = {id(p): n for (_, n), p in opt.shard_names.items()}
    out = []
    for g in opt.param_groups:
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = list(dict.fromkeys(names[id(p)] for p in g["params"]))
        out.append(group)
    return out


def check_optimizer(pm, opt) -> None:
    from ..optim import ShardedOptimizer

    if not isinstance(opt, ShardedOptimizer) or opt._sw_specs is not pm.specs:
        raise ShardingError("the optimizer was not made by this ParallelModule, so its state cannot be named",
                            fix="create it with pm.optimizer(torch.optim.AdamW, lr=...)")


def sharded_state_dict(pm, optimizer=None) -> dict:
    """{"model": ..., "optim": ...} for dcp.save / dcp.load; every tensor is a view of the live
    shards and optimizer state (a dcp.load fills them in place; the optimizer needs state to fill,
    i.e. a step taken, and its hyperparameters come back with restore.apply_groups)."""
    out = {MODEL: model_chunks(pm)}
    if optimizer is not None:
        out[OPTIM] = optim_state(pm, optimizer)
    return out
