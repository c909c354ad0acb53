"""Checkpoints of a training loop: every N steps, in the background, atomic, verified, resumable.

    ck = sw.Checkpointer("ckpt", every=100, keep=3, async_save=True)
    start = ck.resume(pm, opt)              # the newest complete checkpoint's step (0: none); binds pm, opt
    for step in range(start + 1, total + 1):
        loss = pm.step(*next(batches)); opt.step(); pm.zero_grad()
        ck.step(step, extra=lambda: {"data": loader.state_dict()})   # saves when step % every == 0
    ck.close()                              # waits for the last save (also done at exit)

``step`` counts completed steps, from 1: ``ck.step(s)`` after step ``s`` saves the state a resumed
run continues from with step ``s + 1``; ``ck.step(s)`` with ``s`` at or below the step saved or
resumed last raises CheckpointError (a loop counting from 0 would repeat a step at every resume).
Each checkpoint is ``<directory>/step_<s>`` (8 digits), written by pm.save's machinery
(io.write): aside, summed into a manifest, renamed into place once every rank has finished.
``resume`` checks the newest one against its manifest and falls back to the one before if it is
damaged, with a CheckpointWarning naming both.

An asynchronous save copies the state this process writes into CPU memory (staging.py) on the
calling thread, so the next step may change the shards at once, and runs the write, the
manifest and the rename on a writer thread: with the torch backend over a gloo group of its
own, made by ``resume`` (collective), so its collectives never interleave with the step's.
DCP's own async_save stages with torch ops that ShardChunks refuse, hence this writer; the
scheme is async_save's thread executor. A new save first waits for the one in flight; an error
of a background save is raised by the next ``step``, ``save``, ``wait`` or ``close``.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import sys
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

from ...core.errors import CheckpointCorruptError, CheckpointError, ConfigError
from . import io, precision, staging
from .state import sharded_state_dict
from .sync import Sync
from .training import CheckpointWarning, saved_step, train_state

log = logging.getLogger("shardwise.checkpoint")

_NAME = re.compile(r"^step_(\d+)$")
_STALE = re.compile(r"^\.step_\d+\.(tmp|old)-")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def complete(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint renamed into place under ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


class Checkpointer:
    """Periodic checkpoints of one ParallelModule and its optimizer (bound by ``resume``).

    ``every``: save when ``step % every == 0``; ``keep``: how many complete checkpoints to keep
    (older ones are removed after each save; None keeps all; keep at least 2 so a damaged newest
    one has a predecessor); ``async_save``: write in the background; ``storage_writer``: a callable
    directory -> DCP StorageWriter (default dcp.FileSystemWriter); ``timeout``: seconds the
    writer's collectives wait for the other ranks (default: the collective timeout,
    ``$SHARDWISE_COLLECTIVE_TIMEOUT`` or 300).
    """

    def __init__(self, directory, every: int = 100, keep: int | None = 2, async_save: bool = True,
                 storage_writer=None, timeout: float | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be a positive number of steps, got {every!r}", fix="e.g. every=100")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"keep must be None or at least 1, got {keep!r}", fix="e.g. keep=2")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every, self.keep, self.async_save = every, keep, bool(async_save)
        self.storage_writer, self.timeout = storage_writer, timeout
        self.extra: dict = {}        # the resumed checkpoint's extra ({} when starting afresh)
        self.resumed_from: str | None = None
        self._pm = self._opt = self._sync = self._group = None
        self._last_step: int | None = None  # the step last saved or resumed (0: none yet)
        self._last_how = "resumed"
        self._pending: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        _at_exit(self)

    # -- binding and resuming ----------------------------------------------------------------
    def resume(self, pm, optimizer=None, rng: bool = True) -> int:
        """Bind ``pm`` and ``optimizer`` and load the newest complete checkpoint into them (its step;
        0 and nothing loaded when there is none). A damaged checkpoint is passed over for the one
        before it, with a CheckpointWarning naming both; if every one is damaged, CheckpointError.
        ``rng=True``: the random generators must be restored (see pm.load). Collective."""
        self._bind(pm, optimizer)
        candidates = self._sync.broadcast(self._survey() if self._sync.leader else None)
        damaged = []
        for step, path in reversed(candidates):
            try:
                out = io.load(pm, path, optimizer, rng=rng, sync=self._sync, complete=True)
            except CheckpointCorruptError as e:
                damaged.append((path, e))
                continue
            self._resumed(path, out, damaged)
            return self._last_step
        if damaged:
            raise CheckpointError(f"every checkpoint in {self.directory!r} is damaged; the newest: "
                                  f"{_why(damaged[0][1])}",
                                  fix="restore the files from a copy, or move the directory away to start afresh")
        log.info("no checkpoint in %s: starting at step 0", self.directory)
        self._last_step = 0
        return 0

    def _bind(self, pm, optimizer) -> None:
        if self._pm is not None and (self._pm is not pm or self._opt is not optimizer):
            raise ConfigError("this Checkpointer is bound to another module or optimizer already",
                              fix="make one Checkpointer per training loop")
        self._pm, self._opt = pm, optimizer
        if self._sync is None:
            self._group = _own_group(pm, self.timeout)
            self._sync = Sync(pm, self._group)

    def _survey(self) -> list[tuple[int, str]]:
        """The complete checkpoints (leader); leftovers of interrupted saves are removed."""
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if _STALE.match(name):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        return complete(self.directory)

    def _resumed(self, path: str, out: dict, damaged: list) -> None:
        step = out.pop("step")
        if step is None:
            raise CheckpointError(f"checkpoint {path!r} records no step", fix="save it with Checkpointer or "
                                  "pm.save(path, ..., step=N)")
        for bad, e in damaged:
            warnings.warn(f"{_why(e)}: resuming from the checkpoint before it, {path}, instead",
                          CheckpointWarning, stacklevel=3)
        self.extra, self.resumed_from, self._last_step, self._last_how = out, path, int(step), "resumed"
        log.info("resumed from %s (step %d)", path, step)

    # -- saving -------------------------------------------------------------------------------
    def step(self, step: int, extra=None) -> bool:
        """After training step ``step`` (counted from 1): save if ``step % every == 0`` (True when a
        save started). ``extra``: a dict, or a callable returning one (called only when saving).
        A step at or below the one already saved or resumed raises CheckpointError: a loop counting
        from 0 would repeat one step after every resume."""
        self._check_bound()
        self._check_after_last(step)
        if step % self.every:
            self._raise_failed()
            return False
        self.save(step, extra)
        return True

    def _check_after_last(self, step: int) -> None:
        last = self._last_step
        if last is None or step > last:
            return
        if last == 0:
            where = "no step is done yet (ck.resume returned 0)"
        else:
            where = f"step {last} was {'saved' if self._last_how == 'saved' else 'resumed from'} already"
        raise CheckpointError(
            f"ck.step({step}): {where}; steps count from 1: ck.step(s) comes after training step s, and the "
            f"state of step {last} continues with step {last + 1}. A loop counting from 0 (range(start, total)) "
            "repeats a step after every resume",
            fix="start = ck.resume(pm, opt); for step in range(start + 1, total + 1): "
                "...; ck.step(step)")

    def save(self, step: int, extra=None) -> None:
        """Save now (waiting for the save in flight first), whatever ``every`` says."""
        self._check_bound()
        self.wait()
        extra = extra() if callable(extra) else extra
        step = saved_step(step, extra)
        state = {**sharded_state_dict(self._pm, self._opt), **train_state(self._pm, self._opt, step, extra)}
        path = step_dir(self.directory, step)
        info = {"step": step, "world_size": self._pm.mesh.size, **precision.info(self._pm)}
        self._last_step, self._last_how = step, "saved"
        if not self.async_save:
            self._write(state, path, info, time.monotonic())
            return
        t0 = time.monotonic()
        staged = staging.stage(state)  # the state as it is at this step, before training moves on
        log.debug("staged step %d: %d bytes in %.3fs", step, staging.nbytes(staged), time.monotonic() - t0)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-checkpoint")
        self._pending = self._pool.submit(self._write, staged, path, info, t0)

    def _write(self, state: dict, path: str, info: dict, t0: float) -> None:
        io.write(state, path, self._sync, info, self.storage_writer)
        if self._sync.leader:
            self._prune()
        log.info("saved step %d to %s in %.2fs", info["step"], path, time.monotonic() - t0)

    def _prune(self) -> None:
        if self.keep is None:
            return
        for _, path in complete(self.directory)[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    # -- waiting and closing -----------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error as a CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                raise CheckpointError(f"a background checkpoint save failed: {_cause(e)}",
                                      fix="see the error above; the previous checkpoints are intact") from e

    def _raise_failed(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def close(self) -> None:
        """Wait for the last save and release the writer thread and process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._group is not None:
                _destroy(self._group)
                self._group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the complete checkpoints, oldest first."""
        return [p for _, p in complete(self.directory)]

    def _check_bound(self) -> None:
        if self._pm is None:
            raise ConfigError("the Checkpointer does not know the module yet",
                              fix="call start_step = ck.resume(pm, optimizer) before the training loop")
        if self._closed:
            raise ConfigError("the Checkpointer is closed", fix="make a new one")


def _cause(e: BaseException) -> str:
    """One line: DCP's CheckpointException by the ranks' own errors ({rank: (exception, traceback)})."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        errs = {r: x[0] if isinstance(x, tuple) else x for r, x in failures.items()}
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(errs.items()))
    return f"{type(e).__name__}: {e}"


def _why(e: BaseException) -> str:
    return str(e).split("\n  fix: ")[0]


def _own_group(pm, timeout):
    """A gloo group over every rank for the writer's collectives (torch backend), None otherwise."""
    if pm.backend.name != "torch":
        return None
    import datetime

    import torch.distributed as dist

    from ...run.collectives import default_timeout

    seconds = timeout if timeout is not None else default_timeout()
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))


def _destroy(group) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - already gone with the default group
        pass


def _at_exit(ck: Checkpointer) -> None:
    """At exit, wait for ``ck``'s last save and destroy its group while Python is whole; a failure
    is printed (the exit code is the script's). The writer thread is joined before atexit runs."""
    ref = weakref.ref(ck)

    def finish():
        c = ref()
        if c is None:
            return
        try:
            c.close()
        except Exception as e:  # noqa: BLE001 - nothing left to raise to
            print(f"shardwise: the last checkpoint save did not complete: {e}", file=sys.stderr, flush=True)

    atexit.register(finish)
