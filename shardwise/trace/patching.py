"""A class patch held while tracing: installed while any thread has it open (a count under a
lock), substituting only on threads that have it open (``active``), undone by the last to close.
trace/moe.py (Hugging Face's experts dispatcher) and trace/hf_flex.py (its flex_attention
interfaces) route library calls to shardwise's ops this way."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable


class TracingPatch:
    def __init__(self):
        self._local = threading.local()  # .depth: contexts open on this thread
        self._lock = threading.Lock()
        self._open = 0  # contexts open in any thread
        self._undo: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        """Whether this thread has the patch open (the patched functions substitute only then)."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def opened(self, install: Callable[[], Callable[[], None]]):
        """Hold the patch open; ``install()`` patches and returns what undoes it, called by the first
        opener in any thread."""
        with self._lock:
            if self._open == 0:
                self._undo = install()
            self._open += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._open -= 1
                if self._open == 0:
                    self._undo()
                    self._undo = None
