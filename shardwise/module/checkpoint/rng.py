"""The random generators a resumed run needs to draw what the uninterrupted run would have drawn.

shardwise's own per-rank streams (dropout masks, ``rand_like``: rules/random.py) are not state of
their own: each run of a program starts its rank generator from torch's CPU generator and hands
the final state back to it (run/backend.py), so torch's CPU generator *is* the rank stream
between steps. Capturing it, the CUDA generators (when CUDA is in use), Python's ``random`` and
NumPy's global generator (when NumPy is loaded) therefore captures everything a step draws.
"""
from __future__ import annotations

import random
import sys

import torch


def capture() -> dict:
    """This process's generator states, as plain picklable values."""
    state = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def restore(state: dict) -> None:
    """Put the generators back as ``capture`` saw them (those this process has)."""
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def same(a: dict, b: dict) -> bool:
    """Whether two captured states are equal (every generator, bit for bit)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if k == "torch":
            ok = torch.equal(x, y)
        elif k == "cuda":
            ok = len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))
        elif k == "numpy":
            ok = x[0] == y[0] and bool((x[1] == y[1]).all()) and tuple(x[2:]) == tuple(y[2:])
        else:
            ok = x == y
        if not ok:
            return False
    return True
