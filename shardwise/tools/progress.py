"""Progress and quiet for long commands (``shardwise verify-rules``).

torch prints some warnings from C++ (``TORCH_WARN``) straight to the process's stderr when they
fire on a rank thread, outside Python's ``warnings`` machinery; the rule sweep provokes a known,
harmless set of them on purpose (a variance over a dim of size 1). ``quiet_stderr`` routes file
descriptor 2 through a filter that drops those lines and passes every other line through, and
``sweep_progress`` shows a rich progress bar (ops done of the total, strategies verified, the op being checked) on
the real stderr.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import warnings

KNOWN_WARNINGS = (r"degrees of freedom is <= 0",)


@contextlib.contextmanager
def quiet_stderr(patterns=KNOWN_WARNINGS):
    """Within the block, lines written to fd 2 that match ``patterns`` are dropped; the
    original stderr's fd is yielded (for output that must not be filtered, e.g. a live bar)."""
    pats = [re.compile(p) for p in patterns]
    sys.stderr.flush()
    saved = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump():
        with os.fdopen(r, "rb") as src:
            for line in src:
                if not any(p.search(line.decode(errors="replace")) for p in pats):
                    os.write(saved, line)

    t = threading.Thread(target=pump, name="shardwise-stderr-filter", daemon=True)
    t.start()
    try:
        with warnings.catch_warnings():
            for p in patterns:
                warnings.filterwarnings("ignore", message=f".*{p}")
            yield saved
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the pump sees EOF
        t.join(timeout=10)
        os.close(saved)


@contextlib.contextmanager
def sweep_progress(op_filter: str | None = None):
    """Yields ``progress(op, strategies)`` for ``verify.sweep.sweep``: a bar of ops checked and
    strategies verified so far, on the real stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..rules import DEFAULT, load_all

    total = sum(1 for op in load_all(DEFAULT).ops() if not op_filter or op_filter in str(op))
    with quiet_stderr() as fd:
        err = os.fdopen(os.dup(fd), "w")
        bar = Progress(SpinnerColumn(), TextColumn("verify-rules"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("ops, {task.fields[strategies]} strategies  {task.fields[now]}"), TimeElapsedColumn(), console=Console(file=err),
                       transient=True)
        task = bar.add_task("ops", total=total, now="collecting samples ...", strategies=0)
        done = {"n": 0}

        def progress(op, strategies=0):
            bar.update(task, completed=done["n"], now=str(op), strategies=strategies)
            done["n"] += 1

        try:
            with bar:
                yield progress
        finally:
            err.close()
