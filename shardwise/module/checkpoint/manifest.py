"""A checkpoint's manifest: the size and CRC-32 of every file in it, written last.

``manifest.json`` is written once every process has finished its files (and checked its share
of them), inside the checkpoint's temporary directory, before that directory is renamed into
place: a directory under its final name with a manifest is a complete checkpoint, and one
whose files no longer match it (truncated, overwritten, missing) raises
:class:`~shardwise.core.errors.CheckpointCorruptError` naming the file when it is loaded.

Checking and summing are split across the processes (file ``i`` by process ``i % world``), so
each reads only its share; every process then raises the same error.
"""
from __future__ import annotations

import json
import os
import time
import zlib

from ...core.errors import CheckpointCorruptError
from .sync import Sync

MANIFEST = "manifest.json"
FORMAT = "shardwise-checkpoint/1"
_CHUNK = 8 << 20


def checksum(path: str) -> dict:
    """{"size": bytes, "crc32": hex} of one file (read in chunks; zlib releases the GIL on them)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, "crc32": f"{crc:08x}"}


def files_in(directory: str) -> list[str]:
    """Every regular file under ``directory`` but the manifest, relative and sorted."""
    out = []
    for root, _, names in os.walk(directory):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), directory)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def summarise(directory: str, sync: Sync) -> dict:
    """{relative path: checksum} of every file, each process summing its share (collective)."""
    files = sync.broadcast(files_in(directory) if sync.leader else None)
    mine = {f: checksum(os.path.join(directory, f)) for f in files[sync.rank::sync.world]}
    out: dict = {}
    for part in sync.all_gather(mine):
        out.update(part)
    return out


def write(directory: str, files: dict, info: dict) -> None:
    """Write the manifest atomically (a temporary file renamed), flushed to disk."""
    body = {"format": FORMAT, "written": time.strftime("%Y-%m-%dT%H:%M:%S"), **info, "files": files}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make a rename or a new entry in ``directory`` durable (where the OS allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read(directory: str) -> dict | None:
    """The manifest of ``directory``, None if it has none; a manifest that does not parse is corrupt."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            body = json.load(f)
        if body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
            raise ValueError(f"not a {FORMAT} manifest")
        return body
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"checkpoint {directory!r}: its {MANIFEST} cannot be read ({e})",
                                     path=directory, file=MANIFEST, fix=_FIX) from e


_FIX = ("resume from an earlier checkpoint (Checkpointer.resume falls back to the newest complete one by "
        "itself), or delete this one")


def problem(directory: str, rel: str, want: dict) -> str | None:
    """What is wrong with one file against its manifest entry, or None."""
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
        return "is missing"
    size = os.path.getsize(path)
    if size != want["size"]:
        return f"has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
    got = checksum(path)["crc32"]
    if got != want["crc32"]:
        return f"has CRC-32 {got}, the manifest says {want['crc32']} (its contents changed)"
    return None


def verify(directory: str, sync: Sync, required: bool = False) -> dict | None:
    """Check every file against the manifest (collective); the manifest, or None when there is none
    and it is not ``required``. Raises CheckpointCorruptError naming the first damaged file."""
    body, err = None, None
    if sync.leader:
        try:
            body = read(directory)
        except CheckpointCorruptError as e:
            err = (e.file, str(e).split("\n  fix: ")[0])
    body, err = sync.broadcast((body, err))
    if err is None and body is None and required:
        err = (MANIFEST, f"checkpoint {directory!r} has no {MANIFEST}: it was never completed")
    if err is None and body is not None:
        names = sorted(body["files"])
        mine = [(f, problem(directory, f, body["files"][f])) for f in names[sync.rank::sync.world]]
        bad = sorted((f, p) for part in sync.all_gather([m for m in mine if m[1]]) for f, p in part)
        if bad:
            f, p = bad[0]
            more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
            err = (f, f"checkpoint {directory!r}: file {f!r} {p}{more}")
    if err is not None:
        raise CheckpointCorruptError(err[1], path=directory, file=err[0], fix=_FIX)
    return body
