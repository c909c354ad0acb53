"""Python's cyclic garbage collector paused while a plan is made or figured.

    with collect_once():        # trace + search, a rank's lowering, or a plan's stats()/summary()
        ...

Tracing, planning and a plan's figures keep many objects per graph node alive, so with the
collector on, its full passes come often and each rescans the whole process (torch and
transformers included), more of them the deeper the model (~1 s of a 32-block 8B shape's
stats()). It is paused meanwhile; one pass over the young generation (everything made
meanwhile) then frees their cycles. A caller who paused it, or an enclosing collect_once, is
left alone.
"""
from __future__ import annotations

import contextlib
import functools
import gc


@contextlib.contextmanager
def collect_once():
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()
            gc.collect(0)


def collecting_once(fn):
    """``fn`` run inside ``collect_once()``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with collect_once():
            return fn(*args, **kwargs)
    return wrapper
