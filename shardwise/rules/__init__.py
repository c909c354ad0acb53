"""Sharding rules, one module per op family, registered into an explicit Registry."""
from __future__ import annotations

import dataclasses
import importlib

from .registry import DEFAULT, LocalCall, LocalCtx, OpCall, Registry, Rule, Strategy, Strategy1D, TensorMeta, rule

# Each family module has ``register(registry)``; adding a family = adding its name here.
FAMILIES = (
    "pointwise", "view", "factory", "reduction", "norm", "softmax", "loss", "embedding", "matmul",
    "attention_sdpa", "attention", "random", "sort", "indexing",
    "conv", "pool", "norm_batch", "repeat", "moe", "moe_experts", "core_extra",
)
# Families whose rules hold for any chunk boundaries (elementwise, contractions, reductions over
# whole dims), so the planner may restate them with unit shards. Index-, offset- and
# collective-based families are left out: their local args depend on where chunks start.
BLOCKWISE = ("pointwise", "view", "matmul", "reduction", "norm", "softmax", "loss")
_loaded: set = set()


def load_all(registry: Registry = DEFAULT) -> Registry:
    """Register every built-in family into ``registry`` (once per registry)."""
    if id(registry) not in _loaded:
        for name in FAMILIES:
            try:
                mod = importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
                continue  # family not written yet
            before = registry.ops()
            mod.register(registry)
            if name in BLOCKWISE:
                for op in registry.ops() - before:
                    registry.add(dataclasses.replace(registry.get(op), blockwise=True))
        _loaded.add(id(registry))
    return registry


__all__ = ["DEFAULT", "LocalCall", "LocalCtx", "OpCall", "Registry", "Rule", "Strategy", "Strategy1D",
           "TensorMeta", "rule", "load_all"]
