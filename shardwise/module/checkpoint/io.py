"""pm.save(path, optimizer=opt, extra=...) / pm.load(path, optimizer=opt) through
torch.distributed.checkpoint.

Threads backend: this one process holds every rank and writes every rank's shards (DCP without
a process group). Torch backend: every process writes its own rank's shards (collective: every
rank calls). Each region is written once, by its first holder; the file of a rank holds only
the shards it writes. Beside the weights: the optimizer's state, and the training state
(training.py: step, each rank's random generators, the user's ``extra``); the manifest also
records the run's precision (precision.py: a load into another precision says what it did).

A save never damages the checkpoint already at ``path``: DCP writes into a fresh sibling
directory; every process then sums its share of the files into a manifest (manifest.py), and
only then does the directory replace ``path`` (an atomic exchange of the two directories where
the OS has one), and the old one is removed. An exception during the save leaves ``path`` as it
was. A load checks the files against the manifest first (CheckpointCorruptError names a damaged
file); a checkpoint without one (written by dcp.save or an older shardwise) loads unchecked.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import warnings
from contextlib import contextmanager

import torch.distributed.checkpoint as dcp

from ...core.errors import CheckpointError
from . import manifest, precision
from .restore import OptimTargets, model_targets
from .state import OPTIM, check_optimizer, sharded_state_dict
from .sync import Sync
from .training import TRAIN, apply, saved_step, train_state, train_targets


def _dcp_save(state: dict, writer, sync: Sync) -> None:
    """dcp.save over the processes of ``sync``; in one process (the threads backend) DCP's own
    single-process save, which dcp.save reaches only after warning that it 'assumes' that intent
    (it warns even when told so with no_dist=True)."""
    if sync.distributed:
        dcp.save(state, storage_writer=writer, process_group=sync.group)
        return
    inner = getattr(dcp.state_dict_saver, "_save_state_dict", None)
    stateful = getattr(dcp.state_dict_saver, "_stateful_to_state_dict", None)
    if inner is None or stateful is None:  # another torch: its public call, its warning filtered where safe
        with _quiet():
            dcp.save(state, storage_writer=writer, no_dist=True)
        return
    inner(state_dict=stateful(state), storage_writer=writer, no_dist=True)


def _dcp_load(targets: dict, path: str, sync: Sync) -> None:
    """dcp.load into ``targets`` in place; in one process without DCP's 'assuming' warning (_dcp_save).
    Our targets hold no Stateful objects at their top level, so DCP's own load fills them as given."""
    if sync.distributed:
        dcp.load(targets, checkpoint_id=path, process_group=sync.group)
        return
    inner = getattr(dcp.state_dict_loader, "_load_state_dict", None)
    if inner is None:
        with _quiet():
            dcp.load(targets, checkpoint_id=path, no_dist=True)
        return
    inner(state_dict=targets, storage_reader=dcp.FileSystemReader(path), no_dist=True)


@contextmanager
def _quiet():
    """The fallback where DCP's private single-process calls are gone: its warning filtered, on
    the main thread only (catch_warnings swaps the process's filters, which a background save
    must not do under a training loop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save(pm, path, optimizer=None, extra=None, step=None) -> None:
    """Write a sharded DCP checkpoint of the parameters, buffers, optimizer state (if given) and
    training state (step, generators, ``extra``)."""
    step = saved_step(step, extra)
    state = {**sharded_state_dict(pm, optimizer), **train_state(pm, optimizer, step, extra)}
    write(state, path, Sync(pm), {"step": step, "world_size": pm.mesh.size, **precision.info(pm)})


def write(state: dict, path, sync: Sync, info: dict, storage_writer=None) -> None:
    """Save a prepared state dict to ``path``: aside, summed into a manifest, then renamed into
    place once every process has finished (collective over ``sync``). ``storage_writer``: a
    callable directory -> DCP StorageWriter (default: dcp.FileSystemWriter)."""
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    tmp, err = None, None
    if sync.leader:
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
        except OSError as e:
            err = f"cannot create a directory beside {path}: {e}"
    tmp, err = sync.broadcast((tmp, err))
    if err:
        raise CheckpointError(f"save: {err}", fix="save to a writable directory")
    try:
        writer = (storage_writer or dcp.FileSystemWriter)(tmp)
        _dcp_save(state, writer, sync)
        files = manifest.summarise(tmp, sync)  # collective: every process has finished its files
        if sync.leader:
            manifest.write(tmp, files, info)
    except BaseException:
        if sync.leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if sync.leader:
        _replace(tmp, path)
        manifest.fsync_dir(parent)
    sync.barrier()  # every process returns once the checkpoint is in place


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


def load(pm, path, optimizer=None, rng=None, sync: Sync | None = None, complete: bool = False) -> dict:
    """Load a DCP checkpoint saved on any mesh and placements (by shardwise or a DTensor / FSDP2 job
    with the same global shapes) into the live shards, the optimizer's state if given, and the
    training state if saved; returns ``extra`` plus "step" (None when not saved).

    ``rng``: None restores the random generators where the checkpoint has them for the ranks held
    here (else a CheckpointWarning says why not); True requires it (CheckpointError); False
    leaves them alone. ``complete``: a checkpoint without a manifest is damaged (Checkpointer).
    A checkpoint of a run with another precision warns what was loaded (checkpoint/precision.py)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"pm.load: no checkpoint directory at {path!r}",
                              fix="pass the path given to pm.save (or dcp.save's checkpoint_id)")
    if optimizer is not None:
        check_optimizer(pm, optimizer)
    sync = sync or Sync(pm)
    saved = manifest.verify(path, sync, required=complete)
    md = dcp.FileSystemReader(path).read_metadata()
    targets = model_targets(pm, md, repr(path))
    opt = OptimTargets(pm, optimizer, md, repr(path)) if optimizer is not None else None
    if opt is not None:
        targets = {**targets, OPTIM: opt.targets()}
    targets.update(train_targets(pm, md))
    _dcp_load(targets, path, sync)
    if opt is not None:
        opt.install(targets[OPTIM])
    precision.report(pm, saved, path)  # another precision than the saving run's: says what was loaded
    return apply(pm, optimizer, {TRAIN: targets[TRAIN]} if TRAIN in targets else {}, rng, repr(path))
