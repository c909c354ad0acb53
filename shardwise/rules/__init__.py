"""Sharding rules, one module per op family, registered into an explicit Registry."""
from __future__ import annotations

import importlib

from .registry import DEFAULT, LocalCall, LocalCtx, OpCall, Registry, Rule, Strategy, Strategy1D, TensorMeta, rule

# Each family module lists its rule rows (ROWS), or has ``register(registry)`` when its rows need the
# registry (pool) or a late import (indexing); adding a family = adding its name here.
FAMILIES = (
    "pointwise", "view", "factory", "reduction", "norm", "softmax", "loss", "embedding", "matmul",
    "attention_sdpa", "attention", "random", "sort", "indexing",
    "conv", "pool", "norm_batch", "repeat", "moe", "moe_experts", "padding", "sampling", "distance",
    "diagonal", "shift", "strided", "complex", "fft", "linalg", "weight_norm",
    "flat_index", "bins", "segment",
    "unpool", "im2col",
    "copies",
    "rearrange",
    "small_math",
    "loss_elementwise", "loss_margin", "layers", "embedding_bag",
)


def load_all(registry: Registry = DEFAULT) -> Registry:
    """Register every built-in family into ``registry`` (once: the registry's ``loaded`` flag)."""
    if not registry.loaded:
        for name in FAMILIES:
            mod = importlib.import_module(f"{__name__}.{name}")
            if hasattr(mod, "register"):
                mod.register(registry)
            else:
                registry.add(*mod.ROWS)
        registry.loaded = True
    return registry


def registered_ops(registry: Registry | None = None) -> frozenset:
    """The aten overloads (and custom ops) that have a rule."""
    load_all()
    return (registry or DEFAULT).ops()


__all__ = ["DEFAULT", "LocalCall", "LocalCtx", "OpCall", "Registry", "Rule", "Strategy", "Strategy1D",
           "TensorMeta", "rule", "load_all", "registered_ops"]
