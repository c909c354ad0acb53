"""The full (unsharded) optimizer state, as one device's optimizer over ``model.parameters()``
would hold it: ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``
with indices in ``model.named_parameters()`` order, so ``torch.optim.AdamW(model.parameters())
.load_state_dict(pm.optimizer_state_dict())`` continues training on one device.
"""
from __future__ import annotations

from ..execute import gather
from .state import check_optimizer, state_kind


def _gather(pm, name: str, key: str, per_rank: dict):
    kind = state_kind(pm, name, key, per_rank)  # refuses state it cannot lay out
    if kind == "shard":
        full = gather(pm.backend, {r: {name: v} for r, v in per_rank.items()}, name, pm.specs[name])
        live = {v.untyped_storage().data_ptr() for v in per_rank.values()}
        # a replicated shard gathers to itself: copy, so the full state never moves with training
        return full.clone() if full.untyped_storage().data_ptr() in live else full
    value = next(iter(per_rank.values()))
    return value.detach().clone() if kind == "scalar" else value


def optimizer_state_dict(pm, opt) -> dict:
    """Collective on the torch backend (state is gathered on every rank)."""
    check_optimizer(pm, opt)
    index = {n: i for i, (n, _) in enumerate(pm.model.named_parameters())}
    state = {}
    for name, per_rank in opt.named_state().items():
        if not any(per_rank.values()):
            continue
        keys = next(s for s in per_rank.values() if s).keys()
        state[index[name]] = {k: _gather(pm, name, k, {r: s[k] for r, s in per_rank.items()}) for k in keys}
    names = {id(p): n for (_, n), p in opt.shard_names.items()}
    groups = []
    for g in opt.param_groups:
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = sorted({index[names[id(p)]] for p in g["params"]})
        groups.append(group)
    return {"state": dict(sorted(state.items())), "param_groups": groups}
