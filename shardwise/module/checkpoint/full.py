"""The full (unsharded) optimizer state, as one device's optimizer over ``model.parameters()``
would hold it: ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``
with indices in ``model.named_parameters()`` order, so ``torch.optim.AdamW(model.parameters())
.load_state_dict(pm.optimizer_state_dict())`` continues training on one device.
"""
from __future__ import annotations

from .state import check_optimizer, param_groups, state_entries, state_kind


def _gather(pm, name: str, key: str, per_rank: dict):
    kind = state_kind(pm, name, key, per_rank)  # refuses state it cannot lay out
    if kind == "shard":
        full = pm._gather(name, shards={r: {name: v} for r, v in per_rank.items()})
        live = {v.untyped_storage().data_ptr() for v in per_rank.values()}
        # a replicated shard gathers to itself: copy, so the full state never moves with training
        return full.clone() if full.untyped_storage().data_ptr() in live else full
    value = next(iter(per_rank.values()))
    return value.detach().clone() if kind == "scalar" else value


def optimizer_state_dict(pm, opt) -> dict:
    """Collective on the torch backend (state is gathered on every rank)."""
    check_optimizer(pm, opt)
    index = {n: i for i, (n, _) in enumerate(pm.model.named_parameters())}
    state = {index[n]: s for n, s in state_entries(opt, lambda n, k, per_rank: _gather(pm, n, k, per_rank)).items()}
    groups = [{**g, "params": sorted({index[n] for n in g["params"]})} for g in param_groups(opt)]
    return {"state": dict(sorted(state.items())), "param_groups": groups}
