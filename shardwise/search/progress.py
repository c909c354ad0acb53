"""A live line on stderr while a long ILP solve runs (search/solve.py), so planning is not silent.

    with solve_progress(after_s=2.0, limit_s=10.0) as show:
        show("round 2 (mesh dim 'tp'), best 1525.26 us")

Nothing is shown before ``after_s`` (most solves end sooner), nor when the stream is not a
terminal (pipes, logs, pytest), nor on any process but rank 0 of a torch.distributed launch
(every process plans). The line is rich's, as the CLI's bars (tools/progress.py), and goes
away when the solve ends.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time


def shown_on(stream) -> bool:
    """Whether a progress line goes to ``stream``: a terminal, and rank 0 (or no launcher)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def solve_progress(after_s: float, limit_s: float | None = None, stream=None):
    """Yields ``show(text)``: what the solve does now; a rich line from ``after_s`` seconds on."""
    stream = sys.stderr if stream is None else stream
    if not shown_on(stream):
        yield lambda text: None
        return
    t0, lock = time.perf_counter(), threading.Lock()
    state = {"text": "propagation", "bar": None, "done": False}

    def start() -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn

        with lock:
            if state["done"]:
                return
            limit = "" if limit_s is None or limit_s == float("inf") else f" of {limit_s:g} s"
            bar = Progress(SpinnerColumn(), TextColumn("planning (ilp): {task.description}"),
                           _Elapsed(t0, limit), console=Console(file=stream), transient=True)
            state["task"] = bar.add_task(state["text"], total=None)
            bar.start()
            state["bar"] = bar

    def show(text: str) -> None:
        with lock:
            state["text"] = text
            if state["bar"] is not None:
                state["bar"].update(state["task"], description=text)

    timer = threading.Timer(after_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield show
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["bar"] is not None:
                state["bar"].stop()


def _Elapsed(t0: float, limit: str):
    """A rich column: seconds since the solve began (not since the line appeared), and the limit."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Elapsed(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{time.perf_counter() - t0:.1f} s{limit}", style="progress.elapsed")

    return Elapsed()
