"""Launch local processes, one per rank, each with a gloo process group.

``spawn(fn, nproc, *args)`` runs ``fn(rank, *args)`` in ``nproc`` fresh ("spawn" start
method) processes and returns their results in rank order. ``fn`` must be a picklable
top-level function; results travel back pickled, so they must be picklable too. As with
any "spawn" start method, a script that calls ``spawn`` needs an
``if __name__ == "__main__":`` guard.

Failures never hang: a child that raises is re-raised here (same exception type where it
can be rebuilt, with a note naming the rank and carrying its traceback); a child that dies
or does not finish within ``timeout`` seconds is killed and reported as a
:class:`~shardwise.core.errors.CollectiveError` naming it. Every child is joined or killed
before ``spawn`` returns or raises.

``run_script(script, nproc, script_args)`` is ``shardwise run SCRIPT --nproc N``: it runs a
user's script on ``nproc`` local processes through torch's own launcher
(torch.distributed.run, by way of shardwise.run.torchrun, which keeps the script's arguments
out of the launcher's parser), which sets RANK, WORLD_SIZE, MASTER_ADDR, ... for each; the
script picks its process-group backend (gloo on CPU, NCCL with CUDA). It returns the
launcher's exit code: 0 when every rank succeeded, non-zero when any failed (the failed
rank's traceback is on stderr, prefixed with its rank, and the launcher stops the others).
With ``max_restarts=K`` the launcher's elastic agent restarts the whole group after a failure,
up to K times, and the exit code is that of the last attempt.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Mapping, Sequence

from ..core.errors import CollectiveError, ConfigError, ConfigTypeError

# Once one rank has failed, how long the others get to finish or report before being killed.
FAILURE_GRACE_S = 5.0
# After every result is in, how long a child may take to exit before being killed.
EXIT_GRACE_S = 10.0
_POLL_S = 0.05


def _child(fn, rank: int, nproc: int, port: int, args: tuple, results, timeout: float, backend: str):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            td = datetime.timedelta(seconds=timeout)
            store = dist.TCPStore("127.0.0.1", port, world_size=nproc, is_master=False, timeout=td)
            dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=td)
            out = fn(rank, *args)
            try:
                payload = pickle.dumps(out)
            except Exception as e:  # noqa: BLE001 - reported as this rank's failure
                raise ConfigTypeError(f"the result of rank {rank} ({type(out).__name__}) cannot be pickled: {e}",
                                      fix="return tensors and plain Python values from the function spawn runs "
                                          "(the parent unpickles each rank's result)") from e
            results.put(("ok", rank, payload))
        except BaseException as e:  # noqa: BLE001 - sent to the parent, which re-raises it
            tb = traceback.format_exc()
            try:
                exc = pickle.dumps(e)
                pickle.loads(exc)
            except Exception:  # noqa: BLE001 - fall back to type name + message
                exc = None
            results.put(("err", rank, (type(e).__qualname__, str(e), tb, exc)))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown is best effort
            pass
    # The queue's feeder thread is flushed at process exit, before the parent sees it exit.


def _store(timeout: float):
    """A TCP store served from this process on a free port (the kernel picks it; no race)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _rebuild(rank: int, nproc: int, info) -> BaseException:
    name, msg, tb, blob = info
    err = None
    if blob is not None:
        try:
            err = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            err = None
    note = f"shardwise: raised on rank {rank} of {nproc} (spawned process); its traceback:\n{tb}"
    if not isinstance(err, Exception):  # unrebuildable, or SystemExit/KeyboardInterrupt
        return CollectiveError(f"rank {rank} of {nproc} raised {name}: {msg}\n{tb}", rank=rank)
    if hasattr(err, "add_note"):
        err.add_note(note)
    return err


def spawn(fn, nproc: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, *args)`` in ``nproc`` local processes with a ``backend`` process group.

    Returns the results in rank order. ``timeout`` (seconds) bounds the whole run,
    process start-up included, and is also the process group's collective timeout.
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(f"spawn needs nproc >= 1, got {nproc!r}", fix="pass the mesh size, e.g. nproc=2")
    deadline = time.monotonic() + timeout
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = _store(timeout)
    procs = [ctx.Process(target=_child, args=(fn, rank, nproc, store.port, args, results, timeout, backend),
                         name=f"shardwise-rank{rank}") for rank in range(nproc)]
    got: dict[int, object] = {}
    failed: dict[int, BaseException] = {}  # in the order failures arrived
    try:
        for p in procs:
            p.start()

        def take(msg):
            kind, rank, payload = msg
            if kind == "ok":
                got[rank] = pickle.loads(payload)
            else:
                failed[rank] = _rebuild(rank, nproc, payload)

        def drain():
            while True:
                try:
                    take(results.get_nowait())
                except queue_mod.Empty:
                    return

        fail_deadline = None
        while len(got) + len(failed) < nproc:
            now = time.monotonic()
            if now >= deadline or (fail_deadline is not None and now >= fail_deadline):
                break
            try:
                take(results.get(timeout=_POLL_S))
                continue
            except queue_mod.Empty:
                pass
            # A child that exited has flushed its message, if any, into the pipe already.
            exited = [r for r, p in enumerate(procs) if r not in got and r not in failed and p.exitcode is not None]
            if exited:
                drain()
                for r in exited:
                    if r not in got and r not in failed:
                        failed[r] = CollectiveError(
                            f"rank {r} of {nproc} exited with code {procs[r].exitcode} without reporting "
                            "a result (see its stderr)",
                            rank=r,
                        )
            if failed and fail_deadline is None:
                fail_deadline = time.monotonic() + FAILURE_GRACE_S
        drain()

        if failed:
            first = next(iter(failed))
            err = failed[first]
            others = [r for r in failed if r != first]
            hung = [r for r in range(nproc) if r not in got and r not in failed]
            extra = []
            if others:
                extra.append(f"rank(s) {others} failed after it")
            if hung:
                extra.append(f"rank(s) {hung} were still running and were killed")
            if extra and hasattr(err, "add_note"):
                err.add_note("shardwise: " + "; ".join(extra))
            raise err
        if len(got) < nproc:
            hung = [r for r in range(nproc) if r not in got]
            raise CollectiveError(
                f"spawn: rank(s) {hung} of {nproc} did not finish within {timeout:.1f}s and were killed; "
                f"rank(s) {sorted(got)} finished",
                missing=tuple(hung),
            )
        # Every result is in: let the children tear down their process groups and exit.
        end = time.monotonic() + EXIT_GRACE_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        return [got[r] for r in range(nproc)]
    finally:
        _kill([p for p in procs if p.pid is not None])
        results.close()
        results.join_thread()
        del store


