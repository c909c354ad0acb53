"""A ``shardwise run``'s logs: every rank's output in one file, its first failure in one line.

    log = gather(log_dir)          # <log_dir>/run.log: the launcher's and every rank's output
    line = first_failure(log_dir)  # "rank 1: ShardingError: ... (fix: ...)", or None

``run_script(..., log_dir=D)`` has torch's launcher write each rank's stdout and stderr under D
(``--log-dir``, ``--redirects``; stdout also shown as it comes, ``--tee``) and each rank's
exception into its error file (run/script_entry.py, torch's ``record``):
``D/<run id>/attempt_<k>/<local rank>/{stdout.log, stderr.log, error.json}``. One node, so a
local rank is the rank. A failure is read from the last attempt (``--max-restarts``); a rank
stopped because another failed (RankFailedError) comes after the ranks that failed first.
"""
from __future__ import annotations

import glob
import json
import os
import re

LAUNCHER_LOG = "launcher.log"
RUN_LOG = "run.log"
_CONSEQUENCES = ("RankFailedError",)  # raised because another rank failed: that one is the news


def _attempts(log_dir: str) -> list[str]:
    """The attempt directories of the run logged under ``log_dir``, in order."""
    found = glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*"))
    return sorted((d for d in found if os.path.isdir(d)), key=lambda d: int(d.rsplit("_", 1)[1]))


def _ranks(attempt: str) -> list[tuple[int, str]]:
    return sorted((int(n), os.path.join(attempt, n)) for n in os.listdir(attempt) if n.isdigit())


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def gather(log_dir: str) -> str:
    """Write ``<log_dir>/run.log``: the launcher's output, then each attempt's ranks' stdout and
    stderr; returns its path."""
    out = os.path.join(log_dir, RUN_LOG)
    os.makedirs(log_dir, exist_ok=True)
    with open(out, "w") as f:
        f.write(f"=== launcher (torch.distributed.run) ===\n{_read(os.path.join(log_dir, LAUNCHER_LOG))}")
        for attempt in _attempts(log_dir):
            for rank, d in _ranks(attempt):
                for stream in ("stdout", "stderr"):
                    text = _read(os.path.join(d, f"{stream}.log"))
                    f.write(f"\n=== {os.path.basename(attempt)} rank {rank} {stream} ===\n{text}")
    return out


def stderr_lines(log_dir: str) -> int:
    """How many lines the ranks of the last attempt wrote to stderr."""
    attempts = _attempts(log_dir)
    if not attempts:
        return 0
    return sum(len(_read(os.path.join(d, "stderr.log")).splitlines()) for _, d in _ranks(attempts[-1]))


def _error(path: str) -> tuple[str, str, int] | None:
    """(type name, message, unix time) of one error file, or None where absent or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
        msg = data["message"]
        text = msg["message"] if isinstance(msg, dict) else str(msg)
        when = int(msg.get("extraInfo", {}).get("timestamp", 0)) if isinstance(msg, dict) else 0
    except (OSError, ValueError, KeyError, TypeError):
        return None
    kind, _, rest = text.partition(": ")
    return kind, rest, when


def one_line(kind: str, message: str) -> str:
    """A recorded ``Type: message`` as one line; a shardwise error's fix (its '\n  fix: ' tail) last."""
    message, _, fix = message.partition("\n  fix: ")
    message = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    fix = " ".join(line.strip() for line in fix.splitlines() if line.strip())
    return f"{kind}: {message}" + (f" (fix: {fix})" if fix else "")


def first_failure(log_dir: str) -> str | None:
    """The first failing rank's error as one line ("rank R: Type: message (fix: ...)") from the
    last attempt's error files; None where no rank recorded one (killed, or exited by itself)."""
    attempts = _attempts(log_dir)
    if not attempts:
        return None
    errors = []
    for rank, d in _ranks(attempts[-1]):
        err = _error(os.path.join(d, "error.json"))
        if err is not None:
            kind, message, when = err
            errors.append(((kind in _CONSEQUENCES, when, rank), rank, kind, message))
    if not errors:
        return None
    _, rank, kind, message = min(errors)
    return f"rank {rank}: {one_line(kind, message)}"


def exit_line(log_dir: str, code: int) -> str:
    """What ``shardwise run`` prints when the launcher exits with ``code`` (not 0): the first failure
    and where every rank's output is, on one line."""
    log = gather(log_dir)
    failure = first_failure(log_dir)
    if failure is None:
        failure = f"a rank exited with code {code} without a Python exception (killed, or sys.exit)"
    return f"{_squeeze(failure)}; every rank's output: {log}"


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
