"""The running rank's scope: its collectives and random generator, set by the runtime's backends
(per thread or per process) and read by lower/comm.py's calls and the rules whose local calls
communicate or draw random numbers; below rules/, lower/ and run/ (docs/architecture.md)."""
from __future__ import annotations

import threading

import torch

from .errors import ConfigError

_current = threading.local()  # per thread (threads backend): .value, .generator
_process: dict = {"value": None, "generator": None}  # per process (torch backend)


class _scoped:
    """Set ``slot`` for this thread (or this process) for the duration of the block (a class, not a
    generator: every rank's run of every step enters one)."""

    __slots__ = ("obj", "prev", "process_wide", "slot", "where")

    def __init__(self, slot: str, obj, process_wide: bool):
        self.slot, self.obj, self.process_wide = slot, obj, process_wide

    def __enter__(self):
        # a thread-local's __dict__ is the entering thread's
        where = self.where = _process if self.process_wide else _current.__dict__
        self.prev, where[self.slot] = where.get(self.slot), self.obj
        return self.obj

    def __exit__(self, *exc) -> None:
        self.where[self.slot] = self.prev


def current():
    """The collectives of the rank running on this thread (threads) or in this process (torch)."""
    c = getattr(_current, "value", None) or _process["value"]
    if c is None:
        raise ConfigError("no shardwise collectives are active here",
                          fix="run per-rank code through a backend (shardwise.run.run_threads or the torch "
                              "backend); collectives exist only inside a rank's run")
    return c


def using(c, process_wide: bool = False):
    """Make ``c`` the current collectives for this thread (or this process)."""
    return _scoped("value", c, process_wide)


def set_process_collectives(c):
    """Make ``c`` this process's collectives (what ``using(c, process_wide=True)`` enters) and
    return the previous ones, to be set back: the torch backend's per-step call, without a
    context manager's calls."""
    prev, _process["value"] = _process["value"], c
    return prev


def rank_generator() -> torch.Generator | None:
    """The random generator of the rank running here (random ops draw from it so every rank
    sees the stream a single device would see), or None outside a sharded run."""
    return getattr(_current, "generator", None) or _process["generator"]


def using_generator(g: torch.Generator | None, process_wide: bool = False):
    """Make ``g`` this rank's generator for the duration (see rank_generator)."""
    return _scoped("generator", g, process_wide)
