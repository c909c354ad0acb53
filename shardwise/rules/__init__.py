"""Sharding rules, one module per op family, registered into an explicit Registry."""
from __future__ import annotations

import importlib

from .registry import DEFAULT, LocalCall, LocalCtx, OpCall, Registry, Rule, Strategy, Strategy1D, TensorMeta, rule

# Each family module has ``register(registry)``; adding a family = adding its name here.
FAMILIES = (
    "pointwise", "view", "factory", "reduction", "norm", "softmax", "loss", "embedding", "matmul",
    "attention_sdpa", "attention", "random", "sort", "indexing",
)
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
            mod.register(registry)
        _loaded.add(id(registry))
    return registry


__all__ = ["DEFAULT", "LocalCall", "LocalCtx", "OpCall", "Registry", "Rule", "Strategy", "Strategy1D",
           "TensorMeta", "rule", "load_all"]