# In the launcher's environment when it may restart: the restarted workers' process group then
# rendezvouses on a fresh store instead of the one torchrun shares across restarts, where the dead
# rank's old address is still found ("connection refused", torch 2.13).
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launcher_command(script: str, nproc: int, script_args: Sequence[str] = (),
                     launcher_args: Sequence[str] = (), max_restarts: int = 0, log_dir: str | None = None) -> list[str]:
    """The command line that runs ``script`` on ``nproc`` local processes through torch's launcher
    (shardwise.run.torchrun: torch.distributed.run with the script's arguments kept whole): one
    node, a rendezvous of its own on a free port of 127.0.0.1, ``max_restarts`` restarts of the
    whole group when a worker fails. ``log_dir``: each rank's stdout and stderr into files there
    (stdout shown too), the script run by run/script_entry.py, which records its exception in
    torch's error file (run/script_logs.py reads them)."""
    logs, target = [], [str(script)]
    if log_dir is not None:
        logs = ["--log-dir", str(log_dir), "--redirects", "3", "--tee", "1", "--module"]
        target = ["shardwise.run.script_entry", str(script)]
    return [
        sys.executable, "-m", "shardwise.run.torchrun",
        "--nnodes", "1", f"--nproc-per-node={nproc}",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", f"shardwise-{uuid.uuid4().hex[:12]}",
        "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts),
        *logs, *launcher_args, "--", *target, *map(str, script_args),
    ]


def _count(value, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"run_script needs {what} >= {least}, got {value!r}",
                          fix="--nproc 2" if what == "nproc" else "--max-restarts 1")
    return value


def run_script(script: str, nproc: int, script_args: Sequence[str] = (), *, timeout: float | None = None,
               env: Mapping[str, str] | None = None, launcher_args: Sequence[str] = (),
               max_restarts: int = 0, log_dir: str | None = None) -> int:
    """Run ``script`` on ``nproc`` local processes through torch's launcher; its exit code.

    ``timeout``: seconds a shardwise collective waits for the other ranks before raising
    CollectiveError (``$SHARDWISE_COLLECTIVE_TIMEOUT`` in the workers); ``env``: extra
    environment for them; ``launcher_args``: more options for torch.distributed.run;
    ``max_restarts``: when a worker fails (raises, is killed), torch's elastic agent stops the
    others and starts the whole group again, up to this many times (the script resumes from its
    checkpoint: shardwise.Checkpointer). The workers' output goes to this process's stdout and
    stderr; ``TORCHELASTIC_RESTART_COUNT`` tells a worker which attempt it is. ``log_dir``: instead,
    every rank's stdout and stderr and the launcher's own output go to files under it (the
    ranks' stdout is shown as well), and each rank's exception to its error file:
    ``script_logs.exit_line(log_dir, code)`` then says in one line what failed first.

        shardwise run train.py --nproc 2 --max-restarts 1 -- --steps 10
    """
    _count(nproc, "nproc", 1)
    _count(max_restarts, "max_restarts", 0)
    if not os.path.isfile(script):
        raise ConfigError(f"shardwise run: no script at {script!r}",
                          fix="give the path of a Python training script (relative to the current directory)")
    child_env = dict(os.environ)
    if max_restarts:
        child_env.update(RESTART_ENV)
    child_env.update(env or {})
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}", fix="e.g. 300")
        from .collectives import TIMEOUT_ENV

        child_env[TIMEOUT_ENV] = str(float(timeout))
    child_env.setdefault("OMP_NUM_THREADS", "1")  # the launcher's own default, without its warning
    cmd = launcher_command(script, nproc, script_args, launcher_args, max_restarts, log_dir)
    if log_dir is None:
        return subprocess.run(cmd, env=child_env, check=False).returncode
    from .script_logs import LAUNCHER_LOG

    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, LAUNCHER_LOG), "w") as launcher_log:
        return subprocess.run(cmd, env=child_env, check=False, stderr=launcher_log).returncode
