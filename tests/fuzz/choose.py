"""Where the fuzzer's random choices come from: hypothesis (shrinkable) or a seeded Random (hunting).

The program generator only asks a Chooser for ints, choices and coin flips, so the same
generator runs under hypothesis in the test suite (failures shrink to a small program) and
under ``random.Random(seed)`` in the long hunt (``python -m tests.fuzz.hunt``), where every
failure is logged and the hunt goes on. Every choice shrinks towards its first option / lowest
value, so generators list their simplest options first.
"""
from __future__ import annotations

import random


class Chooser:
    """Choices drawn from a ``random.Random``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options):
        options = list(options)
        return options[self.int(0, len(options) - 1)]

    def coin(self, p: float = 0.5) -> bool:
        """True with probability ``p``; shrinks to False."""
        return self.int(0, 99) >= round(100 * (1 - p))

    def subset(self, items, p: float = 0.5) -> list:
        return [x for x in items if self.coin(p)]

    def shuffled(self, items) -> list:
        rest, out = list(items), []
        while rest:
            out.append(rest.pop(self.int(0, len(rest) - 1)))
        return out


class HypothesisChooser(Chooser):
    """Choices drawn through hypothesis's ``data.draw``, so a failing program shrinks."""

    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        from hypothesis import strategies as st

        return self.data.draw(st.integers(lo, hi)) if hi > lo else lo
