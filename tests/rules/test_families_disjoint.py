"""Each op has its rule in one family: a second row for it would replace the first silently (the
registry keeps the last one added, and the families load in rules.FAMILIES order)."""
from __future__ import annotations

import importlib

from shardwise.rules import FAMILIES, Registry


def test_no_op_is_registered_by_two_families():
    owner: dict = {}
    clashes = []
    for name in FAMILIES:
        mod = importlib.import_module(f"shardwise.rules.{name}")
        reg = Registry()
        mod.register(reg) if hasattr(mod, "register") else reg.add(*mod.ROWS)
        for op in reg.ops():
            if op in owner:
                clashes.append(f"{op}: {owner[op]} and {name}")
            owner[op] = name
    assert not clashes, "ops with a rule in two families:\n" + "\n".join(clashes)
