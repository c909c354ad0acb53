"""pm.save(path, optimizer=opt) / pm.load(path, optimizer=opt) through torch.distributed.checkpoint.

Threads backend: this one process holds every rank and writes every rank's shards (DCP without
a process group). Torch backend: every process writes its own rank's shards (collective: every
rank calls). Each region is written once, by its first holder; the file of a rank holds only
the shards it writes.

A save never damages the checkpoint already at ``path``: DCP writes into a fresh sibling
directory, which replaces ``path`` only once the save is complete (an atomic exchange of the
two directories where the OS has one), then the old one is removed. An exception during the
save leaves ``path`` as it was.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager

import torch.distributed.checkpoint as dcp

from ...core.errors import ShardingError
from . import precision
from .restore import OptimTargets, model_targets
from .state import OPTIM, check_optimizer, sharded_state_dict


def _torch(pm) -> bool:
    return pm.backend.name == "torch"


def _dist_kwargs(pm) -> dict:
    return {} if _torch(pm) else {"no_dist": True}


@contextmanager
def _quiet(pm):
    """DCP warns that it 'assumes' a single process; on the threads backend that is the intent."""
    with warnings.catch_warnings():
        if not _torch(pm):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _broadcast(pm, value):
    """Rank 0's ``value`` on every rank (torch backend; the threads backend has one process)."""
    if not _torch(pm):
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(pm) -> None:
    if _torch(pm):
        import torch.distributed as dist

        dist.barrier()


def _is_writer_process(pm) -> bool:
    return not _torch(pm) or pm.backend.rank == 0


def save(pm, path, optimizer=None) -> None:
    """Write a sharded DCP checkpoint of the parameters, buffers and (optionally) optimizer state."""
    path = os.path.abspath(os.fspath(path))
    state = sharded_state_dict(pm, optimizer)
    parent, base = os.path.split(path)
    tmp, err = None, None
    if _is_writer_process(pm):
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
        except OSError as e:
            err = f"cannot create a directory beside {path}: {e}"
    tmp, err = _broadcast(pm, (tmp, err))
    if err:
        raise ShardingError(f"pm.save: {err}", fix="save to a writable directory")
    try:
        with _quiet(pm):
            dcp.save(state, checkpoint_id=tmp, **_dist_kwargs(pm))
        if _is_writer_process(pm):
            precision.write(pm, tmp)
        _barrier(pm)
    except BaseException:
        if _is_writer_process(pm):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _is_writer_process(pm):
        _replace(tmp, path)
    _barrier(pm)


def _replace(tmp: str, path: str) -> None:
    """Move the finished checkpoint ``tmp`` to ``path``, replacing what is there: one atomic exchange
    where the OS has it (Linux renameat2), else the old one is renamed away first (a crash between
    the two renames leaves it as ``.<name>.old-*`` beside ``path``)."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    if _exchange(tmp, path):
        old = tmp  # now holds the previous checkpoint
    else:
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
        os.rmdir(old)
        os.rename(path, old)
        os.rename(tmp, path)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def load(pm, path, optimizer=None) -> None:
    """Load a DCP checkpoint saved on any mesh and placements (by shardwise or a DTensor / FSDP2 job
    with the same global shapes) into the live shards, and the optimizer's state if given. A
    checkpoint of a run with another precision warns what was loaded (checkpoint/precision.py)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ShardingError(f"pm.load: no checkpoint directory at {path!r}",
                            fix="pass the path given to pm.save (or dcp.save's checkpoint_id)")
    if optimizer is not None:
        check_optimizer(pm, optimizer)
    md = dcp.FileSystemReader(path).read_metadata()
    targets = model_targets(pm, md, repr(path))
    opt = OptimTargets(pm, optimizer, md, repr(path)) if optimizer is not None else None
    if opt is not None:
        targets = {**targets, OPTIM: opt.targets()}
    with _quiet(pm):
        dcp.load(targets, checkpoint_id=path, **_dist_kwargs(pm))
    if opt is not None:
        opt.install(targets[OPTIM])
    precision.report(pm, path)  # another precision than the saving run's: says what was loaded
