"""Loading a DCP checkpoint into a ParallelModule laid out in any way: the targets are built from
the checkpoint's metadata (what was saved, under which keys, with which global shapes) and this
module's own placements; DCP reads whatever saved chunks overlap each target chunk.

Accepted layouts: shardwise's and FSDP2 / DTensor jobs' ``{"model": ..., "optim": ...}`` (see
state.py), and a bare model state dict saved at the top level (``dcp.save(model.state_dict())``).
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ...core.errors import ShardingError
from .chunks import shard_chunks
from .state import MODEL, OPTIM, full_shapes, held, layout_of, param_chunks


def _paths(md: Metadata) -> dict:
    """{flat key: path tuple}; DCP records the nesting in planner_data when it flattened a dict."""
    data = md.planner_data if isinstance(md.planner_data, dict) else {}
    return {k: tuple(data.get(k, (k,))) for k in md.state_dict_metadata}


def _model_prefix(pm, md: Metadata) -> str:
    keys = md.state_dict_metadata
    return f"{MODEL}." if any(f"{MODEL}.{k}" in keys for k in pm.aliases) else ""


def _check_tensor(md_entry, shape, what: str, where: str) -> None:
    size = getattr(md_entry, "size", None)
    if size is None or tuple(size) != tuple(shape):
        got = "a non-tensor value" if size is None else f"shape {tuple(size)}"
        raise ShardingError(f"checkpoint {where}: {what} has {got} but this model's is {tuple(shape)}",
                            fix="load a checkpoint of the same model (global shapes must match; placements and "
                                "mesh may differ)")


def model_targets(pm, md: Metadata, where: str) -> dict:
    """{key: ShardChunks over the live shards} for every parameter and persistent buffer (once each)."""
    prefix, keys, shapes = _model_prefix(pm, md), md.state_dict_metadata, full_shapes(pm)
    out, missing = {}, []
    for name in dict.fromkeys(pm.aliases.values()):
        key = next((k for k, n in pm.aliases.items() if n == name and prefix + k in keys), None)
        if key is None:
            missing.append(name)
            continue
        _check_tensor(keys[prefix + key], shapes[name], f"{key!r}", where)
        if held(pm, name):  # under a pipeline, the other stages' processes load the rest
            out[key] = param_chunks(pm, name, shapes)
    if missing:
        raise ShardingError(f"checkpoint {where} has no entry for {missing} (looked for keys {prefix!r} + the model's "
                            f"state-dict keys; it holds e.g. {sorted(keys)[:6]})",
                            fix="save it from the same model, with pm.save or dcp.save({'model': state_dict})")
    return {MODEL: out} if prefix else out


class OptimTargets:
    """Fresh per-rank tensors for the optimizer state a checkpoint holds, and how to install them."""

    def __init__(self, pm, opt, md: Metadata, where: str):
        self.pm, self.opt, self.where = pm, opt, where
        paths = [(k, p) for k, p in _paths(md).items() if p[:1] == (OPTIM,)]
        if not paths:
            raise ShardingError(f"checkpoint {where} holds no optimizer state (no '{OPTIM}.' keys)",
                                fix="save it with pm.save(path, optimizer=opt), or load without optimizer=")
        self.locals: dict = {}  # (name, key) -> {rank: tensor}
        self.state = self._state_targets(md, [(k, p) for k, p in paths if p[1:2] == ("state",)])
        self.groups = _group_targets([p for _, p in paths if p[1:2] == ("param_groups",)])

    def _state_targets(self, md: Metadata, paths: list) -> dict:
        shapes, names = full_shapes(self.pm), set(self.opt.names)
        out: dict = {}
        for flat, p in paths:
            name, key = _split_state_path(flat, p, names)
            if name is None:
                continue
            entry = md.state_dict_metadata[flat]
            out.setdefault(name, {})[key] = self._target(name, key, entry, shapes)
        return out

    def _target(self, name, key, entry, shapes):
        if isinstance(entry, BytesStorageMetadata):
            return None  # a plain value, loaded in place of the None
        if len(entry.size) == 0:
            return torch.zeros((), dtype=entry.properties.dtype)
        _check_tensor(entry, shapes[name], f"optimizer state {key!r} of {name!r}", self.where)
        lay = layout_of(self.pm, name, shapes, entry.properties.dtype)
        shards = self.pm.shards
        per_rank = {r: torch.zeros(lay.local_shape(self.pm.mesh, r), dtype=lay.dtype, device=shards[r][name].device)
                    for r in self.opt.ranks if name in shards[r]}
        self.locals[(name, key)] = per_rank
        return shard_chunks(lay, self.pm.mesh, per_rank, self.pm.owner_dims)

    def targets(self) -> dict:
        return {"state": self.state, "param_groups": self.groups}

    def install(self, loaded: dict) -> None:
        """Put the loaded values into the optimizer: state per shard, hyperparameters per group. As
        torch's load_state_dict, a parameter without saved state (it never had a gradient) has none."""
        for (rank, name), shard in self.opt.shard_names.items():
            entries = loaded["state"].get(name)
            if entries is None:
                self.opt.state.pop(shard, None)
            else:
                self.opt.state[shard] = {key: self._local(name, key, v, rank) for key, v in entries.items()}
        apply_groups(self.opt, loaded["param_groups"], self.where)

    def _local(self, name, key, value, rank):
        if (name, key) in self.locals:
            return self.locals[(name, key)][rank]
        return value.clone() if isinstance(value, torch.Tensor) else value


def _split_state_path(flat: str, path: tuple, names: set):
    """(param name, state key) of an ``optim.state...`` entry, or (None, None) for another model's."""
    if len(path) == 4:
        return (path[2], path[3]) if path[2] in names else (None, None)
    for name in names:  # no nesting recorded: split the flat key on a known name
        head = f"{OPTIM}.state.{name}."
        if flat.startswith(head) and "." not in flat[len(head):]:
            return name, flat[len(head):]
    return None, None


def _group_targets(paths: list):
    """The nested shape of the saved param_groups (a list of dicts, or one opaque value)."""
    if any(len(p) == 2 for p in paths):
        return None
    groups: list = []
    for p in paths:
        i, field = p[2], p[3]
        while len(groups) <= i:
            groups.append({})
        groups[i][field] = None
    return groups


def apply_groups(opt, saved, where: str = "state dict") -> None:
    """Copy each saved group's hyperparameters onto the group holding the same parameter names
    (after a dcp.load of pm.sharded_state_dict(opt): ``apply_groups(opt, sd["optim"]["param_groups"])``)."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise ShardingError(f"checkpoint {where}: optimizer param_groups are not a list of dicts")
    for i, group in enumerate(opt.param_groups):
        ids = {id(q) for q in group["params"]}
        mine = {n for (_, n), p in opt.shard_names.items() if id(p) in ids}
        hits = {j for j, g in enumerate(saved) if mine & set(g.get("params", ()))}
        if not hits and len(saved) == len(opt.param_groups) == 1:
            hits = {0}
        if len(hits) != 1:
            raise ShardingError(f"checkpoint {where}: param group {i} of the optimizer matches saved groups "
                                f"{sorted(hits)} by parameter name; it must match exactly one",
                                fix="build the optimizer's param groups as the saved job did")
        group.update({k: v for k, v in saved[hits.pop()].items() if k not in ("params", "param_names")})
